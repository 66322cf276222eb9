"""One ``metrics.jsonl`` line per step, from what the step's parts returned.

Pure: the step loop hands over the samplers' outputs, the trainers' stats and the sync report;
nothing here calls an actor, so the arithmetic (per-token means over ranks, idle shares) is
testable without Ray.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from rltpu.config import RunConfig

SYNC_KEYS = ("seconds", "bytes", "copied_bytes", "host_bytes", "ici_bytes", "dcn_bytes", "staged_bytes",
             "device_put_bytes", "zero_copy_frac")


def _mean(values: list):
    vals = [float(v) for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def _sum(values: list):
    vals = [v for v in values if v is not None]
    return sum(vals) if vals else None


def _mixed_versions(gen: dict) -> float:
    v = np.asarray(gen["token_versions"])
    played = v >= 0
    hi = np.where(played, v, -1).max(axis=1)
    lo = np.where(played, v, np.iinfo(v.dtype).max).min(axis=1)
    return float(np.mean(played.any(axis=1) & (hi > lo)))


@dataclass
class StepTimes:
    t_step: float  # perf_counter at the step's start
    sample_s: float
    train_s: float


def step_record(cfg: RunConfig, *, step: int, version: int, emulated: bool, gen: dict, rewards: np.ndarray,
                outs: list[dict], n_samplers: int, extra: dict, batch: dict, kl, stats: list[dict], sync: dict | None,
                probe: float | None, times: StepTimes, reward_parts: dict, sync_generation: int,
                sampler_weight_versions: list[int], data_cursor) -> dict:
    """``sync`` None for a step interrupted after its update landed (no sync figures)."""
    tc = cfg.trainer
    sync = sync or dict.fromkeys(SYNC_KEYS)
    tokens = max(sum(s["tokens"] for s in stats), 1)

    def per_token(key: str) -> float:  # per-rank sums -> one mean over the global batch
        return sum(s[key] for s in stats) / tokens

    padded, total = sum(o["padded_slots"] for o in outs), sum(o["total_slots"] for o in outs)
    sampler_busy = sum(o["seconds"] for o in outs) / n_samplers
    tis = tc.off_policy_correction == "tis"
    return {
        "mode": cfg.placement.mode,
        "step": step, "weight_version": version, "emulated": emulated,
        "reward_mean": extra.get("reward_mean_sampled", float(rewards.mean())), "reward_std": float(rewards.std()),
        "kl_in_reward": float(kl.sum() / max(batch["loss_mask"].sum(), 1)) if kl is not None else None,
        **extra, **reward_parts,
        "loss": per_token("pg_sum"), "kl": per_token("kl_sum"), "entropy": per_token("entropy_sum"),
        "clip_frac": per_token("clipped"), "logp_gap": per_token("logp_gap_sum"),
        # truncated IS (trainer.off_policy_correction=tis): mean weight, share of tokens at the cap
        "is_weight_mean": per_token("is_weight_sum") if tis else None,
        "is_truncated_frac": per_token("is_truncated") if tis else None,
        "grad_norm": stats[0]["grad_norm"], "lr": stats[0]["lr"],
        "micro_batches": stats[0]["micro_batches"],
        "train_padding_frac": sum(s["train_padding_frac"] for s in stats) / len(stats),
        "value_mse": per_token("value_sq_err_sum") if "value_sq_err_sum" in stats[0] else None,
        "value_mean": per_token("value_sum") if "value_sum" in stats[0] else None,
        "response_len": float(gen["lengths"].mean()),
        # multi-turn episodes (env:): policy turns per episode, episodes cut by env.max_tokens or the
        # prompt buckets, policy tokens per row, and the environment workers' seconds in reset/step
        "env_turns_mean": float(gen["turns"].mean()) if "turns" in gen else None,
        "env_truncated_frac": float(gen["truncated"].mean()) if "truncated" in gen else None,
        "policy_tokens_mean": float(gen["policy_mask"].sum(1).mean()) if "policy_mask" in gen else None,
        "env_s": max(o["env_seconds"] for o in outs) if "env_seconds" in outs[0] else None,
        # async: episodes whose turns were sampled by different weight versions (a sync between turns)
        "env_mixed_version_frac": _mixed_versions(gen) if "token_versions" in gen else None,
        "sample_s": times.sample_s, "train_s": times.train_s, "sync_s": sync["seconds"],
        "step_s": time.perf_counter() - times.t_step,
        # time each group spent in its own work (mean sampler over its generate calls; slowest
        # trainer rank): with step_s, the share of the step each group sat idle
        "sampler_busy_s": sampler_busy, "trainer_busy_s": max(s["seconds"] for s in stats),
        "new_tokens_per_s": sum(o["new_tokens"] for o in outs) / max(
            sampler_busy if cfg.placement.staleness else times.sample_s, 1e-9),
        "compiles": sum(o["compiles"] for o in outs), "compile_s": sum(o["compile_seconds"] for o in outs),
        "sample_program_s": max(o["program_seconds"] for o in outs),
        "sample_host_s": max(o["host_seconds"] for o in outs),
        "padding_frac": padded / max(total, 1),
        # the sampler engine's own counters (continuous engine: busy decode slots, prompt tokens
        # prefilled once per prompt, rows preempted for KV pages); None where an engine has none
        "sampler_occupancy": _mean([o.get("occupancy") for o in outs]),
        "sampler_prefill_tokens": _sum([o.get("prefill_tokens") for o in outs]),
        "sampler_preemptions": _sum([o.get("preemptions") for o in outs]),
        "sync_bytes": sync["bytes"], "sync_copied_bytes": sync.get("copied_bytes"),
        "sync_adapter_only": sync.get("adapter_only"),  # LoRA: this step's sync moved only the adapters
        "sync_host_bytes": sync["host_bytes"], "sync_ici_bytes": sync["ici_bytes"], "sync_dcn_bytes": sync["dcn_bytes"],
        "sync_staged_bytes": sync.get("staged_bytes"),
        # host staging -> sampler devices (real chips, tensor-parallel meshes): each device's slices
        "sync_device_put_bytes": sync.get("device_put_bytes"),
        "sync_generation": sync_generation, "sampler_weight_versions": list(sampler_weight_versions),
        "sync_zero_copy_frac": sync["zero_copy_frac"],
        "sampler_versions": sorted({int(v) for v in gen["versions"]}),
        "sync_probe_max_diff": probe, "data_epoch": data_cursor.epoch, "data_position": data_cursor.position,
    }
