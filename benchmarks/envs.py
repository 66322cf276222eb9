"""The two learning multi-turn examples (tool lookup, guess game) from random init, and each with the environment's turn removed.

    .venv/bin/python benchmarks/envs.py [--examples lookup,guess] [--seed 0] [--out FILE]

For each example: ``rltpu train configs/env_<example>.yaml`` (until its target reward or its step
limit), then the same config with ``env.max_turns=1`` for as many steps as the first run took (the
policy's first turn only: no tool result, no feedback). Reported per run: wall time (Ray start and
compilation included), steps, mean reward of the first and last 5 steps, policy turns per episode
at the end, median step/sample/train seconds, and the machine, load and commit. Writes
``benchmarks/results/single/envs-<machine>-<date>.json`` unless ``--out`` says otherwise (``-``: only
print it, as ``benchmarks/all.py --only envs`` runs it); prints it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from all import commit_info, loadavg, machine, machine_slug, train_run  # noqa: E402


def run(config: str, seed: int, *overrides: str) -> dict:
    out, recs = train_run(config, seed, *overrides, prefix="rltpu-envs-")
    return out | {"turns_last": recs[-1]["env_turns_mean"]} if recs else out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", default="lookup,guess")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    m = machine()
    doc = {"benchmark": "envs", "machine": m, "date": dt.date.today().isoformat(), **commit_info(),
           "load_at_start": loadavg(), "runs": {}}
    for name in args.examples.split(","):
        config = f"configs/env_{name}.yaml"
        print(f"envs: {name} ...", file=sys.stderr, flush=True)
        full = run(config, args.seed)
        steps = full.get("steps", 30)
        print(f"envs: {name} without the environment's turn ({steps} steps) ...", file=sys.stderr, flush=True)
        ablated = run(config, args.seed, "env.max_turns=1", f"trainer.steps={steps}", "trainer.target_reward=null")
        doc["runs"][name] = {"multi_turn": full, "max_turns_1": ablated}
    text = json.dumps(doc, indent=1)
    print(text)
    if args.out != "-":  # '-': stdout only (benchmarks/all.py keeps it in the day's results file)
        out = Path(args.out) if args.out else ROOT / "benchmarks/results/single" / f"envs-{machine_slug(m)}-{doc['date']}.json"
        out.write_text(text + "\n")
    if any("error" in r for runs in doc["runs"].values() for r in runs.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
