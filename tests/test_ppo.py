"""PPO with a critic: the value model learns the returns, its state survives a checkpoint, and
the config refuses PPO without a critic."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from learner.trainer import TrainerEngine
from rltpu.config import ConfigError, CriticConfig, TrainerConfig, load_config
from rltpu.control.batch import build_train_batch, split_by_rank
from test_trainer_fsdp import MCFG, G, SEED, TEMPERATURE, V, synthetic_batch

torch.set_num_threads(1)
TCFG = TrainerConfig(lr=1e-3, algorithm="ppo")
CCFG = CriticConfig(lr=3e-3, value_clip=None, gae_lambda=0.95)


def ppo_batch(engine: TrainerEngine, rewards: np.ndarray) -> dict:
    base = synthetic_batch(0)  # reuse its generations: rebuild them as a gen dict
    P = 5
    gen = {"prompt": base["tokens"][:, :P].astype(np.int32), "prompt_mask": base["attention_mask"][:, :P].astype(np.int32),
           "tokens": base["tokens"][:, P:].astype(np.int32), "logprobs": base["old_logprobs"][:, P:],
           "lengths": base["loss_mask"][:, P:].sum(1).astype(np.int32)}
    layout = build_train_batch(gen, rewards, G)
    values = engine.values(split_by_rank(layout, 1)[0])
    return split_by_rank(build_train_batch(gen, rewards, G, estimator="ppo", values=values, gamma=1.0, lam=0.95), 1)[0]


def test_critic_learns_returns_and_checkpoints(tmp_path):
    eng = TrainerEngine(MCFG, TCFG, V, SEED, TEMPERATURE, critic_cfg=CCFG)
    rewards = np.linspace(0, 1, 2 * G).astype(np.float32)
    batch = ppo_batch(eng, rewards)
    m = batch["loss_mask"][:, 1:] > 0
    # a fresh critic's head is zero: values 0, so the first returns are the plain rewards-to-go
    assert np.abs(batch["old_values"]).max() == 0
    last = np.array([np.flatnonzero(row)[-1] for row in m])
    np.testing.assert_allclose(batch["returns"][:, 1:][np.arange(len(last)), last], rewards, rtol=1e-6)
    errs = []
    for _ in range(25):
        stats = eng.train_step(batch)
        errs.append(stats["value_sq_err_sum"] / stats["tokens"])
    assert errs[-1] < 0.5 * errs[0], errs  # the value model fits the returns
    # the critic (weights and AdamW state) round-trips through a checkpoint
    ck = eng.save_checkpoint(tmp_path / "ck", {})
    assert (ck / "critic.index.json").exists() and (ck / "critic_optimizer-rank00000.safetensors").exists()
    fresh = TrainerEngine(MCFG, TCFG, V, SEED + 1, TEMPERATURE, critic_cfg=CCFG)
    fresh.load_checkpoint(ck)
    np.testing.assert_array_equal(fresh.values(batch), eng.values(batch))
    a, b = eng.train_step(batch), fresh.train_step(batch)
    assert a["value_sq_err_sum"] == pytest.approx(b["value_sq_err_sum"], rel=1e-6)
    # a PPO trainer refuses a checkpoint without a critic
    plain = TrainerEngine(MCFG, TCFG, V, SEED, TEMPERATURE).save_checkpoint(tmp_path / "plain", {})
    with pytest.raises(ValueError, match="no critic"):
        fresh.load_checkpoint(plain)


def test_ppo_config_errors(tmp_path):
    """PPO declares a critic (``register_estimator("ppo", critic=True)``): the section is required
    with it and refused without it, before Ray starts (``check_algorithm``)."""
    from rltpu.control.controller import check_algorithm

    cfg = tmp_path / "c.yaml"
    cfg.write_text("trainer: {steps: 1}\n")
    with pytest.raises(ConfigError, match="ppo needs a value model"):
        check_algorithm(load_config(cfg, ["trainer.algorithm=ppo"]))
    with pytest.raises(ConfigError, match=r"only used by an algorithm with a value model \(ppo\), not "
                                          r"trainer.algorithm=grpo"):
        check_algorithm(load_config(cfg, ["critic.lr=0.001"]))
    ok = load_config(cfg, ["trainer.algorithm=ppo", "critic.lr=0.001"])
    check_algorithm(ok)
    assert ok.critic.lr == 0.001


def test_critic_from_model_path_streams_the_backbone(tmp_path):
    """With model.path the critic's backbone is read from the checkpoint (no gathered copy): it
    equals the policy's backbone, and its head starts at zero."""
    pytest.importorskip("transformers")
    from rltpu.models.hf.tiny import write_tiny_checkpoint

    write_tiny_checkpoint(tmp_path / "ck", "qwen2")
    from rltpu.config import ModelConfig

    mcfg = ModelConfig(path=str(tmp_path / "ck"))  # the checkpoint's config.json fills the fields
    eng = TrainerEngine(mcfg, TCFG, mcfg.vocab_size, SEED, TEMPERATURE, critic_cfg=CCFG)
    pol = dict(eng.model.named_parameters())
    for name, p in eng.critic.named_parameters():
        if name.startswith("model."):
            assert torch.equal(p, pol[name]), name
    assert not eng.critic.score.weight.any()
