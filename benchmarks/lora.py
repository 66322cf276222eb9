"""LoRA beside full-parameter training, through ``rltpu train`` (issue 20): does each learn, in how many
steps and seconds, and what does a sync move?

    .venv/bin/python benchmarks/lora.py [--seed 0] [--out FILE]

Runs the quickstart (``configs/quickstart.yaml``, until its target reward 0.95 or 100 steps) as configured
and with ``trainer.lora.rank=8 trainer.lr=3e-3`` (LoRA's usual higher learning rate: at the quickstart's
1e-3 the adapters learn about 3x slower per step, at 1e-2 they stall near 0.25; one-process runs of
``benchmarks/lora_learns.py``). Reported per run: wall time (Ray start and compilation included), steps,
mean reward of the first and last 5 steps, the bytes each step's sync moved (``sync_bytes``; the start-up
sync, before step 1, is the full one) and whether every step's sync was adapter-only, the median step/sample/train/sync seconds, and the machine, load and
commit. Both again from the quickstart's seeded init written as a Hugging Face directory (``model.path``;
``BASE`` in the commands; ``hf_base_commands`` say how it is written). Then ``benchmarks/lora_memory.py --layers 24`` (a Qwen2-0.5B-shaped policy on 2 FSDP2 ranks, one
GRPO step each way: trainer memory per rank and sync bytes per step, full-parameter and LoRA), its JSON
under ``qwen2_0_5b``. Writes ``benchmarks/results/single/lora-<machine>-<date>.json`` unless ``--out`` says otherwise
(``-``: only print it, as ``benchmarks/all.py --only lora`` runs it); prints it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from all import commit_info, loadavg, machine, machine_slug, train_run  # noqa: E402

LORA = ("trainer.lora.rank=8", "trainer.lr=3e-3")
RUNS = {"full": (), "lora_rank8": LORA}
# the same task from a Hugging Face checkpoint directory (model.path: config.json, model.safetensors and a
# tokenizer.json with the same ids), written by `rltpu export --adapters` as the base of a one-step LoRA run:
# the seeded init, loaded through the checkpoint path (streamed FSDP shards, the directory's tokenizer)
HF_RUNS = {"hf_full": (), "hf_lora_rank8": LORA}


def hf_base(seed: int) -> tuple[Path, list[str]]:
    """The quickstart's seeded init as an HF directory, by the CLI: train 1 LoRA step, export the adapters
    (which writes ``base/``). Returns the directory and the commands."""
    tmp = Path(tempfile.mkdtemp(prefix="rltpu-lora-hf-"))
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0")
    cmds = [["train", "configs/quickstart.yaml", f"seed={seed}", "progress=false", *LORA, "trainer.steps=1",
             "--run-dir", str(tmp / "one")],
            ["export", str(tmp / "one" / "checkpoint"), str(tmp / "peft"), "--adapters"]]
    for c in cmds:
        res = subprocess.run([sys.executable, "-m", "rltpu.cli", *c], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=1800)
        if res.returncode:
            raise SystemExit(f"benchmarks/lora.py: rltpu {' '.join(c)} failed: {res.stderr.strip().splitlines()[-1:]}")
    return tmp / "peft" / "base", [f"rltpu {' '.join(c)}" for c in cmds]


def run(config: str, seed: int, *overrides: str) -> dict:
    out, recs = train_run(config, seed, *overrides, prefix="rltpu-lora-")
    if not recs:
        return out
    synced = [r for r in recs if r.get("sync_bytes") is not None]  # the start-up (full) sync is not a step's
    return out | {
        "sync_bytes": sorted({r["sync_bytes"] for r in synced}),
        "adapter_only_every_step": all(r.get("sync_adapter_only") for r in synced) if synced else None,
        "sync_s": round(statistics.median(r["sync_s"] for r in recs[1:] or recs), 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="results file; '-' prints only")
    args = ap.parse_args()
    doc = {"benchmark": "lora", "machine": machine(), **commit_info(), "date": dt.date.today().isoformat(),
           "loadavg_before": loadavg(), "config": "configs/quickstart.yaml", "seed": args.seed, "runs": {}}
    for name, overrides in RUNS.items():
        doc["runs"][name] = run("configs/quickstart.yaml", args.seed, *overrides)
        print(f"# {name}: {json.dumps({k: v for k, v in doc['runs'][name].items() if k != 'curve'})}",
              file=sys.stderr, flush=True)
    base, doc["hf_base_commands"] = hf_base(args.seed)
    for name, overrides in HF_RUNS.items():
        doc["runs"][name] = run("configs/quickstart.yaml", args.seed, f"model.path={base}", *overrides)
        doc["runs"][name]["command"] = doc["runs"][name]["command"].replace(str(base), "BASE")
    t0 = time.perf_counter()
    mem = subprocess.run([sys.executable, "benchmarks/lora_memory.py", "--layers", "24"], cwd=ROOT, capture_output=True,
                         text=True, timeout=3600)
    doc["qwen2_0_5b"] = ({"command": "python benchmarks/lora_memory.py --layers 24", "wall_s": round(time.perf_counter() - t0, 1)}
                         | (json.loads(mem.stdout) if mem.returncode == 0 else {"error": mem.stderr.strip().splitlines()[-8:]}))
    doc["loadavg_after"] = loadavg()
    text = json.dumps(doc, indent=1)
    if args.out != "-":
        out = Path(args.out) if args.out else (ROOT / "benchmarks" / "results" / "single"
                                               / f"lora-{machine_slug(doc['machine'])}-{doc['date']}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
