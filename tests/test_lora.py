"""LoRA (issue 20): adapters start at the base, only they train; the sampler applies them (merged or
as a low-rank matmul) to the trainer's logits with 0 recompiles; adapter-only sync specs; adapters-only
checkpoints resume exactly; ``rltpu export`` writes the merged model (transformers) and PEFT adapters
(peft onto the base), both equal to the policy's logits; config errors are one line, exit 2.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from learner.trainer import TrainerEngine
from rltpu.config import ConfigError, LoraConfig, ModelConfig, RunConfig, SamplerConfig, TrainerConfig, load_config
from rltpu.control.batch import build_train_batch, split_by_rank
from rltpu.models.spec import is_adapter, lora_shapes, param_shapes
from rltpu.sync.collective import adapter_spec, param_spec, plan_stream

torch.set_num_threads(1)
torch.set_float32_matmul_precision("highest")
ROOT = Path(__file__).resolve().parents[1]
V, PAD, EOS, SEED = 17, 0, 2, 0
MCFG = ModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64, init_std=0.2)
# lm_head too (untied here): its adapter runs through the trainer's chunked logprob path and the sampler's
# merged / low-rank head, and exports like a projection's
LORA = LoraConfig(rank=4, alpha=8, target_modules=("q_proj", "v_proj", "o_proj", "up_proj", "down_proj", "lm_head"))
# kl_coef > 0: the loss reads the reference, which with LoRA is the base with adapters off
TCFG = TrainerConfig(lr=2e-2, kl_coef=0.05, lora=LORA)


def batch(vocab: int = V, seed: int = 0) -> dict:
    """4 prompts x G=2 rows of random rollouts with distinct rewards: a real GRPO update."""
    rng = np.random.default_rng(seed)
    R, P, T = 8, 5, 4
    gen = {"prompt": rng.integers(3, vocab, (R, P)).astype(np.int32), "prompt_mask": np.ones((R, P), np.int32),
           "tokens": rng.integers(3, vocab, (R, T)).astype(np.int32),
           "logprobs": -rng.uniform(0.5, 3, (R, T)).astype(np.float32), "lengths": np.full(R, T, np.int32)}
    return split_by_rank(build_train_batch(gen, rng.uniform(0, 1, R).astype(np.float32), 2, True), 1)[0]


def probe(vocab: int = V):
    rng = np.random.default_rng(3)
    ids = rng.integers(3, vocab, (2, 12)).astype(np.int32)
    return ids, np.tile(np.arange(12, dtype=np.int32), (2, 1)), np.ones_like(ids)


def test_lora_starts_at_the_base_and_trains_only_adapters():
    base = TrainerEngine(MCFG, TCFG.model_copy(update={"lora": None}), V, SEED)
    eng = TrainerEngine(MCFG, TCFG, V, SEED)
    assert eng.ref_model is None  # the reference is the base itself: no second copy
    assert np.abs(eng.probe_logits(*probe()) - base.probe_logits(*probe())).max() <= 1e-6
    names = {n for n, p in eng.model.named_parameters() if p.requires_grad}
    assert names == set(lora_shapes(MCFG, LORA, V))  # PEFT's names; 2 per adapted projection
    opt_params = [p for g in eng.optimizer.param_groups for p in g["params"]]
    assert len(opt_params) == len(names)  # no AdamW state for the frozen base
    before = {k: v.clone() for k, v in eng.full_state_dict().items()}
    b = batch()
    for _ in range(2):
        eng.train_step(b)
    after = eng.full_state_dict()
    # the same gradients with the LM head (and its adapter) applied 7 tokens at a time under checkpointing
    from learner.lora import load_adapters

    chunked = TrainerEngine(MCFG, TCFG.model_copy(update={"logprob_chunk_tokens": 7}), V, SEED)
    load_adapters(chunked.model, {k: v for k, v in after.items() if is_adapter(k)})
    want, got = eng.grads(b), chunked.grads(b)
    assert set(got) == names and all(want[k].abs().max() > 0 for k in ("lm_head.lora_A.weight", "lm_head.lora_B.weight"))
    for k in names:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-7)
    moved = {k for k in after if not torch.equal(after[k], before[k])}
    assert moved == names  # A and B both moved (B from 0), nothing else
    assert all(p.grad is None for n, p in eng.model.named_parameters() if n not in names)
    # the reference (adapters off) is still exactly the base; the policy is not
    np.testing.assert_array_equal(eng.logprobs(b, reference=True), base.logprobs(b))
    assert np.abs(eng.logprobs(b) - base.logprobs(b)).max() > 1e-3
    # the LoRA forward is W x + (alpha / r) B A x: rebuild it by hand from the merged weights
    from learner.lora import merge_into
    from rltpu.models.torch_llama import LlamaForCausalLM

    full = eng.full_state_dict()
    merged = merge_into({k: v for k, v in full.items() if not is_adapter(k)},
                        {k: v for k, v in full.items() if is_adapter(k)}, LORA.scale)
    plain = LlamaForCausalLM(MCFG, V)
    plain.load_state_dict(merged)
    with torch.no_grad():
        want = plain(*(torch.as_tensor(x) for x in probe())).numpy()
    assert np.abs(eng.probe_logits(*probe()) - want).max() <= 1e-4


def test_adapter_spec_is_what_later_syncs_move():
    full = param_spec(MCFG, V, LORA)
    ad = adapter_spec(full)
    base = param_spec(MCFG, V)
    assert full[: len(base)] == base and [e[0] for e in ad] == list(lora_shapes(MCFG, LORA, V))
    # bytes on the wire per sync: all trainer streams of the adapter spec = adapter elements x 4 bytes
    want = sum(int(np.prod(s)) for s in lora_shapes(MCFG, LORA, V).values()) * 4
    r = LORA.rank
    by_hand = MCFG.num_hidden_layers * (r * 32 + 32 * r + r * 32 + 16 * r + r * 32 + 32 * r + r * 32 + 64 * r
                                        + r * 64 + 32 * r) * 4  # q, v (kv 2 x hd 8 = 16), o, up, down
    by_hand += (r * 32 + V * r) * 4  # lm_head [V, 32]
    assert want == by_hand
    for n_trainers in (1, 2):
        sent = sum(m.nbytes for rank in range(n_trainers) for m in plan_stream(ad, n_trainers, rank, 2**20))
        assert want <= sent < want + 64 * n_trainers  # one packed bucket per stream, 64-byte padding at most
    assert sum(int(np.prod(s)) for s in param_shapes(MCFG, V).values()) * 4 > 5 * want


@pytest.mark.parametrize("mode", ["merged", "lowrank"])
def test_sampler_applies_adapters_equal_to_trainer_without_recompiles(mode):
    from rltpu.sampling.engine import SamplerEngine

    lora = LORA.model_copy(update={"sampler_apply": mode})
    eng = TrainerEngine(MCFG, TCFG.model_copy(update={"lora": lora}), V, SEED)
    spec = param_spec(MCFG, V, lora)
    grid = SamplerConfig(engine="static", group_size=2, max_new_tokens=4, batch_buckets=(4,), prompt_buckets=(8,))
    smp = SamplerEngine(MCFG, grid, V, PAD, EOS, {n: (s, d) for n, s, d in spec}, lora=lora)
    assert any(is_adapter(k) for k in smp.param_structs) == (mode == "lowrank")
    smp.precompile()
    compiles = smp.stats.compiles

    def arrays(names):
        import jax.numpy as jnp

        sd = eng.full_state_dict()
        return {n: jnp.asarray(sd[n].numpy()) for n in names}

    with pytest.raises(ValueError, match="before the base"):
        smp.set_adapters(arrays([e[0] for e in adapter_spec(spec)]), 0)
    smp.set_params(arrays([e[0] for e in spec]), 0)  # the first sync: base + adapters
    held = smp.device_weight_bytes()
    prompts = [[3, 4, 5], [6, 7]]
    for v in range(1, 4):
        eng.train_step(batch(seed=v))
        smp.set_adapters(arrays([e[0] for e in adapter_spec(spec)]), v)  # later syncs: adapters only
        diff = np.abs(smp.probe_logits(*probe()) - eng.probe_logits(*probe())).max()
        assert diff <= 1e-4, (v, diff)
        smp.generate(prompts, 2, seed=v)
    assert np.abs(eng.probe_logits(*probe()) - TrainerEngine(MCFG, TCFG, V, SEED).probe_logits(*probe())).max() > 1e-3
    assert smp.stats.compiles == compiles  # new adapter values never recompile the programs
    assert smp.adapters.merge_compiles() <= 2  # the merge (or B scaling) program: once per dtype layout
    assert smp.device_weight_bytes() == held  # same arrays held each sync (no growth)


def _tiny_qwen2(tmp_path):
    pytest.importorskip("transformers")
    from rltpu.models.hf.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path / "src", "qwen2")


@pytest.mark.parametrize("base", ["seeded", "qwen2"])
def test_checkpoint_resume_and_export_round_trip(tmp_path, base):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from rltpu.data.char_tokenizer import CharTokenizer
    from rltpu.models.hf.export import export_checkpoint

    if base == "seeded":
        run = RunConfig.model_validate({"model": MCFG.model_dump(), "trainer": TCFG.model_dump()})
        vocab = CharTokenizer().vocab_size
    else:
        run = RunConfig.model_validate({"model": {"path": str(_tiny_qwen2(tmp_path))}, "trainer": TCFG.model_dump()})
        vocab = run.model.vocab_size
    eng = TrainerEngine(run.model, run.trainer, vocab, run.seed)
    eng.train_step(batch(vocab))
    ckpt = eng.save_checkpoint(tmp_path / "run" / "checkpoint", {"step": 1, "weight_version": 1,
                                                                 "config": run.to_dict()})
    # adapters and their AdamW state only: the base is model.path or the seeded init
    assert {p.name for p in ckpt.iterdir()} == {"adapters.index.json", "adapters-rank00000.safetensors",
                                                "optimizer.index.json", "optimizer-rank00000.safetensors",
                                                "trainer_state.json"}
    from rltpu.models.hf.shards import ShardedPart

    assert sorted(ShardedPart(ckpt, "adapters").names()) == sorted(lora_shapes(run.model, LORA, vocab))
    want = eng.probe_logits(*probe(vocab))
    again = TrainerEngine(run.model, run.trainer, vocab, run.seed)
    again.load_checkpoint(ckpt)
    np.testing.assert_array_equal(again.probe_logits(*probe(vocab)), want)
    s1, s2 = eng.train_step(batch(vocab, 1)), again.train_step(batch(vocab, 1))  # optimizer state came back
    assert s1["grad_norm"] == s2["grad_norm"]
    np.testing.assert_array_equal(again.probe_logits(*probe(vocab)), eng.probe_logits(*probe(vocab)))
    want = eng.probe_logits(*probe(vocab))
    ckpt = eng.save_checkpoint(tmp_path / "run" / "checkpoint", {"step": 2, "weight_version": 2,
                                                                 "config": run.to_dict()})
    ids = torch.as_tensor(probe(vocab)[0]).long()

    merged = tmp_path / "merged"
    export_checkpoint(ckpt, merged)
    hf = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()
    with torch.no_grad():
        assert np.abs(hf(ids).logits.float().numpy() - want).max() <= 1e-4

    res = subprocess.run([sys.executable, "-m", "rltpu.cli", "export", str(ckpt), str(tmp_path / "peft"),
                          "--adapters"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert cfg["r"] == LORA.rank and cfg["lora_alpha"] == LORA.alpha and cfg["peft_type"] == "LORA"
    base_dir = cfg["base_model_name_or_path"]
    assert (base == "qwen2") == (base_dir == str(run.model.path))
    base_model = transformers.AutoModelForCausalLM.from_pretrained(base_dir).eval()
    with torch.no_grad():
        base_logits = base_model(ids).logits.float().numpy()
    assert np.abs(base_logits - want).max() > 1e-3  # the adapters matter
    model = peft.PeftModel.from_pretrained(base_model, tmp_path / "peft").eval()
    with torch.no_grad():
        assert np.abs(model(ids).logits.float().numpy() - want).max() <= 1e-4


@pytest.mark.parametrize("override,needle", [
    (["trainer.lora.rank=0"], "lora.rank=0 must be a positive integer"),
    (["trainer.lora.target_modules=[q_proj,embed_tokens]"], "'embed_tokens', not a projection"),
    (["model.tie_word_embeddings=true", "trainer.lora.target_modules=[q_proj,lm_head]"], "ties it to the embeddings"),
    (["trainer.algorithm=ppo", "critic.lr=1e-3", "trainer.lora.rank=8"], "PPO's critic is not supported"),
    (["placement.chips_per_trainer=2", "trainer.lora.rank=8"], "tensor parallelism"),
])
def test_config_errors_are_one_line(override, needle):
    with pytest.raises(ConfigError, match=needle) as err:
        load_config(ROOT / "configs" / "quickstart.yaml", override)
    assert "\n" not in str(err.value)


def test_cli_refuses_bad_lora_before_ray(tmp_path):
    res = subprocess.run([sys.executable, "-m", "rltpu.cli", "train", str(ROOT / "configs" / "quickstart.yaml"),
                          "trainer.lora.rank=-2", f"run_dir={tmp_path / 'r'}"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "lora.rank=-2" in lines[0] and not (tmp_path / "r").exists(), res.stderr


def test_plan_costs_lora_memory_and_sync_by_hand():
    """``rltpu plan``: with LoRA the trainer holds grads and AdamW states for the adapters only, no
    reference copy, and a steady-state sync moves the adapters' bytes."""
    from rltpu.plan.costmodel import Workload, lora_params, sync_route, trainer_memory
    from rltpu.plan.hardware import tpu
    from rltpu.plan.shapes import ModelShape

    m = ModelShape(24, 896, 4864, 14, 2, 64, 151936, True, "float32")  # Qwen2-0.5B
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    n = lora_params(m, 8, targets)
    assert n == 24 * 8 * ((896 + 896) + 2 * (896 + 128) + (896 + 896) + 2 * (896 + 4864) + (4864 + 896))
    full = Workload(prompts=8, group=4, prompt_len=64, new_tokens=64, reference=True)
    lora = Workload(prompts=8, group=4, prompt_len=64, new_tokens=64, reference=True, lora=(8, targets))
    a, b = trainer_memory(m, full, 2, 1000, True), trainer_memory(m, lora, 2, 1000, True)
    assert a["grads"] == m.params * 4 / 2 and b["grads"] == n * 4 / 2
    assert b["adam_states"] == 2 * n * 4 / 2 and "reference" not in b and a["reference"] == m.params * 4 / 2
    assert b["weights"] == (m.params + n) * 4 / 2
    hw = tpu("v5e")
    moved = lambda w: sum(h.bytes for h in sync_route(hw, m, w, 2, [0, 0], {0: 2}, 2, False)  # noqa: E731
                          if h.link == "PCIe" and "stage" in h.what)
    assert moved(full) == m.params * 4 and moved(lora) == n * 4
    # the LM head's adapter where it is untied (a tied head has no module of its own: nothing added)
    untied = ModelShape(24, 896, 4864, 14, 2, 64, 151936, False, "float32")
    assert lora_params(untied, 8, (*targets, "lm_head")) == n + 8 * (896 + 151936)
    assert lora_params(m, 8, (*targets, "lm_head")) == n
