"""README's figures come from the newest committed results file of ``benchmarks/all.py``.

Every figure block in README.md (``<!-- bench:NAME -->`` ... ``<!-- /bench:NAME -->``) must equal
what ``benchmarks/all.py`` renders from the newest committed ``benchmarks/results/*.json``: editing
a figure by hand, or citing an older file, fails here; ``python benchmarks/all.py --readme``
rewrites the blocks after a new measurement. Each test bound a block quotes must still be in its
test file. Fast: reads JSON and text, runs nothing.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _load_all():
    spec = importlib.util.spec_from_file_location("bench_all", ROOT / "benchmarks" / "all.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bench = _load_all()


@pytest.fixture(scope="module")
def latest():
    path = bench.latest_results(committed=True)
    assert path is not None, "no committed benchmarks/results/*.json: run benchmarks/all.py and commit its file"
    return path, json.loads(path.read_text())


def test_results_file_records_machine_load_and_commit(latest):
    path, doc = latest
    m = doc["machine"]
    assert path.name == f"{bench.machine_slug(m)}-{doc['date']}.json"
    assert m["cpu_model"] and m["cores"] >= 1 and m["ram_gib"] > 0 and m["platform"]
    assert re.fullmatch(r"[0-9a-f]{40}", doc["commit"]) and isinstance(doc["dirty"], bool)
    for name, part in doc["parts"].items():
        assert part["command"].split()[1].startswith("benchmarks/"), (name, part["command"])
        assert re.fullmatch(r"[0-9a-f]{40}", part["commit"]), name
        assert len(part["loadavg_before"]) == 3 and len(part["loadavg_after"]) == 3, name
        assert part["load_during"]["samples"] >= 1 and part["wall_s"] > 0, name


@pytest.mark.parametrize("name", list(bench.BLOCKS))
def test_readme_block_is_what_the_results_file_holds(latest, name):
    path, doc = latest
    found = bench.block_re(name).search(README)
    assert found, f"README.md has no <!-- bench:{name} --> block"
    want = bench.render(name, doc, path)
    assert found.group(2) == want, (
        f"README's {name!r} figures differ from {path.name}; re-measure (benchmarks/all.py --only ...) and run "
        f"`python benchmarks/all.py --readme`, or restore the block:\n{want}")


def test_readme_cites_only_the_latest_results_file(latest):
    path, _ = latest
    cited = set(re.findall(r"benchmarks/results/([\w.-]+\.json)", README))
    assert cited == {path.name}, cited


def test_readme_has_no_unsourced_approximations():
    outside = README
    for name in bench.BLOCKS:
        outside = bench.block_re(name).sub("", outside)
    assert "another run" not in outside
    assert not re.search(r"~\s?\d", outside), re.findall(r".{30}~\s?\d.{20}", outside)


@pytest.mark.parametrize("test_file,code", bench.TEST_BOUNDS)
def test_quoted_bounds_are_what_the_tests_check(test_file, code):
    assert code in (ROOT / test_file).read_text(), f"{test_file} no longer runs `{code}`: update README and TEST_BOUNDS"
