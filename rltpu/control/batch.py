"""Sampler outputs -> rewards -> GRPO advantages -> one fixed-shape training batch, split by rank.

All arrays are numpy; rows are prompt-major (prompt 0's G samples, then prompt 1's, ...).
The batch has the static shape (rows, prompt_bucket + max_new_tokens), so on TPU the trainer's
program does not change shape from step to step either.
"""

from __future__ import annotations

import numpy as np
import torch

from learner.losses import AdvantageInputs, get_estimator, turn_advantages


EPISODE_KEYS = ("policy_mask", "token_versions", "turns", "truncated", "token_turns", "turn_returns")


def merge_generations(outs: list[dict], pad_id: int) -> dict:
    """Concatenate per-sampler outputs (or already merged batches), left-padding prompts to the
    widest prompt bucket used."""
    P = max(o["prompt"].shape[1] for o in outs)

    def lpad(a, fill):
        return np.pad(a, ((0, 0), (P - a.shape[1], 0)), constant_values=fill)

    return {
        "prompt": np.concatenate([lpad(o["prompt"], pad_id) for o in outs]),
        "prompt_mask": np.concatenate([lpad(o["prompt_mask"], 0) for o in outs]),
        "tokens": np.concatenate([o["tokens"] for o in outs]),
        "logprobs": np.concatenate([o["logprobs"] for o in outs]),
        "lengths": np.concatenate([o["lengths"] for o in outs]),
        "versions": np.concatenate([o["versions"] if "versions" in o else np.full(len(o["lengths"]), o["version"])
                                    for o in outs]),
        # multi-turn episodes (rltpu.data.envs): which response tokens are the policy's, and their versions
        **{k: np.concatenate([o[k] for o in outs]) for k in EPISODE_KEYS if all(k in o for o in outs)},
    }


def score(gen: dict, examples: list[dict], group_size: int, tokenizer, reward_fn) -> tuple[np.ndarray, list[str]]:
    texts = [tokenizer.decode(gen["tokens"][r, : gen["lengths"][r]]) for r in range(len(gen["lengths"]))]
    rewards = np.array([float(reward_fn(t, examples[r // group_size])) for r, t in enumerate(texts)], np.float32)
    return rewards, texts


def train_layout(gen: dict) -> dict:
    """The fixed-shape token layout of a batch (R, P+T): prompt then completion, masks, positions,
    the sampler's logprobs. Everything the trainer needs except the advantages."""
    prompt, pmask = gen["prompt"], gen["prompt_mask"]  # (R, P)
    tokens, lengths = gen["tokens"], gen["lengths"]  # (R, T), (R,)
    T = tokens.shape[1]
    real = (np.arange(T)[None, :] < lengths[:, None]).astype(np.int32)  # (R, T) incl. EOS
    # multi-turn: only the policy's tokens are trained; the environment's are seen, not scored
    cmask = gen["policy_mask"].astype(np.int32) * real if "policy_mask" in gen else real
    ppos = np.maximum(np.cumsum(pmask, axis=1) - 1, 0)
    cpos = pmask.sum(axis=1, keepdims=True) + np.arange(T)[None, :]
    return {
        "tokens": np.concatenate([prompt, tokens], axis=1).astype(np.int64),  # (R, P+T)
        "position_ids": np.concatenate([ppos, cpos], axis=1).astype(np.int64),
        "attention_mask": np.concatenate([pmask, real], axis=1).astype(np.int64),
        "loss_mask": np.concatenate([np.zeros_like(pmask), cmask], axis=1).astype(np.float32),
        "old_logprobs": np.concatenate([np.zeros(pmask.shape, np.float32), gen["logprobs"] * cmask], axis=1),
    }


def build_train_batch(gen: dict, rewards: np.ndarray, group_size: int, scale_rewards: bool = True,
                      estimator: str = "grpo", kl: np.ndarray | None = None, kl_coef: float = 0.0,
                      gamma: float = 1.0, values: np.ndarray | None = None, lam: float = 1.0,
                      turn_credit: bool = False, reference_logprobs: np.ndarray | None = None,
                      old_logprobs: np.ndarray | None = None) -> dict:
    """``train_layout`` plus per-token ``advantages`` (R, P+T), zero on prompt and padding, from the
    registered ``estimator`` (``learner.losses.ESTIMATORS``).

    ``kl`` (R, P+T), aligned like ``old_logprobs``, is a per-token KL estimate to put in the
    reward (``trainer.kl_in_reward``). An estimator that needs a critic gets its ``values`` (same
    alignment) and the batch gains ``returns`` and ``old_values`` for the critic's update; one
    that needs the trainer's own logprobs of the rollout gets ``old_logprobs`` in place of the
    sampler's; one that needs the reference's gets ``reference_logprobs``.
    """
    est = get_estimator(estimator)
    batch = train_layout(gen)
    if old_logprobs is not None:
        batch["old_logprobs"] = np.asarray(old_logprobs, np.float32) * batch["loss_mask"]
    m = torch.from_numpy(batch["loss_mask"])
    as_t = lambda a: torch.from_numpy(np.asarray(a, np.float32)) if a is not None else None  # noqa: E731
    inputs = AdvantageInputs(as_t(rewards), m, group_size, scale_rewards, as_t(kl), kl_coef, gamma, as_t(values), lam,
                             as_t(reference_logprobs))
    if est.critic:
        adv, ret = est.fn(inputs)
        return batch | {"advantages": adv.numpy(), "returns": ret.numpy(), "old_values": (inputs.values * m).numpy(),
                        "max_new_tokens": int(gen["tokens"].shape[1])}
    if turn_credit:  # multi-turn (env.credit: turn): each turn's tokens on its own return-to-go
        if "turn_returns" not in gen:
            raise ValueError("turn credit needs episodes (env.credit: turn): the batch has no turn_returns")
        P = gen["prompt"].shape[1]
        tt = np.concatenate([np.full((len(gen["lengths"]), P), -1, np.int32), gen["token_turns"]], axis=1)
        adv = turn_advantages(torch.from_numpy(gen["turn_returns"]), torch.from_numpy(np.asarray(gen["turns"])),
                              torch.from_numpy(tt), m, group_size, scale=scale_rewards and estimator == "grpo")
    else:
        adv = est.fn(inputs)
    return batch | {"advantages": adv.numpy().astype(np.float32), "max_new_tokens": int(gen["tokens"].shape[1])}


def keep_informative_groups(rewards: np.ndarray, group_size: int) -> np.ndarray:
    """DAPO dynamic sampling: indices of the groups whose rewards are not all equal (a group with
    zero variance has zero advantage everywhere and only dilutes the batch)."""
    g = np.asarray(rewards, np.float64).reshape(-1, group_size)
    return np.flatnonzero(g.max(axis=1) > g.min(axis=1))


def select_groups(gen: dict, groups: np.ndarray, group_size: int) -> dict:
    """The rows of ``gen`` belonging to ``groups`` (prompt-major order kept)."""
    rows = (np.asarray(groups)[:, None] * group_size + np.arange(group_size)[None, :]).reshape(-1)
    return {k: (v[rows] if isinstance(v, np.ndarray) and v.ndim >= 1 and len(v) == len(gen["lengths"]) else v)
            for k, v in gen.items()}


def fill_dynamic_batch(rounds: list[tuple[dict, np.ndarray]], n: int, group_size: int,
                       pad_id: int) -> tuple[dict, np.ndarray, int, int]:
    """DAPO's refill: from successive sampling rounds (each ``(gen, rewards)`` of n groups), the first
    n informative groups in sampling order; if there are fewer, the batch is topped up with
    zero-variance groups in sampling order. Returns ``(gen, rewards, informative, filler)``."""
    G = group_size
    kept, spare = [], []
    for gen, rewards in rounds:
        groups = np.asarray(rewards).reshape(-1, G)
        keep = keep_informative_groups(rewards, G)
        drop = np.setdiff1d(np.arange(len(groups)), keep)
        kept.append((select_groups(gen, keep, G), groups[keep].reshape(-1)))
        spare.append((select_groups(gen, drop, G), groups[drop].reshape(-1)))
    have = sum(len(r) // G for _, r in kept)
    parts = [p for p in kept + (spare if have < n else []) if len(p[1])]
    gen = select_groups(merge_generations([g for g, _ in parts], pad_id), np.arange(n), G)
    return gen, np.concatenate([r for _, r in parts])[: n * G], min(have, n), max(n - have, 0)


def split_by_rank(batch: dict, n: int) -> list[dict]:
    """Contiguous row shards, one per trainer rank; each carries the global loss-token and row counts."""
    rows = len(batch["tokens"])
    if rows % n:
        raise ValueError(f"{rows} rows cannot be split evenly over {n} trainer ranks")
    k = rows // n
    total = float(batch["loss_mask"].sum())
    counts = {"global_tokens": total, "global_seqs": float(rows)}
    return [{key: v[i * k:(i + 1) * k] if isinstance(v, np.ndarray) else v for key, v in batch.items()} | counts
            for i in range(n)]


def split_prompts(items: list, n: int) -> list[list]:
    k = len(items) // n
    return [items[i * k:(i + 1) * k] for i in range(n)]
