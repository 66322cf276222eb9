"""The rollout backend: what a sampler actor needs from the engine that generates its rows.

Why a seam: the sampler actor, the colocated actor and the controller's tests only ever call these
methods, so a second engine (vLLM, issue 31) or a fake (``rltpu.sampling.fake``, the controller
tests) stands where the compiled JAX engine (``SamplerEngine``, the default) stands today.

Contract of ``generate``: rows prompt-major (prompt 0's G completions, then prompt 1's, ...);
numpy ``prompt`` (R, P) left-padded, ``prompt_mask``, ``tokens`` (R, N) padded after the stop
token, ``logprobs`` (R, N) the sampler's own log-probabilities of the sampled tokens, ``lengths``
(R,) counting the stop token, ``version`` the weight version that generated them, plus the
accounting the step record reads (``new_tokens``, ``seconds``, ``program_seconds``,
``host_seconds``, ``padded_slots``, ``total_slots``, ``compiles``, ``compile_seconds``).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class RolloutBackend(Protocol):
    version: int  # the weight version held; -1 before the first ``set_params``
    stats: object  # counters with at least ``compiles`` (programs built) and ``compile_log``

    def precompile(self) -> list:
        """Build every program ahead of the first request; the compile log ``[(cell..., seconds, from_cache)]``."""

    def generate(self, prompts: list[list[int]], n_per_prompt: int, seed: int, greedy: bool = False) -> dict:
        """G = ``n_per_prompt`` completions per prompt (see the module docstring); ``greedy``: evaluation
        rows at temperature 0, never trained on. Same (seed, prompts, weights) -> same rows."""

    def set_params(self, params: dict, version: int) -> None:
        """Adopt a full set of named weights as ``version`` (between generate calls)."""

    def set_adapters(self, adapters: dict, version: int) -> None:
        """LoRA: new adapter values over the base already held, as ``version``."""

    def probe_logits(self, tokens: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """Full-sequence logits (R, L, V): the weight-sync probe compares them with the trainer's."""

    def describe(self) -> dict:
        """Where the weights live: ``tp`` (devices spanned), ``mesh``, ``device_weight_bytes``, ``model_bytes``."""


def build_backend(model_cfg, sampler_cfg, vocab_size: int, pad_id: int, eos_id: int, param_shapes: dict,
                  devices=None, lora=None, pack: bool = True) -> RolloutBackend:
    """The backend ``sampler.backend`` names: the compiled JAX engine (``rltpu.sampling.engine``), or
    vLLM (``rltpu.sampling.vllm_backend``; ``devices`` then only counts its chips: vLLM's tensor parallel
    size). ``pack``: the JAX engine's weight layout (``SamplerEngine``)."""
    if getattr(sampler_cfg, "backend", "jax") == "vllm":
        from rltpu.sampling.vllm_backend import VllmBackend

        tp = devices if isinstance(devices, int) else len(devices) if devices else 1
        return VllmBackend(model_cfg, sampler_cfg, vocab_size, pad_id, eos_id, param_shapes, tp=tp)
    from rltpu.sampling.engine import SamplerEngine

    return SamplerEngine(model_cfg, sampler_cfg, vocab_size, pad_id, eos_id, param_shapes, devices=devices, lora=lora,
                         pack=pack)
