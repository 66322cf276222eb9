"""``sampler.backend: vllm`` (rltpu/sampling/vllm_backend.py) against the JAX engine, without Ray.

One vLLM engine (CPU build, in-process) serves every test of the module: its build and vLLM's
import take most of the module's time. Checkpoints are tiny random Qwen2s written by
``transformers`` (head_dim 32: vLLM's CPU attention takes no smaller head).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
import jax  # noqa: E402

from rltpu.config import ModelConfig, SamplerConfig  # noqa: E402
from rltpu.models import jax_llama  # noqa: E402
from rltpu.models.hf.load import load_jax_params  # noqa: E402
from rltpu.models.hf.tiny import write_tiny_checkpoint  # noqa: E402
from rltpu.models.spec import param_shapes  # noqa: E402
from rltpu.sampling.engine import SamplerEngine  # noqa: E402

pytestmark = pytest.mark.xdist_group("vllm_backend")  # one worker, one vLLM engine for the module

V = 128
EOS_NEVER = V + 7  # outside the vocabulary: rows run all their tokens
LOGP_TOL = 1e-4  # fp32 |vLLM - JAX| per token (measured: greedy 2.4e-6, 64 sampled rows x 16 3.8e-6 max)
PROMPTS = [[5, 9, 17, 33, 2], [7, 7, 8, 100, 3, 4, 5, 6, 9], list(range(10, 22))]


def _ckpt(root, seed):
    return write_tiny_checkpoint(root / f"q{seed}", "qwen2", seed=seed, hidden_size=128, num_heads=4, num_kv_heads=2,
                                 with_tokenizer=False, vocab_size=V)


def _torch_params(path) -> dict:
    """The checkpoint's tensors as torch tensors: what weight sync hands the backend."""
    from safetensors.torch import load_file

    return {k: v.float() for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from rltpu.sampling.vllm_backend import VllmBackend

    root = tmp_path_factory.mktemp("vllm")
    paths = [_ckpt(root, 0), _ckpt(root, 1)]
    mcfg = ModelConfig(path=str(paths[0]))
    shapes = {k: (s, mcfg.dtype) for k, s in param_shapes(mcfg, V).items()}
    scfg = SamplerConfig(temperature=1.0, max_new_tokens=16, batch_buckets=(16,), prompt_buckets=(16,),
                         precompile=False, compile_cache=False)
    be = VllmBackend(mcfg, scfg, V, 0, EOS_NEVER, shapes)
    try:  # a fresh engine holds dummy weights only: it must refuse to sample from them
        be.generate(PROMPTS, 1, seed=0)
        refused = None
    except RuntimeError as e:
        refused = str(e)
    return {"be": be, "paths": paths, "mcfg": mcfg, "scfg": scfg, "shapes": shapes, "refused": refused}


def _jax_engine(env, path, **overrides):
    mcfg = ModelConfig(path=str(path))
    eng = SamplerEngine(mcfg, env["scfg"].model_copy(update=overrides), V, 0, overrides.pop("eos", EOS_NEVER),
                        env["shapes"])
    eng.set_params(load_jax_params(mcfg), 0)
    return eng


def _rows(out):
    return [out["tokens"][r, :out["lengths"][r]].tolist() for r in range(len(out["lengths"]))]


def _teacher_logprobs(path, out) -> np.ndarray:
    """log softmax(logits) of each sampled token, recomputed by the JAX model over prompt + row (T = 1)."""
    mcfg = ModelConfig(path=str(path))
    ids = np.concatenate([out["prompt"], out["tokens"]], 1)
    mask = np.concatenate([out["prompt_mask"], np.arange(out["tokens"].shape[1])[None] < out["lengths"][:, None]], 1)
    pos = np.maximum(np.cumsum(mask, 1) - 1, 0)
    logits = np.asarray(jax.jit(jax_llama.forward, static_argnums=1)(load_jax_params(mcfg), mcfg, ids, pos, mask))
    lp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - \
        logits.max(-1, keepdims=True)
    P = out["prompt"].shape[1]
    got = np.take_along_axis(lp[:, P - 1:-1], out["tokens"][..., None].astype(np.int64), -1)[..., 0]
    return np.where(mask[:, P:], got, 0.0)


def test_refuses_to_generate_before_weights(env):
    assert env["refused"] is not None and "no weights yet" in env["refused"]


def test_greedy_parity_with_the_jax_engine_and_set_params_without_restart(env):
    """Temperature 0: vLLM's tokens equal the JAX engine's, token for token, and their logprobs (at
    T = 1) agree within LOGP_TOL. New weights through ``set_params`` (the same engine, the same
    prompts: a stale prefix cache would show) give what a fresh JAX engine on them gives; the old
    weights again give the first rows back."""
    be, (a, b) = env["be"], env["paths"]
    engine = id(be.llm)
    be.set_params(_torch_params(a), 1)
    got_a = be.generate(PROMPTS, 1, seed=0, greedy=True)
    ref_a = _jax_engine(env, a).generate(PROMPTS, 1, seed=0, greedy=True)
    assert _rows(got_a) == _rows(ref_a) and all(len(r) == 16 for r in _rows(got_a))
    gap = np.abs(got_a["logprobs"] - ref_a["logprobs"]).max()
    assert gap <= LOGP_TOL, gap
    assert got_a["version"] == 1 and got_a["prompt"].shape == (3, 12) and got_a["prompt_mask"].sum() == 26

    be.set_params(_torch_params(b), 2)
    got_b = be.generate(PROMPTS, 1, seed=0, greedy=True)
    ref_b = _jax_engine(env, b).generate(PROMPTS, 1, seed=0, greedy=True)
    assert _rows(got_b) == _rows(ref_b) and _rows(got_b) != _rows(got_a)
    assert np.abs(got_b["logprobs"] - ref_b["logprobs"]).max() <= LOGP_TOL
    assert got_b["version"] == 2 and id(be.llm) == engine  # the same engine, no restart

    be.set_params(_torch_params(a), 3)
    assert _rows(be.generate(PROMPTS, 1, seed=0, greedy=True)) == _rows(got_a)


def test_g_samples_seeds_stops_and_sampled_logprobs(env):
    """G rows per prompt, prompt-major; rows of a prompt differ, the same seed gives the same rows;
    a stop token ends its row (counted in the length, pad after it); every sampled token's logprob
    equals the one recomputed over the whole row (the trainer's view) within LOGP_TOL."""
    be, a = env["be"], env["paths"][0]
    be.set_params(_torch_params(a), 4)
    G = 6
    out = be.generate(PROMPTS, G, seed=11)
    assert out["tokens"].shape == (len(PROMPTS) * G, 16) and out["logprobs"].dtype == np.float32
    rows = _rows(out)
    for i in range(len(PROMPTS)):
        assert len({tuple(r) for r in rows[i * G:(i + 1) * G]}) > 1  # G different samples
        assert (out["prompt"][i * G:(i + 1) * G] == out["prompt"][i * G]).all()
    assert _rows(be.generate(PROMPTS, G, seed=11)) == rows
    assert _rows(be.generate(PROMPTS, G, seed=12)) != rows
    teacher = _teacher_logprobs(a, out)
    assert np.abs(out["logprobs"] - teacher).max() <= LOGP_TOL
    assert (out["logprobs"][out["tokens"] != 0] < 0).all()

    # a stop id that is among the sampled tokens: rows end at its first occurrence
    stop = int(np.bincount(out["tokens"][:, :8].ravel(), minlength=V)[1:].argmax()) + 1
    be.stop_ids = (EOS_NEVER, stop)
    try:
        st = be.generate(PROMPTS, G, seed=11)
    finally:
        be.stop_ids = (EOS_NEVER,)
    stopped = 0
    for r in range(len(st["lengths"])):
        n = int(st["lengths"][r])
        row = st["tokens"][r, :n].tolist()
        assert stop not in row[:-1]
        if row[-1] == stop:
            stopped += 1
        else:
            assert n == 16
        assert (st["tokens"][r, n:] == 0).all() and (st["logprobs"][r, n:] == 0).all()
    assert stopped >= 1
    assert st["new_tokens"] == int(st["lengths"].sum()) < out["new_tokens"]


def test_probe_matches_the_jax_models_token_logprobs(env):
    """The sync probe's (R, L) token logprobs equal the JAX model's log-softmax at the same tokens."""
    be, a = env["be"], env["paths"][0]
    be.set_params(_torch_params(a), 5)
    tokens = np.zeros((2, 10), np.int64)
    mask = np.zeros((2, 10), np.int64)
    tokens[0, :10], mask[0, :10] = np.arange(20, 30), 1
    tokens[1, :6], mask[1, :6] = [3, 1, 4, 1, 5, 9], 1
    pos = np.maximum(np.cumsum(mask, 1) - 1, 0)
    got = be.probe_logits(tokens, pos, mask)
    mcfg = ModelConfig(path=str(a))
    logits = np.asarray(jax_llama.forward(load_jax_params(mcfg), mcfg, tokens, pos, mask), np.float64)
    lp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ref = np.take_along_axis(lp[:, :-1], tokens[:, 1:, None], -1)[..., 0]
    valid = (mask[:, 1:] > 0)
    assert np.abs(got[:, :-1][valid] - ref[valid]).max() <= LOGP_TOL
    from rltpu.control.weights import probe_gap

    assert probe_gap(logits.astype(np.float32), got, tokens, mask) <= LOGP_TOL
    assert probe_gap(logits.astype(np.float32) * 1.01, got, tokens, mask) > 1e-3


MOE_CHILD = """
import json, sys
import numpy as np, torch, transformers
from rltpu.config import ModelConfig, SamplerConfig
from rltpu.models.hf.tiny import write_tiny_checkpoint
from rltpu.sampling.vllm_backend import VllmBackend

root, V, eos = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
paths = [write_tiny_checkpoint(f"{root}/moe{s}", "qwen3_moe", seed=s, hidden_size=128, num_heads=4, num_kv_heads=2,
                               with_tokenizer=False, vocab_size=V) for s in (0, 1)]
models = [transformers.AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for p in paths]
named = [{k: v.detach().clone() for k, v in m.named_parameters()} for m in models]
assert any(".mlp.experts." in k for k in named[0])
shapes = {k: (tuple(v.shape), "float32") for k, v in named[0].items()}
scfg = SamplerConfig(temperature=1.0, max_new_tokens=4, batch_buckets=(4,), prompt_buckets=(16,),
                     precompile=False, compile_cache=False)
be = VllmBackend(ModelConfig(path=str(paths[0])), scfg, V, 0, eos, shapes)
tokens = np.array([list(range(20, 32)), [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]], np.int64)
mask = np.ones_like(tokens)
pos = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
gaps = []
for version, (model, params) in enumerate(zip([*models, models[0]], [*named, named[0]]), 1):
    be.set_params(params, version)
    got = be.probe_logits(tokens, pos, mask)[:, :-1]
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.from_numpy(tokens)).logits.double(), -1).numpy()
    ref = np.take_along_axis(lp[:, :-1], tokens[:, 1:, None], -1)[..., 0]
    gaps.append(float(np.abs(got - ref).max()))
print("GAPS " + json.dumps(gaps))
"""


def test_moe_experts_match_transformers_after_each_in_place_sync(tmp_path):
    """Qwen3-MoE: the trainer's own tensors (transformers' fused experts) synced into the running engine,
    three times (two weight sets, then the first again), give vLLM token logprobs equal to transformers'
    on the same weights. vLLM 0.32's CPU build leaves reloaded experts unpacked for its kernel (gap 1.96
    without ``_repack_cpu_experts``). In a fresh process: vLLM keeps its parallel state per process, and
    the module's dense engine built first leaves no expert-parallel group for a MoE engine."""
    res = subprocess.run([sys.executable, "-c", MOE_CHILD, str(tmp_path), str(V), str(EOS_NEVER)],
                         capture_output=True, text=True, timeout=600)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("GAPS ")), None)
    assert res.returncode == 0 and line, res.stderr[-3000:]
    gaps = json.loads(line[5:])
    assert len(gaps) == 3 and max(gaps) <= LOGP_TOL, gaps


def test_without_vllm_installed_the_error_names_the_fix():
    code = ("import sys; sys.modules['vllm'] = None\n"
            "from rltpu.sampling.vllm_backend import import_vllm\n"
            "import_vllm()\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=os.environ | {"JAX_PLATFORMS": "cpu"})
    assert res.returncode != 0
    assert "pip install -e '.[vllm]'" in res.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("overrides,needle", [
    ({"placement": {"mode": "colocated", "sampler_chips": 2, "trainer_chips": 2}}, "placement.mode=disaggregated"),
    ({"trainer": {"lora": {"rank": 4}}}, "remove trainer.lora"),
    ({"sampler": {"temperature": 0.7, "top_k": 5}}, "set top_k=0 and top_p=1"),
    ({"model": {"path": None}}, "set model.path"),
])
def test_config_refuses_what_the_vllm_backend_does_not_run(tmp_path, overrides, needle):
    from rltpu.config import ConfigError, RunConfig

    path = _ckpt(tmp_path, 0)
    data = {"model": {"path": str(path)}, "sampler": {"backend": "vllm"}}
    for k, v in overrides.items():
        data[k] = data.get(k, {}) | v
    if data["model"]["path"] is None:
        data["model"] = {}
    with pytest.raises((ConfigError, ValueError)) as err:
        RunConfig.model_validate(data)
    assert needle in str(err.value)
    RunConfig.model_validate({"model": {"path": str(path)}, "sampler": {"backend": "vllm", "temperature": 0.7}})


def test_config_without_vllm_installed_names_the_extra(tmp_path, monkeypatch):
    import importlib.util

    from rltpu.config import RunConfig

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ValueError, match=r"pip install -e '\.\[vllm\]'"):
        RunConfig.model_validate({"model": {"path": str(_ckpt(tmp_path, 0))}, "sampler": {"backend": "vllm"}})
