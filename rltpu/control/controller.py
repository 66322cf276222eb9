"""The GRPO job: place chip-owning actor groups, then loop sample -> reward -> train -> sync.

    rltpu train configs/quickstart.yaml

One step (``Controller.step``), on-policy:
  1. the next ``prompts_per_step`` prompts are split over the sampler actors, each draws G
     completions per prompt with its compiled JAX program (weights of version v);
  2. rewards (``task.reward_fn``) and group-relative advantages are computed here;
  3. the fixed-shape batch is split by rank over the FSDP2 trainer actors, which take one AdamW
     step (version v+1);
  4. trainer rank 0 broadcasts the new weights to every sampler over the sync process group;
  5. one line goes to ``metrics.jsonl``.
Placement modes change steps 1 and 4 only: with ``placement.staleness`` s > 0 the rollouts of steps
k+1..k+s are already being generated while step k trains (``_step_async``); with
``placement.mode: colocated`` each trainer process also runs its chip's sampler and weights pass
in-process (``_publish_local``). Every remote call below is a visible method call on a named actor
handle.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from learner.losses import kl_estimate
from learner.reward_model import combine_rewards
from rltpu.chips.cluster import PlacementError, start_or_join
from rltpu.config import ConfigError, RunConfig, save_config
from rltpu.data.sources import build_dataset, build_tokenizer, check_prompt_lengths, resolve_vocab, with_tokenizer_stops
from rltpu.observe.health import HealthError
from rltpu.observe.loggers import build_loggers, check_loggers
from rltpu.data.rewards import load_reward_fn
from rltpu.control.supervisor import Supervision
from rltpu.control.batch import (build_train_batch, fill_dynamic_batch, keep_informative_groups, merge_generations,
                           score, split_by_rank, split_prompts, train_layout)
from rltpu.chips.topology import ChipTable, Role, assign_roles, check_disjoint
from rltpu.sync.collective import param_spec


def _actor_env(cfg: RunConfig) -> dict[str, str]:
    """Env fixed at process start. JAX_PLATFORMS and libtpu's vars are set later by ``claim``
    (``rltpu.chips.backend``), before the engine imports JAX."""
    return {"OMP_NUM_THREADS": str(cfg.backend.threads), "RAY_AUTH_MODE": "disabled"}


def _actor_classes(colocated: bool = False) -> dict:
    from actors.reward_actor import RewardActor
    from actors.sampler_actor import SamplerActor
    from actors.trainer_actor import TrainerActor

    if colocated:  # one process per trainer chip runs both engines
        from actors.colocated_actor import ColocatedActor

        TrainerActor = ColocatedActor  # noqa: N806
    return {Role.TRAINER: TrainerActor, Role.SAMPLER: SamplerActor, Role.REWARD: RewardActor}


@dataclass
class Rollout:
    """Prompts handed to the samplers for one future step (async mode): what a rewind needs."""

    step: int  # the step that will train on it
    data_before: dict  # the data cursor before its prompts were drawn
    drawn: list[str]  # ledger ids of its prompts
    examples: list[dict]
    shards: list
    seed: int
    refs: dict = field(default_factory=dict)  # sampler rank -> (handle, ObjectRef)


class Controller(Supervision):
    def __init__(self, cfg: RunConfig, address: str | None = None, resume: bool = False):
        self.cfg, self.address, self.resume = cfg, address or cfg.cluster.address, resume
        self.colocated = cfg.placement.mode == "colocated"
        self.staleness = cfg.placement.staleness
        self._inflight: deque[Rollout] = deque()  # async: rollouts submitted, not yet trained on
        self._current: Rollout | None = None  # async: popped for this step, not yet committed
        self._submitting: dict | None = None  # async: the cursor while a rollout's prompts are drawn
        self.interrupted_record: dict | None = None  # the metrics of a step interrupted after its update
        self.run_dir = cfg.resolved_run_dir
        self.table = ChipTable.build(cfg.cluster)
        self.roles = assign_roles(self.table, cfg.placement)  # raises before anything starts
        # one factory for both data sources: the built-in task + char tokenizer, or a prompt file +
        # a Hugging Face tokenizer (whose extra EOS ids become sampler stop tokens)
        self.tokenizer = build_tokenizer(cfg)
        self.cfg = cfg = with_tokenizer_stops(cfg, self.tokenizer)
        self.vocab = resolve_vocab(cfg, self.tokenizer)
        self.reward_fn = load_reward_fn(cfg.task.reward_fn, cfg.task.reward_kwargs)
        self.data = build_dataset(cfg, self.tokenizer)
        if hasattr(self.data, "check_lengths"):  # a prompt file: fail on a too-long row before Ray starts
            st = self.data.check_lengths(self.tokenizer, cfg.sampler)
            print(f"rltpu: dataset {cfg.task.dataset}: {st['rows']} rows, prompt tokens "
                  f"{st['prompt_tokens_min']}/{st['prompt_tokens_mean']:.1f}/{st['prompt_tokens_max']} (min/mean/max)"
                  f"{', ' + str(st['truncated_rows']) + ' truncated' if st['truncated_rows'] else ''}",
                  file=sys.stderr, flush=True)
        self.spec = param_spec(cfg.model, self.vocab)
        if cfg.model.path:  # every tensor's name, shape and byte range, before Ray starts (headers only)
            from rltpu.models.hf.weights import CheckpointDir

            CheckpointDir(cfg.model.path).check(cfg.model, self.vocab)
        self.probe = self.probe_batch()
        self.samplers, self.trainers, self.rewarders, self.reports = [], [], [], []
        self.version, self.step_idx = 0, 0
        self.cluster_info: dict = {}
        self._ray = None
        self.pg = None
        self.compile_log, self.compile_summary = [], {}
        self._phase = "idle"
        check_loggers(cfg)  # a configured logger's missing package fails before Ray starts
        self._init_supervision()  # health monitor, fencing and replacement: rltpu/control/supervisor.py

    # -- start-up ------------------------------------------------------------------------------
    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        save_config(self.cfg, self.run_dir / "config.yaml")
        needed = sum(len(chips) for groups in self.roles.values() for chips in groups)
        self.cluster_info = start_or_join(self.cfg.cluster, self.table, needed, self.address)
        import ray

        self._ray = ray
        self.emulated = self.table.emulated  # refined from the actors' own view of their nodes below
        self.slice_names = self._slice_names()
        self._spawn_all()
        self._claim_chips()
        self._start_health()
        self._start_dashboard()
        n_t = len(self.trainers)
        members = self.trainers if self.colocated else self.trainers + self.samplers
        master, port = ray.get(self.trainers[0].rendezvous.remote())
        args = lambda r: (master, port, len(members), r, n_t, self.cfg.sync.timeout_s)  # noqa: E731
        ray.get([a.init_process_groups.remote(*args(r)) for r, a in enumerate(members)])
        builds = self._build_trainers()
        rm_vocab = ray.get([r.build.remote() for r in self.rewarders])
        if rm_vocab and min(rm_vocab) < self.vocab:
            raise ConfigError(f"reward_model {self.cfg.reward_model.path} has vocab_size {min(rm_vocab)} < the "
                              f"policy's {self.vocab}; the reward model must share the policy's tokenizer")
        t_compile = time.perf_counter()
        compiles = builds if self.colocated else \
            [s.build.remote(self.vocab, self.tokenizer.pad_id, self.tokenizer.eos_id, self.spec, self._cache_dir())
             for s in self.samplers]
        ray.get(builds)
        self.compile_log = ray.get(compiles)
        self._report_compiling(time.perf_counter() - t_compile)
        if self.resume:
            self._load_checkpoint()
        self._join_sync()
        self._sync(self.version)
        self._write_placement()
        self.state = "running"

    def _cache_dir(self) -> str | None:
        return str((self.run_dir / "jax_cache").resolve()) if self.cfg.sampler.compile_cache else None

    def _build_trainers(self) -> list:
        """Start every trainer's engine (colocated: and its in-process sampler, whose compile log
        the call returns); refs, so the caller can overlap them with other builds."""
        if self.colocated:
            return [t.build.remote(self.vocab, self.tokenizer.pad_id, self.tokenizer.eos_id, self.spec,
                                   self._cache_dir()) for t in self.trainers]
        return [t.build.remote(self.vocab) for t in self.trainers]

    def _processes(self) -> list:
        """Every chip-owning actor once (colocated trainers are also the samplers)."""
        return self.trainers + ([] if self.colocated else self.samplers) + self.rewarders

    def _slice_names(self) -> list[str] | None:
        """Slice index -> the ``ray.io/tpu-slice-name`` label of its nodes, or None if unlabelled.

        Embedded clusters use the chip table's names; a joined cluster's slices are whatever its
        TPU VMs are called, taken in sorted order.
        """
        nodes = [n for n in self._ray.nodes() if n["Alive"]]
        labels = [n.get("Labels", {}) for n in nodes if n.get("Resources", {}).get("TPU")]
        if not labels or not all("ray.io/tpu-worker-id" in lb and "ray.io/tpu-slice-name" in lb for lb in labels):
            return None
        names = sorted({lb["ray.io/tpu-slice-name"] for lb in labels})
        if self.cluster_info["mode"] == "embedded":
            names = [self.table.slice_name(s) for s in range(self.cfg.cluster.slices)]
        if len(names) < self.cfg.cluster.slices:
            raise PlacementError(
                f"cluster.slices={self.cfg.cluster.slices} but the Ray cluster has {len(names)} labelled TPU "
                f"slice(s) ({', '.join(names)}); lower cluster.slices"
            )
        return names[: self.cfg.cluster.slices]

    def _spawn_all(self) -> None:
        """One placement group, one bundle per actor, bundles in chip order on each host.

        Ray hands a bundle's TPU ids in bundle order on a fresh node, so ordering bundles by the
        planned chips makes Ray's assignment equal the plan; ``_claim_chips`` checks that it did.
        Chips the plan skips are covered by idle filler bundles so the order still lines up.
        """
        from ray.util.placement_group import placement_group

        classes = _actor_classes(self.colocated)
        planned = sorted(((chips[0].global_id, role, rank, chips) for role in classes
                          for rank, chips in enumerate(self.roles.get(role, []))), key=lambda x: x[0])
        bundles, selectors, slots, expected = [], [], [], {}
        for host in self.table.hosts():
            used = [p for p in planned if (p[3][0].slice, p[3][0].host) == host]
            if not used:
                continue
            last = max(c.index for p in used for c in p[3])
            by_start = {p[3][0].index: p for p in used}
            i = 0
            while i <= last:
                sel = {"ray.io/tpu-worker-id": str(host[1]), "ray.io/tpu-slice-name": self.slice_names[host[0]]} \
                    if self.slice_names else {}
                if i in by_start:
                    _, role, rank, chips = by_start[i]
                    slots.append((len(bundles), role, rank, chips))
                    bundles.append({"TPU": len(chips)})
                    i += len(chips)
                else:  # a chip the plan leaves idle: reserve it so later bundles keep their ids
                    bundles.append({"TPU": 1})
                    i += 1
                selectors.append(sel)
        pg = placement_group(bundles, strategy="PACK", name=f"rltpu-{os.getpid()}", bundle_label_selector=selectors)
        try:
            self._ray.get(pg.ready(), timeout=120)
        except self._ray.exceptions.GetTimeoutError:
            raise PlacementError(
                f"Ray could not reserve {sum(b['TPU'] for b in bundles)} TPU chips in 120 s "
                f"(cluster has {self.cluster_info.get('tpu_chips')}); are other jobs holding chips?"
            ) from None
        actors = {Role.TRAINER: {}, Role.SAMPLER: {}, Role.REWARD: {}}
        self.pg, self.bundles = pg, {}  # (role, rank) -> (bundle index, chips): a replacement reuses them
        for bundle, role, rank, chips in slots:
            self.bundles[(role, rank)] = (bundle, chips)
            actors[role][rank] = self._new_actor(role, rank)
            expected[(role, rank)] = chips
        self.trainers = [actors[Role.TRAINER][r] for r in range(len(actors[Role.TRAINER]))]
        self.samplers = [actors[Role.SAMPLER][r] for r in range(len(actors[Role.SAMPLER]))]
        self.rewarders = [actors[Role.REWARD][r] for r in range(len(actors[Role.REWARD]))]
        if self.colocated:  # the same handles (one list: a replaced trainer is the replaced sampler)
            self.samplers = self.trainers
        self.planned_chips = [expected[(Role.TRAINER, r)] for r in range(len(self.trainers))] + \
                             [expected[(Role.SAMPLER, r)] for r in range(len(actors[Role.SAMPLER]))] + \
                             [expected[(Role.REWARD, r)] for r in range(len(self.rewarders))]

    def _new_actor(self, role: Role, rank: int, incarnation: int = 0):
        """Start ``role`` ``rank``'s process on its placement-group bundle (its chips)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle, chips = self.bundles[(role, rank)]
        return self._ray.remote(_actor_classes(self.colocated)[role]).options(
            name=f"rltpu-{role.value}-{rank}-{os.getpid()}" + (f"-{incarnation}" if incarnation else ""),
            num_cpus=0, resources={"TPU": len(chips)},
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle),
            runtime_env={"env_vars": _actor_env(self.cfg)},
        ).remote(rank, self.cfg.to_dict())

    def _chips_for(self, ident: dict) -> list:
        """Map Ray's assignment (node, TPU ids) to chip-table entries."""
        labels = next((n.get("Labels", {}) for n in self._ray.nodes() if n["NodeID"] == ident["node_id"]), {})
        host = int(labels.get("ray.io/tpu-worker-id", 0))
        slice_name = labels.get("ray.io/tpu-slice-name")
        sl = self.slice_names.index(slice_name) if self.slice_names and slice_name in self.slice_names else 0
        on_host = {c.index: c for c in self.table.chips_on(sl, host)}
        missing = [i for i in ident["ray_tpu_ids"] if i not in on_host]
        if missing:
            raise RuntimeError(f"Ray assigned TPU ids {missing} that the chip table has no entry for on host {host}")
        return [on_host[i] for i in ident["ray_tpu_ids"]]

    def _claim_chips(self) -> None:
        ray = self._ray
        actors = self._processes()
        idents = ray.get([a.identity.remote() for a in actors])
        if self.cfg.cluster.emulated is None:
            self.emulated = not all(i["tpu_present"] for i in idents)
        got = [self._chips_for(i) for i in idents]
        for planned, actual, ident in zip(self.planned_chips, got, idents):
            if [c.global_id for c in planned] != [c.global_id for c in actual]:
                raise PlacementError(
                    f"Ray gave pid {ident['pid']} TPU ids {ident['ray_tpu_ids']} but the plan wanted chips "
                    f"{[c.global_id for c in planned]}; another job may hold chips on this host"
                )
        self.reports = ray.get([a.claim.remote(c, i, self.emulated) for a, c, i in zip(actors, got, idents)])
        check_disjoint(self.reports)  # from the actors' own reports: no chip held by two processes

    def _report_compiling(self, wall_s: float) -> None:
        """The "compiling" phase, on its own: seconds per grid cell per sampler, and disk-cache loads."""
        for rank, log in enumerate(self.compile_log):
            cells = ", ".join(f"{r}x{p}x{t} {s:.1f}s{' (cache)' if hit else ''}" for r, p, t, s, hit in log)
            print(f"rltpu: compiling: sampler {rank}: {cells}", file=sys.stderr, flush=True)
        self.compile_summary = {
            "wall_s": wall_s, "programs": sum(len(log) for log in self.compile_log),
            "cache_hits": sum(int(hit) for log in self.compile_log for *_, hit in log),
            "seconds": sum(s for log in self.compile_log for *_, s, _hit in log),
        }

    def _write_placement(self) -> None:
        info = {
            "cluster": self.cluster_info, "emulated": self.emulated, "pod_type": self.table.pod_type,
            "mode": self.cfg.placement.mode, "staleness": self.staleness,
            "chips": self.table.to_rows(), "actors": self.reports, "compile_log": self.compile_log,
            "compiling": self.compile_summary,
        }
        if self.colocated:  # both roles resident in one process: what each process holds, measured
            info["memory"] = self._ray.get([t.memory.remote() for t in self.trainers])
        (self.run_dir / "placement.json").write_text(json.dumps(info, indent=1, default=str))

    # -- one step ------------------------------------------------------------------------------
    def step(self) -> dict:
        if self.staleness:
            return self._step_async()
        t_step = time.perf_counter()
        self._phase = "sample"
        t0 = time.perf_counter()
        gen, rewards, outs, ds = self._sample_scored(self.cfg.sampler.group_size)
        return self._train_and_sync(gen, rewards, outs, ds, t_step, time.perf_counter() - t0)

    # -- async off-policy (placement.staleness = s > 0) -------------------------------------------
    def _step_async(self) -> dict:
        """Step t trains on a rollout the samplers started earlier; before waiting for it, rollouts
        up to step t+s are handed out, so the samplers generate while the trainers train.

        A sampler runs its calls in order, so a rollout submitted after the sync of version v was
        issued is generated by weights >= v. Rollout t+s is submitted once version t-1 is synced:
        trained at step t+s (policy version t+s-1), it lags by at most s versions. The lag is
        measured from the versions the samplers stamp on every row, and checked.
        """
        t_step = time.perf_counter()
        self._phase = "sample"
        last = min(self.step_idx + 1 + self.staleness, self.cfg.trainer.steps)
        while (self._inflight[-1].step if self._inflight else self.step_idx) < last:
            self._submit_rollout(self._inflight[-1].step + 1 if self._inflight else self.step_idx + 1)
        t0 = time.perf_counter()
        ro = self._current = self._inflight.popleft()
        outs = self._collect(ro)
        G = self.cfg.sampler.group_size
        gen = merge_generations(outs, self.tokenizer.pad_id)
        rewards = self._rewards(gen, ro.examples, G)
        lag = self.version - np.asarray(gen["versions"])
        if lag.max() > self.staleness:
            raise RuntimeError(f"rollout for step {ro.step} came from weight version {int(gen['versions'].min())}, "
                               f"{int(lag.max())} behind v{self.version} > placement.staleness={self.staleness}")
        self._drawn = ro.drawn
        ds = {"staleness": int(lag.max()), "staleness_mean": float(lag.mean()),
              "rollouts_in_flight": len(self._inflight)}
        return self._train_and_sync(gen, rewards, outs, ds, t_step, time.perf_counter() - t0)

    def _submit_rollout(self, step: int) -> None:
        """Draw step ``step``'s prompts and hand them to the samplers (returns at once)."""
        cfg, n = self.cfg, self.cfg.trainer.prompts_per_step
        data_before, saved = self.data.state_dict(), self._drawn
        self._submitting, self._drawn = data_before, []  # an interrupt mid-draw still rewinds to here
        examples = self._draw(n)
        drawn, self._drawn = self._drawn, saved
        prompt_ids = [self.data.encode(e, self.tokenizer) for e in examples]
        check_prompt_lengths(prompt_ids, examples, cfg.sampler)
        shards = split_prompts(prompt_ids, len(self.samplers))
        seed = cfg.seed * 1_000_003 + (step - 1) * 131  # what the on-policy loop uses for this step
        G = cfg.sampler.group_size
        refs = {r: (s, s.generate.remote(shards[r], G, seed + r)) for r, s in enumerate(self.samplers)}
        self._inflight.append(Rollout(step, data_before, drawn, examples, shards, seed, refs))
        self._submitting = None

    def _collect(self, ro: Rollout) -> list[dict]:
        """Wait for a submitted rollout; a shard whose sampler died is redone, same seed, on its
        replacement (``_generate``)."""
        return self._generate(ro.shards, self.cfg.sampler.group_size, ro.seed, ro.refs)

    def _untrained_data_state(self) -> dict:
        """The data cursor a resume must restart from: before the oldest rollout not yet trained on,
        so in-flight prompts are drawn again (none lost) and trained ones are not (none replayed)."""
        if self._current is not None:
            return self._current.data_before
        if self._inflight:
            return self._inflight[0].data_before
        return self._submitting or self.data.state_dict()

    def _drop_inflight(self) -> dict:
        """Forget every untrained rollout (after a failure); returns the cursor to rewind to."""
        state = self._untrained_data_state()
        self._inflight.clear()
        self._current = self._submitting = None
        return state

    # -- train, sync, metrics (both modes) ---------------------------------------------------------
    def _train_and_sync(self, gen: dict, rewards: np.ndarray, outs: list[dict], ds: dict, t_step: float,
                        sample_s: float) -> dict:
        ray, cfg = self._ray, self.cfg
        G = cfg.sampler.group_size
        tc = cfg.trainer
        kl = values = None
        if tc.kl_in_reward or tc.algorithm == "ppo":  # passes over the rollout before the advantages
            layout = train_layout(gen)
            parts = split_by_rank(layout, len(self.trainers))
            if tc.kl_in_reward:  # the reference's logprobs: the penalty shapes the advantages
                ref = np.concatenate(ray.get([t.logprobs.remote(b, True) for t, b in zip(self.trainers, parts)]))
                kl = kl_estimate(torch.from_numpy(layout["old_logprobs"]), torch.from_numpy(ref), tc.kl_estimator)
                kl = (kl * torch.from_numpy(layout["loss_mask"])).numpy()
            if tc.algorithm == "ppo":  # the critic's values: GAE needs them
                values = np.concatenate(ray.get([t.values.remote(b) for t, b in zip(self.trainers, parts)]))
        batch = build_train_batch(gen, rewards, G, tc.scale_rewards, estimator=tc.algorithm, kl=kl,
                                  kl_coef=tc.kl_coef, gamma=tc.gamma, values=values,
                                  lam=cfg.critic.gae_lambda if cfg.critic else 1.0)
        t1 = time.perf_counter()
        parts = split_by_rank(batch, len(self.trainers))
        refs = [t.train_step.remote(b) for t, b in zip(self.trainers, parts)]
        self._phase, self.step_idx = "train", self.step_idx + 1  # the update will land even if interrupted
        self._commit_ledger(int(np.min(gen["versions"])))
        self._current = None
        stats = sync = None
        try:
            stats = ray.get(refs)
            train_s = time.perf_counter() - t1
            self.version += 1
            self._phase = "sync"
            sync = self._sync_healing(self.version)  # a dead sampler is replaced and re-joined
        except KeyboardInterrupt:
            # the update lands anyway (the final checkpoint queues behind it on the trainers): count
            # it and log the step, without sync figures, so metrics and checkpoint agree on the step
            if stats is None:
                stats = ray.get(refs)
                train_s = time.perf_counter() - t1
                self.version += 1
            self.interrupted_record = self._record(gen, rewards, outs, ds, batch, kl, stats, None, None,
                                                   t_step, sample_s, train_s)
            raise
        probe = self._probe() if cfg.sync.verify_every and self.step_idx % cfg.sync.verify_every == 0 else None
        return self._record(gen, rewards, outs, ds, batch, kl, stats, sync, probe, t_step, sample_s, train_s)

    def _record(self, gen: dict, rewards: np.ndarray, outs: list[dict], ds: dict, batch: dict, kl, stats: list[dict],
                sync: dict | None, probe: float | None, t_step: float, sample_s: float, train_s: float) -> dict:
        """One ``metrics.jsonl`` line; ``sync`` None for a step interrupted after its update landed."""
        tc = self.cfg.trainer
        sync = sync or dict.fromkeys(("seconds", "bytes", "copied_bytes", "ici_bytes", "dcn_bytes", "zero_copy_frac"))
        tokens = max(sum(s["tokens"] for s in stats), 1)

        def per_token(key: str) -> float:  # per-rank sums -> one mean over the global batch
            return sum(s[key] for s in stats) / tokens

        padded, total = sum(o["padded_slots"] for o in outs), sum(o["total_slots"] for o in outs)
        sampler_busy = sum(o["seconds"] for o in outs) / len(self.samplers)
        if self.colocated and sync["seconds"] is not None:  # both roles resident: what each process holds now
            mem = self._ray.get([t.memory.remote() for t in self.trainers])
            ds = dict(ds, proc_rss_mb=max(m["rss_bytes"] for m in mem) / 2**20,
                      proc_peak_rss_mb=max(m["peak_rss_bytes"] for m in mem) / 2**20)
        return {
            "mode": self.cfg.placement.mode,
            "step": self.step_idx, "weight_version": self.version, "emulated": self.emulated,
            "reward_mean": ds.get("reward_mean_sampled", float(rewards.mean())), "reward_std": float(rewards.std()),
            "kl_in_reward": float(kl.sum() / max(batch["loss_mask"].sum(), 1)) if kl is not None else None,
            **ds, **self._reward_parts,
            "loss": per_token("pg_sum"), "kl": per_token("kl_sum"), "entropy": per_token("entropy_sum"),
            "clip_frac": per_token("clipped"), "logp_gap": per_token("logp_gap_sum"),
            # truncated IS (trainer.off_policy_correction=tis): mean weight, share of tokens at the cap
            "is_weight_mean": per_token("is_weight_sum") if tc.off_policy_correction == "tis" else None,
            "is_truncated_frac": per_token("is_truncated") if tc.off_policy_correction == "tis" else None,
            "grad_norm": stats[0]["grad_norm"], "lr": stats[0]["lr"],
            "micro_batches": stats[0]["micro_batches"],
            "train_padding_frac": sum(s["train_padding_frac"] for s in stats) / len(stats),
            "value_mse": per_token("value_sq_err_sum") if "value_sq_err_sum" in stats[0] else None,
            "value_mean": per_token("value_sum") if "value_sum" in stats[0] else None,
            "response_len": float(gen["lengths"].mean()),
            "sample_s": sample_s, "train_s": train_s, "sync_s": sync["seconds"],
            "step_s": time.perf_counter() - t_step,
            # time each group spent in its own work (mean sampler over its generate calls; slowest
            # trainer rank): with step_s, the share of the step each group sat idle
            "sampler_busy_s": sampler_busy, "trainer_busy_s": max(s["seconds"] for s in stats),
            "new_tokens_per_s": sum(o["new_tokens"] for o in outs) / max(sampler_busy if self.staleness else sample_s,
                                                                         1e-9),
            "compiles": sum(o["compiles"] for o in outs), "compile_s": sum(o["compile_seconds"] for o in outs),
            "sample_program_s": max(o["program_seconds"] for o in outs),
            "sample_host_s": max(o["host_seconds"] for o in outs),
            "padding_frac": padded / max(total, 1),
            "sync_bytes": sync["bytes"], "sync_copied_bytes": sync.get("copied_bytes"), "sync_ici_bytes": sync["ici_bytes"], "sync_dcn_bytes": sync["dcn_bytes"],
            "sync_generation": self.sync_generation, "sampler_weight_versions": list(self.sampler_versions), "sync_zero_copy_frac": sync["zero_copy_frac"], "sampler_versions": sorted({int(v) for v in gen["versions"]}),
            "sync_probe_max_diff": probe, "data_epoch": self.data.cursor.epoch, "data_position": self.data.cursor.position,
        }

    def _sample_scored(self, G: int) -> tuple[dict, np.ndarray, list[dict], dict]:
        """Sample and score ``prompts_per_step`` prompts x G; with ``trainer.dynamic_sampling`` keep
        only groups whose rewards differ (DAPO), sampling more prompts until the batch is full.

        Returns the merged generations, their rewards, the per-sampler outputs (for accounting)
        and dynamic-sampling metrics. If ``max_sample_rounds`` calls do not fill the batch, it is
        topped up with zero-variance groups (zero advantage; counted in ``ds_filler_groups``).
        """
        cfg, n = self.cfg, self.cfg.trainer.prompts_per_step
        done_rounds, outs_all, sampled = [], [], []
        rounds, have, seen = 0, 0, 0
        while have < n and rounds < (cfg.trainer.max_sample_rounds if cfg.trainer.dynamic_sampling else 1):
            examples = self._draw(n)  # next_batch(n), recording prompt ids for the ledger
            prompt_ids = [self.data.encode(e, self.tokenizer) for e in examples]
            check_prompt_lengths(prompt_ids, examples, cfg.sampler)
            shards = split_prompts(prompt_ids, len(self.samplers))
            seed = cfg.seed * 1_000_003 + self.step_idx * 131 + rounds * 7
            outs = self._generate(shards, G, seed)  # s.generate(shard, G, seed + rank); a failed one is redone
            gen = merge_generations(outs, self.tokenizer.pad_id)
            rewards = self._rewards(gen, examples, G)
            outs_all.append(outs)
            sampled.append(rewards)
            rounds, seen = rounds + 1, seen + n
            if not cfg.trainer.dynamic_sampling:
                return gen, rewards, outs, {}
            done_rounds.append((gen, rewards))
            have += len(keep_informative_groups(rewards, G))
        gen, rewards, have, filler = fill_dynamic_batch(done_rounds, n, G, self.tokenizer.pad_id)
        # reward_mean: over everything sampled this step (the policy's real score); the kept batch's
        # mean is biased upward by the filter and is reported beside it
        return gen, rewards, [o for outs in outs_all for o in outs], {
            "ds_rounds": rounds, "ds_prompts_sampled": seen, "ds_informative_groups": have,
            "ds_filler_groups": filler, "reward_mean_trained": float(rewards.mean()),
            "reward_mean_sampled": float(np.concatenate(sampled).mean())}

    def _rewards(self, gen: dict, examples: list[dict], G: int) -> np.ndarray:
        """``task.reward_weight x reward_fn`` plus, with a reward-model group, its scores (rows split
        over the reward actors). Component means go to this step's metrics."""
        rule, _texts = score(gen, examples, G, self.tokenizer, self.reward_fn)
        rm = None
        if self.rewarders:
            layout = train_layout(gen)
            keys = ("tokens", "position_ids", "attention_mask")
            parts = np.array_split(np.arange(len(rule)), len(self.rewarders))
            rm = np.concatenate(self._ray.get([r.score.remote(*(layout[k][idx] for k in keys))
                                               for r, idx in zip(self.rewarders, parts)]))
        self._reward_parts = {"reward_rule_mean": float(rule.mean()),
                              "reward_model_mean": float(rm.mean()) if rm is not None else None}
        return combine_rewards(rule, rm, self.cfg.task.reward_weight, self.cfg.reward_model)

    def _join_sync(self) -> None:
        """Build the next weight-sync generation (standalone gloo groups on trainer 0's store, routed
        by slice). Called at start and after a failed sync, once dead samplers were replaced."""
        if not hasattr(self, "_sync_store"):
            self._sync_store = self._ray.get(self.trainers[0].rendezvous.remote())
            self.sync_generation = 0
            self.sampler_versions = [-1] * len(self.samplers)
        if self.colocated:  # weights pass in-process: no sync fabric to build
            return
        self.sync_generation += 1
        t_sl = [chips[0].slice for chips in self.roles[Role.TRAINER]]
        s_sl = [chips[0].slice for chips in self.roles[Role.SAMPLER]]
        args = lambda p: (*self._sync_store, self.sync_generation, p, t_sl, s_sl, self.cfg.sync.timeout_s)  # noqa: E731
        self._ray.get([a.join_sync.remote(*args(p)) for p, a in enumerate(self.trainers + self.samplers)])

    def _sync(self, version: int) -> dict:
        """Every trainer streams its shards, every sampler stages and publishes atomically; on any
        failure every sampler keeps its previous version (recorded in ``sampler_versions``)."""
        t0 = time.perf_counter()
        if self.colocated:
            return self._publish_local(version, t0)
        refs = [t.push_weights.remote(self.spec, version) for t in self.trainers]
        refs += [s.receive_weights.remote(version) for s in self.samplers]
        try:
            out = self._ray.get(refs)
        except Exception as e:
            from rltpu.sync.collective import WeightSyncError

            alive = []
            for i, s in enumerate(self.samplers):
                try:
                    self.sampler_versions[i] = int(self._ray.get(s.weight_version.remote(), timeout=30))
                    alive.append(i)
                except Exception:  # noqa: BLE001 - a dead sampler: its version is unknown
                    self.sampler_versions[i] = -1
            raise WeightSyncError(
                f"weight sync v{version} failed ({str(e).splitlines()[-1][:300]}); sampler versions now "
                f"{self.sampler_versions} (alive: {alive}); replace dead samplers and call _join_sync()") from e
        sent, received = out[: len(self.trainers)], out[len(self.trainers):]
        self.sampler_versions = [int(r["version"]) for r in received]
        return {"seconds": time.perf_counter() - t0, "bytes": sum(x["bytes"] for x in sent),
                "buckets": sum(x["buckets"] for x in sent),
                "ici_bytes": sum(r["link_bytes"]["ici"] for r in received),
                "dcn_bytes": sum(r["link_bytes"]["dcn"] for r in received),
                "zero_copy_frac": sum(r["zero_copy"] for r in received) / max(sum(r["tensors"] for r in received), 1)}

    def _publish_local(self, version: int, t0: float) -> dict:
        """Colocated: each process hands its trainer's weights to its own sampler engine (with several
        trainer ranks FSDP's all-gather assembles the full tensors first); no sync fabric."""
        out = self._ray.get([t.publish_local.remote(version) for t in self.trainers])
        self.sampler_versions = [int(o["version"]) for o in out]
        # bytes: what crossed between processes (FSDP's all-gather; 0 with one rank); copied: the
        # in-process snapshot the sampler adopts
        return {"seconds": time.perf_counter() - t0, "bytes": sum(o["gathered_bytes"] for o in out),
                "copied_bytes": sum(o.get("copied_bytes", 0) for o in out),
                "buckets": sum(o.get("buckets", 0) for o in out),
                "ici_bytes": sum(o["link_bytes"]["ici"] for o in out),
                "dcn_bytes": sum(o["link_bytes"]["dcn"] for o in out),
                "zero_copy_frac": sum(o["zero_copy"] for o in out) / max(sum(o["tensors"] for o in out), 1)}

    def probe_batch(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A fixed probe from the dataset (synthetic: prompts plus answers; a file: its first
        prompts), cut to what the sampler's grid can hold, right-padded."""
        limit = max(self.cfg.sampler.prompt_buckets) + self.cfg.sampler.max_new_tokens
        rows = [self.tokenizer.encode(text, add_bos=bos)[-limit:] for text, bos in self.data.probe_texts(4)]
        L = max(map(len, rows))
        tokens = np.zeros((len(rows), L), np.int64)
        mask = np.zeros((len(rows), L), np.int64)
        for i, r in enumerate(rows):
            tokens[i, :len(r)], mask[i, :len(r)] = r, 1
        pos = np.maximum(np.cumsum(mask, 1) - 1, 0)
        return tokens, pos, mask

    def _probe(self) -> float:
        """Max |logit diff| between trainer and every sampler on the probe (catches sync bugs)."""
        probe = self.probe
        t_logits = self._ray.get([t.probe_logits.remote(*probe) for t in self.trainers])[0]
        s_logits = self._ray.get([s.sampler_probe_logits.remote(*probe) if self.colocated else
                                  s.probe_logits.remote(*probe) for s in self.samplers])
        mask = probe[2].astype(bool)
        return float(max(np.abs(s[mask] - t_logits[mask]).max() for s in s_logits))

    # -- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self, data_state: dict | None = None) -> str:
        # the cursor sits before any rollout still in flight (async): a resume draws those prompts again
        meta = {"step": self.step_idx, "weight_version": self.version,
                "data": data_state or self._untrained_data_state(), "seed": self.cfg.seed, "config": self.cfg.to_dict(),
                "in_flight_prompts": [p for ro in ([self._current] if self._current else []) + list(self._inflight)
                                      for p in ro.drawn],
                # sampler randomness is a pure function of (seed, step, sampler rank): nothing else to save
                "sampler_seed_rule": "seed * 1000003 + step * 131 + sampler_rank"}
        path = str(self.run_dir / "checkpoint")
        return self._ray.get([t.save_checkpoint.remote(path, meta) for t in self.trainers])[0]

    def _load_checkpoint(self, required: bool = True) -> bool:
        """The newest checkpoint whose files verify (a corrupt one is skipped with a warning); the
        ledger voids any step after it."""
        from learner.checkpoint import latest_valid

        warn = lambda m: print(f"rltpu: warning: {m}", file=sys.stderr, flush=True)  # noqa: E731
        path = latest_valid(self.run_dir / "checkpoint", max(self.cfg.checkpoint.keep_last, 2), warn)
        if path is None:
            if required:
                raise ConfigError(f"--resume: no valid checkpoint in {self.run_dir / 'checkpoint'}[.prev*]; "
                                  f"run without --resume")
            return False
        meta = self._ray.get([t.load_checkpoint.remote(str(path)) for t in self.trainers])[0]
        self.step_idx, self.version = int(meta["step"]), int(meta["weight_version"])
        self.data.load_state_dict(meta["data"])
        self.ledger.rollback(self.step_idx, f"resumed from {path.name} at step {self.step_idx}")
        return True

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> list[dict]:
        cfg = self.cfg
        writer = build_loggers(cfg, self.run_dir, cfg.trainer.steps - self.step_idx)
        records, data_before = [], self.data.state_dict()
        try:
            while self.step_idx < cfg.trainer.steps or not self._saved_final():  # a failed final save rewinds
                data_before, self._phase, step_before = self.data.state_dict(), "idle", self.step_idx
                self._drawn = []
                try:
                    rec = self.step()
                    self._phase = "idle"
                    records.append(rec)
                    writer.write(rec)
                    if cfg.checkpoint.every_steps and self.step_idx % cfg.checkpoint.every_steps == 0:
                        self._phase = "checkpoint"
                        self.save_checkpoint()
                        self._phase = "idle"
                except (HealthError, KeyboardInterrupt):
                    raise
                except Exception as err:  # noqa: BLE001 - an actor died or hung: replace, rewind, redo
                    self._phase = "idle"
                    if self.staleness:  # async: every untrained rollout is redrawn after the recovery
                        data_before, step_before = self._drop_inflight(), self.step_idx
                    self._recover(err, data_before, step_before)
                self._write_trace()
        except KeyboardInterrupt:
            # checkpoint what the trainer really holds: if the interrupted step never reached the
            # trainer, its prompts go back to the data cursor so a resume samples them again
            if self.interrupted_record is not None:  # the step whose update landed mid-interrupt
                writer.write(self.interrupted_record)
            writer.close()
            print(f"\nrltpu: interrupted at step {self.step_idx}; saving checkpoint", flush=True)
            try:
                self.save_checkpoint(self._untrained_data_state() if self.staleness else
                                     data_before if self._phase == "sample" else self.data.state_dict())
            except Exception as err:  # noqa: BLE001 - report and keep the previous checkpoint
                print(f"rltpu: could not write the final checkpoint ({err}); the previous one is kept")
            raise
        writer.close()
        return records

    def shutdown(self, state: str = "finished") -> None:
        self._stop_supervision(state)
        if self._ray is None or not self._ray.is_initialized():
            return
        for a in self._processes():
            try:
                self._ray.get(a.shutdown.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - best effort; the actor is killed next
                pass
            self._ray.kill(a)
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)
        self._ray.shutdown()
        from rltpu.chips.cluster import stop_emulated_nodes

        stop_emulated_nodes()  # the emulated worker nodes this process started, if any
