"""One sampler: owns its chips, runs its rollout backend (``rltpu.sampling.backend``; the compiled JAX
engine by default), receives weights from the trainers over the sync fabric."""

from __future__ import annotations

import os

from rltpu.observe.health import Heartbeat
from rltpu.chips.runtime import ProcessRuntime, ray_identity


class SamplerActor:
    # what this process reads of the run config (``rltpu.config.sections_of``); nothing else is sent
    SECTIONS = ("cluster.generation", "backend", "model", "sampler", "trainer.lora", "sync",
                "placement.chips_per_trainer")

    def __init__(self, rank: int, sections: dict):
        from rltpu.config import Sections

        self.cfg = Sections.read(sections, "SamplerActor.SECTIONS")
        self.rt = ProcessRuntime("sampler", rank, self.cfg.cluster.generation, self.cfg.backend)
        self.engine = None
        self.spec = None
        self.calls = 0
        self.hb = Heartbeat("sampler", rank, lambda: {"step": self.calls, "version": self.engine.version,
                                                      "compiles": self.engine.stats.compiles})

    def identity(self) -> dict:
        with self.hb.phase("identity"):
            return ray_identity()

    def claim(self, chips, identity, emulated):
        with self.hb.phase("claim"):
            return self.rt.claim(chips, identity, emulated)

    def init_process_groups(self, *args) -> None:
        with self.hb.phase("rendezvous"):
            self.rt.init_process_groups(*args)

    def start_heartbeat(self, monitor, interval_s: float, incarnation: int) -> None:
        self.hb.start(monitor, interval_s, incarnation, self.rt.report())

    def build(self, vocab_size: int, pad_id: int, eos_id: int, spec, cache_dir: str | None = None) -> list:
        """Build the engine and its grid; with ``cache_dir`` a restart loads programs from disk."""
        from rltpu.sampling.backend import build_backend
        from rltpu.sampling.engine import enable_compile_cache

        if cache_dir:
            enable_compile_cache(cache_dir)
        self.spec = spec
        shapes = {name: (shape, dtype) for name, shape, dtype in spec}
        with self.hb.phase("compiling"):
            if self.cfg.sampler.backend == "vllm":  # vLLM shards over the chips itself; on real TPUs its TPU build
                if self.rt.decision is not None and self.rt.decision.jax_platforms == "tpu":
                    os.environ["VLLM_TARGET_DEVICE"] = "tpu"  # else rltpu.sampling.vllm_backend picks its CPU build
                devices = max(len(self.rt.chips), 1)
            else:
                devices = self._devices()
            self.engine = build_backend(self.cfg.model, self.cfg.sampler, vocab_size, pad_id, eos_id, shapes,
                                        devices=devices, lora=self.cfg.trainer.lora)
            return self.engine.precompile() if self.cfg.sampler.precompile else []

    def _devices(self):
        """The JAX devices of this sampler's chips: None for one chip (the unsharded engine), else all
        of them (a tensor-parallel mesh). JAX must see exactly the claimed chips: libtpu's
        TPU_VISIBLE_CHIPS on real ones, ``--xla_force_host_platform_device_count`` on emulated ones."""
        import jax

        k = max(len(self.rt.chips), 1)
        devices = jax.devices()
        if len(devices) != k:
            raise RuntimeError(
                f"sampler {self.rt.rank}: claimed {k} chips but JAX sees {len(devices)} devices "
                f"({devices[0].platform}); the chip claim must run before any JAX call in this process")
        return None if k == 1 else devices

    def join_sync(self, *args) -> dict:
        with self.hb.phase("join_sync"):
            return self.rt.join_sync(*args)

    def receive_weights(self, version: int, spec=None, positions: list[int] | None = None) -> dict:
        """Stage version ``version`` beside the live one; publish only after every sampler verified
        every bucket. On any failure the live version stays and the error propagates. ``spec``: what
        this sync carries (default: the full spec from ``build``; LoRA's later syncs: the adapters).
        ``positions``: each trainer rank's mesh position (``rltpu.sync.collective.send_shards``)."""
        from rltpu.models.spec import is_adapter
        from rltpu.sync.collective import count_zero_copy, device_put_params, receive_staged, torch_to_jax

        spec = self.spec if spec is None else spec
        with self.hb.phase("syncing"):
            try:
                tensors, stats = receive_staged(self.rt.fabric, spec, version,
                                                int(self.cfg.sync.bucket_mb * 2**20), self.cfg.sync.wire_dtype,
                                                trainer_tp=self.cfg.placement.chips_per_trainer, positions=positions)
            except Exception:
                self.rt.fabric.close()
                raise
            if getattr(self.engine, "takes_torch", False):  # vLLM: loads the torch tensors into its own weights
                params, put, zero = tensors, 0, 0
            elif getattr(self.engine, "mesh", None) is not None:  # tensor parallel: each device receives its slice
                params, put = device_put_params(tensors, self.engine.param_shardings)
                zero = 0
            elif self.rt.decision is not None and self.rt.decision.jax_platforms == "tpu":
                params, put = device_put_params(tensors)  # host staging -> the sampler's TPU devices
                zero = 0
            else:  # emulated: JAX on CPU adopts the aligned host buffers through DLPack
                params, put = torch_to_jax(tensors), 0
                zero = count_zero_copy(tensors, params)
            if spec and all(is_adapter(n) for n, _, _ in spec):
                self.engine.set_adapters(params, version)  # LoRA: over the base already held
            else:
                self.engine.set_params(params, version)  # the swap: generation runs between actor calls
        return stats | {"zero_copy": zero, "tensors": len(tensors), "device_put_bytes": put,
                        "adapter_only": bool(spec) and all(is_adapter(n) for n, _, _ in spec)}

    def weight_version(self) -> int:
        return self.engine.version if self.engine else -1

    def generate(self, prompts: list[list[int]], n_per_prompt: int, seed: int) -> dict:
        with self.hb.phase("sampling"):
            out = self.engine.generate(prompts, n_per_prompt, seed)
        self.calls += 1
        return out

    def generate_eval(self, prompts: list[list[int]], n_per_prompt: int, seed: int, greedy: bool) -> dict:
        with self.hb.phase("sampling"):
            return self.engine.generate(prompts, n_per_prompt, seed, greedy=greedy)

    def probe_logits(self, tokens, position_ids, attention_mask):
        with self.hb.phase("probe"):
            return self.engine.probe_logits(tokens, position_ids, attention_mask)

    def report(self) -> dict:
        return self.rt.report() | {"weight_version": self.engine.version if self.engine else -1}

    def layout(self) -> dict:
        """Where this sampler's weights live (``RolloutBackend.describe``)."""
        return {"rank": self.rt.rank} | self.engine.describe()

    def shutdown(self) -> None:
        self.hb.stop()
        self.rt.shutdown()
