"""``rltpu export``: a run checkpoint becomes a directory ``transformers`` loads with the policy's logits.

The policy is moved by a real GRPO step before it is saved, so the export cannot pass by
copying the initial checkpoint; the reference logits are the trainer engine's own.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from learner.trainer import TrainerEngine  # noqa: E402
from rltpu.config import ConfigError, RunConfig  # noqa: E402
from rltpu.models.hf.export import export_checkpoint  # noqa: E402
from rltpu.models.hf.tiny import write_tiny_checkpoint  # noqa: E402
from rltpu.control.batch import build_train_batch, split_by_rank  # noqa: E402
from rltpu.data.char_tokenizer import CharTokenizer  # noqa: E402

torch.set_float32_matmul_precision("highest")
ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-4


def trained_checkpoint(run: RunConfig, vocab: int, out: Path) -> tuple[TrainerEngine, Path]:
    """One GRPO step on random rollouts, then the run's checkpoint layout under ``out``."""
    eng = TrainerEngine(run.model, run.trainer, vocab, run.seed)
    rng = np.random.default_rng(0)
    R, P, T = 4, 6, 5
    gen = {"prompt": rng.integers(3, vocab, (R, P)).astype(np.int32), "prompt_mask": np.ones((R, P), np.int32),
           "tokens": rng.integers(3, vocab, (R, T)).astype(np.int32),
           "logprobs": -rng.uniform(0.5, 3, (R, T)).astype(np.float32), "lengths": np.full(R, T, np.int32)}
    batch = split_by_rank(build_train_batch(gen, np.array([1.0, 0.0, 0.5, 0.2], np.float32), 4, True), 1)[0]
    before = {k: v.clone() for k, v in eng.full_state_dict().items()}
    eng.train_step(batch)
    assert any(not torch.equal(before[k], v) for k, v in eng.full_state_dict().items())  # the policy moved
    return eng, eng.save_checkpoint(out / "checkpoint", {"step": 1, "weight_version": 1, "config": run.to_dict()})


def probe(vocab: int):
    rng = np.random.default_rng(3)
    ids = rng.integers(3, vocab, (2, 24))
    return ids, np.tile(np.arange(24), (2, 1)), np.ones_like(ids)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3-tied", "mistral-window"])
def test_export_round_trip_matches_policy_logits(tmp_path, kind):
    arch, kw = {"qwen2": ("qwen2", {}), "qwen3-tied": ("qwen3", {"tied": True}),
                "mistral-window": ("mistral", {"sliding_window": 8})}[kind]
    src = write_tiny_checkpoint(tmp_path / "src", arch, **kw)
    run = RunConfig.model_validate({"model": {"path": str(src)}, "trainer": {"lr": 1e-2}})
    eng, ckpt = trained_checkpoint(run, run.model.vocab_size, tmp_path / "run")
    out = tmp_path / "exported"
    shard = ["--shard-mb", "0.05"] if kind == "qwen2" else []  # several weight files + index
    res = subprocess.run([sys.executable, "-m", "rltpu.cli", "export", str(ckpt), str(out), *shard], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert (out / "model.safetensors.index.json").is_file() == (kind == "qwen2")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == json.loads((src / "config.json").read_text())["architectures"][0]
    ids, pos, mask = probe(run.model.vocab_size)
    want = eng.probe_logits(ids, pos, mask)
    with torch.no_grad():
        got = hf(torch.as_tensor(ids)).logits.float().numpy()
    assert np.abs(got - want).max() <= TOL
    # the tokenizer files came along and load offline
    tok_src = transformers.AutoTokenizer.from_pretrained(src, local_files_only=True)
    tok_out = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    text = "<|im_start|>user\nRepeat: 1 2 3<|im_end|>"
    assert tok_out.encode(text) == tok_src.encode(text) and tok_out.chat_template == tok_src.chat_template


def test_export_of_a_char_tokenizer_run(tmp_path):
    """A run on the built-in model and character tokenizer exports as Llama with an equivalent
    ``tokenizers`` tokenizer: same ids (BOS first) and the policy's logits."""
    run = RunConfig.model_validate({"model": {"hidden_size": 32, "intermediate_size": 64, "init_std": 0.2},
                                    "trainer": {"lr": 1e-2}})
    tok = CharTokenizer()
    eng, ckpt = trained_checkpoint(run, tok.vocab_size, tmp_path / "run")
    out = tmp_path / "exported"
    summary = export_checkpoint(ckpt, out)
    assert summary["architecture"] == "LlamaForCausalLM"
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids, pos, mask = probe(tok.vocab_size)
    with torch.no_grad():
        got = hf(torch.as_tensor(ids)).logits.float().numpy()
    assert np.abs(got - eng.probe_logits(ids, pos, mask)).max() <= TOL
    hf_tok = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    for text in ("123=", "c9r0s", "0123456789crs="):
        assert hf_tok.encode(text) == tok.encode(text)
        assert hf_tok.decode(tok.encode(text, add_bos=False)) == text
    assert (hf_tok.eos_token_id, hf_tok.pad_token_id, hf_tok.bos_token_id) == (tok.eos_id, tok.pad_id, tok.bos_id)


def test_export_errors_are_one_line(tmp_path):
    src = write_tiny_checkpoint(tmp_path / "src", "qwen2")
    run = RunConfig.model_validate({"model": {"path": str(src)}})
    _, ckpt = trained_checkpoint(run, run.model.vocab_size, tmp_path / "run")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (src / name).unlink()
    with pytest.raises(ConfigError) as err:
        export_checkpoint(ckpt, tmp_path / "out")
    assert "\n" not in str(err.value) and str(src) in str(err.value) and "tokenizer" in str(err.value)
    res = subprocess.run([sys.executable, "-m", "rltpu.cli", "export", str(tmp_path), str(tmp_path / "o")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "trainer_state.json" in res.stderr
    # a config the family cannot express (Llama has no q/k norm) is refused, not silently dropped
    run = RunConfig.model_validate({"model": {"hidden_size": 32, "intermediate_size": 64, "qk_norm": True}})
    _, ckpt = trained_checkpoint(run, 17, tmp_path / "run2")
    with pytest.raises(ValueError) as err:
        export_checkpoint(ckpt, tmp_path / "out2")
    assert "qk_norm" in str(err.value) and "\n" not in str(err.value)
