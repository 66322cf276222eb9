"""One colocated process per trainer chip: an FSDP2 trainer rank *and* a sampler, phases alternating.

It is a trainer rank (group ``trainer``, same rank, same process groups, same checkpoints) that
also samples; weights pass in-process (``rltpu.sync.colocated.publish_local``), never over the sync
fabric, so it has none of the fabric's methods (``join_sync``, ``push_weights``, ``receive_weights``).
Both footprints stay resident (``memory()``, also in every ``report()``).
"""

from __future__ import annotations

from actors.trainer_actor import TrainerRank
from rltpu.observe.health import Heartbeat


class _ColocatedHeartbeat(Heartbeat):
    """A trainer heartbeat that also carries the sampler engine's weight version."""

    def report(self) -> dict:
        out = super().report()
        try:
            out["sampler_version"] = self.stats().get("sampler_version")
        except Exception:  # noqa: BLE001 - engines mid-build
            out["sampler_version"] = None
        return out


class ColocatedActor(TrainerRank):
    ROLES = {"colocated": True, "engines": ["trainer", "sampler"]}  # marks its claim and reports
    SECTIONS = TrainerRank.SECTIONS + ("sampler",)

    def __init__(self, rank: int, sections: dict):
        super().__init__(rank, sections)  # ProcessRuntime("trainer", rank, ...): reports as trainer-<rank>
        self.rt.decision_role = "colocated"  # refused on real chips: TorchTPU and JAX cannot share one chip
        self.sampler = None
        self.spec = None
        self.calls = 0
        self.hb = _ColocatedHeartbeat("trainer", rank, self._beat)

    def _beat(self) -> dict:
        return {"step": self.engine.step if self.engine else None,
                "version": self.engine.step if self.engine else None,
                "compiles": self.sampler.stats.compiles if self.sampler else None,
                "sampler_version": self.sampler.version if self.sampler else -1}

    # -- start-up: both engines ----------------------------------------------------------------
    def build(self, vocab_size: int, pad_id: int, eos_id: int, spec, cache_dir: str | None = None) -> list:
        """The trainer engine exactly as ``TrainerRank.build``, then the sampler engine exactly as
        ``SamplerActor.build``; returns the sampler's compile log. The sampler has no weights until
        ``publish_local``."""
        from rltpu.sampling.backend import build_backend
        from rltpu.sampling.engine import enable_compile_cache

        super().build(vocab_size)  # phase "loading"
        if cache_dir:
            enable_compile_cache(cache_dir)
        self.spec = spec
        shapes = {name: (shape, dtype) for name, shape, dtype in spec}
        with self.hb.phase("compiling"):
            # pack=False: the sampler adopts the trainer's tensors as they are (publish_local)
            self.sampler = build_backend(self.cfg.model, self.cfg.sampler, vocab_size, pad_id, eos_id, shapes,
                                         pack=False)
            return self.sampler.precompile() if self.cfg.sampler.precompile else []

    # -- weights, in-process ---------------------------------------------------------------------
    def publish_local(self, version: int, alias: bool = False, keep_live: bool = False) -> dict:
        """This rank's trainer weights -> its own sampler as ``version``. Collective over the trainer
        group when it has more than one rank (every rank calls it at once). See rltpu/sync/colocated.py."""
        from rltpu.sync.colocated import publish_local

        with self.hb.phase("syncing"):
            return publish_local(self.engine.model, self.sampler, self.spec, version, alias, keep_live)

    def weight_version(self) -> int:
        return self.sampler.version if self.sampler else -1

    # -- sampling ----------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], n_per_prompt: int, seed: int) -> dict:
        with self.hb.phase("sampling"):
            out = self.sampler.generate(prompts, n_per_prompt, seed)
        self.calls += 1
        return out

    def generate_eval(self, prompts: list[list[int]], n_per_prompt: int, seed: int, greedy: bool) -> dict:
        with self.hb.phase("sampling"):
            return self.sampler.generate(prompts, n_per_prompt, seed, greedy=greedy)

    def sampler_probe_logits(self, tokens, position_ids, attention_mask):
        return self.sampler.probe_logits(tokens, position_ids, attention_mask)

    # probe_logits (the trainer's), train_step, logprobs, values, checkpoints: TrainerRank's

    # -- reporting -----------------------------------------------------------------------------------
    def memory(self) -> dict:
        from rltpu.sync.colocated import process_memory

        return process_memory(self.engine, self.sampler)

    def claim(self, chips, identity, emulated, launch_env: dict | None = None):
        """The chip claim, marked: this one process holds both engines on these chips."""
        return super().claim(chips, identity, emulated, launch_env) | self.ROLES

    def report(self) -> dict:
        return self.rt.report() | self.ROLES | {"weight_version": self.weight_version(), "memory": self.memory()}
