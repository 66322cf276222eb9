"""One sampler: owns its chips, runs the compiled JAX engine, receives weights from trainer 0."""

from __future__ import annotations

from rltpu.runtime import ProcessRuntime, ray_identity


class SamplerActor:
    def __init__(self, rank: int, cfg_dict: dict):
        from rltpu.config import RunConfig

        self.cfg = RunConfig.model_validate(cfg_dict)
        self.rt = ProcessRuntime("sampler", rank, self.cfg.cluster.generation, self.cfg.backend)
        self.engine = None
        self.spec = None

    def identity(self) -> dict:
        return ray_identity()

    def claim(self, chips, identity, emulated):
        return self.rt.claim(chips, identity, emulated)

    def init_process_groups(self, *args) -> None:
        self.rt.init_process_groups(*args)

    def build(self, vocab_size: int, pad_id: int, eos_id: int, spec, cache_dir: str | None = None) -> list:
        """Build the engine and its grid; with ``cache_dir`` a restart loads programs from disk."""
        from rltpu.sampler import SamplerEngine, enable_compile_cache

        if cache_dir:
            enable_compile_cache(cache_dir)
        self.spec = spec
        shapes = {name: (shape, dtype) for name, shape, dtype in spec}
        self.engine = SamplerEngine(self.cfg.model, self.cfg.sampler, vocab_size, pad_id, eos_id, shapes)
        return self.engine.precompile() if self.cfg.sampler.precompile else []

    def receive_weights(self, version: int) -> dict:
        from rltpu.weight_sync import count_zero_copy, receive_weights, torch_to_jax

        tensors, stats = receive_weights(self.spec, version, int(self.cfg.sync.bucket_mb * 2**20), self.rt.sync_group)
        params = torch_to_jax(tensors)
        self.engine.set_params(params, version)  # swap only after every bucket arrived
        return stats | {"zero_copy": count_zero_copy(tensors, params), "tensors": len(tensors)}

    def generate(self, prompts: list[list[int]], n_per_prompt: int, seed: int) -> dict:
        return self.engine.generate(prompts, n_per_prompt, seed)

    def probe_logits(self, tokens, position_ids, attention_mask):
        return self.engine.probe_logits(tokens, position_ids, attention_mask)

    def report(self) -> dict:
        return self.rt.report() | {"weight_version": self.engine.version if self.engine else -1}

    def shutdown(self) -> None:
        self.rt.shutdown()
