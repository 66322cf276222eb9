"""The planner only offers what `rltpu train` runs (issue 16 points 5 and 6): a sampler process with
k chips runs (a k-device JAX mesh, ``rltpu.sampling.tp``) and is costed with the memory its mesh
really holds per chip; a trainer block of k chips runs as k one-chip FSDP x TP ranks
(``learner/tp.py``); layouts the runtime refuses (``rltpu.chips.topology.unimplemented_parallelism``,
the check `rltpu train` makes) are costed and shown with the reason, never the winner, never written
by --write-config.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import yaml  # noqa: E402

from rltpu.chips.topology import ChipTable, Role, assign_roles, unimplemented_parallelism  # noqa: E402
from rltpu.config import load_config  # noqa: E402
from rltpu.models.spec import param_shapes  # noqa: E402
from rltpu.plan import costmodel as cm  # noqa: E402
from rltpu.plan.planner import make_plan  # noqa: E402
from rltpu.plan.report import html_page, markdown  # noqa: E402
from rltpu.plan.shapes import ModelShape  # noqa: E402
from rltpu.plan.writer import placed_config  # noqa: E402
from rltpu.sampling import tp  # noqa: E402
from test_plan import LLAMA_1B, LLAMA_8B, write_cfg  # noqa: E402

COLOCATED_TP = "tensor parallelism inside colocated processes is not implemented"


def test_the_check_names_what_is_missing():
    assert unimplemented_parallelism(1, 1) == ""
    assert unimplemented_parallelism(2, 1) == unimplemented_parallelism(8, 1) == ""  # sampler TP runs
    assert unimplemented_parallelism(1, 8) == unimplemented_parallelism(4, 4) == ""  # trainer TP runs
    line = unimplemented_parallelism(4, 4, mode="colocated")
    assert COLOCATED_TP in line and "placement.mode=disaggregated" in line and "\n" not in line
    assert unimplemented_parallelism(1, 1, mode="colocated") == ""
    assert unimplemented_parallelism(2, 2, full=False, mode="colocated") == \
        f"colocated chips_per_process=2: {COLOCATED_TP}"


@pytest.mark.parametrize("model, k", [(LLAMA_1B, 2), (LLAMA_1B, 4), (LLAMA_8B, 8),
                                      ({**LLAMA_1B, "vocab_size": 128_257}, 4)])
def test_sampler_memory_is_what_the_mesh_holds_per_chip(model, k):
    """The planner's per-chip sampler weights equal the bytes ``rltpu.sampling.tp`` puts on each
    device (by shapes: GQA k/v split gcd(kv_heads, k) ways, norms and an odd vocabulary whole)."""
    from rltpu.config import ModelConfig

    mcfg = ModelConfig(**model, dtype="bfloat16")
    vocab = model["vocab_size"]
    shapes = param_shapes(mcfg, vocab)
    layout = tp.plan(mcfg, vocab, k)
    per_device = sum(tp.expected_device_bytes(shapes, dict.fromkeys(shapes, 2), layout).values())
    assert cm.sampler_weight_bytes(ModelShape.from_config(mcfg, vocab), k) == pytest.approx(per_device, rel=1e-12)
    whole = sum(int(np.prod(s)) for s in shapes.values()) * 2
    table = vocab * mcfg.hidden_size * 2  # one vocabulary table (tied: the only one), bf16
    if vocab % k == 0:
        assert per_device < whole / k * 1.2  # about 1/k: only the norms (and GQA's k/v) are not split k ways
    else:  # an indivisible vocabulary stays whole on every chip
        assert per_device > whole / k + table * (1 - 1 / k) * 0.99


def _1b_on_v5e_16(tmp_path):
    return load_config(write_cfg(
        tmp_path, "l1b", cluster={"generation": "v5e", "topology": "4x4"},
        placement={"sampler_chips": 8, "trainer_chips": 8}, model={**LLAMA_1B, "dtype": "bfloat16"},
        sampler={"group_size": 8, "max_new_tokens": 256, "batch_buckets": [16, 32, 64, 128], "prompt_buckets": [256]},
        trainer={"prompts_per_step": 16}, backend={"matmul_precision": "medium"}))


def test_refused_candidates_are_reported_but_never_win_nor_written(tmp_path):
    """A 1B model on a v5e-16: sampler- and trainer-TP layouts run and compete; layouts the runtime refuses are
    still enumerated and costed, each says why, and none is the winner, ahead of a runnable one in
    the ranking, or written by --write-config."""
    plan = make_plan(_1b_on_v5e_16(tmp_path))
    multi = [c for c in plan.candidates if c.chips_per_sampler > 1 or c.chips_per_trainer > 1]
    refused = [c for c in multi if not c.runnable]
    assert refused
    for c in multi:
        if c.mode == "colocated":
            assert c.not_runnable == f"colocated chips_per_process={c.chips_per_sampler}: {COLOCATED_TP}"
        else:  # a sampler mesh over its chips, a trainer block as a TP group: runs
            assert c.runnable, c.not_runnable
    assert any(c.runnable and c.chips_per_trainer > 1 for c in multi)
    tp4 = next(c for c in multi if c.mode != "colocated" and c.chips_per_sampler == 4 and c.chips_per_trainer == 1)
    assert tp4.runnable and tp4.feasible
    assert tp4.memory["sampler"]["weights"] == pytest.approx(cm.sampler_weight_bytes(plan.model, 4))

    win = plan.winner
    assert win is not None and win.runnable and win is plan.best_runnable
    # ranking: every feasible runnable candidate before any feasible refused one
    flags = [c.runnable for c in plan.feasible]
    assert flags == sorted(flags, reverse=True) and flags[0]
    data = placed_config(plan)
    assert (data["placement"]["chips_per_sampler"], data["placement"]["chips_per_trainer"]) == \
        (win.chips_per_sampler, win.chips_per_trainer)
    again = load_config(_write(tmp_path, data))
    assign_roles(ChipTable.build(again.cluster, emulated=True), again.placement)

    # the report shows the refused ones with the reason, and the JSON says it per candidate
    md = markdown(plan, top=len(plan.candidates))
    assert COLOCATED_TP in md
    assert f"## Winner: {win.name}" in md
    js = plan.to_json()
    assert js["winner"] == win.name
    rows = {c["name"]: c for c in js["candidates"]}
    assert rows[tp4.name]["runnable"] is True and rows[tp4.name]["not_runnable"] == ""
    bad = refused[0]
    assert rows[bad.name]["runnable"] is False and rows[bad.name]["not_runnable"] == bad.not_runnable
    html_page(plan, top=40)


def test_when_only_a_sampler_mesh_fits_it_wins_and_is_written(tmp_path):
    """8B in bf16 on a v5e-16: a whole copy of the weights (16 GB) fills a 16 GB chip, so only
    samplers with 2 or more chips fit. The runtime runs them: one wins, --write-config writes it
    and the train-time checks accept it."""
    cfg = load_config(write_cfg(
        tmp_path, "l8b", cluster={"generation": "v5e", "topology": "4x4"},
        placement={"sampler_chips": 8, "trainer_chips": 8}, model={**LLAMA_8B, "dtype": "bfloat16"},
        sampler={"group_size": 4, "max_new_tokens": 256, "batch_buckets": [16, 32, 64], "prompt_buckets": [256]},
        trainer={"prompts_per_step": 16}, backend={"matmul_precision": "medium"}))
    plan = make_plan(cfg)
    assert plan.feasible and all(c.chips_per_sampler > 1 for c in plan.feasible if c.mode != "colocated")
    win = plan.winner
    assert win is not None and win.runnable and win.chips_per_sampler > 1
    assert win.peak_bytes()["sampler"] <= plan.hw.hbm_bytes
    data = placed_config(plan)
    assert data["placement"]["chips_per_sampler"] == win.chips_per_sampler
    again = load_config(_write(tmp_path, data))
    roles = assign_roles(ChipTable.build(again.cluster, emulated=True), again.placement)
    assert all(len(chips) == win.chips_per_sampler for chips in roles[Role.SAMPLER])
    assert f"## Winner: {win.name}" in markdown(plan)
    html_page(plan)


def _write(tmp_path, data):
    out = tmp_path / "placed.yaml"
    out.write_text(yaml.safe_dump(data))
    return out


def test_a_model_that_does_not_split_is_not_runnable_at_that_width(tmp_path):
    """14 heads and 2 kv heads (Qwen2-0.5B's attention): a sampler mesh of 4 or a trainer TP group of 4
    would be refused by the runtime (heads do not divide), so the planner never offers them; 2 is fine
    for both."""
    cfg = load_config(write_cfg(
        tmp_path, "q05", cluster={"generation": "v5e", "topology": "4x4"},
        placement={"sampler_chips": 8, "trainer_chips": 8},
        model={**LLAMA_1B, "num_attention_heads": 14, "num_key_value_heads": 2, "hidden_size": 896,
               "intermediate_size": 4864, "dtype": "bfloat16"},
        sampler={"group_size": 8, "max_new_tokens": 256, "batch_buckets": [16, 32, 64, 128], "prompt_buckets": [256]},
        trainer={"prompts_per_step": 16}, backend={"matmul_precision": "medium"}))
    plan = make_plan(cfg)
    by_width = {}
    for c in plan.candidates:
        if c.mode != "colocated":
            by_width.setdefault((c.chips_per_sampler, c.chips_per_trainer), c)
    assert by_width[(4, 1)].not_runnable == "chips_per_sampler=4: model num_attention_heads=14 does not divide by 4"
    assert by_width[(1, 4)].not_runnable == "chips_per_trainer=4: model num_attention_heads=14 does not divide by 4"
    assert by_width[(2, 2)].runnable
    assert plan.winner is not None and plan.winner.runnable
