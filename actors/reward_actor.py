"""One reward-model scorer: owns its chips, runs ``learner.reward_model.RewardModelEngine``."""

from __future__ import annotations

from rltpu.runtime import ProcessRuntime, ray_identity


class RewardActor:
    def __init__(self, rank: int, cfg_dict: dict):
        from rltpu.config import RunConfig

        self.cfg = RunConfig.model_validate(cfg_dict)
        self.rt = ProcessRuntime("reward", rank, self.cfg.cluster.generation, self.cfg.backend)
        self.engine = None

    def identity(self) -> dict:
        return ray_identity()

    def claim(self, chips, identity, emulated):
        return self.rt.claim(chips, identity, emulated)

    def build(self) -> int:
        from learner.reward_model import RewardModelEngine

        self.engine = RewardModelEngine(self.cfg.reward_model.path, self.rt.backend_info["device"])
        return self.engine.vocab_size

    def score(self, tokens, position_ids, attention_mask):
        return self.engine.score(tokens, position_ids, attention_mask)

    def report(self) -> dict:
        return self.rt.report()

    def shutdown(self) -> None:
        self.rt.shutdown()
