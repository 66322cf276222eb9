"""Acceptance for reward workers and evaluation, through the CLI (issue 18, acceptance 2 and 3):
the quickstart for 4 steps with a reward that sleeps past its deadline on the examples whose id is
0 mod 10 and raises on 1 mod 10 (about 10% of calls each), and a held-out evaluation every 2 steps.

Every step finishes; per step the counters equal the injected faults exactly (16 samples per faulty
prompt, prompts read back from the ledger); the driver never waits on rewards much past the 1 s
deadline; the ledger shows every prompt once; eval figures land in metrics.jsonl and the dashboard,
and no evaluation prompt reaches the ledger.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rltpu.observe.ledger import check, effective, read_ledger
from rltpu.observe.metrics import read_metrics

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0")
G, PROMPTS, STEPS, TIMEOUT_S = 16, 64, 4, 1.0


@pytest.mark.serial
def test_faulty_rewards_are_defaulted_counted_and_bounded_and_eval_stays_out_of_training(joined_quickstart_run):
    # the run (tests/conftest.py, shared with test_e2e.py's joined-cluster check): the quickstart for STEPS
    # steps, task.reward_fn=tests.reward_faults:faulty_partial_credit with task.reward_timeout_s=TIMEOUT_S and
    # task.reward_max_failure_frac=0.5, 8 held-out digit strings (run.digits) as eval.dataset every 2 steps (4 samples, k=2)
    run = joined_quickstart_run
    assert (run.steps, run.timeout_s) == (STEPS, TIMEOUT_S)
    run_dir, res, wall, digits = run.run_dir, run.res, run.wall, run.digits
    assert res.returncode == 0, res.stderr[-3000:]

    m = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in m] == list(range(1, STEPS + 1))
    ledger = read_ledger(run_dir / "ledger.jsonl")
    assert check(ledger, STEPS, PROMPTS) == []  # every prompt exactly once, in order
    steps = effective(ledger)
    for r in m:
        ids = [int(p.split(":")[2]) for p in steps[r["step"]]]
        injected_timeouts, injected_errors = G * sum(i % 10 == 0 for i in ids), G * sum(i % 10 == 1 for i in ids)
        assert (r["reward_calls"], r["reward_timeouts"], r["reward_errors"]) == \
               (PROMPTS * G, injected_timeouts, injected_errors), (r["step"], ids)
        # scoring overlaps: the driver waits about one deadline for all of a step's hanging calls
        assert r["reward_wait_s"] <= TIMEOUT_S + 1.5, r
        assert r["step_s"] <= r["sample_s"] + r["train_s"] + (r["sync_s"] or 0) + 1.0, r
        assert r["sample_s"] <= TIMEOUT_S + 6.0, r  # generation + scoring, under load
    total = sum(r["reward_timeouts"] + r["reward_errors"] for r in m)
    failures = [json.loads(line) for line in (run_dir / "reward_failures.jsonl").read_text().splitlines()]
    assert len(failures) == total and {f["kind"] for f in failures} == {"timeout", "error"}
    assert sum("raised on" in line and "tests.reward_faults:faulty_partial_credit" in line
               for line in res.stderr.splitlines()) == sum(r["reward_errors"] > 0 for r in m)  # one line a step

    evals = [r for r in m if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [2, 4]
    for r in evals:
        assert 0 <= r["eval/accuracy"] <= 1 and 0 <= r["eval/mean@k"] <= r["eval/pass@k"] <= 1
        assert r["eval/prompts"] == len(digits) and r["eval/samples"] == 4 and r["eval/reward_failures"] == 0
    assert "eval-" not in (run_dir / "ledger.jsonl").read_text()  # eval prompts never reach the ledger

    status = subprocess.run([sys.executable, "-m", "rltpu.cli", "status", str(run_dir)], cwd=ROOT, env=ENV,
                            capture_output=True, text=True, timeout=60)
    line = next(ln for ln in status.stdout.splitlines() if ln.startswith("rewards:"))
    last = m[-1]
    assert f"step {STEPS}: {last['reward_errors']} errors, {last['reward_timeouts']} timeouts" in line, line
    from rltpu.observe.dashboard import page, prometheus

    html = page(run_dir)
    assert 'id="reward-failures"' in html and "eval/pass@k" in html
    assert f"rltpu_eval_pass_at_k {evals[-1]['eval/pass@k']}" in prometheus(run_dir)
    print(f"\nwall {wall:.0f}s; per step: " + "; ".join(
        f"{r['step']}: {r['reward_timeouts']} timeouts {r['reward_errors']} errors, wait {r['reward_wait_s']:.2f}s, "
        f"sample {r['sample_s']:.2f}s, step {r['step_s']:.2f}s" for r in m))
