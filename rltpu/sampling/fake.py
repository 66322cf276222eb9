"""A rollout backend without a model: seeded canned rows, for controller tests (no JAX, no Ray).

Why: the controller's loop (shards, rewards, advantages, sync, recovery) is tested on it in seconds
(``tests/fakes.py``). It keeps the ``RolloutBackend`` contract: rows prompt-major, the same rows for
the same (seed, prompts, weight version), ``version`` stamped on every call, and it refuses to
generate before it holds weights, as the real engine does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


@dataclass
class FakeStats:
    compiles: int = 0
    compile_log: list = field(default_factory=list)


class FakeBackend:
    def __init__(self, vocab_size: int, pad_id: int, eos_id: int, max_new_tokens: int):
        self.vocab_size, self.pad_id, self.eos_id, self.max_new_tokens = vocab_size, pad_id, eos_id, max_new_tokens
        self.version = -1
        self.params: dict | None = None
        self.stats = FakeStats()

    def precompile(self) -> list:
        self.stats.compiles += 1
        self.stats.compile_log.append((1, 1, self.max_new_tokens, 0.0, False))
        return list(self.stats.compile_log)

    def generate(self, prompts: list[list[int]], n_per_prompt: int, seed: int, greedy: bool = False) -> dict:
        if self.params is None:
            raise RuntimeError("sampler has no weights yet: call set_params (weight sync) first")
        R, N = len(prompts) * n_per_prompt, self.max_new_tokens
        P = max(len(p) for p in prompts)
        prompt = np.full((R, P), self.pad_id, np.int64)
        mask = np.zeros((R, P), np.int64)
        for i, p in enumerate(prompts):
            prompt[i * n_per_prompt:(i + 1) * n_per_prompt, P - len(p):] = p
            mask[i * n_per_prompt:(i + 1) * n_per_prompt, P - len(p):] = 1
        rng = np.random.default_rng([seed, self.version, int(greedy)])
        low = min(3, self.vocab_size - 1)
        tokens = rng.integers(low, self.vocab_size, (R, N))
        lengths = rng.integers(1, N + 1, R)
        tokens[np.arange(R), lengths - 1] = self.eos_id
        tokens[np.arange(N)[None, :] >= lengths[:, None]] = self.pad_id
        logprobs = np.where(np.arange(N)[None, :] < lengths[:, None], -math.log(self.vocab_size - low), 0.0)
        new = int(lengths.sum())
        return {"prompt": prompt, "prompt_mask": mask, "tokens": tokens, "logprobs": logprobs.astype(np.float32),
                "lengths": lengths, "version": self.version, "new_tokens": new, "seconds": 1e-3,
                "program_seconds": 1e-3, "host_seconds": 0.0, "padded_slots": R * N - new, "total_slots": R * N,
                "compiles": 0, "compile_seconds": 0.0, "truncated_prompts": 0}

    def set_params(self, params: dict, version: int) -> None:
        self.params, self.version = dict(params), version

    def set_adapters(self, adapters: dict, version: int) -> None:
        if self.params is None:
            raise ValueError("adapters need the base weights first")
        self.params, self.version = self.params | adapters, version

    def probe_logits(self, tokens, position_ids, attention_mask) -> np.ndarray:
        """Logits that depend only on the weights held: equal for equal weights (the sync probe)."""
        bias = float(sum(np.asarray(v, np.float64).sum() for v in (self.params or {}).values()))
        return np.full((*np.shape(tokens), self.vocab_size), bias, np.float32)

    def describe(self) -> dict:
        return {"tp": 1, "mesh": None, "device_weight_bytes": {},
                "model_bytes": sum(int(np.asarray(v).nbytes) for v in (self.params or {}).values())}
