"""``sampler.backend: vllm``: vLLM's ``LLM`` in the sampler process, behind ``RolloutBackend``.

Why: vLLM covers every architecture it supports (Gemma 3, Qwen3-MoE, ...) with its own kernels, where
the JAX engine covers the families written here by hand. The trade: the JAX engine's logprobs match
the trainer's to 1e-4 with zero steady compiles; vLLM's differ by whatever its kernels do, so the
gap is measured every step (``logp_gap`` in metrics.jsonl) instead of bounded (docs/backends.md).

How: the engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); it is built from
``model.path``'s config with dummy weights and refuses to generate until the first ``set_params``
(weights only ever come from the trainer, over the same sync fabric as for the JAX engine). A sync
loads the named tensors in place through the model's own ``load_weights`` on every worker
(``LLM.collective_rpc``) and drops the prefix cache: no engine restart. Prompts go in as token ids;
G samples per prompt are one request with ``n=G`` (prefix caching shares the prompt's KV pages);
stops are the tokenizer's EOS plus ``sampler.stop_token_ids`` (vLLM's own EOS handling is off so
both backends stop on the same ids); every row carries the sampled tokens' logprobs.

Logprobs follow the JAX engine's convention, those of ``softmax(logits / T)`` before top-k / top-p
(``T = 1`` when greedy): vLLM's ``raw_logprobs`` at T = 1 (or greedy), its ``processed_logprobs``
(after temperature) otherwise. With T not 1 *and* top-k / top-p, vLLM has no mode that matches, so
that combination is refused when the config is read (``rltpu.config``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np

# vLLM's CPU attention kernels take these head sizes only (vllm/v1/attention/backends/cpu_attn.py)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
INSTALL_HINT = "pip install -e '.[vllm]' (vLLM's CPU build; on TPUs vLLM's TPU build, docs/backends.md)"


def import_vllm():
    """vLLM, set up for this process: in-process engine, the CPU platform unless the chips are real
    TPUs (libtpu is installed beside it here, and vLLM would otherwise see two platforms), and no
    OpenMP core pinning of its own (the process shares its cores the way the JAX engine does)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"sampler.backend=vllm needs vLLM, which is not installed ({e}): {INSTALL_HINT}") from None
    return vllm


@dataclass
class VllmStats:
    compiles: int = 0  # vLLM builds no per-shape programs here (eager mode)
    cache_hits: int = 0
    compile_seconds: float = 0.0
    compile_log: list = field(default_factory=list)
    build_seconds: float = 0.0  # the LLM engine's construction


def _load_weights(worker, named: list) -> None:
    """Runs on each vLLM worker: vLLM's in-place reload (the model's own loader stacks q/k/v and
    gate/up and takes this worker's TP shard; then its CPU kernels repack the weights again, which is
    why a plain ``model.load_weights`` after the first load finds emptied parameters)."""
    worker.model_runner.reload_weights(weights_iterator=iter(named), is_checkpoint_format=True)
    _repack_cpu_experts(worker.model_runner.get_model())


def _repack_cpu_experts(model) -> int:
    """Pack MoE experts for vLLM's CPU kernel again after an in-place reload. Why: vLLM 0.32 prepacks
    them (``CPUUnquantizedExperts.process_weights_after_loading``) only on the first load; on a weight
    update its ``_setup_kernel`` copies the new experts into the packed storage unpacked, and the
    kernel then reads scrambled weights (tiny Qwen3-MoE: token logprobs off from transformers' by up to
    2 nats). The packing keeps the shape, so it is redone in place. Returns the layers packed."""
    try:
        from vllm import _custom_ops as ops
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # not the CPU build (vLLM's TPU build has its own MoE path)
        return 0
    n = 0
    for mod in model.modules():
        experts = getattr(getattr(getattr(mod, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
            continue
        for name in ("w13_weight", "w2_weight"):
            p = getattr(mod, name)
            p.data.copy_(ops.cpu_prepack_moe_weight(p.data, experts.isa))  # packs into a new tensor
        n += 1
    return n


def _model_param_count(worker) -> int:
    return sum(p.numel() for p in worker.model_runner.model.parameters())


class VllmBackend:
    """``RolloutBackend`` over ``vllm.LLM``. ``tp``: the sampler's chips (``chips_per_sampler``); vLLM
    shards the model over them itself (``tensor_parallel_size``)."""

    takes_torch = True  # weight sync hands it the received torch tensors as they are (no JAX arrays)

    def __init__(self, model_cfg, sampler_cfg, vocab_size: int, pad_id: int, eos_id: int, param_shapes: dict,
                 tp: int = 1, seed: int = 0):
        if not model_cfg.path:
            raise ValueError("sampler.backend=vllm builds its model from model.path (a Hugging Face checkpoint "
                             "directory); set model.path or use sampler.backend=jax")
        vllm = import_vllm()
        self.mcfg, self.cfg = model_cfg, sampler_cfg
        self.vocab_size, self.pad_id, self.eos_id = vocab_size, pad_id, eos_id
        self.stop_ids = tuple(dict.fromkeys((eos_id, *sampler_cfg.stop_token_ids)))
        self.param_shapes = {k: tuple(s) for k, (s, _d) in param_shapes.items()}
        self.version = -1
        self.tp = tp
        self.stats = VllmStats()
        head_dim = getattr(model_cfg, "head_dim", None)
        if os.environ.get("VLLM_TARGET_DEVICE") == "cpu" and head_dim and head_dim not in CPU_HEAD_SIZES:
            raise ValueError(f"vLLM's CPU attention takes head_dim in {list(CPU_HEAD_SIZES)}, this model has "
                             f"{head_dim}; use a model with one of those (rltpu tiny-checkpoint --hidden-size 128 "
                             f"gives 32) or sampler.backend=jax")
        self.prompt_limit = max(sampler_cfg.prompt_buckets)
        # T = 1 (or greedy): the raw distribution is the trainer's; else the tempered one
        self.logprobs_mode = "raw_logprobs" if sampler_cfg.temperature in (0.0, 1.0) else "processed_logprobs"
        t0 = time.perf_counter()
        self.llm = vllm.LLM(
            model=str(model_cfg.path), dtype=model_cfg.dtype, load_format="dummy", skip_tokenizer_init=True,
            enforce_eager=True, enable_prefix_caching=True, seed=seed, tensor_parallel_size=tp,
            max_model_len=self.prompt_limit + sampler_cfg.max_new_tokens,
            max_num_seqs=max(sampler_cfg.batch_buckets), logprobs_mode=self.logprobs_mode,
            # every prefill whole: a prompt cut by chunked prefill has its sampled token discarded, and vLLM
            # then rewinds the request's seeded generator, which CPU generators cannot ("does not use offset")
            enable_chunked_prefill=False, max_num_batched_tokens=max(4096, self.prompt_limit + sampler_cfg.max_new_tokens),
            revision=getattr(model_cfg, "revision", None))
        self.stats.build_seconds = time.perf_counter() - t0
        self._vllm = vllm

    # -- weights ---------------------------------------------------------------------------------
    def set_params(self, params: dict, version: int) -> None:
        """Load the named tensors into the running engine (no restart), then forget cached prefixes:
        their KV was computed by the old weights."""
        import torch

        missing = set(self.param_shapes) - set(params)
        if missing:
            raise ValueError(f"weights for version {version} lack {sorted(missing)[:3]}")
        named = []
        for k, v in params.items():
            t = v if isinstance(v, torch.Tensor) else torch.from_numpy(np.asarray(v))
            if k in self.param_shapes and tuple(t.shape) != self.param_shapes[k]:
                raise ValueError(f"weight {k} has shape {tuple(t.shape)}, expected {self.param_shapes[k]}")
            named.append((k, t))
        self.version = -1  # a failed load leaves no usable version behind
        self.llm.collective_rpc(_load_weights, args=(named,))
        self.llm.reset_prefix_cache()
        self.version = version

    def set_adapters(self, adapters: dict, version: int) -> None:
        raise ValueError("sampler.backend=vllm takes full weights only: drop trainer.lora or use sampler.backend=jax")

    def precompile(self) -> list:
        """Nothing to compile ahead (vLLM runs eagerly here); its engine was built in ``__init__``."""
        return list(self.stats.compile_log)

    # -- generation --------------------------------------------------------------------------------
    def fit_prompts(self, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
        """As the JAX engine: prompts longer than the largest prompt bucket are an error, or cut to
        their last tokens with ``sampler.truncate_prompts``."""
        too_long = [len(p) for p in prompts if len(p) > self.prompt_limit]
        if too_long and not self.cfg.truncate_prompts:
            raise ValueError(f"prompt length={max(too_long)} exceeds the largest bucket {self.prompt_limit}; add a "
                             f"larger sampler.prompt_buckets entry or set sampler.truncate_prompts=true")
        return [p[-self.prompt_limit:] for p in prompts], len(too_long)

    def _params(self, i: int, n: int, seed: int, greedy: bool, max_new: int):
        """Request ``i``'s sampling parameters. vLLM seeds child j of an ``n``-request with seed + j, so
        request i takes seeds [base + i*n, base + (i+1)*n): no two rows of a call share a stream."""
        c = self.cfg
        base = (seed * 1_000_003) % (2**31 - 2**20)
        return self._vllm.SamplingParams(
            n=n, temperature=0.0 if greedy else c.temperature, top_p=1.0 if greedy else c.top_p,
            top_k=0 if greedy else c.top_k, max_tokens=max_new,
            stop_token_ids=[t for t in self.stop_ids if 0 <= t < self.vocab_size],  # vLLM refuses the rest
            ignore_eos=True, logprobs=0, seed=base + i * n, detokenize=False)

    def generate(self, prompts: list[list[int]], n_per_prompt: int, seed: int, greedy: bool = False,
                 max_new_tokens: int | None = None) -> dict:
        """G = ``n_per_prompt`` rows per prompt, prompt-major, in the JAX engine's layout."""
        if self.version < 0:
            raise RuntimeError("sampler has no weights yet: call set_params (weight sync) first")
        from vllm.inputs import TokensPrompt

        t_call = time.perf_counter()
        prompts, truncated = self.fit_prompts(prompts)
        N = max_new_tokens or self.cfg.max_new_tokens
        G = n_per_prompt
        reqs = [TokensPrompt(prompt_token_ids=list(map(int, p))) for p in prompts]
        params = [self._params(i, G, seed, greedy, N) for i in range(len(prompts))]
        t0 = time.perf_counter()
        outs = self.llm.generate(reqs, params, use_tqdm=False)
        program_s = time.perf_counter() - t0
        R, P = len(prompts) * G, max(len(p) for p in prompts)
        prompt = np.full((R, P), self.pad_id, np.int32)
        mask = np.zeros((R, P), np.int32)
        tokens = np.full((R, N), self.pad_id, np.int32)
        logprobs = np.zeros((R, N), np.float32)
        lengths = np.zeros(R, np.int64)
        for i, (p, out) in enumerate(zip(prompts, outs)):
            rows = sorted(out.outputs, key=lambda c: c.index)
            if len(rows) != G:
                raise RuntimeError(f"vLLM returned {len(rows)} completions for a prompt, expected {G}")
            for j, c in enumerate(rows):
                r = i * G + j
                prompt[r, P - len(p):], mask[r, P - len(p):] = p, 1
                ids = list(c.token_ids)[:N]
                tokens[r, :len(ids)] = ids
                logprobs[r, :len(ids)] = [lp[t].logprob for t, lp in zip(ids, c.logprobs)]
                lengths[r] = len(ids)
        new = int(lengths.sum())
        real_prompt = int(mask.sum())
        return {"prompt": prompt, "prompt_mask": mask, "tokens": tokens, "logprobs": logprobs, "lengths": lengths,
                "version": self.version, "new_tokens": new, "seconds": program_s, "program_seconds": program_s,
                "host_seconds": time.perf_counter() - t_call - program_s,
                # vLLM packs tokens without padding: every slot it ran was a real token
                "padded_slots": 0, "total_slots": real_prompt + new, "compiles": 0, "compile_seconds": 0.0,
                "truncated_prompts": truncated, "engine": "vllm", "prefill_tokens": real_prompt}

    # -- the weight-sync probe -------------------------------------------------------------------------
    probe_kind = "token_logprobs"

    def probe_logits(self, tokens, position_ids, attention_mask) -> np.ndarray:
        """(R, L): log p(tokens[:, j+1] | tokens[:, :j+1]) at position j, 0 where there is none; the
        controller compares them with the trainer's log-softmax at the same tokens (vLLM hands out
        logprobs, not logits). Rows are right-padded (``Controller.probe_batch``)."""
        from vllm.inputs import TokensPrompt

        tokens, attention_mask = np.asarray(tokens), np.asarray(attention_mask)
        rows = [tokens[r, attention_mask[r] > 0].tolist() for r in range(len(tokens))]
        sp = self._vllm.SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False,
                                       ignore_eos=True)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=r) for r in rows], sp, use_tqdm=False)
        out = np.zeros(tokens.shape, np.float32)
        for r, (ids, o) in enumerate(zip(rows, outs)):
            for j in range(1, len(ids)):  # prompt_logprobs[j]: token j given tokens < j
                out[r, j - 1] = o.prompt_logprobs[j][ids[j]].logprob
        return out

    def describe(self) -> dict:
        n = self.llm.collective_rpc(_model_param_count)
        itemsize = 2 if self.mcfg.dtype == "bfloat16" else 4
        return {"tp": self.tp, "mesh": None, "device_weight_bytes": {f"vllm-worker-{i}": k * itemsize
                                                                     for i, k in enumerate(n)},
                "model_bytes": sum(int(np.prod(s)) for s in self.param_shapes.values()) * itemsize,
                "backend": "vllm"}
