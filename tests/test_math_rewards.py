"""GSM8K's rewards scored by hand (issue 32, acceptance 2): the math-verify verifier against the
``####`` answer, the format reward, their weighted sum and the verl ``compute_score`` adapter."""

from __future__ import annotations

import pytest

from actors.reward_fn_worker import RewardFnWorker
from rltpu.config import ConfigError, build_config
from rltpu.control.rewards import RewardPool
from rltpu.data.math_rewards import compute_score, gsm8k_format, math_correct
from rltpu.data.rewards import load_reward_fn, term_metric_names
from rltpu.observe.loggers import group_key

REF = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether in "
       "April and May.\n#### 72")
REF_BIG = "Each month is 1,250 dollars, so 12 months is 12 * 1,250 = <<12*1250=15000>>15,000.\n#### 15000"

# (completion, reference, correct by hand, format by hand)
TABLE = [
    ("She sold 72 clips.\n#### 72", REF, 1, 1),  # the GSM8K form
    ("#### 72", REF, 1, 1),
    ("#### 72.00", REF, 1, 1),  # an equivalent form
    ("#### 72.", REF, 1, 1),  # a closing full stop
    ("#### $72", REF, 1, 1),  # a dollar sign
    ("The answer is \\boxed{72}", REF, 1, 0),  # LaTeX, no #### line: right but not formatted
    ("So she sold 72 clips in total.", REF, 1, 0),  # the last number of plain prose
    ("72 clips", REF, 1, 0),  # a unit after the number
    ("#### 144/2", REF, 1, 0),  # an expression of the same value (right; not a plain "#### <number>")
    ("#### 73", REF, 0, 1),  # wrong, well formatted
    ("#### -72", REF, 0, 1),  # the sign matters
    ("I think 72 or 73.\n#### 73", REF, 0, 1),  # only the #### answer counts
    ("#### 72 clips and 5 pens", REF, 0, 0),  # the answer after #### is 5 (math-verify's last number)
    ("seventy-two", REF, 0, 0),  # words are not parsed
    ("", REF, 0, 0),
    ("#### 15,000", REF_BIG, 1, 1),  # thousands separators
    ("#### 15000", REF_BIG, 1, 1),
    ("It costs $15,000.00 a year.", REF_BIG, 1, 0),  # dollars, commas and cents in prose
    ("15000 dollars", REF_BIG, 1, 0),  # a unit word
    ("#### 1,500", REF_BIG, 0, 1),
    ("#### 150,00", REF_BIG, 0, 0),  # a misplaced comma is not a thousands separator
    ("#### 0.5", "#### 1/2", 1, 1),  # a bare reference: fractions and decimals
    ("#### 25", "#### 25%", 1, 1),  # a percent sign in the reference
]


@pytest.mark.parametrize("completion,reference,correct,formatted", TABLE)
def test_gsm8k_verifier_and_format_by_hand(completion, reference, correct, formatted):
    ex = {"answer": reference}
    assert math_correct(completion, ex) == correct
    assert gsm8k_format(completion, ex) == formatted
    # verl's shape, with the bare number verl's GSM8K preprocessing stores as ground truth
    assert compute_score("openai/gsm8k", completion, reference.rpartition("####")[2].strip()) == correct


def test_weighted_rewards_sum_each_term_times_its_weight():
    cfg = build_config({"task": {"rewards": [
        {"fn": "rltpu.data.math_rewards:math_correct", "weight": 1.0, "kwargs": {"column": "ref"}},
        {"fn": "rltpu.data.math_rewards:gsm8k_format", "weight": 0.25}]}})
    assert cfg.task.reward_fn == "rltpu.data.rewards:weighted_sum"
    fn = load_reward_fn(cfg.task.reward_fn, cfg.task.reward_kwargs)
    ex = {"ref": REF}
    assert fn("#### 72", ex) == 1.25  # right and formatted
    assert fn("72 clips", ex) == 1.0  # right only
    assert fn("#### 73", ex) == 0.25  # formatted only
    assert fn("no idea", ex) == 0.0
    # the saved config reads back the same (reward_fn/kwargs derived from rewards, not a second setting)
    again = build_config(cfg.to_dict())
    assert (again.task.reward_fn, again.task.reward_kwargs) == (cfg.task.reward_fn, cfg.task.reward_kwargs)


class _Inline:
    """``RayRewardWorkers``' five methods in this process: the real ``RewardFnWorker``, answering at once."""

    def __init__(self, task):
        self.task = task

    def spawn(self, slot, incarnation):
        t = self.task
        return RewardFnWorker(slot, t.reward_fn, dict(t.reward_kwargs), t.reward_timeout_s, t.reward_concurrency)

    def call(self, handle, texts, examples):
        return handle.score(texts, examples)

    def wait(self, refs, timeout):
        return list(refs)

    def get(self, ref):
        return ref

    def kill(self, handle):
        pass


def test_each_weighted_term_logs_its_own_mean_per_step():
    task = build_config({"task": {"reward_workers": 2, "rewards": [
        {"fn": "rltpu.data.math_rewards:math_correct", "weight": 1.0, "kwargs": {"column": "ref"}},
        {"fn": "rltpu.data.math_rewards:gsm8k_format", "weight": 0.25}]}}).task
    pool = RewardPool(task, _Inline(task), log=lambda _line: None)
    pool.start()
    pool.begin_step(1)
    texts = ["#### 72", "72 clips", "#### 73", "no idea", "72", "#### 72"]
    examples = [{"ref": REF}] * 5 + [{"id": 9}]  # the last has no 'ref' column: math_correct raises
    values = pool.collect(pool.submit(texts, examples))
    assert values.tolist() == [1.25, 1.0, 0.25, 0.0, 1.0, task.reward_default]
    m = pool.step_metrics()
    # by hand over the 5 scored rows (the failed one is left out): correct 1,1,0,0,1; format 1,0,1,0,0
    assert m["reward_term_math_correct_mean"] == pytest.approx(0.6)
    assert m["reward_term_gsm8k_format_mean"] == pytest.approx(0.4)
    assert m["reward_errors"] == 1 and m["reward_calls"] == 6
    assert group_key("reward_term_gsm8k_format_mean") == "reward/term_gsm8k_format_mean"
    assert term_metric_names([{"fn": "a:f"}, {"fn": "b:f"}]) == ["reward_term_f_mean", "reward_term_f_2_mean"]
    pool.begin_step(2)  # a new step's means start over
    pool.collect(pool.submit(["#### 73"], [{"ref": REF}]))
    m = pool.step_metrics()
    assert (m["reward_term_math_correct_mean"], m["reward_term_gsm8k_format_mean"]) == (0.0, 1.0)


def test_rewards_list_is_checked_in_one_line():
    with pytest.raises(ConfigError, match="set rewards .* or reward_fn / reward_kwargs, not both"):
        build_config({"task": {"rewards": [{"fn": "a:b"}], "reward_fn": "rltpu.data.rewards:exact_answer"}})
    with pytest.raises(ConfigError, match="rewards is empty"):
        build_config({"task": {"rewards": []}})
    with pytest.raises(ConfigError, match="fn must be 'module:function'"):
        build_config({"task": {"rewards": [{"fn": "no_colon"}]}})
    # a term that cannot be imported fails when the driver loads the function (before Ray starts)
    with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
        load_reward_fn("rltpu.data.rewards:weighted_sum", {"terms": [{"fn": "no_such_module:f"}]})


def test_a_failing_term_is_named_in_the_error():
    fn = load_reward_fn("rltpu.data.rewards:weighted_sum",
                        {"terms": [{"fn": "rltpu.data.math_rewards:math_correct", "kwargs": {"column": "missing"}}]})
    with pytest.raises(RuntimeError, match="rltpu.data.math_rewards:math_correct: .*no 'missing' column"):
        fn("#### 1", {"answer": "#### 1"})


def test_verl_score_runs_a_verl_compute_score_on_nested_columns():
    """A row of verl's GSM8K parquet: data_source and reward_model.ground_truth; extra_info is the row."""
    row = {"data_source": "openai/gsm8k", "reward_model": {"style": "rule", "ground_truth": "72"}}
    fn = load_reward_fn("rltpu.data.rewards:verl_score", {"fn": "rltpu.data.math_rewards:compute_score",
                                                          "ground_truth": "reward_model.ground_truth"})
    assert fn("#### 72", row) == 1.0 and fn("#### 71", row) == 0.0
    seen = {}

    def dict_score(data_source, solution_str, ground_truth, extra_info=None):
        seen.update(source=data_source, extra=extra_info)
        return {"score": 0.5 if solution_str == ground_truth else 0.0, "acc": True}

    import sys
    import types

    mod = types.ModuleType("verl_like_rewards")
    mod.dict_score = dict_score
    sys.modules["verl_like_rewards"] = mod
    try:
        g = load_reward_fn("rltpu.data.rewards:verl_score", {"fn": "verl_like_rewards:dict_score",
                                                             "ground_truth": "reward_model.ground_truth"})
        assert g("72", row) == 0.5 and seen == {"source": "openai/gsm8k", "extra": row}
    finally:
        del sys.modules["verl_like_rewards"]


def test_math_correct_works_on_reward_worker_threads():
    """math-verify's own timeouts use signal.alarm (main thread only); reward workers call on threads."""
    from rltpu.data.rewards import DeadlineRunner

    runner = DeadlineRunner(math_correct, timeout_s=30, concurrency=4)
    out = runner.run([("#### 72", {"answer": REF}), ("#### 7", {"answer": REF})] * 4)
    assert [(v, k) for v, k, _ in out] == [(1.0, "ok"), (0.0, "ok")] * 4
