"""The RLHF reward model: a tiny HF sequence-classification checkpoint written by ``transformers``
scores like ``transformers``; bad checkpoints and configs are one-line errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from learner.reward_model import RewardModelEngine, combine_rewards
from rltpu.config import ConfigError, RewardModelConfig, load_config

transformers = pytest.importorskip("transformers")
V = 17  # the built-in char tokenizer's vocabulary


def write_reward_model(path, num_labels: int = 1, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   num_labels=num_labels, pad_token_id=0, tie_word_embeddings=False)
    model = transformers.LlamaForSequenceClassification(cfg).eval()
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)  # HF initialises it small; a visible head makes the test sharper
    model.save_pretrained(path, safe_serialization=True)
    return model


def test_scores_match_transformers(tmp_path):
    hf = write_reward_model(tmp_path / "rm")
    eng = RewardModelEngine(str(tmp_path / "rm"))
    rng = np.random.default_rng(0)
    lengths = [9, 5, 12, 1]
    ids = np.zeros((4, 12), np.int64)
    mask = np.zeros((4, 12), np.int64)
    for r, n in enumerate(lengths):  # right padding with pad id 0, as HF pools (rightmost non-pad)
        ids[r, :n] = rng.integers(3, V, n)
        mask[r, :n] = 1
    pos = np.maximum(np.cumsum(mask, 1) - 1, 0)
    with torch.no_grad():
        want = hf(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits[:, 0].numpy()
    got = eng.score(ids, pos, mask)
    assert np.abs(got - want).max() <= 1e-4, (got, want)
    assert np.ptp(want) > 0.1  # the rows really score differently
    # left padding (the rollout layout) gives each row the same score: pads are masked out
    left = np.zeros_like(ids)
    lmask = np.zeros_like(mask)
    for r, n in enumerate(lengths):
        left[r, 12 - n:], lmask[r, 12 - n:] = ids[r, :n], 1
    np.testing.assert_allclose(eng.score(left, np.maximum(np.cumsum(lmask, 1) - 1, 0), lmask), want, atol=1e-4)
    with pytest.raises(ValueError, match="outside the reward model's vocabulary"):
        eng.score(ids + 20, pos, mask)


def test_bad_reward_models_are_one_line_errors(tmp_path):
    write_reward_model(tmp_path / "two", num_labels=2)
    with pytest.raises(ValueError, match="score.weight has 2 labels; a reward model has one"):
        RewardModelEngine(str(tmp_path / "two"))
    lm = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64,
                                                                 num_hidden_layers=1, num_attention_heads=4))
    lm.save_pretrained(tmp_path / "lm")
    with pytest.raises(ValueError, match="LlamaForSequenceClassification"):
        RewardModelEngine(str(tmp_path / "lm"))


def test_combine_rewards_by_hand():
    rule, rm = np.array([1.0, 0.0, 0.5]), np.array([2.0, 4.0, 6.0])
    plain = combine_rewards(rule, rm, 0.5, RewardModelConfig(path="x", weight=2.0))
    np.testing.assert_allclose(plain, [0.5 + 4, 8, 0.25 + 12])
    z = (rm - 4) / (np.std(rm) + 1e-6)
    normed = combine_rewards(rule, rm, 1.0, RewardModelConfig(path="x", normalize=True, clip=1.0))
    np.testing.assert_allclose(normed, rule + np.clip(z, -1, 1), rtol=1e-5)
    np.testing.assert_allclose(combine_rewards(rule, None, 2.0, None), 2 * rule)


def test_reward_model_config_errors(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps({"trainer": {"steps": 1}}))
    with pytest.raises(ConfigError, match="placement.reward_chips >= 1"):
        load_config(cfg, ["reward_model.path=/x"])
    with pytest.raises(ConfigError, match="no reward_model section"):
        load_config(cfg, ["placement.reward_chips=1"])
    with pytest.raises(ConfigError, match="trainer_chip_ids and reward_chip_ids both list chip 2"):
        load_config(cfg, ["reward_model.path=/x", "placement.reward_chips=1", "placement.trainer_chip_ids=[2,3]",
                          "placement.reward_chip_ids=[2]"])
