"""Advantage estimators, KL estimators and the clipped policy loss, as pure tensor functions.

Names follow what users know from verl / TRL / OpenRLHF: estimators ``grpo``, ``drgrpo``, ``rloo``,
``reinforce_pp``, ``reinforce_pp_baseline`` (+ ``gae`` for a critic); KL estimators ``k1 k2 k3``;
loss aggregation ``token-mean``, ``seq-mean-token-sum``, ``seq-mean-token-mean``,
``seq-mean-token-sum-norm``. Each is tested against a hand computation in ``tests/test_losses.py``.

Advantages are per token, ``(R, T)`` over completion tokens: outcome estimators broadcast one value
per sequence; REINFORCE++ and GAE vary along the sequence.

Advantage estimators are registered by name (``register_estimator``; ``trainer.algorithm`` names
one). Each declares what it needs before it can run, so the driver asks for exactly that and no
code elsewhere branches on an algorithm's name: the critic's values (``critic``: it then also
returns the critic's targets), the reference model's logprobs, the trainer's own logprobs of the
rollout (``old_logprobs``, recomputed instead of the sampler's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

from rltpu.models.torch_llama import head_logits

KL_ESTIMATORS = ("k1", "k2", "k3")


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards are not a multiple of group_size={group_size}")
    return rewards.float().view(-1, group_size)  # (P, G)


def grpo_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages: ``(r - mean_group) / (std_group + eps)``.

    ``rewards`` is flat ``[num_prompts * group_size]`` with each prompt's G samples contiguous.
    The std is the sample (unbiased) std, as in TRL; ``scale=False`` keeps only the mean baseline
    (Dr. GRPO). A group whose rewards are all equal gets advantage 0 (no signal).
    """
    r = _groups(rewards, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if scale:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    return adv.view(-1)


def turn_advantages(returns: torch.Tensor, turns: torch.Tensor, token_turns: torch.Tensor, mask: torch.Tensor,
                    group_size: int, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages per turn of multi-turn episodes, ``(R, T)``.

    ``returns`` (R, K): each turn's return-to-go (its own reward and the later turns'); ``turns``
    (R,): turns played; ``token_turns`` (R, T): the turn of each token (-1: not the policy's).
    Turn k's tokens get ``(G_k - mean) / (std + eps)`` over the group's episodes that played turn k
    (sample std; ``scale=False`` keeps the mean only; fewer than two such episodes, or all equal: 0).
    Why: with one advantage per episode, a reward earned in turn 1 (a tool call) also rewards
    whatever turn 2 wrote, and the policy learns to repeat it; a turn cannot change what came before.
    """
    R, K = returns.shape
    g = returns.float().view(-1, group_size, K)  # (P, G, K)
    played = (torch.arange(K)[None, :] < turns.view(-1, 1)).view(-1, group_size, K).float()
    n = played.sum(dim=1, keepdim=True)  # (P, 1, K)
    mean = (g * played).sum(dim=1, keepdim=True) / n.clamp(min=1)
    adv = (g - mean) * played
    if scale:
        var = ((g - mean) ** 2 * played).sum(dim=1, keepdim=True) / (n - 1).clamp(min=1)
        adv = adv / (var.sqrt() + eps)
    adv = torch.where(n >= 2, adv, torch.zeros_like(adv)).view(R, K)
    idx = token_turns.long().clamp(min=0)
    out = torch.gather(adv, 1, idx) * (token_turns >= 0).float()
    return out * mask.float()


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE leave-one-out: ``r_i - mean_{j != i} r_j`` (= G/(G-1) times the group-mean baseline)."""
    r = _groups(rewards, group_size)
    others = (r.sum(dim=1, keepdim=True) - r) / (group_size - 1)
    return (r - others).view(-1)


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / std`` over the masked entries (population std), zero where masked out."""
    m = mask.float()
    n = m.sum().clamp(min=1)
    mean = (x * m).sum() / n
    var = (((x - mean) * m) ** 2).sum() / n
    return (x - mean) * torch.rsqrt(var + eps) * m


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = r_t + gamma * G_{t+1}`` along each row, over masked tokens; (R, T) -> (R, T)."""
    m = mask.float()
    out = torch.zeros_like(token_rewards, dtype=torch.float32)
    running = torch.zeros(token_rewards.shape[0], dtype=torch.float32)
    for t in range(token_rewards.shape[1] - 1, -1, -1):
        running = (token_rewards[:, t].float() + gamma * running) * m[:, t]
        out[:, t] = running
    return out


def outcome_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The sequence reward placed on each row's last loss token; (R,), (R, T) -> (R, T)."""
    m = mask.float()
    last = (m.cumsum(1) == m.sum(1, keepdim=True)) & (m > 0)  # the final masked position of each row
    return last.float() * rewards.float()[:, None]


def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """Generalised advantage estimation over masked tokens; returns ``(advantages, returns)``.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` (``V`` past the last token is 0),
    ``A_t = delta_t + gamma * lam * A_{t+1}``, ``returns = A + V``; all (R, T).
    """
    m = mask.float()
    v = values.float() * m
    adv = torch.zeros_like(v)
    next_v = torch.zeros(v.shape[0])
    running = torch.zeros(v.shape[0])
    for t in range(v.shape[1] - 1, -1, -1):
        delta = token_rewards[:, t].float() + gamma * next_v - v[:, t]
        running = (delta + gamma * lam * running) * m[:, t]
        adv[:, t] = running
        next_v = torch.where(m[:, t] > 0, v[:, t], next_v)
    return adv, (adv + v) * m


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator may read: sequence rewards ``(R,)``, the loss mask ``(R, T)``, rows per
    prompt, and the options and extra passes its ``Estimator`` asked for."""

    rewards: torch.Tensor
    mask: torch.Tensor
    group_size: int
    scale: bool = True  # trainer.scale_rewards
    kl: torch.Tensor | None = None  # (R, T) per-token KL put in the reward (trainer.kl_in_reward)
    kl_coef: float = 0.0
    gamma: float = 1.0
    values: torch.Tensor | None = None  # (R, T) the critic's values (Estimator.critic)
    lam: float = 1.0  # GAE's lambda (critic.gae_lambda)
    reference_logprobs: torch.Tensor | None = None  # (R, T) (Estimator.reference)


@dataclass(frozen=True)
class Estimator:
    """``fn(AdvantageInputs) -> advantages (R, T)``; with ``critic`` it returns ``(advantages, returns)``."""

    name: str
    fn: Callable
    critic: bool = False  # needs the critic's values; the batch then carries returns and old values
    reference: bool = False  # needs the reference model's logprobs of the rollout
    old_logprobs: bool = False  # needs the trainer's own logprobs of the rollout (not the sampler's)


ESTIMATORS: dict[str, Estimator] = {}


def register_estimator(name: str, *, critic: bool = False, reference: bool = False, old_logprobs: bool = False):
    """Decorator: ``fn`` becomes the advantage estimator ``trainer.algorithm: <name>``."""
    def add(fn: Callable) -> Callable:
        ESTIMATORS[name] = Estimator(name, fn, critic, reference, old_logprobs)
        return fn
    return add


def get_estimator(name: str) -> Estimator:
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; allowed: {', '.join(ESTIMATORS)}")
    return ESTIMATORS[name]


def _kl_in_sequence_reward(x: AdvantageInputs) -> torch.Tensor:
    m, r = x.mask.float(), x.rewards.float()
    return r - x.kl_coef * (x.kl.float() * m).sum(1) if x.kl is not None else r


@register_estimator("grpo")
def _grpo(x: AdvantageInputs) -> torch.Tensor:
    return grpo_advantages(_kl_in_sequence_reward(x), x.group_size, scale=x.scale)[:, None] * x.mask.float()


@register_estimator("drgrpo")
def _drgrpo(x: AdvantageInputs) -> torch.Tensor:
    return grpo_advantages(_kl_in_sequence_reward(x), x.group_size, scale=False)[:, None] * x.mask.float()


@register_estimator("rloo")
def _rloo(x: AdvantageInputs) -> torch.Tensor:
    return rloo_advantages(_kl_in_sequence_reward(x), x.group_size)[:, None] * x.mask.float()


def _reinforce_pp(x: AdvantageInputs, baseline: bool) -> torch.Tensor:
    m, r = x.mask.float(), x.rewards.float()
    if baseline:
        g = _groups(r, x.group_size)
        r = (g - g.mean(dim=1, keepdim=True)).view(-1)
    tr = outcome_token_rewards(r, m)
    if x.kl is not None:
        tr = tr - x.kl_coef * x.kl.float() * m
    return whiten(discounted_returns(tr, m, x.gamma), m)


register_estimator("reinforce_pp")(lambda x: _reinforce_pp(x, baseline=False))
register_estimator("reinforce_pp_baseline")(lambda x: _reinforce_pp(x, baseline=True))


@register_estimator("ppo", critic=True)
def _ppo(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    return ppo_advantages(x.rewards.float(), x.values, x.mask, x.gamma, x.lam, x.kl, x.kl_coef)


def token_advantages(estimator: str, rewards: torch.Tensor, mask: torch.Tensor, group_size: int,
                     scale: bool = True, kl: torch.Tensor | None = None, kl_coef: float = 0.0,
                     gamma: float = 1.0) -> torch.Tensor:
    """Per-token advantages ``(R, T)`` of a critic-free ``estimator`` from sequence rewards ``(R,)``.

    ``kl`` (R, T), when given, is a per-token KL estimate put *in the reward* (``- kl_coef * kl``):
    summed into the sequence reward for the outcome estimators, kept per token for REINFORCE++.
    """
    est = get_estimator(estimator)
    if est.critic:
        raise ValueError(f"{estimator} advantages need the critic's values: use get_estimator({estimator!r}).fn")
    return est.fn(AdvantageInputs(rewards, mask, group_size, scale, kl, kl_coef, gamma))


def ppo_advantages(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float,
                   kl: torch.Tensor | None = None, kl_coef: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO: GAE over token rewards (the outcome on the last token, minus ``kl_coef * kl`` per token
    when the KL is in the reward); advantages whitened over the batch, returns left raw for the critic."""
    m = mask.float()
    tr = outcome_token_rewards(rewards, m)
    if kl is not None:
        tr = tr - kl_coef * kl.float() * m
    adv, returns = gae(tr, values, m, gamma, lam)
    return whiten(adv, m), returns


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               scale: LossScale, clip: float | None = 0.2) -> tuple[torch.Tensor, float]:
    """``0.5 * max((V - R)^2, (V_clipped - R)^2)`` with ``V_clipped = V_old + clamp(V - V_old, +-clip)``,
    token-mean over the global batch; returns (this rank's loss share, sum of squared errors)."""
    err = (values - returns) ** 2
    if clip is not None:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        err = torch.maximum(err, (clipped - returns) ** 2)
    per_token = 0.5 * err
    return aggregate(per_token, mask, "token-mean", scale), float(((values - returns) ** 2 * mask).sum().detach())


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi (Schulman's k1 / k2 / k3).

    With ``d = ref_logp - logp``: k1 = ``-d`` (unbiased, high variance, can be negative),
    k2 = ``d^2 / 2``, k3 = ``exp(d) - d - 1`` (unbiased, non-negative, low variance).
    """
    d = ref_logp - logp
    if kind == "k1":
        return -d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        return torch.exp(d) - d - 1
    raise ValueError(f"unknown KL estimator {kind!r}; allowed: {', '.join(KL_ESTIMATORS)}")


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref) per token: ``exp(d) - d - 1`` with ``d = ref - logp``."""
    return kl_estimate(logp, ref_logp, "k3")


@dataclass(frozen=True)
class LossScale:
    """Global-batch counts that make per-rank sums add up to one batch-level aggregate.

    ``world`` undoes FSDP's averaging of gradients over ranks (each rank's loss is a share of the
    global aggregate, so the gradients must be summed, not averaged).
    """

    tokens: float  # loss tokens in the global batch
    seqs: float  # sequences (rows) in the global batch
    max_len: int = 1  # completion token budget: Dr.GRPO's constant normaliser
    world: int = 1


LOSS_AGG_MODES: dict[str, Callable] = {}


def register_loss_agg_mode(name: str):
    """Decorator: ``fn(x, mask, scale) -> this rank's unscaled share`` becomes ``trainer.loss_agg_mode: <name>``;
    ``x`` is the masked per-token loss (B, T)."""
    def add(fn: Callable) -> Callable:
        LOSS_AGG_MODES[name] = fn
        return fn
    return add


@register_loss_agg_mode("token-mean")
def _token_mean(x, m, scale):  # sum over all tokens / global token count
    return x.sum() / max(scale.tokens, 1.0)


@register_loss_agg_mode("seq-mean-token-sum")
def _seq_mean_token_sum(x, m, scale):  # per-sequence token sums, mean over sequences
    return x.sum() / max(scale.seqs, 1.0)


@register_loss_agg_mode("seq-mean-token-mean")
def _seq_mean_token_mean(x, m, scale):  # per-sequence token means, mean over sequences
    return (x.sum(1) / m.sum(1).clamp(min=1)).sum() / max(scale.seqs, 1.0)


@register_loss_agg_mode("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(x, m, scale):  # sum over all tokens / (sequences x max_len)   (Dr.GRPO)
    return x.sum() / max(scale.seqs * scale.max_len, 1.0)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, scale: LossScale) -> torch.Tensor:
    """Reduce a (B, T) per-token loss to this rank's share of the global aggregate ``mode``
    (a name in ``LOSS_AGG_MODES``); the share times ``world`` cancels FSDP's gradient averaging."""
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; allowed: {', '.join(LOSS_AGG_MODES)}")
    m = mask.float()
    return LOSS_AGG_MODES[mode](per_token * m, m, scale) * scale.world


@dataclass
class LossOut:
    loss: torch.Tensor  # scalar to backprop (this rank's share of the global aggregate)
    pg_sum: float  # sum over tokens of the policy-gradient term
    kl_sum: float  # sum over tokens of the KL estimate
    clipped: float  # number of tokens whose ratio was clipped
    tokens: float  # number of loss tokens on this rank
    entropy_sum: float = 0.0  # sum over tokens of the policy entropy
    is_weight_sum: float = 0.0  # off-policy correction: sum over tokens of the (truncated) IS weight
    is_truncated: float = 0.0  # tokens whose IS weight hit the cap


def truncated_is_weights(old_logp: torch.Tensor, behaviour_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance weights ``min(pi_old / pi_behaviour, cap)`` per token (no gradient).

    A stale rollout was drawn by an older policy (the sampler's weights, ``behaviour_logp``);
    the PPO ratio is taken against the trainer's current weights (``old_logp``) and this weight
    corrects for the difference. Truncation bounds the variance a rare token could add.
    """
    return torch.exp(old_logp.float() - behaviour_logp.float()).clamp(max=cap).detach()


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    scale: LossScale,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    agg_mode: str = "token-mean",
    dual_clip_c: float | None = None,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    is_weights: torch.Tensor | None = None,
    is_cap: float | None = None,
) -> LossOut:
    """PPO-style clipped surrogate with DAPO's asymmetric clip and an optional dual clip.

    ``ratio`` is clipped to ``[1 - clip_low, 1 + clip_high]`` (clip-higher: ``clip_high > clip_low``
    lets rare tokens gain probability); with ``dual_clip_c`` the loss of a negative-advantage token
    is capped at ``-c * A``. Shapes: ``logp``, ``old_logp``, ``mask``, ``ref_logp``, ``entropy``:
    (B, T) over completion tokens; ``advantages``: (B, T) or (B,) (broadcast along T).
    ``is_weights`` (B, T) (``truncated_is_weights``) multiply each token's clipped surrogate.
    """
    clip_high = clip_low if clip_high is None else clip_high
    mask = mask.float()
    ratio = torch.exp(logp - old_logp)
    adv = advantages.float()
    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
    surr1 = ratio * adv
    surr2 = ratio.clamp(1 - clip_low, 1 + clip_high) * adv
    pg = -torch.minimum(surr1, surr2)  # (B, T)
    if dual_clip_c is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -dual_clip_c * adv), pg)
    is_sum = is_trunc = 0.0
    if is_weights is not None:
        pg = pg * is_weights
        is_sum = float((is_weights * mask).sum())
        if is_cap is not None:
            is_trunc = float(((is_weights >= is_cap) * mask).sum())
    per_token = pg
    kl = torch.zeros_like(pg)
    if ref_logp is not None and kl_coef > 0:
        kl = kl_estimate(logp, ref_logp, kl_estimator)
        per_token = pg + kl_coef * kl
    ent_sum = 0.0
    if entropy is not None:
        ent_sum = float((entropy.detach() * mask).sum())
        if entropy_coef > 0:  # bonus: keeps exploring while groups still disagree
            per_token = per_token - entropy_coef * entropy
    clipped = ((surr2 < surr1).float() * mask).sum()
    return LossOut(
        loss=aggregate(per_token, mask, agg_mode, scale),
        pg_sum=float((pg * mask).sum().detach()),
        kl_sum=float((kl * mask).sum().detach()),
        clipped=float(clipped),
        tokens=float(mask.sum()),
        entropy_sum=ent_sum,
        is_weight_sum=is_sum,
        is_truncated=is_trunc,
    )


def token_entropy(logits: torch.Tensor, temperature: float = 1.0, chunk_tokens: int = 0) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` per position; (B, T, V) -> (B, T).
    ``chunk_tokens``: see ``token_logprobs_entropy``."""
    dummy = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    return token_logprobs_entropy(logits, dummy, temperature, with_entropy=True, chunk_tokens=chunk_tokens)[1]


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   chunk_tokens: int = 0) -> torch.Tensor:
    """Log-probability of each target under ``softmax(logits / temperature)``; (B, T, V) -> (B, T).
    ``chunk_tokens``: see ``token_logprobs_entropy``."""
    return token_logprobs_entropy(logits, targets, temperature, chunk_tokens=chunk_tokens)


def _logp_entropy(x: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor | None, temperature: float,
                  with_entropy: bool):
    """One chunk: (N, H) hidden states and the head's weight (V, H) (or ``(W, A, B, scale)`` with a LoRA
    adapter on the head: ``head_logits``), or (N, V) logits when ``weight``
    is None -> logprobs of ``targets`` (N,) [and entropies (N,)], fp32."""
    z = x if weight is None else head_logits(x, weight)
    logp = torch.log_softmax(z.float() / temperature, dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return lp
    return lp, -(logp.exp() * logp).sum(-1)


def token_logprobs_entropy(x: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                           with_entropy: bool = False, chunk_tokens: int = 0, weight: torch.Tensor | None = None):
    """Per-token logprobs of ``targets`` (and, with ``with_entropy``, the entropy) under
    ``softmax(logits / temperature)``, computed ``chunk_tokens`` tokens at a time.

    ``x`` is either the logits (..., V) or, with ``weight`` (V, H) (or ``(W, A, B, scale)``) given, the hidden states (..., H)
    that the LM head turns into logits chunk by chunk, so the (tokens, V) logits never exist whole.
    ``targets`` has ``x``'s leading shape; returns fp32 tensors of that shape.

    Memory: the fp32 log-softmax is (tokens x V x 4 B): 600 KB a token at a 152k vocabulary. With
    ``chunk_tokens > 0`` and more tokens than that, each chunk runs under ``torch.utils.checkpoint``
    when a gradient is needed: backward keeps only the chunk's inputs (views of ``x``, ``weight``,
    which the caller holds anyway) and recomputes one chunk's softmax at a time, so the extra memory
    is bounded by the chunk, not the sequence. The gradients are the unchunked ones (autograd through
    the same operations, row by row); ``chunk_tokens=0`` is one chunk (no recomputation).
    """
    lead = targets.shape
    flat_x = x.reshape(-1, x.shape[-1])
    flat_t = targets.reshape(-1)
    n = flat_t.numel()
    if chunk_tokens <= 0 or n <= chunk_tokens:
        out = _logp_entropy(flat_x, flat_t, weight, temperature, with_entropy)
    else:
        ws = weight if isinstance(weight, tuple) else (weight,)
        grad = torch.is_grad_enabled() and (x.requires_grad or any(isinstance(w, torch.Tensor) and w.requires_grad
                                                                   for w in ws))
        parts = []
        for lo in range(0, n, chunk_tokens):
            args = (flat_x[lo:lo + chunk_tokens], flat_t[lo:lo + chunk_tokens], weight, temperature, with_entropy)
            parts.append(checkpoint(_logp_entropy, *args, use_reentrant=False) if grad else _logp_entropy(*args))
        out = (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])) if with_entropy else torch.cat(parts)
    # fresh tensors, not views: FSDP2 warns (and would skip its backward hook on an in-place op)
    # when a wrapped module's forward returns a view; the copy is 4 bytes a token
    if with_entropy:
        return out[0].reshape(lead).clone(), out[1].reshape(lead).clone()
    return out.reshape(lead).clone()
