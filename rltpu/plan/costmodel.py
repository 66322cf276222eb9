"""The cost model: memory per chip per role and seconds per phase for one placement candidate.

Every number is a closed formula over the model shape, the workload and a ``Hardware`` entry, so
tests can recompute it by hand. Roofline on TPU: decode is bandwidth-bound (weights + KV cache
streamed once per token), prefill and training are FLOP-bound at a stated efficiency, collectives
are bytes over the link they cross (ICI inside a slice, DCN between slices) at a stated efficiency.
On the ``cpu`` entry every phase comes from probes of rltpu's own calls on this machine: sampling
at the GEMM FLOP/s measured at the model's width times the sampler probe's efficiency; training
as the measured ``train_step`` line (fixed seconds per update + FLOPs at the marginal rate); the
weight sync as the measured ``send_shards``/``receive_staged`` line (fixed seconds + messages x
gloo latency + bytes at the fitted rate); plus the measured Ray fan-out per phase.

Memory (bytes per chip), FSDP over ``f`` trainer chips (all of them shard every tensor):
    weights  P*b/f     grads  P*b/f     AdamW states  2*P*b/f (torch keeps them in the param dtype)
    reference model P*b/f (kl_coef > 0), critic 4*P*b/f, activations per token (see ``_act_*``)
Sampler (tensor parallel over the ``t`` chips of one process, ``sampler_weight_bytes``): weights
    about P*b/t (k/v projections split only g = gcd(kv_heads, t) ways, norms and an indivisible
    vocabulary whole), KV cache rows * (prompt + new) * 2*L*kv_dim*b / g, plus one layer's prefill
    working set and the logits.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rltpu.config import ConfigError, ModelConfig, RunConfig
from rltpu.plan.continuous import EngineGrid, Waves, flops, serve
from rltpu.plan.hardware import GiB, Hardware
from rltpu.plan.shapes import DTYPE_BYTES, PROBE, ModelShape  # noqa: F401 - cm.ModelShape for callers

PRECISION_PASSES = {"medium": 1, "high": 3, "highest": 6}  # MXU passes for fp32 inputs (hardware md)

HOST_S_PER_ROW = 20e-6  # driver: decode + reward_fn + advantages per completion (stated; TPU entries)


def host_s_per_row(hw: Hardware) -> float:
    """The driver's work per row between sampling and training (``build_train_batch``): measured
    on the cpu entry (its draw/score work is charged to the sample phase, where the controller
    times it); the stated ``HOST_S_PER_ROW`` for everything elsewhere."""
    if hw.emulated and "driver" in (hw.cpu or {}):
        return hw.cpu["driver"]["host_s_per_row"]
    return HOST_S_PER_ROW
COMPILE_BASE_S, COMPILE_PER_LAYER_S = 3.0, 1.0  # one XLA program; rough assumption, not calibrated


@dataclass(frozen=True)
class Workload:
    prompts: int
    group: int
    prompt_len: int  # the prompt bucket the sampler compiles (padded length)
    new_tokens: int
    ppo_epochs: int = 1
    reference: bool = False  # kl_coef > 0: a frozen copy of the policy, forward only
    critic: bool = False  # a value model as large as the policy, trained (PPO-style)
    reward_params: float = 0.0  # a separate reward model, forward only (0: rule-based reward)
    precision: str = "highest"
    bucket_mb: float = 16.0
    mixed_precision: str = "fp32"  # trainer.mixed_precision: "bf16" = bf16 compute, fp32 master + AdamW
    reward_chips: int = 0  # placement.reward_chips: a reward-model group on chips of its own
    lora: tuple | None = None  # trainer.lora: (rank, target module names); None = every parameter trains
    engine: str = "static"  # sampler.engine
    grid: EngineGrid | None = None  # the continuous engine's slots and KV pool as the config sizes them
    mean_new: float = 0.0  # mean generated tokens per row (planner.mean_response_len); 0: new_tokens

    @property
    def rows(self) -> int:
        return self.prompts * self.group

    @property
    def mean_new_tokens(self) -> float:
        return self.mean_new or self.new_tokens

    @property
    def tokens(self) -> float:
        """Tokens of one step's training batch (prompt + mean completion per row): the headline's numerator."""
        return self.rows * (self.prompt_len + self.mean_new_tokens)

    @property
    def seq(self) -> int:
        return self.prompt_len + self.new_tokens

    @classmethod
    def from_config(cls, cfg: RunConfig) -> "Workload":
        pl = cfg.planner
        return cls(
            prompts=cfg.trainer.prompts_per_step, group=cfg.sampler.group_size,
            prompt_len=pl.prompt_len or max(cfg.sampler.prompt_buckets),
            new_tokens=pl.response_len or cfg.sampler.max_new_tokens, ppo_epochs=cfg.trainer.ppo_epochs,
            reference=cfg.trainer.kl_coef > 0, critic=pl.critic or getattr(cfg, "critic", None) is not None,
            reward_params=pl.reward_model_params, precision=cfg.backend.matmul_precision,
            bucket_mb=cfg.sync.bucket_mb, mixed_precision=getattr(cfg.trainer, "mixed_precision", "fp32"),
            reward_chips=getattr(cfg.placement, "reward_chips", 0),
            lora=(cfg.trainer.lora.rank, tuple(cfg.trainer.lora.target_modules)) if cfg.trainer.lora else None,
            engine=cfg.sampler.engine,
            grid=EngineGrid.from_config(cfg.sampler) if cfg.sampler.engine == "continuous" else None,
            mean_new=float(pl.mean_response_len or 0),
        )

    def trained_params(self, m: "ModelShape") -> int:
        """Parameters with gradients and AdamW states: all, or with LoRA the adapters only."""
        return lora_params(m, *self.lora) if self.lora else m.params

    def synced_params(self, m: "ModelShape") -> int:
        """Parameters a steady-state weight sync moves: all, or with LoRA the adapters (the base went once)."""
        return self.trained_params(m)

    def state_bytes(self, m: "ModelShape") -> int:
        """Bytes per value of trainer weights, grads and AdamW states (fp32 master under bf16 mixed)."""
        return 4 if self.mixed_precision == "bf16" else m.bytes

    def compute_bytes(self, m: "ModelShape") -> int:
        return 2 if self.mixed_precision == "bf16" else m.bytes


def lora_params(m: ModelShape, rank: int, targets) -> int:
    """LoRA adapter parameters: rank x (in + out) per adapted projection per layer, plus the LM head's
    rank x (hidden + vocab) where it is targeted and untied."""
    H, q, kv, inter = m.hidden, m.heads * m.head_dim, m.kv_dim, m.inter
    dims = {"q_proj": (H, q), "k_proj": (H, kv), "v_proj": (H, kv), "o_proj": (q, H),
            "gate_proj": (H, inter), "up_proj": (H, inter), "down_proj": (inter, H)}
    head = rank * (H + m.vocab) if "lm_head" in targets and not m.tied else 0
    return m.layers * rank * sum(sum(dims[t]) for t in targets if t in dims) + head


def model_shape(cfg: RunConfig) -> ModelShape:
    """From ``planner.hf_config`` (a Hugging Face config.json) if set, else the ``model`` section."""
    m = cfg.model
    if cfg.planner.hf_config:
        p = Path(cfg.planner.hf_config)
        try:
            hf = json.loads(p.read_text())
        except (OSError, ValueError) as err:
            raise ConfigError(f"planner.hf_config={str(p)!r} is not a readable JSON file ({err.__class__.__name__}); "
                              f"point it at a Hugging Face config.json") from None
        keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in keys if k not in hf]
        if missing:
            raise ConfigError(f"planner.hf_config={str(p)!r} lacks {missing[0]}; is it a Llama-style config.json?")
        heads, family, bias = hf["num_attention_heads"], hf.get("model_type"), bool(hf.get("attention_bias"))
        return ModelShape(hf["num_hidden_layers"], hf["hidden_size"], hf["intermediate_size"], heads,
                          hf.get("num_key_value_heads", heads), hf.get("head_dim") or hf["hidden_size"] // heads,
                          hf.get("vocab_size", 32000), bool(hf.get("tie_word_embeddings", False)), m.dtype,
                          # the biases and norms as rltpu.models.hf.config reads each family
                          attention_bias=bias or family == "qwen2",
                          attention_out_bias=bias and family not in ("qwen2", "mistral"), qk_norm=family == "qwen3")
    vocab = m.vocab_size
    if vocab is None:
        from rltpu.data.char_tokenizer import CharTokenizer

        vocab = CharTokenizer().vocab_size
    return ModelShape.from_config(m, vocab)


# ---------------------------------------------------------------------------------------------
# Memory


def _act_bytes_per_token(m: ModelShape, seq: int, checkpointing: bool, b: int | None = None) -> float:
    """Activations a training forward keeps for backward, per token (all layers + logits).

    Without checkpointing each layer keeps ~ (8*H + 4*I) values in the compute dtype plus fp32
    attention scores and probabilities (2 * heads * seq * 4 bytes). With checkpointing only each
    layer's input (H values) is kept, and one layer's full set is rebuilt at a time. Logits and
    their log-softmax are fp32 (2 * V * 4 bytes).
    """
    b = b or m.bytes
    per_layer = (8 * m.hidden + 4 * m.inter) * b + 2 * m.heads * seq * 4
    logits = 2 * m.vocab * 4
    if checkpointing:
        return m.layers * m.hidden * b + per_layer + logits
    return m.layers * per_layer + logits


def trainer_memory(m: ModelShape, w: Workload, fsdp_chips: int, tokens_per_chip: float,
                   checkpointing: bool) -> dict[str, float]:
    P, b, f, cb = m.params, w.state_bytes(m), fsdp_chips, w.compute_bytes(m)
    T = w.trained_params(m)  # LoRA: the frozen base has no grads and no AdamW states
    mem = {"weights": (P + (T if w.lora else 0)) * b / f, "grads": T * b / f, "adam_states": 2 * T * b / f}
    if w.reference and not w.lora:  # LoRA's reference is the base itself (adapters off): no copy
        mem["reference"] = P * m.bytes / f
    if w.critic:
        mem["critic"] = 4 * P * b / f
    # FSDP all-gathers one decoder layer at a time (plus the next one, prefetched), in compute dtype
    mem["fsdp_gather"] = 2 * m.layer_params * cb if f > 1 else 0.0
    mem["activations"] = tokens_per_chip * _act_bytes_per_token(m, w.seq, checkpointing, cb)
    return mem


def sampler_weight_bytes(m: ModelShape, tp: int) -> float:
    """Weight bytes on one of a sampler's ``tp`` chips, as ``rltpu.sampling.tp`` lays them out: q/o
    projections and the MLP split ``tp`` ways; k/v projections ``gcd(kv_heads, tp)`` ways (a kv
    head sits on every chip whose q heads read it); the vocabulary tables ``tp`` ways when the
    vocabulary divides, else whole on every chip; the RMSNorm vectors whole on every chip."""
    if tp == 1:
        return m.params * m.bytes
    H, q = m.hidden, m.heads * m.head_dim
    kv_ways = math.gcd(m.kv_heads, tp)
    split = m.layers * (2 * H * q + 3 * H * m.inter)
    vocab = m.vocab * H * (1 if m.tied else 2)
    split_vocab = m.vocab % tp == 0
    norms = m.layers * 2 * H + H
    return m.bytes * (split / tp + m.layers * 2 * H * m.kv_dim / kv_ways
                      + (vocab / tp if split_vocab else vocab) + norms)


def sampler_memory(m: ModelShape, w: Workload, tp: int, rows: int, grid: EngineGrid | None = None) -> dict[str, float]:
    """Bytes on one of a sampler's ``tp`` chips. The static engine holds a dense cache for its batch
    bucket (``rows``); the continuous one (``grid``, default the config's) holds its page pool, the
    history its decode chunk gathers for every slot, and per-slot logits, whatever the rows."""
    g = grid or w.grid
    if w.engine == "continuous" and g is not None:
        ways = math.gcd(m.kv_heads, tp)  # the pool is split by kv heads
        mem = {
            "weights": sampler_weight_bytes(m, tp),
            "kv_pool": g.pool_bytes(m.kv_bytes_per_token) / ways,
            "decode_history": g.history_bytes(m.kv_bytes_per_token) / ways,
            "prefill_work": max(g.prefill_rows) * g.prompt_pages * g.page_size * (4 * m.hidden + 3 * m.inter)
            * m.bytes / tp,
            # next-token logits per slot and last-prompt-token logits per prefilled prompt, fp32, replicated
            "logits": (2 * g.slots + max(g.prefill_rows)) * m.vocab * 4,
        }
        if w.reward_params:
            mem["reward_model"] = w.reward_params * m.bytes / tp
        return mem
    mem = {
        "weights": sampler_weight_bytes(m, tp),
        "kv_cache": rows * w.seq * m.kv_bytes_per_token / math.gcd(m.kv_heads, tp),  # split by kv heads
        # one layer of the prefill at a time: hidden + MLP intermediates; logits of the batch (fp32)
        "prefill_work": rows * w.prompt_len * (4 * m.hidden + 3 * m.inter) * m.bytes / tp,
        "logits": 2 * rows * m.vocab * 4,
    }
    if w.reward_params:
        mem["reward_model"] = w.reward_params * m.bytes / tp
    return mem


# ---------------------------------------------------------------------------------------------
# Time


def cpu_efficiency(hw: Hardware, kind: str, width: int | None = None) -> float:
    """Fraction of the GEMM rate the compiled sampler reached in the micro-benchmark's probe (a
    small Llama through rltpu's own ``SamplerEngine``). It was probed at several widths: the one
    nearest ``width`` (log scale) is used. Capped at 1."""
    cpu = hw.cpu

    if kind != "sample":
        raise ValueError(f"no efficiency probe for {kind!r}; training uses cpu_train_fit")
    by_width = cpu.get("jax_sample_probe_flops_by_width") if width else None
    if by_width:
        w = min(by_width, key=lambda k: abs(math.log(int(k) / width)))
        return min(1.0, by_width[w] / hw.gemm_flops(int(w), "jax"))
    return min(1.0, cpu["jax_sample_probe_flops"] / hw.gemm_flops(PROBE["hidden_size"], "jax"))


def _log_interp(table: dict[str, float], x: float) -> float:
    """``table`` (width -> value) at ``x``, linear in log(width) between measured widths, clamped
    to the end values outside them."""
    pts = sorted((int(k), v) for k, v in table.items())
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            a = math.log(x / x0) / math.log(x1 / x0)
            return y0 + a * (y1 - y0)
    return pts[-1][1]


def cpu_train_fit(hw: Hardware, fsdp: int, width: int, layers: int, flops: float) -> tuple[float, float]:
    """(fixed seconds per update, seconds for ``flops`` of work) of ``TrainerEngine.train_step`` on
    this CPU, from the micro-benchmark's probe Llamas (2 layers; single process, or 2 FSDP2 ranks over
    gloo when ``fsdp`` > 1), interpolated in log(width); the fixed part grows by the measured seconds
    per layer beyond 2. Two measured lines: small -> large batch, and large -> twice as large, which
    is steeper once the working set outgrows the caches; a step costs the larger of the two (the
    first below the large batch, the second above it). Rates are capped at the GEMM rate."""
    fit = hw.cpu["fsdp_train_steps" if fsdp > 1 else "train_steps"]
    extra = (layers - 2) * fit["per_layer_s"]
    fixed = max(_log_interp(fit["fixed_s"], width) + extra, 0.0)
    gemm = hw.gemm_flops(width, "torch")
    # a slope steeper than the bare GEMM rate is noise in the two points: no step beats its GEMMs
    total = fixed + flops / min(_log_interp(fit["flops"], width), gemm)
    if "flops_hi" in fit:  # micro-benchmarks before v15 measured one line
        total = max(total, _log_interp(fit["fixed_hi_s"], width) + extra +
                    flops / min(_log_interp(fit["flops_hi"], width), gemm))
    return fixed, total - fixed


def ray_fanout_s(hw: Hardware, n: int) -> float:
    """Round trip of ``n`` actor calls gathered by one ``ray.get`` (measured for 1, 2 and 4 actors;
    linear between them and beyond)."""
    ray = hw.cpu["ray"]
    pts = [(1, ray["call_s"]), *([(2, ray["fanout2_s"])] if "fanout2_s" in ray else []), (4, ray["fanout4_s"])]
    for (n0, t0), (n1, t1) in zip(pts, pts[1:]):
        if n <= n1 or (n1, t1) == pts[-1]:
            return max(t0 + (t1 - t0) * (n - n0) / (n1 - n0), 0.0)
    return pts[0][1]


def cpu_sync_fit(hw: Hardware, crowded: bool) -> tuple[float, float, float]:
    """(fixed seconds, bytes/s, seconds per message) of one weight sync on this CPU, from the
    micro-benchmark's real sync (``send_shards`` from 2 FSDP2 trainers to 2 samplers running
    ``receive_staged`` + ``torch_to_jax``) at two model sizes. The per-message cost is the gloo
    broadcast latency measured with as many processes as the sync has (``gloo4`` when they
    outnumber the cores); the two sizes' difference in time, less their difference in messages
    times that latency, over their difference in bytes is the byte rate; what is left of the
    smaller one is the fixed cost (handshake and verdict all-gathers, checksums, shard views,
    staging, the torch -> JAX hand-over)."""
    cpu = hw.cpu
    g = cpu["gloo4" if crowded and "gloo4" in cpu else "gloo"]
    lat = g["bcast_latency_s"]
    probe = cpu["sync_probe"]["by_width"]
    a, b = (probe[k] for k in sorted(probe, key=int)[:1] + sorted(probe, key=int)[-1:])
    dt = b["seconds"] - a["seconds"] - (b["messages"] - a["messages"]) * lat
    if dt <= 0:  # the latency estimate swallowed the difference (noise): charge it all to bytes
        lat, dt = 0.0, b["seconds"] - a["seconds"]
    bw = (b["bytes"] - a["bytes"]) / max(dt, 1e-9)
    fixed = max(a["seconds"] - a["bytes"] / bw - a["messages"] * lat, 0.0)
    return fixed, bw, lat


def matmul_passes(hw: Hardware, m: ModelShape, w: Workload, training: bool = False) -> int:
    """fp32 inputs on TPU cost 1/3/6 MXU passes (medium/high/highest); bf16 (incl. the trainer's
    bf16 mixed precision) and the CPU cost 1."""
    if hw.emulated or m.dtype != "float32" or (training and w.mixed_precision == "bf16"):
        return 1
    return PRECISION_PASSES[w.precision]


def continuous_sample_seconds(hw: Hardware, m: ModelShape, w: Workload, tp: int, rows: int, n_samplers: int = 1,
                              grid: EngineGrid | None = None) -> tuple[dict[str, float], Waves]:
    """One continuous sampler serving ``rows`` rows in waves (``rltpu.plan.continuous.serve``).

    TPU: prefill is FLOP-bound; decode is max(bytes, FLOPs) over the whole request, where the bytes are
    the weights once per step and each computed slot's attended history (``EngineGrid.attended_tokens``,
    read from its pages) plus the chunk's own keys once per step. cpu: the measured continuous program line, fixed
    seconds per host-loop iteration (one admission + one chunk) + FLOPs at the marginal rate.
    """
    g = grid or w.grid
    v = serve(g, rows, w.mean_new_tokens, w.new_tokens)
    f_prefill, f_decode = flops(m, g, v.prefill_prompts, v.slot_steps)
    out: dict[str, float] = {}
    if hw.emulated:
        fit = hw.cpu.get("jax_continuous_fit") or hw.cpu["jax_sample_fit"]
        rate = min(_log_interp(fit["flops"], m.hidden), hw.gemm_flops(m.hidden, "jax"))
        out["program_fixed"] = _log_interp(fit["fixed_s"], m.hidden) * v.chunks
        out["prefill"] = f_prefill / rate
        out["decode"] = f_decode / rate
        out["dispatch"] = ray_fanout_s(hw, n_samplers)
        if "driver" in hw.cpu:
            out["driver"] = w.rows * hw.cpu["driver"]["sample_s_per_row"]
        return out, v
    peak = hw.peak_flops * tp / matmul_passes(hw, m, w)
    kv = m.kv_bytes_per_token / math.gcd(m.kv_heads, tp)
    out["prefill"] = f_prefill / (peak * hw.prefill_mfu)
    streamed = v.decode_steps * sampler_weight_bytes(m, tp) + v.slot_steps * (g.attended_tokens + g.chunk) * kv
    out["decode"] = max(streamed / (hw.hbm_bw * hw.bw_eff), f_decode / (peak * hw.prefill_mfu))
    if tp > 1:  # two all-reduces of the activations per layer per step, over the computed slots
        ar = 2 * (tp - 1) / tp * v.slot_bucket * m.hidden * m.bytes / (hw.ici_bw * hw.link_eff) \
            + hw.collective_latency_s
        out["tp_allreduce"] = (v.decode_steps + v.prefill_calls) * 2 * m.layers * ar
    if w.reward_params:
        out["reward_model"] = 2 * w.reward_params * rows * w.seq / (peak * hw.prefill_mfu)
    return out, v


def sample_seconds(hw: Hardware, m: ModelShape, w: Workload, tp: int, rows: int,
                   n_samplers: int = 1, grid: EngineGrid | None = None) -> dict[str, float]:
    """One sampler replica. The continuous engine: ``continuous_sample_seconds``. The static engine:
    prefill of ``rows`` prompts, then ``new_tokens`` decode steps; the compiled loop runs every step
    of the bucket (rows stop early only when all of them do) and each decode step attends over the
    whole static cache of length prompt + new tokens.
    """
    if w.engine == "continuous" and (grid or w.grid) is not None:
        return continuous_sample_seconds(hw, m, w, tp, rows, n_samplers, grid)[0]
    P, T, S, H, L = w.prompt_len, w.new_tokens, w.seq, m.hidden, m.layers
    passes = matmul_passes(hw, m, w)
    f_prefill = 2 * m.matmul_params * rows * P + 4 * rows * P * P * H * L
    f_step = 2 * m.matmul_params * rows + 4 * rows * S * H * L
    out: dict[str, float] = {}
    if hw.emulated and "jax_sample_fit" in hw.cpu:  # the measured program line: fixed + FLOPs / rate
        fit = hw.cpu["jax_sample_fit"]
        rate = min(_log_interp(fit["flops"], H), hw.gemm_flops(H, "jax"))  # no program beats its GEMMs
        # the fixed part was measured with the probe's decode steps; it is charged per step (the
        # prefill counting as one): sampling, the cache update and the loop run once per step
        out["program_fixed"] = _log_interp(fit["fixed_s"], H) * (T + 1) / (fit["new_tokens"] + 1)
    elif hw.emulated:  # older micro-benchmark: the GEMM rate at this width x the sampler probe's efficiency
        rate = hw.gemm_flops(H, "jax") * cpu_efficiency(hw, "sample", H)
    if hw.emulated:
        out["prefill"] = f_prefill / rate
        out["decode"] = T * f_step / rate
        out["dispatch"] = ray_fanout_s(hw, n_samplers)  # the controller's generate calls, one ray.get
        if "driver" in hw.cpu:  # the controller draws, merges and scores every row inside this phase
            out["driver"] = w.rows * hw.cpu["driver"]["sample_s_per_row"]
        return out
    peak = hw.peak_flops * tp / passes
    out["prefill"] = f_prefill / (peak * hw.prefill_mfu)
    stream = (m.params * m.bytes + rows * S * m.kv_bytes_per_token) / tp  # weights + KV, once per token
    out["decode"] = T * max(stream / (hw.hbm_bw * hw.bw_eff), f_step / (peak * hw.prefill_mfu))
    if tp > 1:  # two all-reduces of the activations per layer per token (Megatron-style TP)
        ar = 2 * (tp - 1) / tp * rows * H * m.bytes / (hw.ici_bw * hw.link_eff) + hw.collective_latency_s
        out["tp_allreduce"] = (T + 1) * 2 * L * ar
    if w.reward_params:
        out["reward_model"] = 2 * w.reward_params * rows * S / (peak * hw.prefill_mfu)
    return out


def train_seconds(hw: Hardware, m: ModelShape, w: Workload, fsdp: int, tp: int, rows_per_actor: float,
                  checkpointing: bool, fsdp_link: str, n_micro: int = 1) -> dict[str, float]:
    """One trainer actor's share of the update (all actors run in parallel).

    FLOPs per epoch: 6 * matmul params * tokens (+2 with checkpointing: the forward again) plus
    attention 12 * tokens * seq * H * L; a reference model adds a forward, a critic a full update.
    FSDP moves 3x the weights per epoch and micro-batch (all-gather forward and backward,
    reduce-scatter grads).
    """
    tokens = rows_per_actor * w.seq
    H, L = m.hidden, m.layers
    # LoRA: backward still forms activation gradients (2 x) but no base weight gradients (the other 2 x)
    mult = (4 if w.lora else 6) + (2 if checkpointing else 0) + (2 if w.reference else 0) + (6 if w.critic else 0)
    flops = w.ppo_epochs * (mult * m.matmul_params * tokens + 12 * tokens * w.seq * H * L)
    cb, sb = w.compute_bytes(m), w.state_bytes(m)  # gathers in compute dtype, grads reduced in state dtype
    T = w.trained_params(m)  # gradients reduced and AdamW run for these only
    fsdp_bytes = n_micro * w.ppo_epochs * (2 * cb * m.params + sb * T) * (fsdp - 1) / fsdp if fsdp > 1 else 0.0
    opt_bytes = w.ppo_epochs * 7 * T * sb / (fsdp * tp)  # read p, g, m, v; write p, m, v
    out: dict[str, float] = {}
    if hw.emulated:  # the measured train_step lines: fixed seconds per update + FLOPs at the marginal rate
        fixed, compute = cpu_train_fit(hw, fsdp, H, L, flops / w.ppo_epochs)  # per epoch
        out["compute"] = compute * w.ppo_epochs  # incl. elementwise work, loss, backward, FSDP traffic per token
        # per update: kernel dispatch per layer, AdamW over every tensor, FSDP's per-layer
        # all-gathers / reduce-scatters, micro-batch planning; once per epoch (and per critic update)
        out["fixed"] = fixed * w.ppo_epochs * (2 if w.critic else 1)
        out["dispatch"] = ray_fanout_s(hw, fsdp * tp)  # the controller's train_step calls, one ray.get
        ray = hw.cpu["ray"]
        if "fanout2_batch_s" in ray:  # + shipping each actor its batch: measured for 256 rows, per token
            per_token = max(ray["fanout2_batch_s"] - ray["fanout2_s"], 0.0) / ray["batch_tokens"]
            out["dispatch"] += per_token * tokens
        return out
    passes = matmul_passes(hw, m, w, training=True)
    compute = flops * passes / (hw.peak_flops * tp * hw.train_mfu)
    bw = (hw.ici_bw if fsdp_link == "ICI" else hw.dcn_bw) * hw.link_eff
    lat = hw.collective_latency_s if fsdp_link == "ICI" else hw.dcn_latency_s
    comm = fsdp_bytes / bw + n_micro * w.ppo_epochs * 3 * (L + 1) * lat if fsdp > 1 else 0.0
    # FSDP prefetch overlaps gathers with compute: only the part that exceeds compute shows
    out["compute"] = compute
    out["fsdp_comm_exposed"] = max(0.0, comm - compute) + (comm / max(L, 1) / 3 if fsdp > 1 else 0.0)
    out["optimizer"] = opt_bytes / (hw.hbm_bw * hw.bw_eff)
    return out


@dataclass
class Hop:
    what: str
    link: str  # PCIe (device <-> host), host (loopback on a TPU VM), ICI, DCN, loopback (gloo here), local
    src: str
    dst: str
    bytes: float
    seconds: float


def sync_route(hw: Hardware, m: ModelShape, w: Workload, fsdp: int, trainer_slices: list[int],
               sampler_slices: dict[int, int], n_samplers: int, colocated: bool,
               hosts_per_slice: int = 1) -> list[Hop]:
    """Weight sync, hop by hop, after the design in ``rltpu/sync/collective.py``: every trainer stages
    its own FSDP shard (W/f bytes, no gather) in host memory and streams it in buckets over gloo; a
    stream reaches the samplers of its own slice by one-to-all sends (loopback on a one-host slice,
    the host NIC otherwise) and crosses DCN once per other slice that holds samplers, to a relay
    sampler that forwards it inside its slice; each sampler then puts the tensors on its chips. No
    byte between a torch trainer and a JAX sampler crosses ICI (they share no runtime). Colocated:
    an in-process reshard, i.e. the FSDP all-gather into each process's TP layout.

    ``sampler_slices`` maps slice -> sampler actors on it. On the cpu entry every link is gloo on
    loopback: a handshake and a verdict all-gather, then each stream's messages broadcast
    one-to-all (gloo's root sends to every receiver in turn), plus a checksum broadcast.
    """
    W = w.synced_params(m) * m.bytes  # the wire carries the sampler's dtype (model.dtype); LoRA: adapters only
    f = max(1, fsdp)
    shard = W / f
    hops: list[Hop] = []
    if colocated:
        if f > 1:
            link = "ICI" if len(set(trainer_slices)) == 1 else "DCN"
            bw = (hw.ici_bw if link == "ICI" else hw.dcn_bw) * hw.link_eff
            lat = hw.collective_latency_s if link == "ICI" else hw.dcn_latency_s
            if hw.emulated:
                link, bw, lat = "loopback", hw.cpu["gloo"]["bcast_bw"], hw.cpu["gloo"]["allgather_latency_s"]
            hops.append(Hop("FSDP all-gather into each process's TP layout", link, "every chip", "every chip",
                            W * (f - 1) / f, W * (f - 1) / f / bw + lat))
        return hops
    if hw.emulated:
        crowded = f + n_samplers > hw.cpu["cores"]
        msgs = stream_messages(m, f, w.bucket_mb) if not w.lora else \
            max(1, math.ceil(shard / (w.bucket_mb * 2**20)))  # LoRA: small adapters, packed into buckets
        if "sync_probe" in hw.cpu:  # the real sync, measured: fixed + messages x latency + bytes / rate
            fixed, bw, lat = cpu_sync_fit(hw, crowded)
            # the probe's 2 trainers x 2 samplers put W on every sampler and n x shard on every trainer
            payload = max(n_samplers * shard, W) / bw
            hops.append(Hop("handshake, checksums, verdict, staging, torch->JAX (measured fixed cost)",
                            "loopback", "all", "all", 0.0, fixed))
            hops.append(Hop(f"{f} shard streams, {msgs} messages each, one-to-all", "loopback",
                            f"{f} trainers", f"{n_samplers} samplers", n_samplers * W, msgs * lat + payload))
        else:  # older micro-benchmark: gloo collectives only
            g = hw.cpu["gloo4" if crowded and "gloo4" in hw.cpu else "gloo"]
            payload = max(n_samplers * shard, W) / g["bcast_bw"]  # a sender's fan-out, or a receiver's W
            hops.append(Hop("handshake + verdict all-gathers", "loopback", "all", "all", 0.0,
                            2 * g["allgather_latency_s"]))
            hops.append(Hop(f"{f} shard streams, {msgs} messages + checksum each, one-to-all", "loopback",
                            f"{f} trainers", f"{n_samplers} samplers", n_samplers * W,
                            (msgs + 1) * g["bcast_latency_s"] + payload))
        hops.append(Hop("Ray dispatch of push/receive", "local", "driver", "actors", 0.0,
                        ray_fanout_s(hw, f + n_samplers)))
        return hops
    # real chips (docs/tpu.md): a torch trainer and a JAX sampler share no runtime, so every byte
    # goes device -> host (PCIe) -> gloo (loopback on one host, the host NIC between hosts) ->
    # host -> device (jax.device_put); ICI carries none of it
    dcn = hw.dcn_bw * hw.link_eff
    inside = ("host", hw.host_loop_bw, hw.collective_latency_s) if hosts_per_slice <= 1 else \
        ("DCN", dcn, hw.dcn_latency_s)  # a slice of several hosts: receivers on other hosts sit behind the NIC
    hops.append(Hop("stage each trainer's shard device -> host (PCIe, reused buffers)", "PCIe", f"{f} trainers",
                    "host memory", W, shard / hw.pcie_bw))
    by_src = {t: trainer_slices.count(t) for t in sorted(set(trainer_slices))}
    for s in sorted(sampler_slices):
        n = sampler_slices[s]
        remote = {t: k for t, k in by_src.items() if t != s}  # streams that must cross DCN to reach s
        if remote:
            nbytes = shard * sum(remote.values())
            hops.append(Hop(f"streams to slice {s} relay (once per slice)", "DCN",
                            f"trainers on slice(s) {sorted(remote)}", f"slice {s} relay", nbytes,
                            shard / dcn + hw.dcn_latency_s))
        local = by_src.get(s, 0)
        link, bw, lat = inside
        if local and n:  # gloo's root sends to each receiver in turn: n copies leave each trainer
            hops.append(Hop(f"streams inside slice {s}", link, f"{local} trainers", f"{n} samplers",
                            shard * local * n, n * shard / bw + lat))
        if remote and n > 1:  # the relay forwards every remote stream to its n - 1 neighbours in turn
            relayed = shard * sum(remote.values())
            hops.append(Hop(f"relay broadcast inside slice {s}", link, f"slice {s} relay", f"{n - 1} samplers",
                            relayed * (n - 1), relayed * (n - 1) / bw + lat))
    hops.append(Hop("host -> device on each sampler (jax.device_put, PCIe)", "PCIe", "host memory",
                    f"{n_samplers} samplers", W * n_samplers, W / hw.pcie_bw))
    return hops


def stream_messages(m: ModelShape, f: int, bucket_mb: float) -> int:
    """Messages in one trainer's stream: pieces of at least min(bucket/4, 256 KiB) go on their own
    (chunked to the bucket), smaller ones are packed into buckets (as ``plan_stream`` does)."""
    bucket = bucket_mb * 2**20
    direct_min = min(bucket / 4, 256 * 1024)
    big = small = 0
    n = 0
    for numel in m.tensor_numels():
        piece = numel / f * m.bytes
        if piece >= direct_min:
            n += math.ceil(piece / bucket)
            big += piece
        else:
            small += piece
    return n + max(1, math.ceil(small / bucket)) if small else max(n, 1)


def compile_seconds(hw: Hardware, m: ModelShape, cells: int, trainer_programs: int) -> float:
    """One-off: every sampler grid cell, plus the trainer's programs on TPU (eager on cpu).
    Rough and uncalibrated: reported, never ranked on."""
    per = COMPILE_BASE_S + COMPILE_PER_LAYER_S * m.layers
    return cells * per + (0 if hw.emulated else trainer_programs * per * 2)


@dataclass
class Phases:
    sample: float
    host: float
    train: float
    sync: float
    step: float
    compile: float
    detail: dict = field(default_factory=dict)
    # the headline: one step's training tokens (prompt + mean completion per row) / step / chips of the
    # cluster, as NeMo-RL reports Tokens/sec/GPU
    tokens_per_s_per_chip: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def fmt_bytes(x: float) -> str:
    return f"{x / GiB:.2f} GiB" if x >= 0.1 * GiB else f"{x / 2**20:.1f} MiB"
