"""``rltpu plan CONFIG``: which chips sample, which train, whether it fits, what a step costs, and why.

    rltpu plan configs/quickstart.yaml --hardware cpu --out /tmp/plan   # plan.md, plan.html, plan.json, ranks.csv
    rltpu plan configs/quickstart.yaml --against runs/quickstart        # predicted vs measured per phase

``make_plan`` reads the same config ``rltpu train`` takes, enumerates placement candidates
(``candidates``), costs each with closed formulas (``costmodel``) over a hardware entry
(``hardware``: TPU generations from public docs, or this CPU from micro-benchmarks) and ranks them.
Nothing here starts Ray or touches a chip.
"""

from __future__ import annotations

from dataclasses import dataclass

from rltpu.config import ConfigError, RunConfig
from rltpu.plan import costmodel as cm
from rltpu.plan import hardware as hwmod
from rltpu.plan.candidates import Candidate, evaluate_all
from rltpu.chips.topology import ChipTable


# Up to this many chips, reports draw every chip and list every rank, and plan.json keeps every
# candidate's rank table; beyond it they summarise by host and slice (a person cannot read 6,144
# rows) and only the shown candidates' tables are kept (plan.json, ranks.csv).
DETAIL_MAX_CHIPS = 512


@dataclass
class Plan:
    cfg: RunConfig
    hw: hwmod.Hardware
    model: cm.ModelShape
    workload: cm.Workload
    table: ChipTable
    candidates: list[Candidate]

    @property
    def feasible(self) -> list[Candidate]:
        return [c for c in self.candidates if c.feasible]

    @property
    def winner(self) -> Candidate | None:
        """The fastest feasible candidate `rltpu train` runs (a faster TP layout is reported, never picked)."""
        return self.best_runnable

    @property
    def best_runnable(self) -> Candidate | None:
        return next((c for c in self.feasible if c.runnable), None)

    @property
    def best_unrunnable(self) -> Candidate | None:
        """The fastest candidate that fits but `rltpu train` refuses here (tensor parallelism, or a
        real-chip runtime limit), for the report."""
        return next((c for c in self.feasible if not c.runnable), None)

    @property
    def as_configured(self) -> Candidate:
        return next(c for c in self.candidates if c.as_configured)

    @property
    def detailed_report(self) -> bool:
        return self.table.num_chips <= DETAIL_MAX_CHIPS

    def shown(self) -> list[Candidate]:
        """The candidates whose chips a report details: the winner (else the config's own placement,
        as the chip map) and the config's own (``--against``)."""
        first = self.winner or self.as_configured
        return [first] + ([self.as_configured] if self.as_configured is not first else [])

    def best(self, mode: str) -> Candidate | None:
        return next((c for c in self.candidates if c.mode == mode), None)

    def label(self) -> str:
        if self.hw.emulated:
            return (f"EMULATED: figures for this CPU ({self.hw.cpu['cores']} cores, one core per emulated "
                    f"{self.cfg.cluster.generation} chip), from micro-benchmarks; they say nothing about a TPU. "
                    + self.chips_note())
        flagged = ", ".join(self.hw.unconfirmed) or "none"
        return (f"{self.hw.name} figures from public docs (docs/tpu-hardware.md); unconfirmed: {flagged}; "
                f"efficiencies are stated assumptions (train MFU {self.hw.train_mfu:.0%}, prefill "
                f"{self.hw.prefill_mfu:.0%}, HBM {self.hw.bw_eff:.0%}, links {self.hw.link_eff:.0%}). "
                + self.chips_note())

    def chips_note(self) -> str:
        """Whose limits decide "runs here": real chips get TorchTPU's/libtpu's, emulated ones do not
        (what a real slice would refuse stays in each note), decided as ``rltpu train`` decides it."""
        if self.table.emulated:
            why = ("cpu figures plan this machine's emulated chips" if self.hw.emulated else
                   "cluster.emulated=true" if self.cfg.cluster.emulated else
                   "cluster.emulated unset and no TPU on this host")
            refused = sum(1 for c in self.candidates if c.backend_refusal)
            gen = self.cfg.cluster.generation
            how = f"--hardware {gen} cluster.emulated=false" if self.hw.emulated else "cluster.emulated=false"
            return (f"Chips: emulated ({why}), so real-chip TorchTPU/libtpu limits are not applied"
                    + (f"; {refused} candidate(s) would be refused on real {gen} chips "
                       f"({how} plans for them)" if refused else "") + ".")
        return ("Chips: real, so TorchTPU/libtpu limits apply (docs/tpu.md; "
                "cluster.emulated=true plans emulated chips).")

    def why(self) -> str:
        """A paragraph: why the winner wins, what the others lose on, what does not fit."""
        win = self.winner
        if win is None:
            tp = self.best_unrunnable
            if tp is not None:
                n_fit = len(self.feasible)
                return (f"{n_fit} placement(s) fit in memory on {self.table.describe()} ({self.hw.name}), but "
                        f"`rltpu train` can run none of them here. The fastest, {tp.name} at {tp.phases.step:.3g} s "
                        f"per step, cannot because {tp.not_runnable}. Change the placement (chips per role), "
                        f"use more chips, a smaller model, or fewer prompts per step.")
            c = self.candidates[0]
            return (f"No candidate fits on {self.table.describe()} ({self.hw.name}). Closest: {c.name}: {c.reason}. "
                    f"Use more chips (cluster.topology/slices), a smaller model, or fewer prompts per step.")
        p = win.phases
        phases = {"sample": p.sample, "train": p.train, "sync": p.sync, "host": p.host}
        dom = max(phases, key=phases.get)
        parts = [f"{win.name} wins at {p.tokens_per_s_per_chip:,.4g} tokens/s/chip ({p.step:.3g} s per step); "
                 f"{dom} is {phases[dom] / p.step:.0%} of it."]
        others = [c for c in self.feasible if c is not win and c.runnable]
        if others:
            r = others[0]
            diffs = {k: getattr(r.phases, k) - getattr(p, k) for k in ("sample", "train", "sync", "host")}
            worst = max(diffs, key=diffs.get)
            parts.append(f"The runner-up, {r.name}, takes {r.phases.step:.3g} s "
                         f"({r.phases.step / p.step - 1:+.0%}), mostly in {worst} ({diffs[worst]:+.3g} s).")
        for mode in ("colocated", "async"):
            best = next((c for c in self.candidates if c.mode == mode), None)
            if best is None or best is win:
                continue
            if best.feasible and best.runnable:
                parts.append(f"Best {mode}: {best.phases.step:.3g} s per step.")
            elif best.feasible:
                parts.append(f"{mode.capitalize()} fits but cannot run here: {best.not_runnable}.")
            else:
                parts.append(f"{mode.capitalize()} does not fit: {best.reason}.")
        tp = self.best_unrunnable
        if tp is not None and tp.phases.step < p.step:
            parts.append(f"{tp.name} would take {tp.phases.step:.3g} s "
                         f"({tp.phases.step / p.step - 1:+.0%}), but `rltpu train` cannot run it here: "
                         f"{tp.not_runnable}.")
        bad = [c for c in self.candidates if not c.feasible]
        refused = [c for c in self.feasible if not c.runnable]
        if refused:
            parts.append(f"{len(refused)} of {len(self.candidates)} candidates fit in memory but cannot run here.")
        if bad:
            parts.append(f"{len(bad)} of {len(self.candidates)} candidates do not fit in memory.")
        return " ".join(parts)

    def to_json(self, rank_tables: bool = True) -> dict:
        """Every candidate; rank tables for all of them on small clusters, for ``shown()`` ones beyond
        ``DETAIL_MAX_CHIPS`` (null elsewhere), none with ``rank_tables=False``."""
        keep = {id(c) for c in (self.candidates if self.detailed_report else self.shown())} \
            if rank_tables else set()

        def cand(c: Candidate) -> dict:
            return {
                "name": c.name, "mode": c.mode, "runnable": c.runnable, "not_runnable": c.not_runnable,
                "backend_refusal": c.backend_refusal,
                "as_configured": c.as_configured,
                "sampler_chips": c.sampler_chips, "trainer_chips": c.trainer_chips,
                "chips_per_sampler": c.chips_per_sampler, "chips_per_trainer": c.chips_per_trainer,
                "sampler_tp": c.sampler_tp, "trainer_fsdp": c.trainer_fsdp, "trainer_tp": c.trainer_tp,
                "reward_model_on": c.reward_on, "reference_on": "trainer" if self.workload.reference else None,
                "critic_on": "trainer" if self.workload.critic else None,
                "activation_checkpointing": c.checkpointing, "feasible": c.feasible, "reason": c.reason,
                "capacity_bytes": c.capacity, "memory_bytes": c.memory,
                "phases_s": c.phases.as_dict() if c.phases else None,
                "sync_route": [h.__dict__ for h in c.route], "warnings": c.warnings,
                "ranks": c.ranks if id(c) in keep else None,
            }

        return {
            "emulated": self.hw.emulated, "label": self.label(), "hardware": self.hw.name,
            "hardware_sources": self.hw.sources, "unconfirmed": list(self.hw.unconfirmed),
            "chips_emulated": self.table.emulated,
            "cluster": self.table.describe(), "chips": self.table.num_chips, "pod_type": self.table.pod_type,
            "model": {**self.model.__dict__, "params": self.model.params},
            "workload": {**self.workload.__dict__, "rows": self.workload.rows, "seq": self.workload.seq},
            "winner": self.winner.name if self.winner else None, "why": self.why(),
            "candidates": [cand(c) for c in self.candidates],
            "microbench": self.hw.cpu,
        }


def resolve_hardware(cfg: RunConfig, name: str | None = None, bench: dict | None = None) -> hwmod.Hardware:
    name = name or cfg.planner.hardware
    if name == "auto":
        name = cfg.cluster.generation
    if name != "cpu" and name != cfg.cluster.generation:
        raise ConfigError(f"--hardware {name} but cluster.generation={cfg.cluster.generation}; plan a generation "
                          f"by setting cluster.generation={name} (or --hardware cpu for this machine)")
    return hwmod.get(name, cfg.cluster.generation, bench)


def make_plan(cfg: RunConfig, hardware: str | None = None, bench: dict | None = None,
              detailed: bool = False) -> Plan:
    """Validate the inputs (one-line ConfigError), then cost and rank every candidate (from actor
    counts per host; ``detailed``: from every chip, as a cross-check, see ``candidates.evaluate``)."""
    hw = resolve_hardware(cfg, hardware, bench)
    hwmod.check_topology(cfg.cluster.generation, cfg.cluster.topology)
    # the chips are emulated on cpu figures; otherwise as ``rltpu train`` decides (cluster.emulated, or
    # when unset: no TPU on this host), so real-chip limits apply where the run would meet them
    table = ChipTable.build(cfg.cluster, emulated=True if hw.emulated else None)
    if not hw.emulated and table.chips_per_slice > hw.max_slice_chips:
        raise ConfigError(f"cluster.topology={cfg.cluster.topology} has {table.chips_per_slice} chips but a "
                          f"{hw.name} slice has at most {hw.max_slice_chips}; use more slices instead")
    model = cm.model_shape(cfg)
    workload = cm.Workload.from_config(cfg)
    if workload.rows < 1 or workload.seq < 2:
        raise ConfigError(f"the workload is empty ({workload.rows} rows of {workload.seq} tokens); "
                          f"set trainer.prompts_per_step and sampler.max_new_tokens >= 1")
    if workload.mean_new > workload.new_tokens:
        raise ConfigError(f"planner.mean_response_len={workload.mean_new:g} exceeds the {workload.new_tokens} new tokens "
                          f"a row may generate; lower it or raise sampler.max_new_tokens / planner.response_len")
    cands = evaluate_all(cfg, table, hw, model, workload, detailed)
    return Plan(cfg, hw, model, workload, table, cands)
