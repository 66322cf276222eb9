"""Sampler outputs -> rewards -> GRPO advantages -> one fixed-shape training batch, split by rank.

All arrays are numpy; rows are prompt-major (prompt 0's G samples, then prompt 1's, ...).
The batch has the static shape (rows, prompt_bucket + max_new_tokens), so on TPU the trainer's
program does not change shape from step to step either.
"""

from __future__ import annotations

import numpy as np
import torch

from learner.losses import grpo_advantages


def merge_generations(outs: list[dict], pad_id: int) -> dict:
    """Concatenate per-sampler outputs, left-padding prompts to the widest prompt bucket used."""
    P = max(o["prompt"].shape[1] for o in outs)

    def lpad(a, fill):
        return np.pad(a, ((0, 0), (P - a.shape[1], 0)), constant_values=fill)

    return {
        "prompt": np.concatenate([lpad(o["prompt"], pad_id) for o in outs]),
        "prompt_mask": np.concatenate([lpad(o["prompt_mask"], 0) for o in outs]),
        "tokens": np.concatenate([o["tokens"] for o in outs]),
        "logprobs": np.concatenate([o["logprobs"] for o in outs]),
        "lengths": np.concatenate([o["lengths"] for o in outs]),
        "versions": np.concatenate([np.full(len(o["lengths"]), o["version"]) for o in outs]),
    }


def score(gen: dict, examples: list[dict], group_size: int, tokenizer, reward_fn) -> tuple[np.ndarray, list[str]]:
    texts = [tokenizer.decode(gen["tokens"][r, : gen["lengths"][r]]) for r in range(len(gen["lengths"]))]
    rewards = np.array([float(reward_fn(t, examples[r // group_size])) for r, t in enumerate(texts)], np.float32)
    return rewards, texts


def build_train_batch(gen: dict, rewards: np.ndarray, group_size: int, scale_rewards: bool) -> dict:
    prompt, pmask = gen["prompt"], gen["prompt_mask"]  # (R, P)
    tokens, lengths = gen["tokens"], gen["lengths"]  # (R, T), (R,)
    R, P = prompt.shape
    T = tokens.shape[1]
    cmask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.int32)  # (R, T) incl. EOS
    ppos = np.maximum(np.cumsum(pmask, axis=1) - 1, 0)
    cpos = pmask.sum(axis=1, keepdims=True) + np.arange(T)[None, :]
    adv = grpo_advantages(torch.from_numpy(rewards), group_size, scale=scale_rewards).numpy()
    return {
        "tokens": np.concatenate([prompt, tokens], axis=1).astype(np.int64),  # (R, P+T)
        "position_ids": np.concatenate([ppos, cpos], axis=1).astype(np.int64),
        "attention_mask": np.concatenate([pmask, cmask], axis=1).astype(np.int64),
        "loss_mask": np.concatenate([np.zeros_like(pmask), cmask], axis=1).astype(np.float32),
        "old_logprobs": np.concatenate([np.zeros(pmask.shape, np.float32), gen["logprobs"] * cmask], axis=1),
        "advantages": adv.astype(np.float32),
    }


def split_by_rank(batch: dict, n: int) -> list[dict]:
    """Contiguous row shards, one per trainer rank; each carries the global loss-token count."""
    rows = len(batch["advantages"])
    if rows % n:
        raise ValueError(f"{rows} rows cannot be split evenly over {n} trainer ranks")
    k = rows // n
    total = float(batch["loss_mask"].sum())
    return [{key: v[i * k:(i + 1) * k] for key, v in batch.items()} | {"global_tokens": total} for i in range(n)]


def split_prompts(items: list, n: int) -> list[list]:
    k = len(items) // n
    return [items[i * k:(i + 1) * k] for i in range(n)]
