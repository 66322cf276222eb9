"""Real Hugging Face checkpoints in both engines.

Every checkpoint here is written by ``transformers`` itself (``rltpu.models.hf.tiny``), so the file
layout, names and config keys are the real ones; the reference numbers are ``transformers``'
own forward and greedy ``generate``. Negative controls switch one feature off in our config and
show the comparison then fails, so a passing comparison means the feature is really exercised.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from rltpu.config import ConfigError, ModelConfig, RunConfig, SamplerConfig, TrainerConfig, load_config  # noqa: E402
from rltpu.models.hf.load import build_policy, load_jax_params  # noqa: E402
from rltpu.models.hf.tiny import write_tiny_checkpoint  # noqa: E402
from rltpu.models.hf.weights import CheckpointDir, CheckpointError  # noqa: E402
from rltpu.models import jax_llama
from rltpu.models.spec import param_shapes  # noqa: E402
from rltpu.sampling.engine import SamplerEngine  # noqa: E402
from procs import spawn_ranks  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
torch.set_float32_matmul_precision("highest")

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-4
L = 40  # sequence length of the logits comparison: crosses the sliding window (8) five times
jforward = jax.jit(jax_llama.forward, static_argnums=1)

# name -> write_tiny_checkpoint kwargs; every family, tied and untied, every optional feature
VARIANTS = {
    "llama": dict(arch="llama"),
    "llama-tied": dict(arch="llama", tied=True),
    "llama3-rope": dict(arch="llama", llama3_rope=True),
    "qwen2-tied": dict(arch="qwen2", tied=True),
    "qwen2-window": dict(arch="qwen2", sliding_window=8),  # layer 0 full, layer 1 sliding
    "qwen3": dict(arch="qwen3", head_dim=32),  # head_dim * heads != hidden_size
    "qwen3-tied-bias": dict(arch="qwen3", tied=True, attention_bias=True),
    "mistral-window": dict(arch="mistral", sliding_window=8),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: write_tiny_checkpoint(root / name, seed=i, **kw) for i, (name, kw) in enumerate(VARIANTS.items())}


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


def batch(vocab: int, seed: int = 0):
    """2 rows of L tokens; row 1 left-padded by 7 (positions restart at its first real token)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (2, L))
    mask = np.ones((2, L), np.int64)
    mask[1, :7] = 0
    pos = np.clip(np.cumsum(mask, 1) - 1, 0, None)
    return ids, pos, mask


def hf_logits(model, ids) -> list[np.ndarray]:
    """transformers' logits for each row unpadded (row 1 without its 7 pads)."""
    with torch.no_grad():
        return [model(torch.as_tensor(ids[:1])).logits.float().numpy()[0],
                model(torch.as_tensor(ids[1:, 7:])).logits.float().numpy()[0]]


def max_diff(ours: np.ndarray, ref: list[np.ndarray]) -> float:
    return float(max(np.abs(ours[0] - ref[0]).max(), np.abs(ours[1, 7:] - ref[1]).max()))


def torch_logits(model, ids, pos, mask) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(ids), torch.as_tensor(pos), torch.as_tensor(mask)).numpy()


def jax_logits(cfg, params, ids, pos, mask) -> np.ndarray:
    return np.asarray(jforward(params, cfg, jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(mask)))


# ---------------------------------------------------------------------------------------------
# acceptance 1: logits and greedy generation equal transformers', every family


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_transformers_in_both_engines(ckpts, name):
    cfg = ModelConfig(path=str(ckpts[name]))
    ids, pos, mask = batch(cfg.vocab_size)
    ref = hf_logits(hf_model(ckpts[name]), ids)
    assert np.abs(ref[0]).max() > 1.0  # logits far from zero: the tolerance is meaningful
    d_torch = max_diff(torch_logits(build_policy(cfg, cfg.vocab_size), ids, pos, mask), ref)
    d_jax = max_diff(jax_logits(cfg, load_jax_params(cfg), ids, pos, mask), ref)
    assert d_torch <= TOL and d_jax <= TOL, (d_torch, d_jax)


@pytest.mark.parametrize("name,feature", [
    ("llama3-rope", {"rope_scaling": None}), ("qwen2-window", {"sliding_window": None, "layer_types": None}),
    ("qwen2-window", {"layer_types": None}), ("qwen3", {"qk_norm": False}),
    ("mistral-window", {"sliding_window": None}), ("qwen3-tied-bias", {"attention_out_bias": False}),
])
def test_each_feature_is_exercised(ckpts, name, feature):
    """The same weights with one feature switched off in our config no longer match transformers."""
    cfg = ModelConfig(path=str(ckpts[name]))
    off = cfg.model_copy(update=feature)
    shapes = param_shapes(off, off.vocab_size)
    params = {k: v for k, v in load_jax_params(cfg).items() if k in shapes}
    ids, pos, mask = batch(cfg.vocab_size)
    ref = hf_logits(hf_model(ckpts[name]), ids)
    assert max_diff(jax_logits(off, params, ids, pos, mask), ref) > 1e-2


@pytest.mark.parametrize("name", list(VARIANTS))
def test_sampler_greedy_equals_transformers_generate(ckpts, name):
    """32 greedy tokens from the compiled sampler (3 prompts left-padded in one batch) equal
    ``generate(do_sample=False)`` per prompt, token for token; EOS is disabled on both sides so
    all 32 are compared, and prompt + 32 tokens cross the sliding window (8) several times."""
    cfg = ModelConfig(path=str(ckpts[name]))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (5, 9, 12)]
    hf = hf_model(ckpts[name])
    ref = []
    for p in prompts:
        out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                          max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
        ref.append(out[0, len(p):].tolist())
    scfg = SamplerConfig(temperature=0, max_new_tokens=32, batch_buckets=(4,), prompt_buckets=(16,),
                         precompile=False, compile_cache=False)
    shapes = {k: (s, cfg.dtype) for k, s in param_shapes(cfg).items()}
    eng = SamplerEngine(cfg, scfg, cfg.vocab_size, 0, cfg.vocab_size + 7, shapes)  # EOS id never sampled
    eng.set_params(load_jax_params(cfg), 0)
    g = eng.generate(prompts, 1, seed=0)
    ours = [g["tokens"][i, :g["lengths"][i]].tolist() for i in range(len(prompts))]
    assert [len(r) for r in ref] == [32] * 3
    assert ours == ref


# ---------------------------------------------------------------------------------------------
# checkpoint formats: shards + index, bf16, config resolution


def test_sharded_index_and_bf16_load_exact(tmp_path):
    """A checkpoint in many shards (with model.safetensors.index.json), stored in bf16, loads into
    both engines bit for bit; the bf16 policy's logits stay close to transformers' bf16 forward."""
    d = write_tiny_checkpoint(tmp_path / "q", "qwen2", dtype="bfloat16", shard_bytes=20_000)
    assert (d / "model.safetensors.index.json").is_file() and len(list(d.glob("*.safetensors"))) > 3
    cfg = ModelConfig(path=str(d))
    assert cfg.dtype == "bfloat16"
    hf = hf_model(d)
    assert hf.dtype == torch.bfloat16
    want = hf.state_dict()
    ours = build_policy(cfg, cfg.vocab_size)
    for k, v in ours.state_dict().items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, want[k]), k
    jp = load_jax_params(cfg)
    for k, v in jp.items():
        assert v.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(v.astype(jnp.float32)), want[k].float().numpy())
    ids, pos, mask = batch(cfg.vocab_size)
    ref = hf_logits(hf, ids)
    scale = float(np.abs(ref[0]).max())
    assert max_diff(torch_logits(ours, ids, pos, mask), ref) <= 0.05 * scale


def test_model_path_fills_the_config_and_explicit_sizes_must_agree(ckpts, tmp_path):
    path = str(ckpts["qwen3"])
    cfg = load_config(None, [f"model.path={path}"]).model
    assert (cfg.architecture, cfg.head_dim, cfg.qk_norm, cfg.attention_bias) == ("qwen3", 32, True, False)
    assert cfg.hidden_size == 64 and cfg.vocab_size == json.loads((ckpts["qwen3"] / "config.json").read_text())["vocab_size"]
    # the same value is fine; a different one is a one-line error naming both
    load_config(None, [f"model.path={path}", "model.hidden_size=64"])
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"model.path={path}", "model.hidden_size=128"])
    msg = str(err.value)
    assert "\n" not in msg and "hidden_size=128" in msg and "config.json" in msg and "hidden_size=64" in msg
    # the actors re-validate the dumped config: it must round-trip to the same model
    run = RunConfig.model_validate({"model": {"path": path}})
    assert RunConfig.model_validate(run.to_dict()).model == run.model
    # dtype is the user's choice (weights are cast on load)
    assert load_config(None, [f"model.path={path}", "model.dtype=bfloat16"]).model.dtype == "bfloat16"


# ---------------------------------------------------------------------------------------------
# FSDP2: each rank reads only its rows


def _fsdp_load_worker(rank, world, port, path, q):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from learner.trainer import TrainerEngine
    from rltpu.models.hf import load as hf_load

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        mesh = init_device_mesh("cpu", (world,))
        cfg = ModelConfig(path=path)
        reads = []
        orig = hf_load.CheckpointDir.read
        hf_load.CheckpointDir.read = lambda self, name, rows=None, cols=None: (reads.append((name, rows)),
                                                                               orig(self, name, rows, cols))[1]
        eng = TrainerEngine(cfg, TrainerConfig(kl_coef=0.1), cfg.vocab_size, 0, mesh=mesh)
        full = {k: v.float().numpy().copy() for k, v in eng.full_state_dict().items()}  # numpy: by value
        local = sum(p.to_local().numel() for p in eng.model.parameters())
        ref_local = sum(p.to_local().numel() for p in eng.ref_model.parameters())
        q.put((rank, {"full": full, "local": local, "ref_local": ref_local, "reads": reads}))
        dist.destroy_process_group()
    except BaseException as err:  # noqa: BLE001 - report instead of hanging the test
        q.put((rank, {"error": repr(err)}))


def test_fsdp_ranks_load_only_their_shard(ckpts):
    """2 gloo ranks build the policy (and the KL reference) from model.path: each reads row
    ranges only, holds about half the parameters, and the gathered weights equal the file's."""
    path = str(ckpts["qwen2-window"])
    out = spawn_ranks(_fsdp_load_worker, 2, (path,), timeout_s=180, what="fsdp load")
    for rank in (0, 1):
        assert "error" not in out[rank], out[rank]
    cfg = ModelConfig(path=path)
    ckpt = CheckpointDir(path)
    total = sum(int(np.prod(s)) for s in param_shapes(cfg).values())
    for rank in (0, 1):
        r = out[rank]
        # each tensor read twice (policy and KL reference), each time only this rank's torch.chunk rows
        want = Counter()
        for name, v in r["full"].items():
            n = v.shape[0]
            chunk = -(-n // 2)
            lo, hi = min(rank * chunk, n), min((rank + 1) * chunk, n)
            if hi > lo:
                want[(name, (lo, hi))] += 2
        assert want and Counter((name, tuple(rows) if rows is not None else None)
                                for name, rows in r["reads"]) == want, (rank, r["reads"])
        assert r["local"] <= total // 2 + 1024 and r["ref_local"] == r["local"]
        for k, v in r["full"].items():
            np.testing.assert_array_equal(v, ckpt.read(k).float().numpy(), err_msg=k)


# ---------------------------------------------------------------------------------------------
# acceptance 5: one-line errors naming the file and the tensor


def _one_line(err) -> str:
    msg = str(err.value)
    assert "\n" not in msg and msg, msg
    return msg


def test_truncated_and_corrupt_safetensors_are_one_line_errors(ckpts, tmp_path):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(ckpts["llama"], d)
    cfg = ModelConfig(path=str(d))
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])  # truncated: the last tensor's bytes are cut
    with pytest.raises(CheckpointError) as err:
        build_policy(cfg, cfg.vocab_size)
    msg = _one_line(err)
    assert str(f) in msg and "truncated" in msg and "tensor model." in msg
    f.write_bytes(b"\x07" * 64 + data[64:])  # corrupt header
    with pytest.raises(CheckpointError) as err:
        load_jax_params(cfg)
    assert str(f) in _one_line(err)
    f.write_bytes(data[:8] + b"\xff" + data[9:])  # header length fine, JSON broken
    with pytest.raises(CheckpointError) as err:
        CheckpointDir(d)
    assert str(f) in _one_line(err) and "header" in str(err.value)


def test_train_cli_stops_on_a_truncated_checkpoint_before_starting(ckpts, tmp_path):
    """``rltpu train`` checks every header before Ray starts: exit 2, one line, file and tensor."""
    import shutil

    from rltpu.data.chat_example import write_chat_example

    d = tmp_path / "m"
    shutil.copytree(ckpts["qwen2-tied"], d)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-4096])
    made = write_chat_example(tmp_path / "data", num_rows=20)
    res = subprocess.run([sys.executable, "-m", "rltpu.cli", "train", str(ROOT / "configs" / "hf_chat.yaml"),
                          f"model.path={d}", f"task.dataset={made['dataset']}", f"run_dir={tmp_path / 'run'}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    line = res.stderr.strip().splitlines()[-1]
    assert line.startswith("rltpu: error:") and str(f) in line and "truncated" in line and "tensor model." in line


def test_config_weights_shape_mismatch_names_file_and_tensor(ckpts, tmp_path):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(ckpts["qwen2-tied"], d)
    c = json.loads((d / "config.json").read_text())
    c["intermediate_size"] = 96  # the weights are 128 wide
    (d / "config.json").write_text(json.dumps(c))
    cfg = ModelConfig(path=str(d))
    with pytest.raises(CheckpointError) as err:
        build_policy(cfg, cfg.vocab_size)
    msg = _one_line(err)
    assert "model.safetensors" in msg and "model.layers.0.mlp.gate_proj.weight" in msg and "[128, 64]" in msg
    # a tensor the config does not describe (q_norm in a checkpoint declared as llama) is named too
    shutil.copytree(ckpts["qwen3"], tmp_path / "n")
    c = json.loads((tmp_path / "n" / "config.json").read_text())
    c["architectures"], c["model_type"] = ["LlamaForCausalLM"], "llama"
    (tmp_path / "n" / "config.json").write_text(json.dumps(c))
    with pytest.raises(CheckpointError) as err:
        load_jax_params(ModelConfig(path=str(tmp_path / "n")))
    assert "unexpected tensor model.layers.0.self_attn." in _one_line(err) and "_norm.weight" in str(err.value)


def test_unsupported_architecture_and_bad_config_json(ckpts, tmp_path):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(ckpts["llama"], d)
    c = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(c, architectures=["GPT2LMHeadModel"])))
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"model.path={d}"])
    msg = _one_line(err)
    assert "GPT2LMHeadModel" in msg and all(a in msg for a in ("LlamaForCausalLM", "Qwen2ForCausalLM",
                                                                "Qwen3ForCausalLM", "MistralForCausalLM"))
    (d / "config.json").write_text("{not json")
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"model.path={d}"])
    assert "config.json" in _one_line(err)
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"model.path={tmp_path / 'nowhere'}"])
    assert "nowhere" in _one_line(err)


def test_missing_tokenizer_is_one_line(ckpts, tmp_path):
    """model.path is also the tokenizer directory: without tokenizer files the run stops at once."""
    import shutil

    from rltpu.data.sources import build_tokenizer

    d = tmp_path / "m"
    shutil.copytree(ckpts["qwen2-tied"], d)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (d / name).unlink()
    cfg = load_config(None, [f"model.path={d}"])
    with pytest.raises(ConfigError) as err:
        build_tokenizer(cfg)
    assert str(d) in _one_line(err) and "tokenizer" in str(err.value)


def test_tiny_checkpoint_cli_and_missing_transformers(tmp_path):
    res = subprocess.run([sys.executable, "-m", "rltpu.cli", "tiny-checkpoint", str(tmp_path / "t"), "--arch",
                          "mistral", "--sliding-window", "4", "--shard-kb", "64"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    cfg = ModelConfig(path=json.loads(res.stdout.strip().splitlines()[-1])["path"])
    assert (cfg.architecture, cfg.sliding_window) == ("mistral", 4)
    code = ("import sys; sys.modules['transformers'] = None\n"
            "from rltpu.models.hf.tiny import write_tiny_checkpoint\n"
            f"write_tiny_checkpoint({str(tmp_path / 'u')!r})")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and res.stderr.strip().splitlines()[-1].startswith("rltpu: error:")
    assert "pip install 'rltpu[hf]'" in res.stderr
    # a word-level tokenizer only where transformers keeps it word-level (qwen2 would rebuild it as BPE)
    res = subprocess.run([sys.executable, "-m", "rltpu.cli", "tiny-checkpoint", str(tmp_path / "w"), "--arch",
                          "qwen2", "--tokenizer", "words"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1].startswith("rltpu: error: --tokenizer words "
                                                                                   "needs --arch llama")


def test_core_path_does_not_import_transformers():
    """Without model.path nothing on the training path needs transformers."""
    code = ("import sys\n"
            "from rltpu.config import ModelConfig, TrainerConfig\n"
            "from learner.trainer import TrainerEngine\n"
            "import rltpu.models.hf.load, rltpu.models.hf.export, rltpu.cli\n"
            "TrainerEngine(ModelConfig(), TrainerConfig(), 17, 0)\n"
            "assert 'transformers' not in sys.modules, 'transformers imported'\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# acceptance 3 (+4 on a real run): rltpu train on a tiny Qwen2 checkpoint and a chat JSONL file

@pytest.mark.slow
def test_train_on_tiny_qwen2_checkpoint_with_chat_jsonl_then_export(tmp_path, shared_ray_head):
    """``rltpu train configs/hf_chat.yaml`` with model.path = a tiny Qwen2 written by transformers:
    trainers stream their FSDP shards (and the KL reference) from the directory, samplers get
    version 0 by weight sync, the tokenizer and chat template come from the same directory and the
    reward reads the row's ``answer`` column. The run's checkpoint then exports to a directory
    transformers loads with the trained policy's logits (checked against our own engine on it)."""
    from rltpu.data.chat_example import write_chat_example
    from rltpu.observe.metrics import read_metrics

    model_dir = write_tiny_checkpoint(tmp_path / "tiny-qwen2", "qwen2", tied=True)
    made = write_chat_example(tmp_path / "data", num_rows=40)
    rows = {json.loads(line)["id"]: json.loads(line) for line in Path(made["dataset"]).read_text().splitlines()}
    run_dir, log = tmp_path / "run", tmp_path / "rewards.jsonl"
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
               RAY_USAGE_STATS_ENABLED="0", RLTPU_TEST_HF_REWARD_LOG=str(log))
    cmd = [sys.executable, "-m", "rltpu.cli", "train", str(ROOT / "configs" / "hf_chat.yaml"), f"run_dir={run_dir}",
           "progress=false", f"model.path={model_dir}", f"task.dataset={made['dataset']}",
           "task.reward_fn=tests.hf_reward:logged_answer_reward", "trainer.steps=3", "trainer.kl_coef=0.05",
           "sync.verify_every=1", "trainer.prompts_per_step=16", "sampler.group_size=8", "sampler.max_new_tokens=8",
           "sampler.batch_buckets=[64]", "sampler.prompt_buckets=[48]",  # the BPE tokenizer's prompts are longer
           "--address", shared_ray_head]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    m = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in m] == [1, 2, 3]
    # samplers (weights by sync) and trainers (weights from the directory, then updated) agree
    assert all(r["sync_probe_max_diff"] is not None and r["sync_probe_max_diff"] <= 1e-4 for r in m)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 3 * 16 * 8
    for c in calls:  # chat-templated prompt from the model dir's tokenizer, answer from the row
        assert c["answer"] == rows[c["id"]]["answer"]
        assert c["prompt"].startswith("<|im_start|>system\n") and c["prompt"].endswith("<|im_start|>assistant\n")

    out = tmp_path / "exported"
    res = subprocess.run([sys.executable, "-m", "rltpu.cli", "export", str(run_dir / "checkpoint"), str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    cfg = ModelConfig(path=str(out))
    trained = build_policy(cfg, cfg.vocab_size)
    start = build_policy(ModelConfig(path=str(model_dir)), cfg.vocab_size)
    assert any(not torch.equal(a, b) for a, b in zip(trained.state_dict().values(), start.state_dict().values()))
    ids, pos, mask = batch(cfg.vocab_size)
    ref = hf_logits(hf_model(out), ids)
    assert max_diff(torch_logits(trained, ids, pos, mask), ref) <= TOL
