"""GRPO advantages and the clipped policy loss, as pure tensor functions.

Registered by name so later estimators (RLOO, REINFORCE++, PPO/GAE) slot in beside them; each is
tested against a hand computation in ``tests/test_losses.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

ADVANTAGE_ESTIMATORS: dict[str, Callable] = {}


def register_advantage(name: str):
    def deco(fn):
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return deco


@register_advantage("grpo")
def grpo_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages: ``(r - mean_group) / (std_group + eps)``.

    ``rewards`` is flat ``[num_prompts * group_size]`` with each prompt's G samples contiguous.
    The std is the sample (unbiased) std, as in TRL; ``scale=False`` keeps only the mean baseline
    (Dr. GRPO). A group whose rewards are all equal gets advantage 0 (no signal).
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards are not a multiple of group_size={group_size}")
    r = rewards.float().view(-1, group_size)  # (P, G)
    adv = r - r.mean(dim=1, keepdim=True)
    if scale:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    return adv.view(-1)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref) per token: ``exp(d) - d - 1`` with ``d = ref - logp``."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


@dataclass
class LossOut:
    loss: torch.Tensor  # scalar to backprop (already divided by the global token count)
    pg_sum: float  # sum over tokens of the policy-gradient term
    kl_sum: float  # sum over tokens of the KL estimate
    clipped: float  # number of tokens whose ratio was clipped
    tokens: float  # number of loss tokens on this rank
    entropy_sum: float = 0.0  # sum over tokens of the policy entropy


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    normalizer: float,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> LossOut:
    """Clipped surrogate, token-level mean over the whole (global) batch.

    Shapes: ``logp``, ``old_logp``, ``mask``, ``ref_logp``, ``entropy``: (B, T) over completion tokens;
    ``advantages``: (B,). ``normalizer`` is the number of loss tokens in the *global* batch, so
    ranks that see different token counts still add up to one token-mean.
    """
    mask = mask.float()
    ratio = torch.exp(logp - old_logp)
    adv = advantages.float().unsqueeze(1)  # (B, 1)
    surr1 = ratio * adv
    surr2 = ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv
    pg = -torch.minimum(surr1, surr2)  # (B, T)
    per_token = pg
    kl = torch.zeros_like(pg)
    if ref_logp is not None and kl_coef > 0:
        kl = kl_k3(logp, ref_logp)
        per_token = pg + kl_coef * kl
    ent_sum = 0.0
    if entropy is not None:
        ent_sum = float((entropy.detach() * mask).sum())
        if entropy_coef > 0:  # bonus: keeps exploring while groups still disagree
            per_token = per_token - entropy_coef * entropy
    loss = (per_token * mask).sum() / normalizer
    clipped = ((surr2 < surr1).float() * mask).sum()
    return LossOut(
        loss=loss,
        pg_sum=float((pg * mask).sum().detach()),
        kl_sum=float((kl * mask).sum().detach()),
        clipped=float(clipped),
        tokens=float(mask.sum()),
        entropy_sum=ent_sum,
    )


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` per position; (B, T, V) -> (B, T)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of each target under ``softmax(logits / temperature)``; (B, T, V) -> (B, T)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
