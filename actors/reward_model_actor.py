"""One reward-model scorer: owns its chips, runs ``learner.reward_model.RewardModelEngine``."""

from __future__ import annotations

from rltpu.observe.health import Heartbeat
from rltpu.chips.runtime import ProcessRuntime, ray_identity


class RewardModelActor:
    # what this process reads of the run config (``rltpu.config.sections_of``); nothing else is sent
    SECTIONS = ("cluster.generation", "backend", "reward_model")

    def __init__(self, rank: int, sections: dict):
        from rltpu.config import Sections

        self.cfg = Sections.read(sections, "RewardModelActor.SECTIONS")
        self.rt = ProcessRuntime("reward", rank, self.cfg.cluster.generation, self.cfg.backend)
        self.engine = None
        self.hb = Heartbeat("reward", rank)

    def identity(self) -> dict:
        with self.hb.phase("identity"):
            return ray_identity()

    def claim(self, chips, identity, emulated):
        with self.hb.phase("claim"):
            return self.rt.claim(chips, identity, emulated)

    def start_heartbeat(self, monitor, interval_s: float, incarnation: int) -> None:
        self.hb.start(monitor, interval_s, incarnation, self.rt.report())

    def build(self) -> int:
        from learner.reward_model import RewardModelEngine

        with self.hb.phase("loading"):
            self.engine = RewardModelEngine(self.cfg.reward_model.path, self.rt.backend_info["device"])
        return self.engine.vocab_size

    def score(self, tokens, position_ids, attention_mask):
        with self.hb.phase("scoring"):
            return self.engine.score(tokens, position_ids, attention_mask)

    def report(self) -> dict:
        return self.rt.report()

    def shutdown(self) -> None:
        self.hb.stop()
        self.rt.shutdown()
