"""Held-out evaluation during training (the ``eval:`` section).

    every eval.every_steps steps, and after the last one (eval.at_end):
      greedy:  one completion per prompt at temperature 0          -> eval/accuracy
      sampled: n = eval.samples per prompt at the sampler's settings -> eval/pass@k, eval/mean@k

A completion is correct when ``task.reward_fn`` scores it >= ``eval.correct_threshold`` (the reward
workers score it; failed calls score ``task.reward_default`` and are counted as ``eval/reward_failures``).
With c correct of n samples, pass@k is the unbiased estimator 1 - C(n-c, k) / C(n, k) (Chen et al.
2021), mean@k is c / n (the expected share of k samples that are correct), both averaged over prompts.

The prompts come from their own dataset (``eval.dataset``: a file, or a Hub id's ``eval.split``, e.g.
GSM8K's ``test``), read once, in file order, and are handed straight to the
samplers: they never go through the training data stream or ``PromptDraws``, so they can never
reach a training batch or ``ledger.jsonl``. The sampled pass uses a seed fixed for the run, so the
same weights give the same figures.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Callable

import numpy as np

from rltpu.data.sources import DatasetError, PromptDataset, check_prompt_lengths


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c correct) is correct."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_metrics(greedy: np.ndarray | None, sampled: np.ndarray | None, k: int, threshold: float) -> dict:
    """``greedy``: (prompts,) rewards of the greedy completions; ``sampled``: (prompts, n) rewards."""
    out: dict = {}
    if greedy is not None:
        out["eval/accuracy"] = float(np.mean(greedy >= threshold))
        out["eval/reward_greedy"] = float(np.mean(greedy))
    if sampled is not None:
        n = sampled.shape[1]
        correct = (sampled >= threshold).sum(axis=1)
        out["eval/pass@k"] = float(np.mean([pass_at_k(n, int(c), k) for c in correct]))
        out["eval/mean@k"] = float(np.mean(correct / n))
        out["eval/reward_sampled"] = float(np.mean(sampled))
        out["eval/k"], out["eval/samples"] = k, n
    return out


class Evaluator:
    """Owned by the controller (a part, like ``WeightSync``); knows the prompts and the arithmetic,
    and reaches samplers and reward workers only through the two callables ``run`` is given."""

    def __init__(self, cfg, sampler_cfg, tokenizer, seed: int, episodes: bool = False):
        """``episodes`` (an ``env:`` run): the samplers' inputs are the examples themselves (the
        environment's ``reset`` writes each first prompt) and a row's score is its episode return."""
        self.cfg = cfg
        if not any(c in cfg.dataset for c in "*?[") and not Path(cfg.dataset).exists():
            raise DatasetError(f"eval.dataset {cfg.dataset!r} does not exist; point it at a held-out file, directory "
                               f"or Hub id (rltpu train resolves ids) or remove the eval section")
        try:
            # a file, glob, directory or Hub snapshot (eval.subset / eval.split), formatted like the task's prompts
            data = PromptDataset.from_config(cfg, seed, tokenizer, shuffle=False)
            rows = range(min(len(data), cfg.max_prompts or len(data)))
            self.examples = [data.example(i) for i in rows]
            if episodes:
                self.prompt_ids = self.examples
            else:
                self.prompt_ids = [data.encode(e, tokenizer) for e in self.examples]
                check_prompt_lengths(self.prompt_ids, self.examples, sampler_cfg)
        except DatasetError as err:
            raise DatasetError(f"eval.dataset: {err}") from None
        if not self.examples:
            raise DatasetError(f"eval.dataset {cfg.dataset!r} has no rows")
        self.seed = seed * 1_000_003 + 999_983  # fixed for the run: same weights, same sampled figures
        self.last_step: int | None = None

    def due(self, step: int, last: bool) -> bool:
        every = self.cfg.every_steps
        return step != self.last_step and ((every and step % every == 0) or (last and self.cfg.at_end))

    def run(self, generate: Callable, score: Callable, step: int) -> dict:
        """``generate(prompt_ids, n, greedy, seed) -> gen`` (rows prompt-major, n per prompt) and
        ``score(gen, examples_per_row) -> (rewards, failures)``; returns the ``eval/*`` metrics."""
        t0, c = time.perf_counter(), self.cfg
        greedy = sampled = None
        failures = 0
        if c.greedy:
            gen = generate(self.prompt_ids, 1, True, self.seed)
            greedy, failed = score(gen, self.examples)
            failures += failed
        if c.samples:
            n = c.samples
            gen = generate(self.prompt_ids, n, False, self.seed)
            rewards, failed = score(gen, [e for e in self.examples for _ in range(n)])
            sampled, failures = np.asarray(rewards).reshape(len(self.examples), n), failures + failed
        self.last_step = step
        return eval_metrics(greedy, sampled, c.k, c.correct_threshold) | {
            "eval/prompts": len(self.examples), "eval/reward_failures": failures,
            "eval/seconds": time.perf_counter() - t0}
