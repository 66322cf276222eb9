"""The trainer engine: one rank of the FSDP2 policy, one policy update per call.

Testable without Ray: give it a process group (or none for a single process). The Ray actor in
``actors/trainer_actor.py`` only forwards to it.

One ``train_step`` reads straight down: forward -> token logprobs -> clipped policy loss
(``learner.losses.policy_loss``, the algorithm's options from ``TrainerConfig``) -> backward ->
clip -> AdamW step. The batch arrives already split by rank, advantages computed; the global
token and row counts (``global_tokens``, ``global_seqs``) make the per-rank losses add up to one
aggregate over the whole batch, and the ``world`` factor undoes FSDP's gradient averaging.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import torch

from learner.fsdp import checkpoint_layers, full_state_dict, parallelize_llama
from learner.tp import clip_grad_norm_, tp_degree
from learner.microbatch import pack_batch, packable, packed_padding, plan_microbatches, scatter_packed, slice_batch
from learner.losses import LossScale, policy_loss, token_logprobs_entropy, truncated_is_weights, value_loss
from learner.optim import build_optimizer
from rltpu.chips.backend import spmd_region
from rltpu.models.torch_llama import LlamaForCausalLM, init_state_dict


class TrainerEngine:
    def __init__(self, model_cfg, trainer_cfg, vocab_size: int, seed: int, temperature: float = 1.0,
                 mesh=None, device: str = "cpu", critic_cfg=None):
        self.cfg, self.temperature, self.mesh, self.device = trainer_cfg, temperature, mesh, device
        self.critic_cfg = critic_cfg
        self.hf = getattr(trainer_cfg, "model_impl", "native") == "hf"  # transformers' modeling code (learner/hf_model.py)
        # data-parallel width: the ranks of a TP group share one batch shard and one loss share
        self.world = (mesh["dp"].size() if mesh.ndim == 2 else mesh.size()) if mesh is not None else 1
        self.tp = tp_degree(mesh)
        # FSDP2 only where there is something to shard over: on a 1-rank group its all-gathers and
        # reduce-scatters are copies of the whole model and DTensor dispatch is paid on every op
        self.sharded = mesh is not None and (self.world > 1 or self.tp > 1)
        self.step = 0
        # model.path: each rank streams its FSDP shard from the HF directory; else a seeded init,
        # identical on every rank (same seed)
        state = None if model_cfg.path or self.hf else init_state_dict(model_cfg, vocab_size, seed)
        self.lora = trainer_cfg.lora  # LoRA: adapters train on a frozen base (learner/lora.py)
        self.init_seed, self.vocab_size = seed, vocab_size  # LoRA checkpoints name their base by these
        self.model = self._build(model_cfg, vocab_size, state, lora=self.lora)
        if self.lora is not None:
            from learner.lora import init_adapters

            init_adapters(self.model, seed)  # B = 0: the policy starts equal to the base
        self.ref_model = None
        self.has_reference = trainer_cfg.kl_coef > 0
        if self.has_reference and self.lora is None:  # with LoRA the reference is the base: adapters off
            self.ref_model = self._build(model_cfg, vocab_size, state)
            self.ref_model.requires_grad_(False)
        self.optimizer, self.scheduler = build_optimizer(self.model, trainer_cfg)
        self._update = spmd_region(self._apply_update, str(device).split(":")[0])
        self.critic = None
        if critic_cfg is not None and self.hf:  # PPO on a transformers body (its head at zero)
            from learner.hf_model import load_value_model

            self.critic = load_value_model(model_cfg, self.device)
            self._wrap(self.critic)
            self.critic_optimizer, self.critic_scheduler = build_optimizer(self.critic, critic_cfg)
        elif critic_cfg is not None:  # PPO: the value model lives on the same ranks as the policy
            from learner.critic import LlamaForValue, critic_state_from_policy, load_backbone_from_checkpoint

            if state is not None:  # seeded init: the policy's starting weights, already in memory
                self.critic = LlamaForValue(model_cfg, vocab_size)
                self.critic.load_state_dict(critic_state_from_policy(state), strict=False)
                self.critic.to(self.device)
            else:  # model.path: meta build, shard, then stream each rank's rows (no full copy)
                with torch.device("meta"):
                    self.critic = LlamaForValue(model_cfg, vocab_size)
            if self.sharded:
                self._parallelize(self.critic)
            elif self.cfg.activation_checkpointing:
                checkpoint_layers(self.critic)
            if state is None:
                self.critic.to_empty(device=self.device)
                load_backbone_from_checkpoint(self.critic, model_cfg)
            self.critic_optimizer, self.critic_scheduler = build_optimizer(self.critic, critic_cfg)

    def _build(self, model_cfg, vocab_size, state, lora=None):
        prepare = None
        if lora is not None:
            from learner.lora import add_lora

            prepare = lambda m: add_lora(m, lora)  # noqa: E731  (before FSDP2 wraps the layers)
        if self.hf:
            from learner.hf_model import load_causal_lm

            model = load_causal_lm(model_cfg, self.device)
            if prepare is not None:
                prepare(model)
                model.to(self.device)  # the adapters are made on the model's device already
            self._wrap(model)
            return model
        if state is None:
            from rltpu.models.hf.load import build_policy

            shard = (lambda m: self._parallelize(m)) if self.sharded else None
            return build_policy(model_cfg, vocab_size, shard, self.device, prepare)
        model = LlamaForCausalLM(model_cfg, vocab_size)
        model.load_state_dict(state)
        if prepare is not None:
            prepare(model)
        model.to(self.device)
        if self.sharded:
            self._parallelize(model)
        elif self.cfg.activation_checkpointing:
            checkpoint_layers(model)
        return model

    def _wrap(self, model) -> None:
        """FSDP2 where there is a group to shard over, else (one rank) activation checkpointing alone."""
        if self.sharded:
            self._parallelize(model)
        elif self.cfg.activation_checkpointing:
            from learner.hf_model import checkpoint_hf

            checkpoint_hf(model) if self.hf else checkpoint_layers(model)

    def _apply_update(self) -> torch.Tensor:
        """Clip, step, schedule: the same operations, collectives (the norm's all-reduce) and shard
        shapes on every rank, so on TorchTPU it runs ``spmd_safe`` (see ``__init__``). The micro-batch
        loop is not marked: its sequence buckets differ between ranks."""
        norm = self._clip(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        return norm

    def _clip(self, params, max_norm: float) -> torch.Tensor:
        """Global grad-norm clip; FSDP x TP gradients sit on two meshes (``learner.tp.clip_grad_norm_``)."""
        if self.tp > 1:
            return clip_grad_norm_(params, max_norm)
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def _parallelize(self, model):
        if self.hf:
            from learner.hf_model import parallelize_hf

            return parallelize_hf(model, self.mesh, self.cfg.mixed_precision, self.cfg.activation_checkpointing)
        return parallelize_llama(model, self.mesh, self.cfg.mixed_precision, self.cfg.activation_checkpointing)

    # -- the update -------------------------------------------------------------------------
    def _tensors(self, batch: dict) -> dict:
        # np.array copies read-only arrays (views into the Ray object store); packed ones are fresh
        return {k: torch.from_numpy(v if v.flags.writeable else np.array(v)).to(self.device)
                for k, v in batch.items() if isinstance(v, np.ndarray)}

    def _policy_logp(self, model, b: dict, with_entropy: bool = False):
        """Logprobs of tokens 1..L-1 (B, L-1) [and the policy's entropy there], ``logprob_chunk_tokens``
        tokens at a time from the final hidden states: the (B, L-1, V) fp32 logits never exist whole."""
        targets = b["tokens"][:, 1:].long()

        def head(hidden, weight):  # hidden (B, L, H): the position before each target
            return token_logprobs_entropy(hidden[:, :-1], targets, self.temperature, with_entropy,
                                          self.cfg.logprob_chunk_tokens, weight=weight)

        return model(b["tokens"], b["position_ids"], b["attention_mask"], head=head)

    def loss(self, batch: dict):
        """This rank's share of the policy loss, and the sampler-vs-trainer logprob gap (a sum).

        ``batch`` may be one micro-batch (see ``learner.microbatch``): global counts keep the shares
        additive. ``recomputed_old`` in it (from ``recompute_old_logprobs``) replaces the sampler's
        logprobs as the ratio's denominator.
        """
        c = self.cfg
        b = self._tensors(batch)
        old_logp = b["recomputed_old"][:, 1:] if "recomputed_old" in b else None
        ref = None
        if self.has_reference and not c.kl_in_reward:  # before the policy's forward: no graph in between
            with torch.no_grad(), self._autocast(), self._reference() as ref_model:
                ref = self._policy_logp(ref_model, b)
        with self._autocast():
            logp, entropy = self._policy_logp(self.model, b, with_entropy=True)
        mask = b["loss_mask"][:, 1:]
        sampler_logp = b["old_logprobs"][:, 1:]
        scale = LossScale(tokens=float(batch["global_tokens"]), seqs=float(batch["global_seqs"]),
                          max_len=int(batch.get("max_new_tokens", mask.shape[1])), world=self.world)
        is_w = None
        if c.off_policy_correction == "tis":  # stale rollouts: ratio vs the trainer, IS weight vs the sampler
            if old_logp is None:  # one epoch: the weights before this update are the ones running now
                old_logp = logp.detach()
            is_w = truncated_is_weights(old_logp, sampler_logp, c.tis_cap)
        out = policy_loss(
            logp, sampler_logp if old_logp is None else old_logp, b["advantages"][:, 1:], mask, scale,
            clip_low=c.clip_eps, clip_high=c.clip_eps_high, agg_mode=c.resolved_loss_agg_mode,
            dual_clip_c=c.dual_clip_c, ref_logp=ref, kl_coef=c.kl_coef, kl_estimator=c.kl_estimator,
            entropy=entropy, entropy_coef=c.entropy_coef, is_weights=is_w, is_cap=c.tis_cap,
        )
        gap = ((logp.detach() - sampler_logp).abs() * mask).sum()
        return out, float(gap)

    @torch.no_grad()
    def logprobs(self, batch: dict, reference: bool = False) -> np.ndarray:
        """Per-token logprobs (R, L) aligned with ``batch["tokens"]`` (0 where not computed), from the
        policy or the frozen reference; for KL in the reward and old-logprob recomputation."""
        if not reference:
            return self._per_token(batch, lambda b: self._policy_logp(self.model, b))
        if not self.has_reference:
            raise RuntimeError("no reference model: set trainer.kl_coef > 0")
        with self._reference() as model:
            return self._per_token(batch, lambda b: self._policy_logp(model, b))

    def _reference(self):
        """The frozen reference policy: its own copy, or with LoRA the base itself (adapters off)."""
        if self.lora is not None:
            from learner.lora import adapters_off

            return adapters_off(self.model)
        return contextlib.nullcontext(self.ref_model)

    @torch.no_grad()
    def values(self, batch: dict) -> np.ndarray:
        """The critic's values (R, L) aligned with ``batch["tokens"]``: entry t is the value of the
        state before token t (read where the policy's logits for token t are)."""
        return self._per_token(batch, lambda b: self.critic(b["tokens"], b["position_ids"], b["attention_mask"])[:, :-1])

    def _per_token(self, batch: dict, fn) -> np.ndarray:
        """Run ``fn`` (tensors -> (r, w-1) per-token values for tokens 1..w-1) over the micro-batches
        and scatter the results back into the full (R, L) layout."""
        R, L = batch["tokens"].shape
        out = np.zeros((R, L), np.float32)
        for mb, src in self._micro_batches(batch, self._plan(batch)):
            with self._autocast():
                vals = fn(self._tensors(mb)).float().cpu().numpy()
            if src is None:
                rows, lo, hi = mb["_slice"]
                out[rows, lo + 1:hi] = vals
            else:
                scatter_packed(out, vals, src)
        return out

    def _plan(self, batch: dict) -> list:
        """This rank's micro-batches; every rank runs the same number (FSDP's collectives pair up)."""
        mask = np.asarray(batch["attention_mask"])
        c = self.cfg
        plan = plan_microbatches(mask, c.micro_batch_tokens, c.seq_bucket, c.length_grouping)
        if self.mesh is not None and self.world > 1:
            n = torch.tensor([len(plan)])
            group = self.mesh.get_group("dp") if self.mesh.ndim == 2 else self.mesh.get_group()
            torch.distributed.all_reduce(n, op=torch.distributed.ReduceOp.MAX, group=group)
            if int(n) != len(plan):
                plan = plan_microbatches(mask, c.micro_batch_tokens, c.seq_bucket, c.length_grouping, int(n))
        return plan

    def _micro_batches(self, batch: dict, plan: list):
        """``(micro-batch, src)`` per planned micro-batch: its rows packed into lines no wider than the
        longest (``learner.microbatch.pack_batch``; ``src`` maps slots back) where the loss allows it,
        else its rows and used columns (``src`` None): always for ``model_impl=hf`` (packed lines need the
        native decoder's segment masks). Shape buckets only on devices that compile."""
        if self.hf or not packable(batch, self.cfg.resolved_loss_agg_mode):  # hf: transformers' own masks
            for rows, lo, hi in plan:
                yield slice_batch(batch, rows, lo, hi) | {"_slice": (rows, lo, hi)}, None
            return
        compiles = torch.device(self.device).type != "cpu"
        for rows, _, _ in plan:
            yield pack_batch(batch, rows, self.cfg.seq_bucket if compiles else 1, line_bucket=compiles)

    def _autocast(self):
        """bf16 compute without FSDP (one process); under FSDP2 its MixedPrecisionPolicy casts instead."""
        if self.cfg.mixed_precision == "bf16" and not self.sharded:
            return torch.autocast(device_type=torch.device(self.device).type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _critic_step(self, batch: dict, plan: list) -> dict:
        """One clipped value-loss step on the critic (PPO), accumulated over the micro-batches."""
        self.critic_optimizer.zero_grad(set_to_none=True)
        sq_err = v_sum = 0.0
        for mb, _ in self._micro_batches(batch, plan):
            b = self._tensors(mb)
            mask = b["loss_mask"][:, 1:]
            scale = LossScale(tokens=float(mb["global_tokens"]), seqs=float(mb["global_seqs"]), world=self.world)
            with self._autocast():
                v = self.critic(b["tokens"], b["position_ids"], b["attention_mask"])[:, :-1]
            loss, err = value_loss(v, b["old_values"][:, 1:], b["returns"][:, 1:], mask, scale,
                                   self.critic_cfg.value_clip)
            loss.backward()
            sq_err, v_sum = sq_err + err, v_sum + float((v.detach() * mask).sum())
        self._clip(self.critic.parameters(), self.critic_cfg.grad_clip)
        self.critic_optimizer.step()
        self.critic_scheduler.step()
        return {"value_sq_err_sum": sq_err, "value_sum": v_sum}

    def train_step(self, batch: dict) -> dict:
        t0 = time.perf_counter()
        plan = self._plan(batch)
        if self.cfg.recompute_old_logprobs or (self.cfg.off_policy_correction == "tis" and self.cfg.ppo_epochs > 1):
            # the ratio's denominator from this trainer, not the sampler (TIS weighs the difference);
            # with one epoch TIS takes it from this step's own forward (the weights have not moved yet)
            batch = dict(batch, recomputed_old=self.logprobs(batch))
        stats: dict = {}
        micro = [mb for mb, _ in self._micro_batches(batch, plan)]  # built once, reused by every epoch
        for epoch in range(self.cfg.ppo_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            sums = dict.fromkeys(("pg_sum", "kl_sum", "clipped", "tokens", "entropy_sum", "is_weight_sum",
                                  "is_truncated"), 0.0)
            gap = 0.0
            for mb in micro:  # gradient accumulation: the shares add up to the global loss
                out, gap_mb = self.loss(mb)
                out.loss.backward()
                gap += gap_mb
                for k in sums:
                    sums[k] += getattr(out, k)
            if epoch == 0:
                stats["logp_gap_sum"] = gap  # sampler-vs-trainer logprob gap, before any update
            norm = self._update()
            if self.critic is not None:
                stats.update(self._critic_step(batch, plan))
        stats.update(sums)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        self.step += 1
        stats.update(grad_norm=float(norm), lr=self.scheduler.get_last_lr()[0], seconds=time.perf_counter() - t0,
                     micro_batches=len(plan), train_padding_frac=packed_padding(micro, batch["attention_mask"]),
                     train_rows_computed=sum(len(mb["tokens"]) for mb in micro), threads=torch.get_num_threads())
        return stats

    def grads(self, batch: dict) -> dict[str, torch.Tensor]:
        """Full (unsharded) gradients of the loss on ``batch`` (trainable parameters only); for
        FSDP-vs-single-process checks."""
        self.optimizer.zero_grad(set_to_none=True)
        for mb, _ in self._micro_batches(batch, self._plan(batch)):
            out, _ = self.loss(mb)
            out.loss.backward()
        grads = {}
        for name, p in self.model.named_parameters():
            g = p.grad
            if g is None and not p.requires_grad:  # frozen (a LoRA base)
                continue
            grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
        self.optimizer.zero_grad(set_to_none=True)
        return grads

    # -- weights out --------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return full_state_dict(self.model)

    @torch.no_grad()
    def probe_logits(self, tokens, position_ids, attention_mask) -> np.ndarray:
        t = lambda x: torch.as_tensor(np.array(x), device=self.device)  # noqa: E731  (copy: Ray arrays are read-only)
        return self.model(t(tokens), t(position_ids), t(attention_mask)).float().cpu().numpy()

    # -- checkpoints ----------------------------------------------------------------------------
    def save_checkpoint(self, directory, meta: dict, keep: int = 1, group=None):
        """Collective over the trainer ranks (``group``: all of them; a 1-D mesh knows it): each writes
        only its own shards (``learner.checkpoint``)."""
        from learner.checkpoint import save_engine

        return save_engine(self, directory, meta, keep, group)

    def load_checkpoint(self, directory, group=None) -> dict:
        """Collective over the trainer ranks: each reads only what overlaps its shards, whatever mesh
        wrote the checkpoint; restores step, schedulers and RNG; returns the checkpoint's JSON."""
        from learner.checkpoint import load_engine

        return load_engine(self, directory, group)
