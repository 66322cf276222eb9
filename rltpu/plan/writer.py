"""``--write-config``: the best placement ``rltpu train`` can run, as a config it accepts (tensor-parallel
ones included: ``chips_per_sampler``/``chips_per_trainer`` as the plan chose them).

Only ``placement`` changes (async as ``staleness: 1`` with ``trainer.off_policy_correction: tis``), plus the trainer's activation checkpointing and micro-batch size the
plan chose and the continuous engine's ``sampler.slots`` (unless the placement is the config's own), and a sampler batch bucket when a sampler
now gets more rows than the largest one holds. The result is validated with the same schema and ``assign_roles`` that
``rltpu train`` runs before starting anything, so a written file cannot fail on placement.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from rltpu.config import ConfigError, build_config
from rltpu.plan.planner import Plan
from rltpu.chips.topology import ChipTable, assign_roles


def placed_config(plan: Plan) -> dict:
    c = plan.best_runnable
    if c is None:
        tp = plan.best_unrunnable
        only_tp = (f"; only {tp.name} and other tensor-parallel placements would, and {tp.not_runnable}"
                   if tp is not None else "")
        raise ConfigError(f"no placement that `rltpu train` can run fits on {plan.table.describe()}{only_tp}; "
                          f"see the plan's reasons (more chips, a smaller model or fewer prompts per step)")
    data = plan.cfg.to_dict()
    data["placement"] = {**c.placement_mode.written(),  # mode and staleness
                         "sampler_chips": c.sampler_chips, "trainer_chips": c.trainer_chips,
                         "chips_per_sampler": c.chips_per_sampler, "chips_per_trainer": c.chips_per_trainer}
    if c.placement_mode.written()["staleness"]:  # stale rollouts: weigh the stale tokens (truncated IS)
        data["trainer"]["off_policy_correction"] = "tis"
    for k in ("reward_chips", "chips_per_reward", "reward_chip_ids"):  # the reward group stays as configured
        if k in plan.cfg.to_dict()["placement"]:
            data["placement"][k] = plan.cfg.to_dict()["placement"][k]
    if not c.as_configured and "activation_checkpointing" in data["trainer"]:
        data["trainer"]["activation_checkpointing"] = c.checkpointing
        rows_t = plan.workload.rows / c.trainer_fsdp
        data["trainer"]["micro_batch_tokens"] = int(c.micro_rows * plan.workload.seq) if c.micro_rows < rows_t else 0
    if c.slots and not c.as_configured:  # the continuous engine's slots the plan fitted (kv_pages=0 follows them)
        data["sampler"]["slots"] = c.slots
    rows = plan.workload.rows // (c.sampler_chips // c.chips_per_sampler)
    buckets = list(data["sampler"]["batch_buckets"])
    if rows > max(buckets):
        data["sampler"]["batch_buckets"] = sorted({*buckets, rows})
    cfg = build_config(data)
    assign_roles(ChipTable.build(cfg.cluster, emulated=True), cfg.placement)
    return cfg.to_dict()


def write_config(plan: Plan, path: Path) -> None:
    data = placed_config(plan)
    c = plan.best_runnable
    head = (f"# written by `rltpu plan` ({plan.hw.name}{', emulated' if plan.hw.emulated else ''}): {c.name}\n"
            f"# predicted {c.phases.tokens_per_s_per_chip:,.4g} tokens/s/chip: step {c.phases.step:.4g} s (sample "
            f"{c.phases.sample:.4g}, train {c.phases.train:.4g}, sync {c.phases.sync:.4g})\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(head + yaml.safe_dump(data, sort_keys=False))
