"""Families only transformers and vLLM run here, trained end to end (issue 31, acceptance 2).

    python benchmarks/hf_models.py [--arch gemma3 qwen3_moe] [--target 0.8] [--steps 80] [--out FILE]

For each family: a tiny random checkpoint written by transformers (``rltpu tiny-checkpoint --arch``, the
quickstart's sizes, the char tokenizer's 17 ids as a ``tokenizers`` directory), then ``rltpu train
configs/quickstart.yaml trainer.model_impl=hf sampler.backend=vllm`` (2 FSDP2 trainer ranks, 1 vLLM
sampler; embedded Ray) until the last-5 mean reward reaches ``--target``; then ``rltpu export`` of the
run's checkpoint, reloaded with ``AutoModelForCausalLM``, against the trainer engine restored from the
same checkpoint (max |logits difference| on the quickstart's prompts). One JSON document on stdout and
in ``--out`` (default ``benchmarks/results/single/hf_models-<machine>-<date>.json``). Too long for CI
(minutes per family on 2 cores); ``tests/test_hf_trainer.py`` covers the parts in seconds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# Ray keeps its token auth (as for users): only the test suite turns it off (tests/test_auth_defaults.py)
ENV = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"} | {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def machine() -> str:
    cpu = platform.processor() or "cpu"
    try:
        name = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
        cpu = "amd-epyc" if "EPYC" in name else name.split()[0].lower()
    except (OSError, StopIteration):
        pass
    return f"{cpu}-{os.cpu_count()}core"


def checkpoint(root: Path, arch: str) -> tuple[Path, Path]:
    from rltpu.data.char_tokenizer import DEFAULT_ALPHABET
    from rltpu.data.hf_tokenizer import HFTokenizer
    from rltpu.models.hf.export import write_char_tokenizer
    from rltpu.models.hf.tiny import write_tiny_checkpoint

    tok = root / "chartok"
    if not tok.is_dir():
        tok.mkdir(parents=True)
        write_char_tokenizer(tok, DEFAULT_ALPHABET)
    model = write_tiny_checkpoint(root / arch, arch, with_tokenizer=False, vocab_size=HFTokenizer(str(tok)).vocab_size,
                                  hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                                  init_std=0.02, max_position_embeddings=64)
    return model, tok


def export_gap(run_dir: Path, out: Path) -> float:
    """max |logits(exported, transformers) - logits(trainer engine restored from the checkpoint)|."""
    import numpy as np
    import torch
    import transformers

    from learner.trainer import TrainerEngine
    from rltpu.config import RunConfig

    res = subprocess.run([sys.executable, "-m", "rltpu.cli", "export", str(run_dir / "checkpoint"), str(out)],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    if res.returncode:
        raise SystemExit(res.stderr[-2000:])
    state = json.loads((run_dir / "checkpoint" / "trainer_state.json").read_text())
    cfg = RunConfig.model_validate(state["config"])
    eng = TrainerEngine(cfg.model, cfg.trainer, 17, cfg.seed)
    eng.load_checkpoint(run_dir / "checkpoint")
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.as_tensor(np.random.default_rng(0).integers(3, 17, (8, 12)))
    with torch.no_grad():
        return float((eng.model(ids, None, torch.ones_like(ids)) - model(input_ids=ids).logits).abs().max())


def run(arch: str, root: Path, target: float, steps: int) -> dict:
    from rltpu.observe.metrics import read_metrics

    model, tok = checkpoint(root, arch)
    run_dir = root / f"run-{arch}"
    cmd = [sys.executable, "-m", "rltpu.cli", "train", str(ROOT / "configs" / "quickstart.yaml"), f"run_dir={run_dir}",
           "progress=false", f"model.path={model}", f"task.tokenizer={tok}", "trainer.model_impl=hf",
           "sampler.backend=vllm", f"trainer.target_reward={target}", f"trainer.steps={steps}", "sync.verify_every=4",
           "placement.sampler_chips=1", "sampler.batch_buckets=[1024]"]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - t0
    if res.returncode:
        return {"arch": arch, "error": (res.stdout + res.stderr)[-2000:]}
    m = read_metrics(run_dir / "metrics.jsonl")
    mean = lambda rows: sum(r["reward_mean"] for r in rows) / len(rows)  # noqa: E731
    probes = [r["sync_probe_max_diff"] for r in m if r.get("sync_probe_max_diff") is not None]
    gaps = [r["logp_gap"] for r in m if r.get("logp_gap") is not None]
    return {"arch": arch, "architecture": json.loads((model / "config.json").read_text())["architectures"][0],
            "steps": len(m), "first5_reward": round(mean(m[:5]), 4), "last5_reward": round(mean(m[-5:]), 4),
            "reached_target": mean(m[-5:]) >= target, "wall_s": round(wall, 1),
            "rewards": [round(r["reward_mean"], 3) for r in m],
            "sync_probe_max_diff": max(probes) if probes else None,
            "logp_gap_max": max(gaps) if gaps else None,
            "export_logits_max_diff": export_gap(run_dir, root / f"export-{arch}")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", nargs="+", default=["gemma3", "qwen3_moe"])
    ap.add_argument("--target", type=float, default=0.8)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    date = datetime.date.today().isoformat()
    out = Path(args.out or ROOT / "benchmarks" / "results" / "single" / f"hf_models-{machine()}-{date}.json")
    with tempfile.TemporaryDirectory() as tmp:
        results = [run(a, Path(tmp), args.target, args.steps) for a in args.arch]
    doc = {"benchmark": "hf_models", "date": date, "machine": machine(),
           "command": "python benchmarks/hf_models.py " + " ".join(sys.argv[1:]),
           "config": "configs/quickstart.yaml trainer.model_impl=hf sampler.backend=vllm placement.sampler_chips=1 "
                     "sampler.batch_buckets=[1024] sync.verify_every=4", "target": args.target, "results": results}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc))
    return 0 if all(r.get("reached_target") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
