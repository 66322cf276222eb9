"""LoRA beside full-parameter training, through ``rltpu train`` (issue 20): does each learn, in how many
steps and seconds, and what does a sync move?

    .venv/bin/python benchmarks/lora.py [--seed 0] [--out FILE]

Runs the quickstart (``configs/quickstart.yaml``, until its target reward 0.95 or 100 steps) as configured
and with ``trainer.lora.rank=8 trainer.lr=3e-3`` (LoRA's usual higher learning rate: at the quickstart's
1e-3 the adapters learn about 3x slower per step, at 1e-2 they stall near 0.25; one-process runs of
``benchmarks/lora_learns.py``). Reported per run: wall time (Ray start and compilation included), steps,
mean reward of the first and last 5 steps, the bytes each step's sync moved (``sync_bytes``; the start-up
sync, before step 1, is the full one) and whether every step's sync was adapter-only, the median step/sample/train/sync seconds, and the machine, load and
commit. Both again on the Hugging Face example, ``configs/hf_chat.yaml`` (its checkpoint and dataset
written by the commands in its header, ``hf_commands``; until its target 0.9 or 150 steps). Then ``benchmarks/lora_memory.py --layers 24`` (a Qwen2-0.5B-shaped policy on 2 FSDP2 ranks, one
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
# the shipped Hugging Face example (configs/hf_chat.yaml: a tiny random Llama written by transformers, a
# word-level tokenizer and chat template in its directory, a chat JSONL dataset), as its header writes it
HF_RUNS = {"hf_full": (), "hf_lora_rank8": LORA}
HF_CONFIG = "configs/hf_chat.yaml"


def hf_example() -> tuple[list[str], list[str]]:
    """Write the example's checkpoint and dataset with the commands ``configs/hf_chat.yaml`` names, into a
    temporary directory. Returns the overrides pointing the config at them, and the commands."""
    tmp = Path(tempfile.mkdtemp(prefix="rltpu-lora-hf-"))
    cmds = [[sys.executable, "-m", "rltpu.cli", "tiny-checkpoint", str(tmp / "tiny-llama"), "--arch", "llama",
             "--tokenizer", "words"],
            [sys.executable, "-m", "rltpu.data.chat_example", str(tmp / "chat_repeat3"), "--min-digits", "3",
             "--max-digits", "3"]]
    for c in cmds:
        res = subprocess.run(c, cwd=ROOT, capture_output=True, text=True, timeout=600)
        if res.returncode:
            raise SystemExit(f"benchmarks/lora.py: {' '.join(c[1:])} failed: {res.stderr.strip().splitlines()[-1:]}")
    shown = [" ".join(["rltpu" if c[2] == "rltpu.cli" else "python -m " + c[2], *c[3:]]).replace(str(tmp) + "/", "data/")
             for c in cmds]
    return [f"model.path={tmp / 'tiny-llama'}", f"task.dataset={tmp / 'chat_repeat3' / 'train.jsonl'}"], shown


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
    paths, doc["hf_commands"] = hf_example()
    for name, overrides in HF_RUNS.items():
        doc["runs"][name] = run(HF_CONFIG, args.seed, *paths, *overrides)
        doc["runs"][name]["command"] = " ".join(w for w in doc["runs"][name]["command"].split()
                                                if not w.startswith(("model.path=", "task.dataset=")))
        print(f"# {name}: {json.dumps({k: v for k, v in doc['runs'][name].items() if k != 'curve'})}",
              file=sys.stderr, flush=True)
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
