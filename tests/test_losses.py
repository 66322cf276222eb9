"""GRPO advantages and loss against numbers worked out by hand."""

import math

import numpy as np
import pytest
import torch

from learner.losses import grpo_advantages, grpo_loss, kl_k3, token_logprobs
from rltpu.rollout import build_train_batch, split_by_rank


def test_grpo_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.0, 1.0, 1.0, 1.0])
    adv = grpo_advantages(r, group_size=4)
    # group 1: mean 0.5, unbiased std sqrt(((.5)^2*2 + 0)/3) = sqrt(1/6)
    s1 = math.sqrt(1 / 6)
    # group 2: mean 0.75, unbiased std sqrt((.75^2 + 3*.25^2)/3) = sqrt(0.25)
    s2 = 0.5
    want = [0.5 / s1, -0.5 / s1, 0, 0, -0.75 / s2, 0.25 / s2, 0.25 / s2, 0.25 / s2]
    np.testing.assert_allclose(adv.numpy(), want, rtol=1e-5)
    # Dr. GRPO: mean baseline only
    np.testing.assert_allclose(grpo_advantages(r, 4, scale=False).numpy()[:2], [0.5, -0.5])
    # a group with equal rewards carries no signal
    assert torch.all(grpo_advantages(torch.ones(4), 4) == 0)
    with pytest.raises(ValueError, match="group_size"):
        grpo_advantages(torch.ones(5), 4)


def test_grpo_loss_by_hand():
    logp = torch.log(torch.tensor([[0.5, 0.25], [0.5, 0.3], [0.2, 0.3]]))
    old = torch.log(torch.tensor([[0.4, 0.25], [0.5, 0.9], [0.4, 0.3]]))
    adv = torch.tensor([1.0, -2.0, -2.0])
    mask = torch.tensor([[1, 1], [1, 0], [1, 0]])
    out = grpo_loss(logp, old, adv, mask, clip_eps=0.2, normalizer=4.0)
    # (0,0): ratio 1.25, A=1  -> min(1.25, 1.2) = 1.2 (clipped)   -> -1.2
    # (0,1): ratio 1,    A=1  -> 1                                -> -1
    # (1,0): ratio 1,    A=-2 -> -2                               -> +2
    # (1,1): masked out
    # (2,0): ratio 0.5,  A=-2 -> min(-1, 0.8*-2=-1.6) = -1.6 (clipped) -> +1.6
    assert out.loss.item() == pytest.approx((-1.2 - 1 + 2 + 1.6) / 4.0, abs=1e-6)
    assert out.clipped == 2 and out.tokens == 4
    # gradient: unclipped tokens get -A * ratio / normalizer; clipped ones get none
    lp = logp.clone().requires_grad_(True)
    grpo_loss(lp, old, adv, mask, 0.2, 4.0).loss.backward()
    np.testing.assert_allclose(lp.grad.numpy(), [[0, -0.25], [0.5, 0], [0, 0]], atol=1e-6)


def test_kl_k3_and_loss_with_reference():
    logp, ref = torch.log(torch.tensor([[0.5]])), torch.log(torch.tensor([[0.25]]))
    want = 0.5 - math.log(0.5) - 1  # exp(d) - d - 1 with d = log(0.25/0.5)
    assert kl_k3(logp, ref).item() == pytest.approx(want, abs=1e-6)
    out = grpo_loss(logp, logp, torch.tensor([0.0]), torch.ones(1, 1), 0.2, 1.0, ref_logp=ref, kl_coef=0.1)
    assert out.loss.item() == pytest.approx(0.1 * want, abs=1e-6)
    assert out.kl_sum == pytest.approx(want, abs=1e-6)


def test_token_logprobs_temperature():
    logits = torch.tensor([[[2.0, 0.0, 0.0]]])
    lp = token_logprobs(logits, torch.tensor([[0]]), temperature=2.0)
    assert lp.item() == pytest.approx(1 - math.log(math.e + 2), abs=1e-6)


def test_train_batch_layout_and_split():
    gen = {
        "prompt": np.array([[0, 1, 5], [1, 4, 5]]), "prompt_mask": np.array([[0, 1, 1], [1, 1, 1]]),
        "tokens": np.array([[7, 2, 0], [8, 9, 2]]), "logprobs": np.array([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.1]]),
        "lengths": np.array([2, 3]),
    }
    b = build_train_batch(gen, np.array([1.0, 0.0], np.float32), group_size=2, scale_rewards=True)
    np.testing.assert_array_equal(b["tokens"][0], [0, 1, 5, 7, 2, 0])
    np.testing.assert_array_equal(b["position_ids"][0], [0, 0, 1, 2, 3, 4])  # left pad shares position 0
    np.testing.assert_array_equal(b["attention_mask"][0], [0, 1, 1, 1, 1, 0])
    np.testing.assert_array_equal(b["loss_mask"][0], [0, 0, 0, 1, 1, 0])  # EOS is scored, pad after it is not
    np.testing.assert_array_equal(b["old_logprobs"][0], [0, 0, 0, -1, -2, 0])
    np.testing.assert_allclose(b["advantages"], [0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5)], rtol=1e-5)
    parts = split_by_rank(b, 2)
    assert [p["tokens"].shape[0] for p in parts] == [1, 1]
    assert all(p["global_tokens"] == 5.0 for p in parts)
    with pytest.raises(ValueError, match="evenly"):
        split_by_rank(b, 3)
