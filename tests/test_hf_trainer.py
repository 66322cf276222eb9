"""``trainer.model_impl: hf``: transformers' modeling code under the trainer engine.

Llama and Qwen2 (which the native decoder also implements) give the native trainer's loss, gradients
and logprobs on the same batch; over 2 FSDP2 ranks the same gradients as one process. Gemma 3
(text) and Qwen3-MoE (which only transformers implements here) take a training step, checkpoint,
resume and export to a directory transformers reloads with the trained engine's logits.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open

from learner.trainer import TrainerEngine
from procs import join_gloo, spawn_ranks
from rltpu.config import ConfigError, LoraConfig, ModelConfig, TrainerConfig, load_config
from rltpu.control.batch import split_by_rank
from rltpu.models.hf.tiny import write_tiny_checkpoint
from test_trainer_fsdp import synthetic_batch

torch.set_num_threads(1)

V, SEED, TEMP = 17, 0, 0.8
# fp32, same weights and batch: measured max |grad diff| 1.8e-7 (qwen2) / 6e-8 (llama) at max |grad| ~0.5,
# logprob diff 2.4e-7. The bound leaves ~50x for other CPUs' summation orders.
TOL = 1e-5
TCFG = dict(lr=1e-2, kl_coef=0.1, entropy_coef=0.01)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_trainer")
    out = {}
    for arch, tied in (("llama", False), ("qwen2", True), ("gemma3", False), ("qwen3_moe", False)):
        hf_only = arch in ("gemma3", "qwen3_moe")  # exported with their tokenizer: its vocabulary (batch ids < V)
        out[arch] = write_tiny_checkpoint(root / arch, arch, tied=tied, vocab_size=None if hf_only else V,
                                          hidden_size=32, num_layers=2, with_tokenizer=hf_only)
    return out


def _engine(path, impl: str, **kw) -> TrainerEngine:
    return TrainerEngine(ModelConfig(path=str(path)), TrainerConfig(**TCFG, model_impl=impl, **kw), V, SEED, TEMP)


class _Run:
    """The model and trainer sections of a run, and the config a checkpoint records (``rltpu export``
    reads model.path, dtype, trainer.model_impl from it). Not a RunConfig: that would also ask for
    ``sampler.backend=vllm`` (these families' only sampler here), which the trainer does not need."""

    def __init__(self, path, **trainer):
        self.model = ModelConfig(path=str(path))
        self.trainer = TrainerConfig(**{**TCFG, "model_impl": "hf", **trainer})

    def to_dict(self) -> dict:
        return {"model": self.model.model_dump(mode="json"), "trainer": self.trainer.model_dump(mode="json")}


def _global(batch: dict) -> dict:
    return split_by_rank(batch, 1)[0]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hf_loss_grads_and_logprobs_equal_the_native_trainer(ckpts, arch):
    """The native engine packs rows into segment-masked lines; the hf one runs padded rows through
    transformers' own masks: the same numbers on real tokens."""
    batch = _global(synthetic_batch())
    native, hf = _engine(ckpts[arch], "native"), _engine(ckpts[arch], "hf")
    assert type(hf.model).__name__.startswith("RltpuHF") and hf.ref_model is not None
    assert [n for n, _ in hf.model.named_parameters()] == [n for n, _ in native.model.named_parameters()]
    (ln, _), (lh, _) = native.loss(batch), hf.loss(batch)
    assert float(ln.loss.detach()) != 0 and abs(float(ln.loss.detach()) - float(lh.loss.detach())) <= TOL
    gn, gh = native.grads(batch), hf.grads(batch)
    assert gn.keys() == gh.keys()
    for name, g in gn.items():
        assert float(g.abs().max()) > 0, name
        assert float((g - gh[name]).abs().max()) <= TOL, name
    pn, ph = native.logprobs(batch), hf.logprobs(batch)
    real = batch["loss_mask"].astype(bool)
    assert real.sum() > 10 and np.abs(pn - ph)[real].max() <= TOL


def _fsdp_worker(rank, world, port, path, batch, q):
    try:
        join_gloo(rank, world, port)
        from torch.distributed.device_mesh import init_device_mesh

        eng = TrainerEngine(ModelConfig(path=path), TrainerConfig(**TCFG, model_impl="hf"), V, SEED, TEMP,
                            mesh=init_device_mesh("cpu", (world,)))
        layer = eng.model.model.layers[0].self_attn.q_proj.weight
        grads = {k: v.numpy() for k, v in eng.grads(split_by_rank(batch, world)[rank]).items()}
        q.put((rank, {"grads": grads, "dtensor": type(layer).__name__}))
    except Exception as e:  # noqa: BLE001 - reported to the parent
        q.put((rank, {"error": f"{type(e).__name__}: {e}"}))


@pytest.mark.slow  # ~30 s on 2 loaded cores (2 spawned ranks)
def test_hf_fsdp_two_ranks_match_one_process(ckpts):
    batch = synthetic_batch()
    want = _engine(ckpts["qwen2"], "hf").grads(_global(batch))
    res = spawn_ranks(_fsdp_worker, 2, (str(ckpts["qwen2"]), batch), 120.0, "hf-fsdp")
    for rank, r in res.items():
        assert "error" not in r, r
        assert r["dtensor"] == "DTensor"  # fully_shard per decoder layer really sharded it
        assert list(r["grads"]) == list(want)
        for name, g in want.items():
            np.testing.assert_allclose(r["grads"][name], g.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("arch", ["gemma3", "qwen3_moe"])
def test_transformers_only_models_train_checkpoint_and_export(ckpts, arch, tmp_path):
    from rltpu.models.hf.export import export_checkpoint

    cfg = _Run(ckpts[arch])
    assert cfg.model.architecture == "other"
    batch = _global(synthetic_batch())
    eng = TrainerEngine(cfg.model, cfg.trainer, V, SEED, TEMP)
    start = {k: v.clone() for k, v in eng.full_state_dict().items()}
    stats = eng.train_step(batch)
    assert np.isfinite(stats["pg_sum"]) and np.isfinite(stats["kl_sum"]) and stats["grad_norm"] > 0
    moved = [k for k, v in eng.full_state_dict().items() if not torch.equal(v, start[k])]
    assert len(moved) == len(start)  # every tensor trained (the MoE's router and experts too)

    ck = tmp_path / "checkpoint"
    eng.save_checkpoint(ck, {"config": cfg.to_dict(), "step": 1})
    again = TrainerEngine(cfg.model, cfg.trainer, V, SEED, TEMP)
    again.load_checkpoint(ck)
    assert all(torch.equal(a, b) for a, b in zip(eng.full_state_dict().values(), again.full_state_dict().values()))

    out = tmp_path / "exported"
    summary = export_checkpoint(ck, out)
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(model).__name__ == summary["architecture"] == json.loads(
        (ckpts[arch] / "config.json").read_text())["architectures"][0]
    ids = torch.as_tensor(batch["tokens"].astype(np.int64))
    with torch.no_grad():
        want = eng.model(ids, None, torch.ones_like(ids))
        got = model(input_ids=ids).logits
    assert float((want - got).abs().max()) <= 1e-5 and float(want.abs().max()) > 0.1
    with safe_open(out / "model.safetensors", "pt") as f:  # the checkpoint layout, as the source has it
        with safe_open(ckpts[arch] / "model.safetensors", "pt") as src:
            assert sorted(f.keys()) == sorted(src.keys())


def test_lora_on_an_hf_model_trains_adapters_only_and_exports_merged(ckpts, tmp_path):
    from rltpu.models.hf.export import export_checkpoint

    lora = {"rank": 4, "target_modules": ["q_proj", "v_proj", "gate_proj"]}
    cfg = _Run(ckpts["gemma3"], lora=LoraConfig(**lora))
    eng = TrainerEngine(cfg.model, cfg.trainer, V, SEED, TEMP)
    assert eng.ref_model is None  # the reference is the base, adapters off
    start = {k: v.clone() for k, v in eng.full_state_dict().items()}
    eng.train_step(_global(synthetic_batch()))
    after = eng.full_state_dict()
    moved = {k for k in start if not torch.equal(start[k], after[k])}
    assert moved and all(".lora_B." in k or ".lora_A." in k for k in moved)
    assert any(k.endswith("mlp.gate_proj.lora_B.weight") for k in moved)
    eng.save_checkpoint(tmp_path / "ck", {"config": cfg.to_dict(), "step": 1})
    export_checkpoint(tmp_path / "ck", tmp_path / "out")
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    ids = torch.as_tensor(synthetic_batch()["tokens"].astype(np.int64))
    with torch.no_grad():
        assert float((eng.model(ids, None, torch.ones_like(ids)) - model(input_ids=ids).logits).abs().max()) <= 1e-5


def test_model_impl_config_errors_are_one_line(ckpts, tmp_path):
    def err(*overrides) -> str:
        with pytest.raises(ConfigError) as e:
            load_config(None, list(overrides))
        return str(e.value).splitlines()[0]

    assert "set trainer.model_impl=hf" in err(f"model.path={ckpts['qwen3_moe']}")
    assert "set model.path" in err("trainer.model_impl=hf")
    assert "chips_per_trainer" in err(f"model.path={ckpts['qwen2']}", "trainer.model_impl=hf",
                                      "placement.chips_per_trainer=2", "placement.trainer_chips=2")
    bad = tmp_path / "gpt"
    shutil.copytree(ckpts["gemma3"], bad)
    c = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({k: v for k, v in c.items() if k != "num_hidden_layers"}))
    assert "num_hidden_layers" in err(f"model.path={bad}", "trainer.model_impl=hf")


@pytest.mark.parametrize("arch", ["gemma3", "qwen3_moe"])
def test_sync_spec_of_a_transformers_only_model_is_the_trainers_own(ckpts, arch):
    """Weight sync sends what ``param_spec`` lists: for ``architecture: other`` it is read off a meta
    build, and names and shapes (adapters too) are the trainer model's parameters, in its order."""
    from rltpu.sync.collective import param_spec

    lora = LoraConfig(rank=4, target_modules=("q_proj", "o_proj"))
    cfg = _Run(ckpts[arch], lora=lora)
    eng = TrainerEngine(cfg.model, cfg.trainer, V, SEED, TEMP)
    have = {n: tuple(p.shape) for n, p in eng.model.named_parameters()}
    spec = param_spec(cfg.model, V, cfg.trainer.lora)
    assert sorted(n for n, _, _ in spec) == sorted(have)
    assert all(have[n] == s and d == "float32" for n, s, d in spec)
    assert sum(n.endswith(".lora_A.weight") for n, _, _ in spec) == 2 * 2  # 2 layers x q_proj, o_proj


def test_ppo_critic_on_a_transformers_body_fits_returns_and_checkpoints(ckpts, tmp_path):
    """PPO's value model on Gemma 3's decoder (``HFValue``: ``model.*`` + a zero ``score`` head)."""
    from rltpu.config import CriticConfig
    from test_ppo import G, ppo_batch

    mcfg, tcfg = ModelConfig(path=str(ckpts["gemma3"])), TrainerConfig(lr=1e-2, algorithm="ppo", model_impl="hf")
    ccfg = CriticConfig(lr=3e-3, value_clip=None, gae_lambda=0.95)
    eng = TrainerEngine(mcfg, tcfg, V, SEED, TEMP, critic_cfg=ccfg)
    assert type(eng.critic).__name__ == "HFValue" and eng.critic.model.embed_tokens.weight.shape[1] == 32
    batch = ppo_batch(eng, np.linspace(0, 1, 2 * G).astype(np.float32))
    assert np.abs(batch["old_values"]).max() == 0  # the head starts at zero
    errs = [(s := eng.train_step(batch))["value_sq_err_sum"] / s["tokens"] for _ in range(15)]
    assert errs[-1] < 0.5 * errs[0], errs
    ck = eng.save_checkpoint(tmp_path / "ck", {})
    fresh = TrainerEngine(mcfg, tcfg, V, SEED, TEMP, critic_cfg=ccfg)
    fresh.load_checkpoint(ck)
    np.testing.assert_array_equal(fresh.values(batch), eng.values(batch))


def test_preflight_check_of_a_transformers_only_checkpoint(ckpts, tmp_path):
    """``rltpu train`` reads every safetensors header before Ray starts: for ``architecture: other`` the
    names are transformers' business (it maps them on load), a non-float tensor is still one line."""
    from rltpu.models.hf.weights import CheckpointDir, CheckpointError, write_safetensors

    cfg = ModelConfig(path=str(ckpts["qwen3_moe"]))
    got = CheckpointDir(cfg.path).check(cfg)
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in got  # per-expert, as the file has them
    bad = tmp_path / "bad"
    shutil.copytree(ckpts["qwen3_moe"], bad)
    write_safetensors(bad / "model.safetensors", [("model.norm.weight", (4,), "int32")],
                      lambda n: torch.zeros(4, dtype=torch.int32))
    with pytest.raises(CheckpointError, match="model.norm.weight has dtype int32"):
        CheckpointDir(str(bad)).check(cfg)
