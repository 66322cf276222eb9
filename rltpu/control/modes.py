"""Placement modes: where the two engines run and what that changes in a step, as one object each.

A mode owns what differs between placements, so the controller's loop has no mode branches and a
new mode is one class plus its tests:
  * ``actor_classes`` and ``shares_processes``: which actor runs each role (``Placement`` spawns them);
  * ``handoff``: how weights reach the samplers (the sync fabric, or in-process);
  * ``step``: the step's shape (sample then train; or train on a rollout drawn earlier);
  * the few records only it knows (what each process holds, how stale a rollout was) and where a
    failed or interrupted step puts the data cursor back;
  * for ``rltpu plan`` (``planned_modes``): its step time from the phase times (``step_seconds``),
    whether it can run with a config (``refusal``) and how ``placement:`` writes it (``written``).

  disaggregated  samplers and trainers on disjoint chips; weights over the sync fabric (default)
  colocated      one process per trainer chip runs both engines; weights pass in-process
  async          disaggregated, and the rollouts of steps k+1..k+s are generated while step k trains
                 (``placement.staleness`` = s > 0)
"""

from __future__ import annotations

import time

import numpy as np

from rltpu.chips.topology import Role

# the step's parts are imported where a step runs (torch, the sync fabric): ``rltpu plan`` imports
# this module for the planner's side of each mode only


class PlacementMode:
    """The on-policy, disaggregated step; subclasses change what their placement changes."""

    name = "disaggregated"
    shares_processes = False  # samplers are the trainer processes (one handle list)

    def __init__(self, placement_cfg):
        self.cfg = placement_cfg

    # -- processes ---------------------------------------------------------------------------------
    def actor_classes(self) -> dict:
        from actors.reward_model_actor import RewardModelActor
        from actors.sampler_actor import SamplerActor
        from actors.trainer_actor import TrainerActor

        return {Role.TRAINER: TrainerActor, Role.SAMPLER: SamplerActor, Role.REWARD: RewardModelActor}

    def trainer_tp(self) -> int:
        """Trainer processes per tensor-parallel group (``placement.chips_per_trainer``)."""
        return self.cfg.chips_per_trainer

    def process_group_members(self, groups) -> list:
        """Who joins the trainers' rendezvous (the samplers too: they share the default group)."""
        return groups.trainers + groups.samplers

    def trainer_build_args(self, vocab: int, sampler_args: tuple) -> tuple:
        return (vocab,)

    def samplers_built_by_trainers(self) -> bool:
        return False

    # -- weights -----------------------------------------------------------------------------------
    def handoff(self, ray, groups, roles: dict, spec, timeout_s: float, deadlines):
        """The weight handoff: ``join()``, ``push(version) -> figures``, ``probe(batch)``,
        ``forget_store()``, ``generation`` and ``sampler_versions``."""
        from rltpu.control.weights import WeightSync

        return WeightSync(ray, groups, roles, spec, timeout_s, deadlines)

    # -- the step ----------------------------------------------------------------------------------
    def step(self, ctl) -> dict:
        """Sample and score ``prompts_per_step`` x G with the current weights, then train and sync."""
        t_step = time.perf_counter()
        ctl.phase = "sample"
        t0 = time.perf_counter()
        gen, rewards, outs, ds = ctl.sample_scored(ctl.cfg.sampler.group_size)
        return ctl.train_and_sync(gen, rewards, outs, ds, t_step, time.perf_counter() - t0)

    def failed_step_cursor(self, ctl, data_before: dict, step_before: int) -> tuple[dict, int]:
        """Where a failed step puts the data cursor back: before its own prompts."""
        return data_before, step_before

    def interrupt_cursor(self, ctl, phase: str) -> dict:
        """The cursor an interrupt's checkpoint keeps: a step stopped while sampling gives its prompts back."""
        if phase == "sample" and ctl.data_before is not None:
            return ctl.data_before
        return ctl.data.state_dict()

    # -- records -----------------------------------------------------------------------------------
    def placement_extra(self, ctl) -> dict:
        """``placement.json``: each sampler's mesh and the weight bytes on each of its devices."""
        return {"sampler_layout": ctl.get_probe([s.layout.remote() for s in ctl.placement.groups.samplers],
                                                "sampler layouts")}

    def record_extra(self, ctl, sync: dict | None) -> dict:
        return {}

    # -- planning (rltpu.plan) -------------------------------------------------------------------
    def written(self) -> dict:
        """The ``placement:`` keys that select this mode."""
        return {"mode": self.cfg.mode, "staleness": self.cfg.staleness}

    def refusal(self, cfg) -> str:
        """Why ``cfg`` cannot run in this mode ("" when it can)."""
        return ""

    def step_seconds(self, sample: float, host: float, train: float, sync: float, cores: int | None = None,
                     n_samplers: int = 1, n_trainers: int = 1) -> float:
        """On-policy: the phases run one after another."""
        return sample + host + train + sync


class ColocatedMode(PlacementMode):
    name = "colocated"
    shares_processes = True

    def actor_classes(self) -> dict:
        from actors.colocated_actor import ColocatedActor

        return super().actor_classes() | {Role.TRAINER: ColocatedActor}

    def trainer_tp(self) -> int:
        return 1

    def process_group_members(self, groups) -> list:
        return list(groups.trainers)

    def trainer_build_args(self, vocab: int, sampler_args: tuple) -> tuple:
        return sampler_args  # the trainer engine, then its in-process sampler (the compile log)

    def samplers_built_by_trainers(self) -> bool:
        return True

    def handoff(self, ray, groups, roles, spec, timeout_s, deadlines):
        return InProcessWeights(ray, groups, deadlines)

    def placement_extra(self, ctl) -> dict:
        """Both roles resident in one process: what each process holds, measured."""
        return {"memory": ctl.get_probe([t.memory.remote() for t in ctl.placement.groups.trainers],
                                        "memory reports")}

    def record_extra(self, ctl, sync: dict | None) -> dict:
        if sync is None:
            return {}
        mem = ctl.get_probe([t.memory.remote() for t in ctl.placement.groups.trainers], "memory reports")
        return {"proc_rss_mb": max(m["rss_bytes"] for m in mem) / 2**20,
                "proc_peak_rss_mb": max(m["peak_rss_bytes"] for m in mem) / 2**20}


class AsyncMode(PlacementMode):
    """Step t trains on a rollout the samplers started earlier; before waiting for it, rollouts up to
    step t+s are handed out, so the samplers generate while the trainers train.

    A sampler runs its calls in order, so a rollout submitted after the sync of version v was issued
    is generated by weights >= v. Rollout t+s is submitted once version t-1 is synced: trained at
    step t+s (policy version t+s-1), it lags by at most s versions. The lag is measured from the
    versions the samplers stamp on every row, and checked.
    """

    name = "async"

    def step(self, ctl) -> dict:
        s = self.cfg.staleness
        t_step = time.perf_counter()
        from rltpu.control.batch import merge_generations

        ctl.phase = "sample"
        q = ctl.rollouts
        last = min(ctl.step_idx + 1 + s, ctl.cfg.trainer.steps)
        while q.last_step(ctl.step_idx) < last:
            self.submit(ctl, q.last_step(ctl.step_idx) + 1)
        t0 = time.perf_counter()
        ro = q.current = q.inflight.popleft()
        G = ctl.cfg.sampler.group_size
        scoring = ctl.scoring(ro.examples, G)
        outs = ctl.generate(ro.shards, G, ro.seed, ro.refs, on_shard=scoring.submit)
        gen = merge_generations(outs, ctl.tokenizer.pad_id)
        rewards = ctl.score(gen, scoring)
        lag = ctl.version - np.asarray(gen["versions"])
        if lag.max() > s:
            raise RuntimeError(f"rollout for step {ro.step} came from weight version {int(gen['versions'].min())}, "
                               f"{int(lag.max())} behind v{ctl.version} > placement.staleness={s}")
        ctl.draws.pending = ro.drawn
        ds = {"staleness": int(lag.max()), "staleness_mean": float(lag.mean()), "rollouts_in_flight": len(q.inflight)}
        return ctl.train_and_sync(gen, rewards, outs, ds, t_step, time.perf_counter() - t0)

    def submit(self, ctl, step: int) -> None:
        """Draw step ``step``'s prompts and hand them to the samplers (returns at once)."""
        from rltpu.control.rollouts import Rollout

        cfg, q = ctl.cfg, ctl.rollouts
        data_before, saved = ctl.data.state_dict(), ctl.draws.pending
        q.submitting, ctl.draws.pending = data_before, []  # an interrupt mid-draw still rewinds to here
        examples = ctl.draws.draw(cfg.trainer.prompts_per_step)
        drawn, ctl.draws.pending = ctl.draws.pending, saved
        shards = ctl.shards(examples)
        seed = cfg.seed * 1_000_003 + (step - 1) * 131  # what the on-policy loop uses for this step
        refs = ctl.submit_shards(shards, cfg.sampler.group_size, seed)
        q.inflight.append(Rollout(step, data_before, drawn, examples, shards, seed, refs))
        q.submitting = None

    def failed_step_cursor(self, ctl, data_before, step_before):
        """Every untrained rollout is redrawn after the recovery."""
        return ctl.rollouts.drop(ctl.data), ctl.step_idx

    def interrupt_cursor(self, ctl, phase: str) -> dict:
        """Before every untrained rollout: a resume draws them again."""
        return ctl.rollouts.untrained_data_state(ctl.data)

    def refusal(self, cfg) -> str:
        if cfg.trainer.dynamic_sampling:  # a refill round needs the step's own rewards before the next draw
            return "trainer.dynamic_sampling needs each step's rewards before the next draw"
        return ""

    def step_seconds(self, sample, host, train, sync, cores=None, n_samplers=1, n_trainers=1) -> float:
        """Sampling of step k+1 overlaps training of step k; the sync is still exposed. Emulated chips
        share ``cores``: overlap cannot beat the cores' total busy time."""
        overlap = max(sample, host + train)
        if cores:
            overlap = max(overlap, (sample * n_samplers + train * n_trainers) / cores + host)
        return overlap + sync


class InProcessWeights:
    """Each process hands its trainer's weights to its own sampler engine (with several trainer
    ranks FSDP's all-gather assembles the full tensors first); no sync fabric to build."""

    def __init__(self, ray, groups, deadlines=None):
        self.ray, self.groups, self.deadlines = ray, groups, deadlines
        self.generation = 0
        self.sampler_versions: list[int] = []

    def _get(self, refs, phase: str, what: str):
        from rltpu.observe.health import bounded_get

        return self.ray.get(refs) if self.deadlines is None else bounded_get(self.ray, refs, phase, self.deadlines,
                                                                              what)

    def forget_store(self) -> None:
        pass

    def join(self) -> None:
        if not self.sampler_versions:
            self.sampler_versions = [-1] * len(self.groups.samplers)

    def push(self, version: int) -> dict:
        t0 = time.perf_counter()
        out = self.ray.get([t.publish_local.remote(version) for t in self.groups.trainers])
        self.sampler_versions = [int(o["version"]) for o in out]
        # bytes: what crossed between processes (FSDP's all-gather; 0 with one rank); copied: the
        # in-process snapshot the sampler adopts
        return {"seconds": time.perf_counter() - t0, "bytes": sum(o["gathered_bytes"] for o in out),
                "copied_bytes": sum(o.get("copied_bytes", 0) for o in out),
                "buckets": sum(o.get("buckets", 0) for o in out), "host_bytes": 0,
                "ici_bytes": sum(o["link_bytes"]["ici"] for o in out),
                "dcn_bytes": sum(o["link_bytes"]["dcn"] for o in out),
                "zero_copy_frac": sum(o["zero_copy"] for o in out) / max(sum(o["tensors"] for o in out), 1)}

    def probe(self, batch: tuple[np.ndarray, np.ndarray, np.ndarray]) -> float:
        """Max |logit diff| between the trainer and every process's own sampler on ``batch``."""
        g = self.groups
        t_logits = self._get([t.probe_logits.remote(*batch) for t in g.trainers], "probe", "the trainers' probe")[0]
        s_logits = self._get([s.sampler_probe_logits.remote(*batch) for s in g.samplers], "probe",
                             "the samplers' probe")
        mask = batch[2].astype(bool)
        return float(max(np.abs(s[mask] - t_logits[mask]).max() for s in s_logits))


MODES: dict[str, type[PlacementMode]] = {"disaggregated": PlacementMode, "colocated": ColocatedMode}


def mode_for(placement_cfg) -> PlacementMode:
    """The mode a config asks for: ``placement.mode``, async when ``placement.staleness`` > 0."""
    if placement_cfg.staleness and placement_cfg.mode == "disaggregated":
        return AsyncMode(placement_cfg)
    return MODES[placement_cfg.mode](placement_cfg)


def planned_modes() -> dict[str, PlacementMode]:
    """The modes ``rltpu plan`` costs, by name, each as the planner writes it (async one step stale)."""
    from rltpu.config import PlacementConfig

    return {m.name: m for m in (PlacementMode(PlacementConfig()), AsyncMode(PlacementConfig(staleness=1)),
                                ColocatedMode(PlacementConfig(mode="colocated")))}
