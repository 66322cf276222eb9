"""Sampler knobs beyond the basics: top-k, top-p statistics, stop tokens, the new-token axis of
the grid, prompt truncation, and the persistent compilation cache across processes."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rltpu.config import SamplerConfig
from rltpu.models import jax_llama
from test_sampler import EOS, PAD, V, _engine, _state, _torch_model

ROOT = Path(__file__).resolve().parents[1]


def _next_token_probs(prompt: list[int], temperature: float) -> np.ndarray:
    model = _torch_model(_state())
    with torch.no_grad():
        ids = torch.tensor([prompt])
        logits = model(ids, torch.arange(len(prompt))[None], torch.ones_like(ids))[0, -1]
    return torch.softmax(logits.double() / temperature, -1).numpy()


def _chi2_crit(df: int, z: float = 3.09) -> float:
    """0.999 quantile of chi-square (Wilson-Hilferty), good to a few percent for df >= 1."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _draw_first_tokens(cfg: SamplerConfig, prompt: list[int], draws: int) -> np.ndarray:
    eng = _engine(cfg)
    eng.set_params(jax_llama.params_from_torch(_state()), 0)
    rows = cfg.batch_buckets[-1]
    out = [eng.generate([prompt], rows, seed=s)["tokens"][:, 0] for s in range(draws // rows)]
    assert eng.stats.compiles == 1  # every draw reused one program
    return np.concatenate(out)


@pytest.mark.parametrize("top_p, top_k", [(0.7, 0), (1.0, 4)])
def test_truncated_sampling_matches_the_truncated_softmax(top_p, top_k):
    temperature, prompt, draws = 0.8, [3, 9, 4], 4096
    cfg = SamplerConfig(engine="static", group_size=2, temperature=temperature, top_p=top_p, top_k=top_k,
                        max_new_tokens=1, batch_buckets=(256,), prompt_buckets=(4,))
    tokens = _draw_first_tokens(cfg, prompt, draws)
    p = _next_token_probs(prompt, temperature)
    order = np.argsort(-p)
    if top_k:
        keep = order[:top_k]
    else:  # nucleus: tokens whose preceding cumulative mass is below top_p
        csum = np.cumsum(p[order])
        keep = order[: int(np.sum(csum - p[order] < top_p))]
    assert 1 < len(keep) < V - 2, "degenerate case: pick another prompt"
    q = np.zeros(V)
    q[keep] = p[keep] / p[keep].sum()
    counts = np.bincount(tokens, minlength=V)
    assert counts[q == 0].sum() == 0, "sampled a token outside the truncated support"
    expected = draws * q[keep]
    chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
    assert chi2 < _chi2_crit(len(keep) - 1), (chi2, counts[keep], expected)
    # the test can tell distributions apart: the untruncated softmax would be rejected
    p_keep = p[keep] / p.sum()
    assert float(((counts[keep] - draws * p_keep) ** 2 / (draws * p_keep)).sum()) > _chi2_crit(len(keep) - 1)


def test_extra_stop_tokens_end_rows():
    # every token stops (pad too: a row that drew it would go on): each real row ends after one token
    cfg = SamplerConfig(engine="static", group_size=2, max_new_tokens=5, batch_buckets=(4,), prompt_buckets=(4,),
                        stop_token_ids=tuple(range(0, V)))
    eng = _engine(cfg)
    eng.set_params(jax_llama.params_from_torch(_state()), 0)
    out = eng.generate([[3, 4], [5]], 2, seed=1)
    assert out["lengths"].tolist() == [1, 1, 1, 1] and out["decode_steps"] == 1
    assert (out["tokens"][:, 1:] == PAD).all() and (out["tokens"][:, 0] != EOS).any()


def test_new_token_axis_of_the_grid_and_truncation():
    cfg = SamplerConfig(engine="static", group_size=2, max_new_tokens=4, new_token_buckets=(4, 8), batch_buckets=(4,),
                        prompt_buckets=(4,), truncate_prompts=True)
    eng = _engine(cfg)
    eng.set_params(jax_llama.params_from_torch(_state()), 0)
    assert [c[:3] for c in eng.precompile()] == [(4, 4, 4), (4, 4, 8)]
    short = eng.generate([[3, 4]], 2, seed=0, max_new_tokens=3)
    assert short["bucket"] == (4, 4, 4) and short["tokens"].shape == (2, 3)
    assert short["decode_steps"] <= 3 and (short["lengths"] <= 3).all()
    long = eng.generate([[3, 4]], 2, seed=0, max_new_tokens=7)
    assert long["bucket"] == (4, 4, 8) and long["tokens"].shape == (2, 7) and (long["lengths"] <= 7).all()
    assert short["compiles"] == long["compiles"] == 0
    with pytest.raises(ValueError, match="max_new_tokens=9 exceeds the largest bucket 8"):
        eng.generate([[3]], 1, seed=0, max_new_tokens=9)
    cut = eng.generate([[9, 9, 3, 4, 5, 6]], 2, seed=0)  # 6 > 4 tokens: keep the last 4
    assert cut["truncated_prompts"] == 1 and cut["prompt"][0].tolist() == [3, 4, 5, 6]
    strict = _engine(cfg.model_copy(update={"truncate_prompts": False}))
    strict.set_params(jax_llama.params_from_torch(_state()), 0)
    with pytest.raises(ValueError, match="truncate_prompts"):
        strict.generate([[9, 9, 3, 4, 5, 6]], 2, seed=0)


_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
sys.path.insert(0, sys.argv[2])
from rltpu.sampling.engine import SamplerEngine, enable_compile_cache
enable_compile_cache(sys.argv[1])
from rltpu.models import jax_llama
from test_sampler import GRID, _engine, _state
eng = _engine(GRID)
eng.precompile()
eng.set_params(jax_llama.params_from_torch(_state()), 0)
out = eng.generate([[3, 4, 5]], 2, seed=0)
print(json.dumps({"compiles": eng.stats.compiles, "cache_hits": eng.stats.cache_hits,
                  "first_sample_s": time.perf_counter() - t0, "tokens": out["tokens"].tolist()}))
"""


def test_persistent_compile_cache_serves_a_restarted_process(tmp_path):
    cache = tmp_path / "jax_cache"

    def run():
        res = subprocess.run([sys.executable, "-c", _CHILD, str(cache), str(ROOT / "tests")], cwd=ROOT,
                             capture_output=True, text=True, timeout=300, env={"JAX_PLATFORMS": "cpu", "PATH": ""})
        assert res.returncode == 0, res.stderr[-2000:]
        return json.loads(res.stdout.strip().splitlines()[-1])

    cold = run()
    assert cold["compiles"] == 4 and cold["cache_hits"] == 0
    assert any(cache.iterdir())  # executables were written to disk
    warm = run()
    assert warm["compiles"] == 4 and warm["cache_hits"] == 4  # every program loaded, none compiled
    assert warm["tokens"] == cold["tokens"]  # the cached programs compute the same thing


def test_microbatches_split_a_request_and_keep_the_row_order():
    cfg = SamplerConfig(engine="static", group_size=2, max_new_tokens=5, batch_buckets=(2, 4), prompt_buckets=(4,),
                        microbatch_rows=2, stop_token_ids=(5,))
    eng = _engine(cfg)
    eng.precompile()
    eng.set_params(jax_llama.params_from_torch(_state()), 0)
    prompts = [[3, 4], [6], [7, 8, 9]]
    out = eng.generate(prompts, 2, seed=3)
    assert out["microbatches"] == 3 and out["compiles"] == 0
    assert out["tokens"].shape == (6, 5) and out["prompt"].shape == (6, 4)
    # rows stay prompt-major: each micro-batch holds one prompt's two samples
    assert [row[row > 0].tolist() for row in out["prompt"][::2]] == prompts
    # each micro-batch stopped with its own rows: its decode loop ran exactly as long as its longest
    # row, so the steps add up per micro-batch (one batch would run 3 x its longest row)
    assert (out["lengths"] >= 1).all() and (out["lengths"] <= 5).all()
    longest = out["lengths"].reshape(3, 2).max(axis=1)
    assert out["decode_steps"] == longest.sum(), (out["decode_steps"], out["lengths"])
    assert longest.min() < longest.max(), out["lengths"]  # the seed makes one micro-batch stop early
    single = _engine(cfg.model_copy(update={"microbatch_rows": 0}))
    single.set_params(jax_llama.params_from_torch(_state()), 0)
    assert "microbatches" not in single.generate(prompts[:2], 2, seed=3)
