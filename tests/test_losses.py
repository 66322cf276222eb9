"""GRPO advantages and loss against numbers worked out by hand."""

import math

import numpy as np
import pytest
import torch

from learner.losses import (LossScale, aggregate, discounted_returns, gae, grpo_advantages, kl_estimate, kl_k3,
                            outcome_token_rewards, policy_loss, rloo_advantages, token_advantages,
                            token_logprobs, whiten)
from rltpu.config import ConfigError, load_config
from rltpu.control.batch import (build_train_batch, fill_dynamic_batch, keep_informative_groups, merge_generations,
                           select_groups, split_by_rank)


def grpo_loss(logp, old, adv, mask, clip_eps, normalizer, **kw):
    """The symmetric-clip, token-mean case of ``policy_loss`` (GRPO as first shipped)."""
    return policy_loss(logp, old, adv, mask, LossScale(tokens=normalizer, seqs=len(mask)), clip_low=clip_eps, **kw)


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
    a = 0.5 / math.sqrt(0.5)  # advantages per token: the sequence's value on its loss tokens only
    np.testing.assert_allclose(b["advantages"], [[0, 0, 0, a, a, 0], [0, 0, 0, -a, -a, -a]], rtol=1e-5)
    parts = split_by_rank(b, 2)
    assert [p["tokens"].shape[0] for p in parts] == [1, 1]
    assert all(p["global_tokens"] == 5.0 and p["global_seqs"] == 2.0 and p["max_new_tokens"] == 3 for p in parts)
    with pytest.raises(ValueError, match="evenly"):
        split_by_rank(b, 3)


# -- the algorithm family ------------------------------------------------------------------------


def test_rloo_by_hand():
    r = torch.tensor([1.0, 0.0, 0.5, 0.5])  # one group of 4
    # r_i - mean of the other three
    want = [1 - 1 / 3, 0 - 2 / 3, 0.5 - 1.5 / 3, 0.5 - 1.5 / 3]
    np.testing.assert_allclose(rloo_advantages(r, 4).numpy(), want, rtol=1e-6)
    # = G/(G-1) x the mean-baseline advantage
    np.testing.assert_allclose(rloo_advantages(r, 4).numpy(), 4 / 3 * grpo_advantages(r, 4, scale=False).numpy(),
                               rtol=1e-6)


def test_discounted_returns_and_whiten_by_hand():
    tr = torch.tensor([[0.0, 0.0, 1.0], [0.5, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 1], [1, 1, 0]])
    g = discounted_returns(tr, m, gamma=0.5)
    np.testing.assert_allclose(g.numpy(), [[0.25, 0.5, 1.0], [0.5, 0.0, 0.0]])
    w = whiten(g, m)
    vals = np.array([0.25, 0.5, 1.0, 0.5, 0.0])  # the 5 masked-in entries
    want = (vals - vals.mean()) / vals.std()
    np.testing.assert_allclose(w[m.bool()].numpy(), want, rtol=1e-5)
    assert w[1, 2] == 0


def test_outcome_token_rewards_on_last_token():
    m = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    got = outcome_token_rewards(torch.tensor([2.0, 3.0, 4.0]), m)
    np.testing.assert_array_equal(got.numpy(), [[0, 2, 0], [0, 0, 3], [0, 0, 0]])


def test_reinforce_pp_with_kl_in_reward_by_hand():
    r = torch.tensor([1.0, 0.0])
    m = torch.tensor([[1, 1], [1, 0]])
    kl = torch.tensor([[0.2, 0.4], [0.6, 9.0]])  # 9.0 sits on a masked slot and must not count
    adv = token_advantages("reinforce_pp", r, m, group_size=2, kl=kl, kl_coef=0.5, gamma=1.0)
    # token rewards: row0 [-0.1, 1 - 0.2] -> returns [0.7, 0.8]; row1 [0 - 0.3] -> [-0.3]
    vals = np.array([0.7, 0.8, -0.3])
    want = (vals - vals.mean()) / vals.std()
    np.testing.assert_allclose(adv[m.bool()].numpy(), want, rtol=1e-5)
    # the baseline variant subtracts the group mean (0.5) before the returns
    adv_b = token_advantages("reinforce_pp_baseline", r, m, group_size=2, kl=kl, kl_coef=0.5)
    vals_b = np.array([0.5 - 0.1 - 0.2, 0.5 - 0.2, -0.5 - 0.3])
    np.testing.assert_allclose(adv_b[m.bool()].numpy(), (vals_b - vals_b.mean()) / vals_b.std(), rtol=1e-5)


def test_outcome_estimators_with_kl_in_reward():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])
    m = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]])
    kl = torch.tensor([[0.1, 0.1], [0.2, 5.0], [0.0, 0.0], [0.0, 0.0]])
    adv = token_advantages("drgrpo", r, m, group_size=2, kl=kl, kl_coef=1.0)
    # sequence rewards after the penalty: [0.8, -0.2 | 0, 0]; mean-baseline per group of 2
    np.testing.assert_allclose(adv.numpy(), [[0.5, 0.5], [-0.5, 0], [0, 0], [0, 0]], rtol=1e-6)
    adv_r = token_advantages("rloo", r, m, group_size=2)
    np.testing.assert_allclose(adv_r.numpy(), [[1, 1], [-1, 0], [0, 0], [0, 0]], rtol=1e-6)
    with pytest.raises(ValueError, match="allowed"):
        token_advantages("ppo2", r, m, 2)


def test_gae_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    m = torch.ones(1, 3)
    adv, ret = gae(rewards, values, m, gamma=0.9, lam=0.8)
    d2 = 1.0 - 0.7  # last token: no next value
    d1 = 0.0 + 0.9 * 0.7 - 0.6
    d0 = 0.0 + 0.9 * 0.6 - 0.5
    a2 = d2
    a1 = d1 + 0.72 * a2
    a0 = d0 + 0.72 * a1
    np.testing.assert_allclose(adv.numpy(), [[a0, a1, a2]], rtol=1e-5)
    np.testing.assert_allclose(ret.numpy(), [[a0 + 0.5, a1 + 0.6, a2 + 0.7]], rtol=1e-5)
    # a masked tail is skipped: the last real token has no successor
    adv2, _ = gae(torch.tensor([[0.0, 1.0, 7.0]]), torch.tensor([[0.5, 0.6, 9.0]]), torch.tensor([[1, 1, 0]]), 1.0, 1.0)
    np.testing.assert_allclose(adv2.numpy(), [[1.0 - 0.5, 1.0 - 0.6, 0.0]], rtol=1e-5)


def test_kl_estimators_by_hand():
    logp, ref = torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25]))
    d = math.log(0.25 / 0.5)
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(-d, abs=1e-6)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5 * d * d, abs=1e-6)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(math.exp(d) - d - 1, abs=1e-6)
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(logp, ref, "k4")


def test_loss_aggregation_modes_by_hand():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 1], [1, 0, 0]])
    sc = LossScale(tokens=4, seqs=2, max_len=3)
    assert aggregate(x, m, "token-mean", sc).item() == pytest.approx(10 / 4)
    assert aggregate(x, m, "seq-mean-token-sum", sc).item() == pytest.approx((6 + 4) / 2)
    assert aggregate(x, m, "seq-mean-token-mean", sc).item() == pytest.approx((2 + 4) / 2)
    assert aggregate(x, m, "seq-mean-token-sum-norm", sc).item() == pytest.approx(10 / (2 * 3))
    # two ranks holding one row each add up to the global aggregate (world undoes FSDP's mean)
    sc2 = LossScale(tokens=4, seqs=2, max_len=3, world=2)
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        halves = aggregate(x[:1], m[:1], mode, sc2) + aggregate(x[1:], m[1:], mode, sc2)
        assert (halves / 2).item() == pytest.approx(aggregate(x, m, mode, sc).item())
    with pytest.raises(ValueError, match="loss_agg_mode"):
        aggregate(x, m, "sum", sc)


def test_clip_higher_and_dual_clip_by_hand():
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.25, 1.25, 4.0]]))  # ratios 1.25, 1.25, 4
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    m = torch.ones(1, 3)
    sc = LossScale(tokens=1, seqs=1)
    sym = policy_loss(logp, old, adv, m, sc, clip_low=0.2)
    # symmetric: min(1.25, 1.2) = 1.2 on the two positive tokens; negative: max(4, 1.2) * 1 -> +4
    assert sym.loss.item() == pytest.approx(-1.2 - 1.2 + 4.0, abs=1e-5)
    high = policy_loss(logp, old, adv, m, sc, clip_low=0.2, clip_high=0.28)
    # clip-higher 0.28: 1.25 < 1.28 is not clipped
    assert high.loss.item() == pytest.approx(-1.25 - 1.25 + 4.0, abs=1e-5)
    assert high.clipped == 0
    dual = policy_loss(logp, old, adv, m, sc, clip_low=0.2, clip_high=0.28, dual_clip_c=3.0)
    # dual clip caps the negative-advantage token's loss at -c * A = 3
    assert dual.loss.item() == pytest.approx(-1.25 - 1.25 + 3.0, abs=1e-5)


def test_dynamic_sampling_selection():
    rewards = np.array([1, 1, 0, 1, 0.5, 0.5, 0, 0.25], np.float32)  # groups of 2: [eq, diff, eq, diff]
    keep = keep_informative_groups(rewards, 2)
    np.testing.assert_array_equal(keep, [1, 3])
    gen = {"prompt": np.arange(8)[:, None], "prompt_mask": np.ones((8, 1)), "tokens": np.arange(16).reshape(8, 2),
           "logprobs": np.zeros((8, 2)), "lengths": np.arange(8), "version": 3}
    sel = select_groups(gen, keep, 2)
    np.testing.assert_array_equal(sel["lengths"], [2, 3, 6, 7])
    assert sel["version"] == 3
    # the refill: two rounds of kept groups merge into one batch with per-row versions
    merged = merge_generations([sel, select_groups(gen | {"version": 4}, np.array([0]), 2)], pad_id=0)
    np.testing.assert_array_equal(merged["lengths"], [2, 3, 6, 7, 0, 1])
    np.testing.assert_array_equal(merged["versions"], [3, 3, 3, 3, 4, 4])


def test_algorithm_config_errors(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("trainer: {steps: 1}\n")
    with pytest.raises(ConfigError, match="kl_in_reward=true needs kl_coef > 0"):
        load_config(cfg, ["trainer.kl_in_reward=true"])
    with pytest.raises(ConfigError, match="kl_estimator"):
        load_config(cfg, ["trainer.kl_estimator=k7"])
    from rltpu.control.controller import check_algorithm  # the registry's names, before Ray starts

    with pytest.raises(ConfigError, match="trainer.algorithm: unknown advantage estimator 'ppo2'; allowed: grpo"):
        check_algorithm(load_config(cfg, ["trainer.algorithm=ppo2"]))
    with pytest.raises(ConfigError, match="trainer.loss_agg_mode: unknown 'sum'; allowed: token-mean"):
        check_algorithm(load_config(cfg, ["trainer.loss_agg_mode=sum"]))
    assert load_config(cfg, ["trainer.algorithm=drgrpo"]).trainer.resolved_loss_agg_mode == "seq-mean-token-sum-norm"
    assert load_config(cfg, ["trainer.algorithm=rloo"]).trainer.resolved_loss_agg_mode == "token-mean"


def test_microbatch_config_errors(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("trainer: {steps: 1}\n")
    # default: 16 prompts x 8 = 128 rows over 2 trainers = 64 rows x (16 + 8) tokens = 1536 per rank
    with pytest.raises(ConfigError, match="larger than a trainer rank's whole batch"):
        load_config(cfg, ["trainer.micro_batch_tokens=1537"])
    assert load_config(cfg, ["trainer.micro_batch_tokens=1536"]).trainer.micro_batch_tokens == 1536
    with pytest.raises(ConfigError, match="below seq_bucket"):
        load_config(cfg, ["trainer.micro_batch_tokens=8"])


def _round(rewards, first_id):
    """One sampling round of len(rewards)/2 groups of 2; row ids = lengths, to trace where rows went."""
    R = len(rewards)
    ids = np.arange(first_id, first_id + R)
    gen = {"prompt": ids[:, None], "prompt_mask": np.ones((R, 1)), "tokens": np.stack([ids, ids], 1),
           "logprobs": np.zeros((R, 2)), "lengths": ids, "version": 0}
    return gen, np.asarray(rewards, np.float32)


def test_dynamic_sampling_refill_by_hand():
    # n = 3 groups of G = 2 per round. Round 1: groups [eq, diff, eq]; round 2: [diff, diff, eq]
    r1 = _round([1, 1, 0, 1, 0, 0], 0)  # rows 0..5: group 1 (rows 2, 3) is informative
    r2 = _round([0, 1, 1, 0, 5, 5], 10)  # rows 10..15: groups 0 (10, 11) and 1 (12, 13)
    gen, rewards, have, filler = fill_dynamic_batch([r1, r2], 3, 2, pad_id=0)
    # the first 3 informative groups in sampling order: (2, 3), (10, 11), (12, 13)
    np.testing.assert_array_equal(gen["lengths"], [2, 3, 10, 11, 12, 13])
    np.testing.assert_array_equal(rewards, [0, 1, 0, 1, 1, 0])
    assert (have, filler) == (3, 0)
    # one round only: 1 informative group, topped up with the first 2 zero-variance groups
    gen, rewards, have, filler = fill_dynamic_batch([r1], 3, 2, pad_id=0)
    np.testing.assert_array_equal(gen["lengths"], [2, 3, 0, 1, 4, 5])
    np.testing.assert_array_equal(rewards, [0, 1, 1, 1, 0, 0])
    assert (have, filler) == (1, 2)
    # the filler groups carry zero advantage: they add tokens but no gradient signal
    adv = grpo_advantages(torch.from_numpy(rewards), 2)
    assert torch.all(adv[2:] == 0) and torch.all(adv[:2] != 0)


def test_truncated_importance_weights_by_hand():
    """Stale rollouts (placement.staleness > 0): ratio against the trainer's logprobs, each token's
    surrogate weighted by min(pi_old / pi_behaviour, cap)."""
    from learner.losses import truncated_is_weights

    behaviour = torch.log(torch.tensor([[0.5, 0.2, 0.4]]))  # the sampler's (stale) policy
    old = torch.log(torch.tensor([[0.5, 0.6, 0.2]]))  # the trainer's weights before the update
    w = truncated_is_weights(old, behaviour, cap=2.0)
    np.testing.assert_allclose(w.numpy(), [[1.0, 2.0, 0.5]], rtol=1e-6)  # 0.6/0.2 = 3 is truncated to 2
    logp = old + torch.log(torch.tensor([[1.1, 1.0, 1.5]]))  # ratios vs old: 1.1, 1.0, 1.5
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    m = torch.ones(1, 3)
    out = policy_loss(logp, old, adv, m, LossScale(tokens=3, seqs=1), clip_low=0.2, is_weights=w, is_cap=2.0)
    # token 0: -min(1.1, 1.1)*1 * w1 = -1.1; token 1: -min(-1, -1) * 2 = +2; token 2: -min(1.5, 1.2) * 0.5 = -0.6
    assert out.loss.item() == pytest.approx((-1.1 + 2.0 - 0.6) / 3, abs=1e-5)
    assert out.is_weight_sum == pytest.approx(3.5)
    assert out.is_truncated == 1
    plain = policy_loss(logp, old, adv, m, LossScale(tokens=3, seqs=1), clip_low=0.2)
    assert plain.loss.item() == pytest.approx((-1.1 + 1.0 - 1.2) / 3, abs=1e-5)
