"""One trainer rank: owns its chips, runs one FSDP2 shard of the policy, sends weights.

``TrainerRank`` is what every trainer process does (claim, rendezvous, train, checkpoint);
``TrainerActor`` adds the sync fabric (``join_sync``, ``push_weights``); a mode whose processes also
sample (``actors/colocated_actor.py``) builds on ``TrainerRank`` and hands weights over in-process.
"""

from __future__ import annotations

from rltpu.observe.health import Heartbeat
from rltpu.chips.runtime import ProcessRuntime, ray_identity
from rltpu.sync.stores import free_port


class TrainerRank:
    # what this process reads of the run config (``rltpu.config.sections_of``); nothing else is sent
    SECTIONS = ("cluster.generation", "backend", "model", "trainer", "critic", "seed", "sampler.temperature",
                "checkpoint.keep_last")

    def __init__(self, rank: int, sections: dict):
        from rltpu.config import Sections

        self.cfg = Sections.read(sections, f"{type(self).__name__}.SECTIONS")
        self.rt = ProcessRuntime("trainer", rank, self.cfg.cluster.generation, self.cfg.backend)
        self.engine = None
        self.hb = Heartbeat("trainer", rank, lambda: {"step": self.engine.step, "version": self.engine.step})

    def identity(self) -> dict:
        with self.hb.phase("identity"):
            return ray_identity()

    def claim(self, chips, identity, emulated, launch_env: dict | None = None):
        """``launch_env``: this rank's TorchTPU launch variables (``rltpu.chips.launch``), on real chips."""
        with self.hb.phase("claim"):
            return self.rt.claim(chips, identity, emulated, launch_env)

    def free_ports(self, n: int) -> list[int]:
        """Ports free on this actor's host: TorchTPU's single-host slice-builder ports (``rltpu.chips.launch``)."""
        from rltpu.chips.launch import free_ports

        return free_ports(n)

    def rendezvous(self) -> tuple[str, int]:
        ip = self.rt.identity.get("node_ip", "127.0.0.1")
        return ip, free_port(ip)

    def init_process_groups(self, *args) -> None:
        with self.hb.phase("rendezvous"):
            self.rt.init_process_groups(*args)

    def start_heartbeat(self, monitor, interval_s: float, incarnation: int) -> None:
        self.hb.start(monitor, interval_s, incarnation, self.rt.report())

    def build(self, vocab_size: int) -> None:
        from learner.fsdp import trainer_mesh
        from learner.trainer import TrainerEngine

        device = self.rt.backend_info["device"]  # resolved once, by rltpu.chips.backend
        # real chips: one slice (rltpu.chips.launch); chips_per_trainer > 1: a (dp, tp) mesh, tp = k
        mesh = trainer_mesh(self.rt.trainer_group, device, tp=self.rt.trainer_tp, groups=self.rt.mesh_groups)
        with self.hb.phase("loading"):
            self.engine = TrainerEngine(self.cfg.model, self.cfg.trainer, vocab_size, self.cfg.seed,
                                        self.cfg.sampler.temperature, mesh=mesh, device=device,
                                        critic_cfg=self.cfg.critic)

    def train_step(self, batch: dict) -> dict:
        with self.hb.phase("training"), self.rt.modes():
            return self.engine.train_step(batch)

    def logprobs(self, batch: dict, reference: bool = False):
        with self.hb.phase("training"), self.rt.modes():
            return self.engine.logprobs(batch, reference)

    def values(self, batch: dict):
        with self.hb.phase("training"), self.rt.modes():
            return self.engine.values(batch)

    def probe_logits(self, tokens, position_ids, attention_mask):
        with self.hb.phase("probe"), self.rt.modes():
            return self.engine.probe_logits(tokens, position_ids, attention_mask)

    def save_checkpoint(self, path: str, meta: dict) -> str:
        """Collective over trainer ranks: each writes its own shards; rank 0 commits (learner/checkpoint.py)."""
        with self.hb.phase("checkpointing"):
            return str(self.engine.save_checkpoint(path, meta, self.cfg.checkpoint.keep_last, self.rt.trainer_group))

    def load_checkpoint(self, path: str) -> dict:
        """Collective over trainer ranks: each reads only what overlaps its shards (any writer mesh)."""
        with self.hb.phase("loading"):
            return self.engine.load_checkpoint(path, self.rt.trainer_group)

    def report(self) -> dict:
        return self.rt.report()

    def shutdown(self) -> None:
        self.hb.stop()
        self.rt.shutdown()


class TrainerActor(TrainerRank):
    """A trainer rank that sends its shards to the samplers over the sync fabric."""

    SECTIONS = TrainerRank.SECTIONS + ("sync",)

    def join_sync(self, *args) -> dict:
        with self.hb.phase("join_sync"):
            return self.rt.join_sync(*args)

    def mesh_position(self) -> int:
        """This rank's flat position in the trainer mesh: the rows of each tensor it holds (and sends)."""
        from learner.tp import mesh_position

        return mesh_position(self.engine.mesh)[0]

    def push_weights(self, spec, version: int, positions: list[int] | None = None) -> dict:
        """Send this rank's own FSDP (x TP) shards (no all-gather); every trainer rank takes part.
        ``positions``: every trainer rank's mesh position as the controller gathered them; on TorchTPU
        they are a permutation of the ranks (``topology_aware_mesh``'s ring order), and receivers place
        each stream by the position it carries."""
        from learner.tp import mesh_position
        from rltpu.sync.collective import HostStaging, WeightSyncError, local_shards, send_shards

        if getattr(self, "staging", None) is None:
            self.staging = HostStaging()  # host buffers kept across syncs (device shards only)
        with self.hb.phase("syncing"):
            try:
                pos, tp_rank = mesh_position(self.engine.mesh)
                me = self.rt.fabric.me
                expected = me if positions is None else positions[me]
                if pos != expected:
                    raise WeightSyncError(f"trainer {me} holds the shards of mesh position {pos} but the controller's "
                                          f"map says {expected}; rebuild the map after the trainer group restarts")
                shards = local_shards(self.engine.model, [n for n, _, _ in spec], self.engine.tp, tp_rank)
                shards, staged = self.staging.stage(shards)  # TorchTPU shards -> host, one copy
                return send_shards(self.rt.fabric, shards, spec, version, int(self.cfg.sync.bucket_mb * 2**20),
                                   self.cfg.sync.wire_dtype, self.engine.tp, positions) | {"staged_bytes": staged}
            except Exception:
                self.rt.fabric.close()  # this generation is spent; the controller builds the next
                raise
