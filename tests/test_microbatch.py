"""Micro-batching by token budget: planning by hand, and the same update as one pass."""

from __future__ import annotations

import numpy as np
import torch

from learner.microbatch import padding_fraction, plan_microbatches, row_spans, slice_batch
from learner.trainer import TrainerEngine
from rltpu.control.batch import split_by_rank
from test_trainer_fsdp import MCFG, SEED, TCFG, TEMPERATURE, V, synthetic_batch

torch.set_num_threads(1)


def test_plan_by_hand():
    # 4 rows over 8 columns: real spans [5,8) [4,8) [1,8) [0,6)
    mask = np.zeros((4, 8), np.int64)
    for r, (a, b) in enumerate([(5, 8), (4, 8), (1, 8), (0, 6)]):
        mask[r, a:b] = 1
    first, last = row_spans(mask)
    assert list(first) == [5, 4, 1, 0] and list(last) == [8, 8, 8, 6]
    # one pass: all rows, only the used columns
    [(rows, lo, hi)] = plan_microbatches(mask, 0, seq_bucket=1)
    assert list(rows) == [0, 1, 2, 3] and (lo, hi) == (0, 8)
    # budget 8 tokens, bucket 1: sorted by length 3,4,6,7 -> [3],[4] fit (2 x 4 = 8), then 6, 7 alone
    plan = plan_microbatches(mask, 8, seq_bucket=1)
    assert [list(r) for r, _, _ in plan] == [[0, 1], [3], [2]]
    assert [(lo, hi) for _, lo, hi in plan] == [(4, 8), (0, 6), (1, 8)]
    # padded slots: (2x4 - 7) + (6 - 6) + (7 - 7) = 1 of 8 + 6 + 7 = 21 computed
    assert padding_fraction(plan, mask) == 1 - 20 / 21
    # at least min_count micro-batches (so every FSDP rank runs the same number of passes)
    assert len(plan_microbatches(mask, 0, 1, min_count=3)) == 3
    # widths round up to the bucket, widened on the prompt (left) side
    [(_, lo, hi)] = plan_microbatches(mask[:1], 0, seq_bucket=4)
    assert (lo, hi) == (4, 8)
    sl = slice_batch({"a": np.arange(32).reshape(4, 8), "n": np.arange(4), "s": 7}, np.array([1, 3]), 2, 5)
    np.testing.assert_array_equal(sl["a"], [[10, 11, 12], [26, 27, 28]])
    assert list(sl["n"]) == [1, 3] and sl["s"] == 7


def test_microbatched_step_equals_one_pass():
    batch = split_by_rank(synthetic_batch(0), 1)[0]
    one = TrainerEngine(MCFG, TCFG.model_copy(update={"ppo_epochs": 1}), V, SEED, TEMPERATURE)
    many = TrainerEngine(MCFG, TCFG.model_copy(update={"ppo_epochs": 1, "micro_batch_tokens": 24, "seq_bucket": 2}),
                         V, SEED, TEMPERATURE)
    g1, g2 = one.grads(batch), many.grads(batch)
    for k in g1:
        np.testing.assert_allclose(g2[k].numpy(), g1[k].numpy(), rtol=1e-4, atol=1e-6, err_msg=k)
    s1, s2 = one.train_step(batch), many.train_step(batch)
    assert s2["micro_batches"] > 1 and s1["micro_batches"] == 1
    # rows packed into lines (learner.microbatch.pack_batch): less padding than the rows-by-columns slice
    mask = batch["attention_mask"]
    assert s1["train_padding_frac"] < padding_fraction(plan_microbatches(mask, 0, seq_bucket=1), mask)
    assert s2["train_padding_frac"] < padding_fraction(plan_microbatches(mask, 24, seq_bucket=2), mask)
    for k in ("pg_sum", "kl_sum", "tokens", "logp_gap_sum"):
        assert abs(s1[k] - s2[k]) <= 1e-4 * max(1.0, abs(s1[k])), k
    m = batch["loss_mask"] > 0  # on the tokens that are scored (padding columns are not computed)
    np.testing.assert_allclose(many.logprobs(batch)[m], one.logprobs(batch)[m], atol=1e-5)


def test_activation_checkpointing_and_bf16():
    batch = split_by_rank(synthetic_batch(1), 1)[0]
    base = TrainerEngine(MCFG, TCFG, V, SEED, TEMPERATURE)
    ac = TrainerEngine(MCFG, TCFG.model_copy(update={"activation_checkpointing": True}), V, SEED, TEMPERATURE)
    g0, g1 = base.grads(batch), ac.grads(batch)
    for k in g0:  # recomputation gives the same gradients
        np.testing.assert_allclose(g1[k].numpy(), g0[k].numpy(), rtol=1e-5, atol=1e-7, err_msg=k)
    bf = TrainerEngine(MCFG, TCFG.model_copy(update={"mixed_precision": "bf16"}), V, SEED, TEMPERATURE)
    lp0, lp1 = base.logprobs(batch), bf.logprobs(batch)
    m = batch["loss_mask"] > 0
    diff = np.abs(lp0 - lp1)[m].max()
    assert 0 < diff < 0.1, diff  # bf16 compute: close to fp32, not identical
    assert all(p.dtype == torch.float32 for p in bf.model.parameters())  # master weights stay fp32


def test_tis_with_one_epoch_needs_no_recompute_pass():
    """With one epoch the trainer's pre-update logprobs are this step's own forward (detached): the
    update equals the one with an explicit recompute pass, and the IS weights differ from 1 where
    the (stale) sampler's logprobs do."""
    batch = split_by_rank(synthetic_batch(2), 1)[0]
    batch["old_logprobs"] = batch["old_logprobs"] - 0.3 * batch["loss_mask"]  # a staler behaviour policy
    tis = {"ppo_epochs": 1, "off_policy_correction": "tis", "tis_cap": 1.2}
    own = TrainerEngine(MCFG, TCFG.model_copy(update=tis), V, SEED, TEMPERATURE)
    recomputed = TrainerEngine(MCFG, TCFG.model_copy(update=tis | {"recompute_old_logprobs": True}), V, SEED,
                               TEMPERATURE)
    s1, s2 = own.train_step(batch), recomputed.train_step(batch)
    assert s1["is_truncated"] > 0 and s1["is_weight_sum"] < 1.2 * s1["tokens"]
    assert abs(s1["is_weight_sum"] - s2["is_weight_sum"]) <= 1e-4 * s1["tokens"]
    for (name, p1), (_, p2) in zip(own.model.named_parameters(), recomputed.model.named_parameters()):
        np.testing.assert_allclose(p1.detach().numpy(), p2.detach().numpy(), rtol=1e-5, atol=1e-6, err_msg=name)
    plain = TrainerEngine(MCFG, TCFG.model_copy(update={"ppo_epochs": 1}), V, SEED, TEMPERATURE)
    plain.train_step(batch)
    moved = [float((p1 - p3).abs().max()) for p1, p3 in zip(own.model.parameters(), plain.model.parameters())]
    assert max(moved) > 1e-6  # the correction changes the update


def _plain_grpo(batch: dict, temperature: float, clip: float):
    """The GRPO loss the trainer computes, in plain PyTorch: each row alone (its real tokens only, no
    padding, no packing, no chunking, no FSDP) through an unwrapped copy of the initial policy,
    log-softmax at ``temperature``, the clipped ratio against the sampler's logprobs times the
    advantage, summed over completion tokens / their count. Returns (loss, {name: grad})."""
    from learner.microbatch import row_spans
    from rltpu.models.torch_llama import LlamaForCausalLM, init_state_dict

    model = LlamaForCausalLM(MCFG, V)
    model.load_state_dict(init_state_dict(MCFG, V, SEED))
    t = {k: torch.from_numpy(np.asarray(v)) for k, v in batch.items() if isinstance(v, np.ndarray)}
    first, last = row_spans(batch["attention_mask"])
    total = torch.zeros(())
    for r, (a, b) in enumerate(zip(first, last)):
        logits = model(t["tokens"][r:r + 1, a:b], t["position_ids"][r:r + 1, a:b])[0, :-1] / temperature
        lp = torch.log_softmax(logits, -1).gather(-1, t["tokens"][r, a + 1:b, None]).squeeze(-1)
        ratio = torch.exp(lp - t["old_logprobs"][r, a + 1:b])
        adv = t["advantages"][r, a + 1:b]
        pg = -torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
        total = total + (pg * t["loss_mask"][r, a + 1:b]).sum()
    loss = total / t["loss_mask"].sum()
    loss.backward()
    return float(loss.detach()), {k: p.grad for k, p in model.named_parameters()}


def test_packed_update_equals_plain_pytorch_grpo():
    """The trainer's GRPO loss and gradients equal the plain computation (``_plain_grpo``) to 1e-5,
    with rows packed into lines (fewer rows computed than the batch has) and FSDP2 skipped on a
    1-rank group (the trainer of a 1-chip run): the speed-ups change no number."""
    from test_trainer_fsdp import _spawn

    batch = split_by_rank(synthetic_batch(3), 1)[0]
    # a sampler that drew from another policy: ratios far from 1, some clipped on both sides
    rng = np.random.default_rng(3)
    batch["old_logprobs"] = (batch["old_logprobs"] + rng.uniform(-0.6, 0.6, batch["old_logprobs"].shape)
                             * batch["loss_mask"]).astype(np.float32)
    tcfg = TCFG.model_copy(update={"kl_coef": 0.0, "entropy_coef": 0.0, "ppo_epochs": 1, "clip_eps": 0.2})
    want_loss, want = _plain_grpo(batch, TEMPERATURE, 0.2)
    eng = TrainerEngine(MCFG, tcfg, V, SEED, TEMPERATURE)
    micro = [mb for mb, _ in eng._micro_batches(batch, eng._plan(batch))]
    assert sum(len(mb["tokens"]) for mb in micro) < len(batch["tokens"])  # packed: fewer lines than rows
    assert abs(sum(float(eng.loss(mb)[0].loss) for mb in micro) - want_loss) <= 1e-5
    one_rank = _spawn(1, batch, tcfg)[0]
    got = {"single": eng.grads(batch), "1-rank FSDP group": one_rank["grads"]}
    for where, grads in got.items():
        for k, g in want.items():
            np.testing.assert_allclose(np.asarray(grads[k]), g.numpy(), rtol=0, atol=1e-5, err_msg=f"{where}: {k}")
    assert one_rank["sharding"][1] is None  # one rank: plain tensors, not DTensor shards
