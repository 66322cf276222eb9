"""Peak host memory of one per-token logprob + entropy forward/backward, whole vs chunked (issue 16 point 4).

    python benchmarks/logprob_memory.py [--tokens 4096] [--vocab 151936] [--hidden 896] [--chunks 0,512,128]

Each variant runs in a fresh process (``ru_maxrss`` only grows): hidden states (tokens x hidden) and
the head (vocab x hidden) are built first, then the pass runs and the peak RSS above that point is
what the pass itself needed. ``before`` is the trainer before chunking: the full (tokens, vocab) fp32
logits, then log-softmax for the logprobs and again for the entropy. ``0`` is
``learner.losses.token_logprobs_entropy`` in one chunk, other numbers its chunk size in tokens
(``trainer.logprob_chunk_tokens``). The loss and every gradient are compared with ``before``
(max abs difference). One JSON document on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _one(mode: str, n: int, v: int, h: int) -> dict:
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    sys.path.insert(0, str(ROOT))
    import torch

    from learner.losses import token_entropy, token_logprobs, token_logprobs_entropy

    torch.set_num_threads(1)
    torch.manual_seed(0)
    hidden = torch.randn(n, h, requires_grad=True)
    weight = (torch.randn(v, h) * 0.05).requires_grad_()
    targets = torch.randint(0, v, (n,))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    if mode == "before":
        logits = torch.nn.functional.linear(hidden, weight).float()
        lp, ent = token_logprobs(logits, targets), token_entropy(logits)
        del logits
    else:
        lp, ent = token_logprobs_entropy(hidden, targets, 1.0, True, int(mode), weight=weight)
    loss = lp.sum() + 0.01 * ent.sum()
    loss.backward()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = Path(os.environ["RLTPU_LOGPROB_OUT"])
    from safetensors.torch import save_file  # results travel as safetensors, never pickle

    save_file({"loss": loss.detach().reshape(1), "d_hidden": hidden.grad, "d_weight": weight.grad}, out)
    return {"mode": mode, "peak_above_inputs_mb": (peak - base) / 1024, "kb_per_token": (peak - base) / n,
            "seconds": seconds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--chunks", default="0,512,128")
    ap.add_argument("--one", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        mode, n, v, h = args.one
        print(json.dumps(_one(mode, int(n), int(v), int(h))))
        return 0
    import tempfile

    from safetensors.torch import load_file

    runs, grads = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ["before", *args.chunks.split(",")]:
            path = Path(tmp) / f"{mode}.safetensors"
            res = subprocess.run([sys.executable, __file__, "--one", mode, str(args.tokens), str(args.vocab),
                                  str(args.hidden)], capture_output=True, text=True, check=True,
                                 env=dict(os.environ, RLTPU_LOGPROB_OUT=str(path)))
            runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
            grads[mode] = load_file(path)
    ref = grads["before"]
    for r in runs:
        g = grads[r["mode"]]
        r["max_abs_diff_vs_before"] = {k: float((g[k] - ref[k]).abs().max()) for k in ref}
    result = {
        "benchmark": "logprob_memory", "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
                    "cores": os.cpu_count(), "loadavg_1m": os.getloadavg()[0]},
        "tokens": args.tokens, "vocab": args.vocab, "hidden": args.hidden,
        "full_logits_fp32_mb": args.tokens * args.vocab * 4 / 2**20, "runs": runs,
    }
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
