"""vLLM's side of ``benchmarks/sampler.py --vs-vllm``: a worker run by *vLLM's own* Python.

    /work/vllm-venv/bin/python benchmarks/sampler_vllm.py     (started by sampler.py; not by hand)

Why a separate process: vLLM's CPU build pins its own torch and transformers and cannot share
rltpu's venv, so sampler.py starts this file with the interpreter given by ``--vllm-python`` and
talks to it over JSON lines (one request on stdin, one answer on the original stdout; vLLM's own
logging goes to stderr). The engine stays in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
prompts go in as token ids (no tokenizer: ``skip_tokenizer_init``), and prefix caching is off so
a repeated call re-does its prefill like every other system in the comparison. Nothing here
imports rltpu, and nothing is downloaded: the checkpoint is a local directory.

Requests: ``{"op": "load", "path": DIR, "max_model_len": 256, "max_num_seqs": 256}`` and
``{"op": "generate", "prompts": [[ids]], "max_tokens": N, "ignore_eos": bool, "stop_token_ids":
[..], "seed": s}``; answers carry ``wall_s`` (one ``LLM.generate`` call) and ``lengths``.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> int:
    proto = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # anything vLLM prints goes to stderr
    llm = None
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "load":
                import vllm
                from vllm import LLM

                t0 = time.perf_counter()
                llm = LLM(model=req["path"], skip_tokenizer_init=True, dtype="float32",
                          max_model_len=req.get("max_model_len", 256), max_num_seqs=req.get("max_num_seqs", 256),
                          enable_prefix_caching=False, seed=0)
                import torch

                ans = {"ok": True, "load_s": time.perf_counter() - t0, "vllm": vllm.__version__,
                       "torch": torch.__version__, "torch_threads": torch.get_num_threads()}
            elif req["op"] == "generate":
                from vllm import SamplingParams
                from vllm.inputs import TokensPrompt

                sp = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=req["max_tokens"],
                                    ignore_eos=req.get("ignore_eos", False),
                                    stop_token_ids=req.get("stop_token_ids") or None, seed=req.get("seed"),
                                    detokenize=False)
                prompts = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
                t0 = time.perf_counter()
                outs = llm.generate(prompts, sp, use_tqdm=False)
                wall = time.perf_counter() - t0
                ans = {"ok": True, "wall_s": wall, "lengths": [len(o.outputs[0].token_ids) for o in outs],
                       "stopped": [o.outputs[0].finish_reason == "stop" for o in outs]}
            elif req["op"] == "quit":
                proto.write(json.dumps({"ok": True}) + "\n")
                return 0
            else:
                ans = {"ok": False, "error": f"unknown op {req['op']!r}"}
        except Exception as exc:  # the parent reports it; the worker stays up for the next request
            ans = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        proto.write(json.dumps(ans) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
