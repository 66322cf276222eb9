"""`rltpu plan` at the scale it talks about (issue 16 point 7): a Llama-3-8B shape on the 6,144-chip
v5p slice (configs/plan_llama8b_v5p_6144.yaml). Candidates are costed from actor counts per host
(``place_counts``) instead of a chip list per actor; these tests check that the count path gives
exactly what the per-chip path (``assign_roles``, ``make_plan(detailed=True)``) gives, and that the
reports summarise by host and slice while the full rank table stays in plan.json and ranks.csv.
Speed is measured by benchmarks/plan_scale.py, not asserted here.
"""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from rltpu.chips.topology import ChipTable, Role, assign_roles, place_counts
from rltpu.config import ClusterConfig, ConfigError, PlacementConfig, load_config
from rltpu.plan.candidates import Candidate, evaluate
from rltpu.plan.planner import make_plan
from rltpu.plan.report import markdown
from test_plan import FAKE_BENCH, LLAMA_1B, QUICKSTART, _browser, _chromium, write_cfg

ROOT = Path(__file__).resolve().parents[1]
BIG = ROOT / "configs" / "plan_llama8b_v5p_6144.yaml"


def _same(a: Candidate, b: Candidate) -> None:
    """Every figure a plan reports for a candidate, compared exactly."""
    for k in ("name", "feasible", "reason", "memory", "capacity", "warnings", "checkpointing", "micro_rows",
              "sampler_tp", "trainer_fsdp", "trainer_tp", "as_configured", "runnable"):
        assert getattr(a, k) == getattr(b, k), (a.name, k)
    assert (a.phases.as_dict() if a.phases else None) == (b.phases.as_dict() if b.phases else None), a.name
    assert [h.__dict__ for h in a.route] == [h.__dict__ for h in b.route], a.name
    assert a.ranks == b.ranks, a.name


# -- the count path equals the per-chip path --------------------------------------------------------

def _runs_as_hosts(table: ChipTable, runs) -> list[tuple[tuple[int, int], int]]:
    hosts = table.hosts()
    return [(hosts[i], a) for first, n, a in runs for i in range(first, first + n)]


def _actors_as_hosts(actors) -> list[tuple[tuple[int, int], int]]:
    out: list = []
    for chips in actors:
        key = (chips[0].slice, chips[0].host)
        if out and out[-1][0] == key:
            out[-1] = (key, out[-1][1] + 1)
        else:
            out.append((key, 1))
    return out


@pytest.mark.parametrize("cluster, placement", [
    (("v5p", "4x4x4", 1), dict(sampler_chips=6, trainer_chips=56)),
    (("v5p", "4x4x4", 1), dict(sampler_chips=6, trainer_chips=56, chips_per_trainer=4)),  # a host left part-used
    (("v5p", "4x4x4", 1), dict(sampler_chips=3, trainer_chips=60, chips_per_trainer=2)),  # a hole no pair fits
    (("v5p", "2x2x1", 3), dict(sampler_chips=5, trainer_chips=6, chips_per_trainer=2)),
    (("v5e", "2x4", 2), dict(sampler_chips=2, trainer_chips=8, chips_per_trainer=8)),
    (("v5e", "4x4", 1), dict(sampler_chips=1, trainer_chips=6, chips_per_trainer=2, reward_chips=8,
                             chips_per_reward=4)),
    (("v5e", "4x4", 1), dict(sampler_chips=8, trainer_chips=9)),  # more chips than the slice
    (("v5p", "2x2x2", 1), dict(sampler_chips=2, trainer_chips=4, chips_per_trainer=4)),  # two hosts of 4
    (("v5p", "4x4x4", 1), dict(sampler_chips=8, trainer_chips=8, chips_per_trainer=8)),  # a process spans hosts
])
def test_place_counts_is_assign_roles_by_host(cluster, placement):
    gen, topo, slices = cluster
    table = ChipTable.build(ClusterConfig(generation=gen, topology=topo, slices=slices), emulated=False)
    p = PlacementConfig(**placement)
    try:
        want = assign_roles(table, p)
    except ConfigError as err:
        with pytest.raises(ConfigError) as got:
            place_counts(table, p)
        assert str(got.value) == str(err)
        return
    got = place_counts(table, p)
    for role in Role:
        assert _runs_as_hosts(table, got[role]) == _actors_as_hosts(want[role]), role


def _8b(**over):
    """The 6,144-chip config on a smaller slice (the per-chip path is quick there too)."""
    return load_config(BIG, [f"{k}={v}" for k, v in over.items()])


@pytest.mark.parametrize("cfg, hw", [
    pytest.param(lambda tmp: _8b(**{"cluster.topology": "4x4x8", "placement.sampler_chips": 64,
                                    "placement.trainer_chips": 64, "trainer.prompts_per_step": 64}), "v5p",
                 id="v5p-128"),
    pytest.param(lambda tmp: load_config(write_cfg(
        tmp, "two", cluster={"generation": "v5p", "topology": "2x2x1", "slices": 2},
        placement={"sampler_chips": 4, "trainer_chips": 4}, model={**LLAMA_1B, "dtype": "bfloat16"},
        sampler={"group_size": 8, "max_new_tokens": 128, "batch_buckets": [16, 32, 64, 128], "prompt_buckets": [128]},
        trainer={"prompts_per_step": 48})), "v5p", id="v5p-2-slices"),
    pytest.param(lambda tmp: load_config(write_cfg(
        tmp, "v5e16", cluster={"generation": "v5e", "topology": "4x4"},
        placement={"sampler_chips": 8, "trainer_chips": 8}, model={**LLAMA_1B, "dtype": "bfloat16"},
        sampler={"group_size": 8, "max_new_tokens": 256, "batch_buckets": [16, 32, 64, 128], "prompt_buckets": [256]},
        trainer={"prompts_per_step": 16})), "v5e", id="v5e-16-tp"),
    pytest.param(lambda tmp: load_config(QUICKSTART), "cpu", id="quickstart-cpu"),
])
def test_count_path_ranks_and_costs_like_the_per_chip_path(cfg, hw, tmp_path):
    """Every candidate, in order, with the same memory, phases, route, warnings, reasons and rank
    table; so the same winner at the same cost. The cpu entry covers the emulated capacity (RAM
    shared by the busiest host's chips) and the colocated candidates."""
    cfg = cfg(tmp_path)
    bench = FAKE_BENCH if hw == "cpu" else None
    fast, slow = make_plan(cfg, hw, bench), make_plan(cfg, hw, bench, detailed=True)
    assert [c.name for c in fast.candidates] == [c.name for c in slow.candidates]
    assert len(fast.candidates) > 10 and fast.winner is not None and slow.winner is not None
    for a, b in zip(fast.candidates, slow.candidates):
        _same(a, b)
    assert fast.winner.name == slow.winner.name
    assert fast.winner.phases.step == slow.winner.phases.step
    assert fast.to_json() == slow.to_json()


# -- the 6,144-chip plan ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def big(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan6144")
    res = subprocess.run([sys.executable, "-m", "rltpu.cli", "plan", str(BIG), "--hardware", "v5p", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    return out, res.stdout


def test_6144_chip_report_summarises_by_host_and_keeps_every_rank_in_the_json(big):
    out, stdout = big
    page = (out / "plan.html").read_text()
    assert len(page.encode()) <= 2 * 2**20
    for el in ("chip-map", "memory-bars", "timeline", "ranked", "ranks", "route", "label", "why"):
        assert f'id="{el}"' in page
    # the chip map: one cell per host (1,536 hosts of 4 chips), no cell per chip
    chip_map = page.split('id="chip-map"')[1].split("</svg>")[0]
    cells = [int(n) for n in re.findall(r'class="host" data-n="(\d+)"', chip_map)]
    assert len(cells) == 1536 and sum(cells) == 6144 and 'class="chip"' not in chip_map
    # details on demand: a closed <details> per slice, one row per host
    details = [d.split("</details>")[0] for d in page.split('<details class="slice-hosts"')[1:]]
    assert len(details) == 1 and details[0].count("<tr><td>") == 1536 and " open" not in details[0][:30]
    # the rank table on the page is a few runs of hosts, not 6,144 rows
    ranks = page.split('<table id="ranks">')[1].split("</table>")[0]
    assert 1 <= ranks.count("<tr><td>") <= 8

    plan = json.loads((out / "plan.json").read_text())
    assert plan["chips"] == 6144
    tables = {c["name"]: c["ranks"] for c in plan["candidates"] if c["ranks"] is not None}
    mine = next(c for c in plan["candidates"] if c["as_configured"])
    assert set(tables) <= {plan["winner"], mine["name"]} and mine["name"] in tables
    ranks = mine["ranks"]
    by_role = Counter(r["role"] for r in ranks)
    assert by_role == {"sampler": 2048, "trainer": 4096}
    ids = sorted(i for r in ranks for i in r["chips"])
    assert ids == list(range(6144))  # every chip once
    # ranks.csv: every rank of the chip map's candidate (the winner), one line each
    rows = list(csv.DictReader((out / "ranks.csv").read_text().splitlines()[1:]))
    win = next(c for c in plan["candidates"] if c["name"] == plan["winner"])
    assert len(rows) == len(tables[plan["winner"]]) == win["sampler_chips"] // win["chips_per_sampler"] + \
        win["trainer_chips"] // win["chips_per_trainer"]
    assert rows[0]["role"] == "sampler" and rows[0]["rank"] == "0"
    # the Markdown (stdout) summarises too
    assert stdout.count("\n") < 200 and "Rank -> chip, by runs of hosts" in stdout


@pytest.mark.skipif(_chromium() is None, reason="no Chromium (see test_plan.py's HTML check)")
def test_6144_chip_page_renders_with_every_chip_on_the_map(big, tmp_path):
    dom = _browser(["--dump-dom", (big[0] / "plan.html").as_uri()], tmp_path / "profile")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert 'data-check="ok"' in dom.stdout and 'data-chips="6144"' in dom.stdout


def test_6144_chip_winner_costs_what_the_per_chip_path_costs():
    """The winner (and the config's own placement) costed again over every chip with assign_roles:
    the same figures as the count path gave."""
    plan = make_plan(load_config(BIG), "v5p")
    assert plan.winner is not None and plan.table.num_chips == 6144
    for c in {id(c): c for c in (plan.winner, plan.as_configured)}.values():
        again = evaluate(Candidate(c.mode, c.sampler_chips, c.trainer_chips, c.chips_per_sampler, c.chips_per_trainer,
                                   reward_on=c.reward_on, as_configured=c.as_configured),
                         plan.cfg, plan.table, plan.hw, plan.model, plan.workload, detailed=True)
        _same(c, again)
    md = markdown(plan)
    assert len(md.splitlines()) < 200
