"""Acceptance (issue 32, item 3) end to end through the CLI: with the default checkpoint settings, a
trainer SIGKILLed at step 30 rewinds at most one cadence (10 steps), not to step 0; ``--resume PATH``
continues from a named, older checkpoint of the run, setting the newer one aside; and with
``checkpoint.hf_export`` the kept checkpoint's ``hf/`` loads in ``transformers`` with the weights
``rltpu export`` reads from its DCP parts."""

import os
import signal

import pytest
import torch
import transformers

from rltpu.models.hf.export import export_checkpoint
from rltpu.observe.ledger import check, read_ledger
from rltpu.observe.metrics import read_metrics

from procs import MECHANICS, MECHANICS_PROMPTS
from test_fault_tolerance import actor, finish, start, steps_done, wait_for

pytestmark = pytest.mark.slow
DEFAULT_EVERY = 10  # checkpoint.every_steps' default (the 30-minute clock never fires in this run)


def test_trainer_killed_at_step_30_rewinds_one_cadence_then_resume_from_a_named_checkpoint(tmp_path):
    run_dir, steps = tmp_path / "run", 33
    proc = start(run_dir, f"trainer.steps={steps}", "trainer.target_reward=null", *MECHANICS)
    try:
        wait_for(lambda: steps_done(run_dir) >= 29, proc, 600, "step 29")
        trainer = actor(run_dir, "trainer-0")
        wait_for(lambda: steps_done(run_dir) >= 30, proc, 120, "step 30", poll_s=0.01)
        done_at_kill = steps_done(run_dir)
        os.kill(trainer["pid"], signal.SIGKILL)
        finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    lines = read_ledger(run_dir / "ledger.jsonl")
    assert check(lines, steps, MECHANICS_PROMPTS) == []
    (rollback,) = [ln for ln in lines if "rollback_to" in ln]
    back = rollback["rollback_to"]
    # the newest periodic checkpoint: a multiple of the cadence, at most one cadence behind the kill
    assert back % DEFAULT_EVERY == 0 and 0 <= done_at_kill - back <= DEFAULT_EVERY and back >= 20, (back, done_at_kill)
    logged = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")]
    assert logged[-(steps - back):] == list(range(back + 1, steps + 1)), logged

    # --resume PATH: checkpoint.prev is the periodic one of step 30 (checkpoint/ is the final, step 33)
    proc = start(run_dir, "trainer.steps=32", "trainer.target_reward=null", *MECHANICS, "checkpoint.hf_export=true",
                 "--resume", str(run_dir / "checkpoint.prev"))
    err = finish(proc)
    assert "moved aside to checkpoint.superseded" in err, err[-2000:]
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")][-2:] == [31, 32]
    lines = read_ledger(run_dir / "ledger.jsonl")
    assert lines[-3]["rollback_to"] == 30 and check(lines, 32, MECHANICS_PROMPTS) == []
    assert (run_dir / "checkpoint.superseded" / "trainer_state.json").is_file()

    # the kept (final, step 32) checkpoint's HF directory: transformers loads it, with the logits of the
    # same checkpoint exported afterwards from its DCP parts by `rltpu export`
    kept = run_dir / "checkpoint"
    exported = export_checkpoint(kept, tmp_path / "exported")
    assert exported["architecture"] and (kept / "hf" / "config.json").is_file()
    logits = []
    for d in (kept / "hf", tmp_path / "exported"):
        model = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
        ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            logits.append(model(ids).logits.float())
    assert torch.isfinite(logits[0]).all() and (logits[0] - logits[1]).abs().max().item() <= 1e-6
