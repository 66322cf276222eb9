"""Run by ``test_sampler_tp.py`` in a fresh process: the host device count must be set before
``import jax``, and the pytest process has already imported JAX with one device.

    python tests/sampler_tp_child.py CHECKPOINT_DIR K [K ...]

Builds the unsharded engine (devices=None) and one engine per K over the first K host devices,
each precompiled then loaded from the Hugging Face directory straight into its shardings; prints
one JSON line with each engine's greedy tokens / logprobs, compile counts and per-device bytes.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

N_DEV = max(int(k) for k in sys.argv[2:])
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={N_DEV}"
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")  # the checkpoint reader imports torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from rltpu.config import ModelConfig, SamplerConfig  # noqa: E402
from rltpu.models.hf.load import load_jax_params  # noqa: E402
from rltpu.models.spec import param_shapes  # noqa: E402
from rltpu.sampling import tp  # noqa: E402
from rltpu.sampling.engine import SamplerEngine  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
BACKEND_COMPILES = [0]  # every XLA compile in this process, not only the engine's own count


def _on_duration(event: str, _secs: float, **_kw) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        BACKEND_COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_on_duration)
NEW = 64


def run(cfg: ModelConfig, k: int) -> dict:
    scfg = SamplerConfig(engine="static", temperature=0, max_new_tokens=NEW, batch_buckets=(4,), prompt_buckets=(16,),
                         precompile=False, compile_cache=False)
    shapes = {n: (s, cfg.dtype) for n, s in param_shapes(cfg).items()}
    # EOS id never sampled: all 64 tokens of every row are compared
    eng = SamplerEngine(cfg, scfg, cfg.vocab_size, 0, cfg.vocab_size + 7, shapes,
                        devices=jax.devices()[:k] if k > 1 else None)
    eng.precompile()
    compiles_after_precompile = eng.stats.compiles
    eng.set_params(load_jax_params(cfg, shardings=eng.param_shardings), 0)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (5, 9, 12)]
    first = eng.generate(prompts, 1, seed=0)
    b0 = BACKEND_COMPILES[0]
    t0 = time.perf_counter()
    g = eng.generate(prompts, 1, seed=0)
    secs = time.perf_counter() - t0
    out = {
        "tokens": g["tokens"].tolist(), "logprobs": g["logprobs"].tolist(), "lengths": g["lengths"].tolist(),
        "repeat_equal": g["tokens"].tolist() == first["tokens"].tolist(),
        "compiles_after_precompile": compiles_after_precompile, "compiles_total": eng.stats.compiles,
        "generate_compiles": first["compiles"] + g["compiles"],
        "backend_compiles_second_call": BACKEND_COMPILES[0] - b0,
        "probe_logits": eng.probe_logits(np.asarray(prompts[2:]), np.arange(12)[None], np.ones((1, 12))).tolist(),
        "tokens_per_s": round(int(g["new_tokens"]) / secs, 1), "compile_s": round(eng.stats.compile_seconds, 2),
    }
    if k > 1:
        per_dev = eng.device_weight_bytes()
        out["resync_equal"] = resync(eng, cfg, prompts, g["tokens"].tolist(), per_dev)
        items = {n: jax.numpy.dtype(s.dtype).itemsize for n, s in eng.param_structs.items()}
        shp = {n: s.shape for n, s in eng.param_structs.items()}
        kinds: dict[str, list] = {}
        for n, s in shp.items():
            kinds.setdefault(tp.kind(n, len(s), eng.layout), []).append(n)
        hlo = next(iter(eng._compiled.values())).as_text()
        out |= {
            "mesh": dict(eng.mesh.shape), "devices": [str(d) for d in eng.mesh.devices.flat],
            "device_bytes": [per_dev[d] for d in eng.mesh.devices.flat],
            "expected": tp.expected_device_bytes(shp, items, eng.layout),
            "total_bytes": sum(int(np.prod(s)) * items[n] for n, s in shp.items()), "kinds": kinds,
            "shardings": {n: str(a.sharding.spec) for n, a in eng.params.items()},
            "cache_spec": list(eng._cache_sharding.spec),
            # the per-device KV cache buffers of the partitioned program: [B, kv heads / g, S, hd]
            "cache_shapes": sorted(set(re.findall(rf"f32\[4,\d+,{16 + NEW},{cfg.head_dim}\]", hlo))),
        } | collectives(hlo)
    return out


def resync(eng, cfg, prompts, tokens, per_dev) -> dict:
    """Weight sync's two delivery paths into a TP engine: host tensors straight into the shardings
    (``device_put_params``, real chips) and whole arrays handed to ``set_params`` (emulated chips'
    DLPack path), which places them. Each must give the same bytes per device and the same tokens."""
    from rltpu.models.hf.weights import CheckpointDir
    from rltpu.sync.collective import device_put_params, torch_to_jax

    ckpt = CheckpointDir(cfg.path)
    tensors = {n: ckpt.read(n) for n in eng.param_structs}
    res = {}
    for version, (name, params) in enumerate((("device_put_params", device_put_params(tensors, eng.param_shardings)[0]),
                                              ("torch_to_jax", torch_to_jax(tensors))), start=1):
        eng.set_params(params, version)
        same = eng.device_weight_bytes() == per_dev and eng.generate(prompts, 1, seed=0)["tokens"].tolist() == tokens
        res[name] = same and eng.stats.compiles == 1
    return res


def collectives(hlo: str) -> dict:
    """Count of each collective in the partitioned program and the most elements one of each kind
    returns: GSPMD gathering a weight (instead of reducing activations) would show up here."""
    ops = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
    counts, biggest = dict.fromkeys(ops, 0), dict.fromkeys(ops, 0)
    for line in hlo.splitlines():
        m = re.search(r"= (.*?) (" + "|".join(ops) + r")(-start)?\(", line)
        if m:
            op = m.group(2)
            counts[op] += 1
            for dims in re.findall(r"\[([\d,]*)\]", m.group(1)):
                biggest[op] = max(biggest[op], int(np.prod([int(d) for d in dims.split(",") if d])))
    return {"collectives": counts, "max_collective_elements": biggest}


def main() -> None:
    cfg = ModelConfig(path=sys.argv[1])
    ks = [int(k) for k in sys.argv[2:]]
    res = {"1": run(cfg, 1)} | {str(k): run(cfg, k) for k in ks}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
