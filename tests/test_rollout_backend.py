"""The rollout backend seam (``rltpu.sampling.backend``): the JAX engine and the fake both keep it."""

from __future__ import annotations

import numpy as np
import pytest

from rltpu.sampling.backend import RolloutBackend
from rltpu.sampling.fake import FakeBackend


def test_the_jax_engine_and_the_fake_are_rollout_backends():
    from rltpu.config import ModelConfig, SamplerConfig
    from rltpu.sampling.backend import build_backend

    mcfg = ModelConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, max_position_embeddings=32)
    scfg = SamplerConfig(engine="static", group_size=2, max_new_tokens=4, batch_buckets=(4,), prompt_buckets=(8,),
                         precompile=False, compile_cache=False)
    eng = build_backend(mcfg, scfg, 20, 0, 1, {"model.embed_tokens.weight": ((20, 16), "float32")})
    assert isinstance(eng, RolloutBackend) and isinstance(FakeBackend(20, 0, 1, 4), RolloutBackend)
    assert eng.describe()["tp"] == 1 and eng.describe()["model_bytes"] == 0  # no weights yet
    # the continuous sampler cuts prompts through the engine's public method
    with pytest.raises(ValueError, match="truncate_prompts"):
        eng.fit_prompts([[1] * 9])


def test_the_fake_backend_keeps_the_generate_contract():
    fb = FakeBackend(vocab_size=12, pad_id=0, eos_id=1, max_new_tokens=5)
    with pytest.raises(RuntimeError, match="no weights"):
        fb.generate([[3, 4]], 2, seed=0)
    fb.set_params({"w": np.ones(3)}, 4)
    out = fb.generate([[3, 4], [5]], 3, seed=7)
    assert out["tokens"].shape == (6, 5) and out["prompt"].shape == (6, 2) and out["version"] == 4
    assert out["prompt"][3:].tolist() == [[0, 5]] * 3 and out["prompt_mask"][3:].tolist() == [[0, 1]] * 3
    rows = np.arange(6)
    assert (out["tokens"][rows, out["lengths"] - 1] == 1).all()  # each row ends on the stop token
    assert (out["logprobs"][np.arange(5)[None, :] >= out["lengths"][:, None]] == 0).all()
    assert out["new_tokens"] == out["lengths"].sum()
    np.testing.assert_array_equal(fb.generate([[3, 4], [5]], 3, seed=7)["tokens"], out["tokens"])
    assert not np.array_equal(fb.generate([[3, 4], [5]], 3, seed=8)["tokens"], out["tokens"])
    fb.set_adapters({"a": np.zeros(1)}, 5)
    assert fb.version == 5 and set(fb.params) == {"w", "a"}
