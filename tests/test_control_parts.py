"""The controller's parts that need no Ray: prompt draws and the ledger, the async rollout queue's
rewind point, and the per-step metrics line."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from rltpu.config import RunConfig
from rltpu.control.records import StepTimes, step_record
from rltpu.control.rollouts import PromptDraws, Rollout, RolloutQueue
from rltpu.data.synthetic import SyntheticPromptDataset
from rltpu.observe.ledger import Ledger, check, effective, read_ledger


def _data(n: int = 10) -> SyntheticPromptDataset:
    return SyntheticPromptDataset("copy", n, seed=3, min_digits=2, max_digits=4)


def test_draws_reach_the_ledger_only_on_commit_and_rewind_redraws_the_same_prompts(tmp_path):
    data = _data()
    draws = PromptDraws(data, Ledger(tmp_path / "ledger.jsonl"))
    first = draws.draw(3)
    assert len(draws.pending) == 3 and not (tmp_path / "ledger.jsonl").exists()
    draws.commit(1, version=0)
    before = data.state_dict()
    second = draws.draw(3)
    draws.rewind(before)  # step 2 failed before its batch reached the trainers
    assert draws.pending == []
    again = draws.draw(3)
    assert [e["id"] for e in again] == [e["id"] for e in second]
    draws.commit(2, version=1)
    lines = read_ledger(tmp_path / "ledger.jsonl")
    assert [ln["step"] for ln in lines] == [1, 2]
    assert lines[0]["prompts"] == [f"0:{i}:{e['id']}" for i, e in enumerate(first)]
    assert check(lines, steps=2, per_step=3) == []  # contiguous positions, nothing replayed
    assert sorted(effective(lines)) == [1, 2]


def test_rollout_queue_rewinds_to_before_the_oldest_untrained_rollout():
    data = _data()
    q = RolloutQueue()
    assert q.untrained_data_state(data) == data.state_dict()
    cursors = []
    for step in (1, 2, 3):
        cursors.append(data.state_dict())
        data.next_batch(2)
        q.inflight.append(Rollout(step, cursors[-1], [f"p{step}a", f"p{step}b"], [], [], seed=step))
    assert q.last_step(default=0) == 3
    assert q.untrained_data_state(data) == cursors[0]
    q.current = q.inflight.popleft()  # step 1 is being trained on: its prompts are still untrained
    assert q.untrained_data_state(data) == cursors[0]
    assert q.prompts_in_flight() == ["p1a", "p1b", "p2a", "p2b", "p3a", "p3b"]
    q.current = None  # step 1's batch reached the trainers
    assert q.untrained_data_state(data) == cursors[1]
    assert q.drop(data) == cursors[1] and not q.inflight and q.prompts_in_flight() == []


def _stats(tokens: int, pg: float, seconds: float) -> dict:
    return {"tokens": tokens, "pg_sum": pg, "kl_sum": 0.0, "entropy_sum": 2.0 * tokens, "clipped": 0.0,
            "logp_gap_sum": 0.0, "grad_norm": 1.5, "lr": 1e-3, "micro_batches": 1, "train_padding_frac": 0.25,
            "seconds": seconds}


def _out(seconds: float, new_tokens: int) -> dict:
    return {"padded_slots": 10, "total_slots": 40, "seconds": seconds, "new_tokens": new_tokens, "compiles": 0,
            "compile_seconds": 0.0, "program_seconds": seconds, "host_seconds": 0.01}


def test_step_record_means_over_the_global_batch_not_per_rank():
    cfg = RunConfig()
    gen = {"lengths": np.array([2, 4, 6, 8]), "versions": np.array([3, 3, 2, 3])}
    times = StepTimes(t_step=time.perf_counter() - 1.0, sample_s=0.5, train_s=0.25)
    rec = step_record(cfg, step=4, version=4, emulated=True, gen=gen, rewards=np.array([0.0, 1.0, 0.5, 0.5]),
                      outs=[_out(0.2, 30), _out(0.4, 50)], n_samplers=2, extra={}, batch={"loss_mask": np.ones(4)},
                      kl=None, stats=[_stats(10, 1.0, 0.2), _stats(30, -5.0, 0.3)], sync=None, probe=None,
                      times=times, reward_parts={"reward_rule_mean": 0.5}, sync_generation=1,
                      sampler_weight_versions=[3, 3], data_cursor=_data().cursor)
    assert rec["loss"] == (1.0 - 5.0) / 40  # token-weighted over both ranks, not (0.1 - 0.1667) / 2
    assert rec["entropy"] == 2.0
    assert rec["reward_mean"] == 0.5 and rec["response_len"] == 5.0
    assert rec["sampler_busy_s"] == (0.2 + 0.4) / 2 and rec["trainer_busy_s"] == 0.3
    assert rec["new_tokens_per_s"] == 80 / 0.5  # on-policy: over the sample phase
    assert rec["padding_frac"] == 20 / 80
    assert rec["sampler_versions"] == [2, 3]
    assert rec["sync_s"] is None and rec["sync_bytes"] is None  # interrupted after its update: no sync figures
    assert rec["step_s"] >= 1.0


def test_compile_cache_dir_config_then_env_then_user_cache_then_run_dir(tmp_path, monkeypatch, capsys):
    """``sampler.compile_cache_dir`` wins, then ``RLTPU_COMPILE_CACHE_DIR`` (a cache shared by many runs,
    as this suite sets it), then the user's private cache (per CPU), then ``<run_dir>/jax_cache`` when the
    user's cache is writable by others; ``compile_cache: false`` turns it off."""
    import stat
    from types import SimpleNamespace

    from rltpu.config import load_config
    from rltpu.control.controller import Controller, host_fingerprint

    def where(*overrides):
        cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml", list(overrides))
        return Controller._cache_dir(SimpleNamespace(cfg=cfg, run_dir=tmp_path / "run"))

    monkeypatch.delenv("RLTPU_COMPILE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    mine = tmp_path / "xdg" / "rltpu" / "jax" / host_fingerprint()
    assert where() == str(mine.resolve())
    assert stat.S_IMODE(mine.stat().st_mode) & 0o077 == 0  # made private: it holds executables the samplers run
    (tmp_path / "xdg" / "rltpu").chmod(0o777)  # another user could swap what is under it
    assert where() == str((tmp_path / "run" / "jax_cache").resolve())
    assert "shared compile cache is off" in capsys.readouterr().err
    monkeypatch.setenv("RLTPU_COMPILE_CACHE_DIR", str(tmp_path / "shared"))
    assert where() == str((tmp_path / "shared").resolve())
    assert where(f"sampler.compile_cache_dir={tmp_path / 'mine'}") == str((tmp_path / "mine").resolve())
    assert where("sampler.compile_cache=false") is None
