"""The planner only offers what `rltpu train` runs (issue 16 point 5, first part): layouts with more
than one chip per process (tensor parallelism) are costed and shown as what TP would give, marked not
runnable with the reason, never the winner, never written by --write-config; `rltpu train` refuses
them (tests/test_config_cli.py) with the same check (``rltpu.chips.topology.unimplemented_parallelism``).
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import pytest  # noqa: E402
import yaml  # noqa: E402

from rltpu.chips.topology import ChipTable, assign_roles, unimplemented_parallelism  # noqa: E402
from rltpu.config import ConfigError, load_config  # noqa: E402
from rltpu.plan.planner import make_plan  # noqa: E402
from rltpu.plan.report import html_page, markdown  # noqa: E402
from rltpu.plan.writer import placed_config  # noqa: E402
from test_plan import LLAMA_1B, LLAMA_8B, write_cfg  # noqa: E402

SAMPLER_TP = "sampler tensor parallelism is not implemented (issue 16)"
TRAINER_TP = "trainer tensor parallelism (FSDP x TP) is not implemented (issue 16)"


def test_the_check_names_what_is_missing():
    assert unimplemented_parallelism(1, 1) == ""
    assert SAMPLER_TP in unimplemented_parallelism(2, 1)
    assert SAMPLER_TP in unimplemented_parallelism(4, 4)  # colocated: the sampler's TP first
    assert TRAINER_TP in unimplemented_parallelism(1, 8)
    line = unimplemented_parallelism(1, 4)
    assert line.startswith("placement.chips_per_trainer=4: ") and "set placement.chips_per_trainer=1" in line
    assert "\n" not in line
    assert unimplemented_parallelism(2, 1, full=False) == f"chips_per_sampler=2: {SAMPLER_TP}"


def _1b_on_v5e_16(tmp_path):
    return load_config(write_cfg(
        tmp_path, "l1b", cluster={"generation": "v5e", "topology": "4x4"},
        placement={"sampler_chips": 8, "trainer_chips": 8}, model={**LLAMA_1B, "dtype": "bfloat16"},
        sampler={"group_size": 8, "max_new_tokens": 256, "batch_buckets": [16, 32, 64, 128], "prompt_buckets": [256]},
        trainer={"prompts_per_step": 16}, backend={"matmul_precision": "medium"}))


def test_tp_candidates_are_reported_but_never_win_nor_written(tmp_path):
    """A 1B model on a v5e-16: TP layouts are still enumerated and costed (memory divided by the
    chips of a process) and at least one fits; the winner, the ranking's head and the written config
    are runnable (one chip per process), every TP row says why it does not run."""
    plan = make_plan(_1b_on_v5e_16(tmp_path))
    tp = [c for c in plan.candidates if c.chips_per_sampler > 1 or c.chips_per_trainer > 1]
    assert tp and any(c.feasible for c in tp)
    for c in tp:
        assert not c.runnable
        assert c.not_runnable in (f"chips_per_sampler={c.chips_per_sampler}: {SAMPLER_TP}",
                                  f"chips_per_trainer={c.chips_per_trainer}: {TRAINER_TP}")
    tp4 = next(c for c in tp if c.mode != "colocated" and c.chips_per_sampler == 4 and c.chips_per_trainer == 1)
    tp1 = next(c for c in plan.candidates if (c.mode, c.sampler_chips, c.trainer_chips, c.chips_per_sampler,
                                                  c.chips_per_trainer) == (tp4.mode, tp4.sampler_chips,
                                                                           tp4.trainer_chips, 1, 1))
    assert tp4.memory["sampler"]["weights"] == pytest.approx(tp1.memory["sampler"]["weights"] / 4)  # TP is costed

    win = plan.winner
    assert win is not None and win.runnable and (win.chips_per_sampler, win.chips_per_trainer) == (1, 1)
    assert win is plan.best_runnable
    # ranking: every feasible runnable candidate before any feasible TP one, each group fastest first
    feas = plan.feasible
    flags = [c.runnable for c in feas]
    assert flags == sorted(flags, reverse=True) and flags[0] and not flags[-1]
    data = placed_config(plan)
    assert (data["placement"]["chips_per_sampler"], data["placement"]["chips_per_trainer"]) == (1, 1)
    again = load_config(_write(tmp_path, data))
    assign_roles(ChipTable.build(again.cluster, emulated=True), again.placement)

    # the report shows them, with the reason, and the JSON says it per candidate
    md = markdown(plan, top=40)
    assert SAMPLER_TP in md
    assert f"## Winner: {win.name}" in md
    js = plan.to_json()
    assert js["winner"] == win.name
    rows = {c["name"]: c for c in js["candidates"]}
    assert rows[tp4.name]["runnable"] is False and SAMPLER_TP in rows[tp4.name]["not_runnable"]
    assert rows[win.name]["not_runnable"] == ""
    faster_tp = plan.best_unrunnable
    if faster_tp.phases.step < win.phases.step:
        assert "Tensor parallelism would give" in plan.why() and SAMPLER_TP in plan.why()
    assert SAMPLER_TP in html_page(plan, top=40)


def test_when_only_tp_fits_there_is_no_winner_and_nothing_is_written(tmp_path):
    """8B in bf16 on a v5e-16: a whole copy of the weights (16 GB) fills a 16 GB chip, so only
    samplers with 2 or 4 chips (TP) fit. Before issue 16's first part the plan picked one and
    --write-config wrote a placement `rltpu train` leaves three quarters idle on; now: no winner."""
    cfg = load_config(write_cfg(
        tmp_path, "l8b", cluster={"generation": "v5e", "topology": "4x4"},
        placement={"sampler_chips": 8, "trainer_chips": 8}, model={**LLAMA_8B, "dtype": "bfloat16"},
        sampler={"group_size": 4, "max_new_tokens": 256, "batch_buckets": [16, 32, 64], "prompt_buckets": [256]},
        trainer={"prompts_per_step": 16}, backend={"matmul_precision": "medium"}))
    plan = make_plan(cfg)
    assert plan.feasible and all(not c.runnable for c in plan.feasible)  # only TP fits
    assert plan.winner is None and plan.best_runnable is None
    assert "No placement `rltpu train` can run fits" in plan.why() and SAMPLER_TP in plan.why()
    with pytest.raises(ConfigError, match=r"no placement that `rltpu train` can run fits.*tensor-parallel"):
        placed_config(plan)
    assert json.loads(json.dumps(plan.to_json(), default=str))["winner"] is None
    assert "## Winner" not in markdown(plan)
    html_page(plan)  # renders (the config's own placement on the chip map)


def _write(tmp_path, data):
    out = tmp_path / "placed.yaml"
    out.write_text(yaml.safe_dump(data))
    return out
