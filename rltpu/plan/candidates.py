"""Placement candidates for one config, each costed, checked against the mesh, and ranked.

Candidates (all over the chips of ``cluster``):
* disaggregated: k sampler chips / n-k trainer chips, sampler tensor parallelism = chips per
  sampler process, trainer FSDP over its processes x TP over the chips of each process;
* async: the same splits, one step off-policy (sampling overlaps training);
* colocated: one process per chip group holds both roles; both footprints stay resident (a TPU
  has no "sleep mode" to free HBM), FSDP over every chip, sampler TP inside each process;
plus the placement the config asks for, marked ``as_configured``. Each mode is the object ``rltpu train``
runs it with (``rltpu.control.modes``): whether its processes hold both roles, its step time from the
phase times, what config it refuses, how ``placement:`` writes it. Chips come from
``rltpu.chips.topology.assign_roles``, the same function ``rltpu train`` places actors with (costed
from its per-host counts, ``place_counts``, so a 6,144-chip slice stays cheap). The
reference model and critic live with the trainer (FSDP-sharded); a reward model is tried on both.
Two separate verdicts per candidate: ``feasible`` (it fits in memory, nothing else) and ``runnable``
(``rltpu train`` can run it on this backend: process sizes it implements, a model that splits, and
on real chips what TorchTPU/libtpu accept, ``backend_refusal``). Real-chip limits apply only when the
chips are real (``ChipTable.emulated`` is False, decided as ``rltpu train`` decides it); on emulated
chips they are kept as a note of what a real slice would refuse.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from rltpu.config import ConfigError, PlacementConfig, RunConfig
from rltpu.control.modes import PlacementMode, mode_for, planned_modes
from rltpu.plan import costmodel as cm
from rltpu.plan.continuous import EngineGrid
from rltpu.plan.hardware import Hardware
from rltpu.chips.launch import check_real_counts
from rltpu.chips.topology import (ChipTable, Role, aligned_blocks, assign_roles, place_counts,
                                  unimplemented_parallelism)

PLANNED = planned_modes()  # name -> the mode object (rltpu.control.modes)
MODES = tuple(PLANNED)  # disaggregated, async, colocated
RUNNABLE_MODES = MODES  # `rltpu train` runs all three (placement.mode, placement.staleness)


@dataclass
class Candidate:
    mode: str  # a name in MODES; ``placement_mode`` is its object
    sampler_chips: int
    trainer_chips: int
    chips_per_sampler: int
    chips_per_trainer: int
    reward_on: str | None = None
    as_configured: bool = False
    checkpointing: bool = False
    feasible: bool = True
    reason: str = ""
    memory: dict = field(default_factory=dict)  # role -> {item: bytes per chip}
    capacity: float = 0.0
    phases: cm.Phases | None = None
    route: list = field(default_factory=list)
    warnings: list = field(default_factory=list)
    sampler_tp: int = 1
    trainer_fsdp: int = 1
    trainer_tp: int = 1
    micro_rows: float = 0.0  # trainer rows per forward/backward (< the shard: gradient accumulation)
    slots: int = 0  # continuous engine: decode slots per sampler (the config's, or halved until it fits)
    kv_pages: int = 0  # continuous engine: pages of its KV pool (without the null page)
    split_refusal: str = ""  # the model does not split over chips_per_* (heads / kv heads / MLP width)
    backend_refusal: str = ""  # what TorchTPU/libtpu refuse on real chips of this generation ("" = nothing)
    real_chips: bool = True  # the chips are real, so backend_refusal makes it not runnable
    _ranks: list | None = field(default=None, repr=False, compare=False)
    _where: tuple | None = field(default=None, repr=False, compare=False)  # (cfg, table) it was costed on

    @property
    def placement_mode(self) -> PlacementMode:
        return PLANNED[self.mode]

    @property
    def ranks(self) -> list[dict]:
        """Rank -> chip rows (role, rank, slice, host, chips, coords), laid out by ``assign_roles`` on
        first read: on a 6,144-chip slice only the candidates a report shows pay for one."""
        if self._ranks is None:
            if self._where is None:  # never placed (assign_roles refused it)
                return []
            self._ranks = rank_table(self, *actor_chips(self, *self._where))
        return self._ranks

    @property
    def name(self) -> str:
        if self.placement_mode.shares_processes:
            base = f"{self.mode} {self.sampler_chips} chips, {self.chips_per_sampler}/process"
        else:
            base = (f"{self.mode} {self.sampler_chips}S(tp{self.chips_per_sampler}) + "
                    f"{self.trainer_chips}T(fsdp{self.trainer_fsdp}xtp{self.chips_per_trainer})")
        return base + (f", RM on {self.reward_on}" if self.reward_on else "")

    @property
    def not_runnable(self) -> str:
        """Why `rltpu train` refuses it on this backend ("" when it runs): every mode runs (async as
        placement.staleness=1), with the process sizes ``rltpu train`` accepts
        (``rltpu.chips.topology.unimplemented_parallelism``, the same check), a model that splits over
        them, and on real chips what the TPU runtimes accept. Memory is ``feasible``'s business."""
        if self.mode not in RUNNABLE_MODES:
            return f"placement mode {self.mode} is not run by rltpu train"
        return unimplemented_parallelism(self.chips_per_sampler, self.chips_per_trainer, full=False,
                                         mode=self.placement_mode.written()["mode"]) \
            or self.split_refusal or (self.backend_refusal if self.real_chips else "")

    @property
    def runnable(self) -> bool:
        """Whether `rltpu train` can run it. A TP candidate (k chips per process) is still costed
        and reported, as what tensor parallelism would give, but never wins nor is written."""
        return not self.not_runnable

    def peak_bytes(self) -> dict[str, float]:
        return {role: sum(items.values()) for role, items in self.memory.items()}


def _bucket(rows: int, buckets: tuple[int, ...]) -> int:
    """The compiled program's row count: the smallest batch bucket that holds ``rows``."""
    return next((b for b in buckets if b >= rows), rows)


@dataclass
class Layout:
    """What the cost model needs from a candidate's chips: actor counts and where they sit."""
    n_s: int
    n_t: int
    sampler_slices: Counter  # slice -> sampler actors on it
    trainer_slices: list  # the slice of each trainer actor
    trainer_hosts: dict  # (slice, host) -> trainer chips on it
    busiest_host: int  # most sampler + trainer chips in use on one host
    tp_crossing: list  # actors whose chips span hosts (assign_roles forbids it; a guard)


def _placement(c: Candidate, cfg: RunConfig) -> PlacementConfig:
    keep = {k: getattr(cfg.placement, k) for k in ("reward_chips", "chips_per_reward", "reward_chip_ids")
            if hasattr(cfg.placement, k)}  # a reward-model group keeps its chips
    return PlacementConfig(
        sampler_chips=c.sampler_chips, trainer_chips=c.trainer_chips, chips_per_sampler=c.chips_per_sampler,
        chips_per_trainer=c.chips_per_trainer,
        sampler_chip_ids=cfg.placement.sampler_chip_ids if c.as_configured else None,
        trainer_chip_ids=cfg.placement.trainer_chip_ids if c.as_configured else None, **keep)


def actor_chips(c: Candidate, cfg: RunConfig, table: ChipTable) -> tuple[list, list]:
    """(sampler actors, trainer actors), each a list of its chips, as ``rltpu train`` places them."""
    if c.placement_mode.shares_processes:
        per = c.chips_per_sampler  # aligned blocks of each host, in host order (as assign_roles does)
        samplers = [table.chips_on(*h)[i:i + per] for h in table.hosts()
                    for i in range(0, len(table.chips_on(*h)) - per + 1, per)][: c.sampler_chips // per]
        return samplers, samplers  # the same processes hold both roles
    roles = assign_roles(table, _placement(c, cfg))
    return roles[Role.SAMPLER], roles[Role.TRAINER]


def rank_table(c: Candidate, samplers: list, trainers: list) -> list[dict]:
    shared = c.placement_mode.shares_processes
    out = []
    for role, actors in ((Role.SAMPLER, samplers), (Role.TRAINER, [] if shared else trainers)):
        for rank, chips in enumerate(actors):
            out.append({"role": "sampler+trainer" if shared else role.value, "rank": rank,
                        "slice": chips[0].slice, "host": chips[0].host,
                        "chips": [ch.global_id for ch in chips], "coords": [list(ch.coords) for ch in chips]})
    return out


def _layout_detailed(c: Candidate, samplers: list, trainers: list) -> Layout:
    shared = c.placement_mode.shares_processes
    used = Counter((ch.slice, ch.host) for chs in (samplers if shared else samplers + trainers) for ch in chs)
    return Layout(
        n_s=len(samplers), n_t=len(trainers), sampler_slices=Counter(chips[0].slice for chips in samplers),
        trainer_slices=[chips[0].slice for chips in trainers],
        trainer_hosts=Counter((ch.slice, ch.host) for chips in trainers for ch in chips),
        busiest_host=max(used.values(), default=1),
        tp_crossing=[[ch.global_id for ch in chips] for chips in samplers + trainers
                     if len({(ch.slice, ch.host) for ch in chips}) > 1])


def _layout_counts(c: Candidate, cfg: RunConfig, table: ChipTable) -> Layout:
    """The same Layout from ``place_counts`` (runs of hosts): no per-chip objects, so a candidate on
    a 6,144-chip slice costs about as much as one on 16 chips."""
    hosts = table.hosts()
    if c.placement_mode.shares_processes:
        s_runs = t_runs = aligned_blocks(table, c.chips_per_sampler, c.sampler_chips // c.chips_per_sampler)
        cps = cpt = c.chips_per_sampler
    else:
        runs = place_counts(table, _placement(c, cfg))
        s_runs, t_runs = runs[Role.SAMPLER], runs[Role.TRAINER]
        cps, cpt = c.chips_per_sampler, c.chips_per_trainer
    s_slices: Counter = Counter()
    used: Counter = Counter()
    for first, n, a in s_runs:
        for i in range(first, first + n):
            s_slices[hosts[i][0]] += a
            used[i] += a * cps
    t_slices, t_hosts = [], {}
    for first, n, a in t_runs:
        for i in range(first, first + n):
            t_slices += [hosts[i][0]] * a
            t_hosts[hosts[i]] = t_hosts.get(hosts[i], 0) + a * cpt
            if not c.placement_mode.shares_processes:
                used[i] += a * cpt
    return Layout(n_s=sum(s_slices.values()), n_t=len(t_slices), sampler_slices=s_slices, trainer_slices=t_slices,
                  trainer_hosts=t_hosts, busiest_host=max(used.values(), default=1), tp_crossing=[])


def _pinned(cfg: RunConfig, c: Candidate) -> bool:
    p = cfg.placement
    return getattr(p, "reward_chip_ids", None) is not None or (
        c.as_configured and (p.sampler_chip_ids is not None or p.trainer_chip_ids is not None))


def split_refusal(m: cm.ModelShape, sampler_tp: int, trainer_tp: int) -> str:
    """Why the runtime would refuse to split this model over the candidate's chips ("" when it can):
    the sampler mesh needs heads and MLP width divisible by k (``rltpu.sampling.tp.plan``), the
    trainer's TP group also kv heads (``rltpu.models.tp_plan.tp_problem``)."""
    for role, k, dims in (("sampler", sampler_tp, (("num_attention_heads", m.heads), ("intermediate_size", m.inter))),
                          ("trainer", trainer_tp, (("num_attention_heads", m.heads),
                                                   ("num_key_value_heads", m.kv_heads),
                                                   ("intermediate_size", m.inter)))):
        for what, n in dims:
            if k > 1 and n % k:
                return f"chips_per_{role}={k}: model {what}={n} does not divide by {k}"
    return ""


def evaluate(c: Candidate, cfg: RunConfig, table: ChipTable, hw: Hardware, m: cm.ModelShape,
             w: cm.Workload, detailed: bool = False) -> Candidate:
    """Fill in memory, feasibility, phases, route and warnings. Costs come from actor counts per
    host (``place_counts``); ``detailed`` (and pinned chip ids) lays out every chip with
    ``assign_roles`` instead and keeps the rank -> chip table. Both give the same figures
    (tests/test_plan_scale.py); the rank table is otherwise built when first read (``ranks``)."""
    shared = c.placement_mode.shares_processes
    if detailed or _pinned(cfg, c):
        samplers, trainers = actor_chips(c, cfg, table)
        lay = _layout_detailed(c, samplers, trainers)
        c._ranks = rank_table(c, samplers, trainers)
    else:
        lay = _layout_counts(c, cfg, table)
    c._where = (cfg, table)
    n_s, n_t = lay.n_s, lay.n_t
    fsdp_chips = c.sampler_chips if shared else c.trainer_chips
    c.sampler_tp, c.trainer_fsdp = c.chips_per_sampler, n_t
    c.trainer_tp = c.chips_per_sampler if shared else c.chips_per_trainer
    c.split_refusal = split_refusal(m, c.sampler_tp, c.trainer_tp)

    # -- memory per chip
    continuous = w.engine == "continuous" and w.grid is not None
    rows_s = -(-w.rows // n_s) if continuous else _bucket(-(-w.rows // n_s), cfg.sampler.batch_buckets)
    rows_t = w.rows / n_t

    def tmem(ckpt: bool, micro_rows: float) -> dict:
        out = cm.trainer_memory(m, w, fsdp_chips, micro_rows * w.seq / c.trainer_tp, ckpt)
        if c.reward_on == "trainer":
            out["reward_model"] = w.reward_params * m.bytes / fsdp_chips
        return out

    def sampler_mem(grid) -> dict:
        out = cm.sampler_memory(m, w, c.chips_per_sampler, rows_s, grid)
        if c.reward_on != "sampler":
            out.pop("reward_model", None)
        return out

    if hw.emulated:  # emulated chips share the host's RAM
        c.capacity = hw.hbm_bytes / lay.busiest_host
    else:
        c.capacity = hw.hbm_bytes
    reserve = {"runtime": hw.runtime_reserve_bytes}
    grid = w.grid
    if continuous and not c.as_configured:  # the config's slots, halved until the sampler fits beside the rest
        beside = reserve["runtime"] + (sum(tmem(True, 1.0).values()) if shared else 0.0)
        while grid.slots > 1 and sum(sampler_mem(grid).values()) + beside > c.capacity:
            grid = EngineGrid.from_config(cfg.sampler, slots=grid.slots // 2)
    smem = sampler_mem(grid)
    if continuous:
        c.slots, c.kv_pages = grid.slots, grid.pages - 1
    extra = sum(smem.values()) if shared else 0.0  # shared processes: the sampler stays resident too
    # the cheapest way to fit: whole shard, then checkpointing, then halving the micro-batch
    micro = rows_t
    choice = None
    if c.as_configured:  # the trainer settings the config asks for, not a search
        ckpt = bool(getattr(cfg.trainer, "activation_checkpointing", False))
        mbt = getattr(cfg.trainer, "micro_batch_tokens", 0)
        micro = min(rows_t, max(1.0, mbt // w.seq)) if mbt else rows_t
        choice = (ckpt, micro, tmem(ckpt, micro))
    while choice is None:
        for ckpt in (False, True):
            t = tmem(ckpt, micro)
            if sum(t.values()) + extra + reserve["runtime"] <= c.capacity:
                choice = (ckpt, micro, t)
                break
        if choice is None:
            if micro <= 1:
                choice = (True, micro, tmem(True, micro))  # does not fit: report the smallest footprint
            else:
                micro = max(1.0, math.ceil(micro / 2))
    c.checkpointing, c.micro_rows, trainer_mem = choice
    if c.micro_rows < rows_t:
        c.warnings.append(f"trainer micro-batches of {c.micro_rows:g} rows (gradient accumulation over "
                          f"{math.ceil(rows_t / c.micro_rows)}: trainer.micro_batch_tokens={int(c.micro_rows * w.seq)})")
    if shared:
        c.memory = {"sampler+trainer": {**{f"sampler {k}": v for k, v in smem.items()},
                                        **{f"trainer {k}": v for k, v in trainer_mem.items()}, **reserve}}
    else:
        c.memory = {"sampler": {**smem, **reserve}, "trainer": {**trainer_mem, **reserve}}
    over = [(role, tot) for role, tot in c.peak_bytes().items() if tot > c.capacity]
    if over:
        role, tot = over[0]
        items = c.memory[role]
        top = sorted(items.items(), key=lambda kv: -kv[1])[:3]
        what = "colocated footprint" if shared else f"{role} shard"
        c.feasible = False
        c.reason = (f"{what} {cm.fmt_bytes(tot)} > {cm.fmt_bytes(c.capacity)} "
                    f"{'RAM per emulated chip' if hw.emulated else 'HBM'} on {hw.name} "
                    f"(largest: {', '.join(f'{k} {cm.fmt_bytes(v)}' for k, v in top)}"
                    f"{'; even with activation checkpointing and 1-row micro-batches' if role != 'sampler' else ''}"
                    f"{f'; continuous engine at sampler.slots={c.slots}, kv_pages={c.kv_pages}' if continuous and role != 'trainer' else ''})")

    # -- mesh mapping: high-traffic dims on ICI inside a slice, DCN only between slices
    t_slices, s_slices = lay.trainer_slices, lay.sampler_slices
    fsdp_link = "ICI" if len(set(t_slices)) <= 1 else "DCN"
    if fsdp_link == "DCN":
        c.warnings.append(
            f"trainer FSDP dimension spans slices {sorted(set(t_slices))}: its all-gathers and reduce-scatters "
            f"(3x the weights per step) would cross DCN; keep trainer chips inside one slice")
    for ids in lay.tp_crossing:
        c.warnings.append(f"an actor's tensor-parallel dimension crosses hosts at chips {ids}")

    # -- time
    oversub_s = max(1.0, n_s / hw.cpu["cores"]) if hw.emulated else 1.0  # emulated chips share cores
    oversub_t = max(1.0, n_t / hw.cpu["cores"]) if hw.emulated else 1.0
    waves = None
    if continuous:
        sample, waves = cm.continuous_sample_seconds(hw, m, w, c.chips_per_sampler, rows_s, n_s, grid)
    else:
        sample = cm.sample_seconds(hw, m, w, c.chips_per_sampler, rows_s, n_samplers=n_s)
    if c.reward_on == "trainer" and "reward_model" in sample:
        sample.pop("reward_model")
    train = cm.train_seconds(hw, m, w, n_t, c.trainer_tp, rows_t, c.checkpointing, fsdp_link,
                             n_micro=math.ceil(rows_t / c.micro_rows))
    if c.reward_on == "trainer" and w.reward_params:
        peak = hw.gemm_flops(m.hidden) if hw.emulated else hw.peak_flops * hw.prefill_mfu * c.trainer_tp
        train["reward_model"] = 2 * w.reward_params * rows_t * w.seq / peak
    hosts_per_slice = max(1, math.ceil(table.chips_per_slice / table.chips_per_host))
    c.route = cm.sync_route(hw, m, w, n_t, t_slices, dict(s_slices), n_s, shared, hosts_per_slice)
    # what TorchTPU/libtpu cannot run on real chips (docs/tpu.md): a backend limit, not memory, so it
    # never touches ``feasible``; it stops the candidate only where the chips are real
    c.real_chips = not table.emulated
    try:
        # trainer TP runs one process per chip (rltpu.chips.topology.trainer_processes)
        check_real_counts(table.generation, lay.trainer_hosts, table.chips_per_host,
                          c.placement_mode.written()["mode"])
    except ConfigError as e:
        c.backend_refusal = str(e)
    sample_s = sum(sample.values()) * oversub_s
    train_s = sum(train.values()) * oversub_t
    sync_s = sum(h.seconds for h in c.route)
    host_s = w.rows * cm.host_s_per_row(hw)
    if c.reward_on == "own chips" and w.reward_params:  # the reward group scores every completion
        rate = hw.gemm_flops(m.hidden) if hw.emulated else hw.peak_flops * hw.prefill_mfu
        host_s += 2 * w.reward_params * w.rows * w.seq / (rate * max(1, w.reward_chips))
    if continuous:  # its prefill programs (prompts per call x prefill length) and decode chunks (one per slot bucket)
        n_cells = len(grid.prefill_rows) * len(grid.prefill_lens) + len(grid.slot_buckets)
    else:
        n_cells = len(cfg.sampler.batch_buckets) * len(cfg.sampler.prompt_buckets) * len(cfg.sampler.new_tokens_grid)
    chips = table.num_chips
    c.phases = cm.Phases(
        sample=sample_s, host=host_s, train=train_s, sync=sync_s,
        step=c.placement_mode.step_seconds(sample_s, host_s, train_s, sync_s,
                                           cores=hw.cpu["cores"] if hw.emulated else None, n_samplers=n_s,
                                           n_trainers=n_t),
        compile=cm.compile_seconds(hw, m, n_cells, 2 if not hw.emulated else 0),
        detail={"sample": sample, "train": train, "oversubscription": {"sample": oversub_s, "train": oversub_t},
                "rows_per_sampler_program": rows_s, "rows_per_trainer": rows_t,
                **({"engine": engine_detail(m, grid, waves, c.chips_per_sampler)} if waves else {})},
    )
    c.phases.tokens_per_s_per_chip = w.tokens / c.phases.step / chips if c.phases.step > 0 else 0.0
    # generated tokens per second per sampler chip, while sampling
    c.phases.detail["sampler_tokens_per_s_per_chip"] = (w.rows * w.mean_new_tokens / sample_s / c.sampler_chips
                                                        if sample_s > 0 else 0.0)
    return c


def engine_detail(m: cm.ModelShape, grid: EngineGrid, v, tp: int) -> dict:
    """The continuous engine of one sampler, for the report: slots, pool, waves."""
    ways = math.gcd(m.kv_heads, tp)
    return {"slots": grid.slots, "page_size": grid.page_size, "kv_pages": grid.pages - 1,
            "kv_pool_bytes_per_chip": grid.pool_bytes(m.kv_bytes_per_token) / ways,
            "pool_rows": v.pool_rows, "concurrent_rows": v.concurrent, "waves": v.waves,
            "decode_steps": v.decode_steps, "chunks": v.chunks, "slot_bucket": v.slot_bucket,
            "slot_steps": v.slot_steps, "prefill_calls": v.prefill_calls, "attended_tokens": grid.attended_tokens}


def enumerate_candidates(cfg: RunConfig, table: ChipTable) -> list[Candidate]:
    n, cph = table.num_chips - getattr(cfg.placement, "reward_chips", 0), table.chips_per_host
    sizes = [s for s in (1, 2, 4, 8) if s <= cph]
    w_rows = cfg.trainer.prompts_per_step * cfg.sampler.group_size
    if getattr(cfg.placement, "reward_chips", 0):
        rm_places = ["own chips"]  # the reward-model group of placement.reward_chips
    else:
        rm_places = ["sampler", "trainer"] if cfg.planner.reward_model_params else [None]
    out: list[Candidate] = []
    split = [m.name for m in PLANNED.values() if not m.shares_processes and not m.refusal(cfg)]
    shared = [m.name for m in PLANNED.values() if m.shares_processes and not m.refusal(cfg)]

    def ok_split(n_s: int, n_t: int) -> bool:
        return cfg.trainer.prompts_per_step % n_s == 0 and w_rows % n_t == 0

    step = 1 if n <= 32 else cph
    for cps in sizes:
        for cpt in sizes:
            for k in range(cps, n, cps):
                if k % step and k != cps:
                    continue
                tch = (n - k) // cpt * cpt
                if tch < cpt or not ok_split(k // cps, tch // cpt):
                    continue
                for rm in rm_places:
                    for mode in split:  # each mode that runs with this config (PlacementMode.refusal)
                        out.append(Candidate(mode, k, tch, cps, cpt, reward_on=rm))
    reward_group = getattr(cfg.placement, "reward_chips", 0)
    for cpp in sizes if not reward_group else ():  # colocation would overlap the reward group's chips
        if n % cpp == 0 and ok_split(n // cpp, n // cpp):
            for rm in rm_places:
                out.extend(Candidate(mode, n, n, cpp, cpp, reward_on=rm) for mode in shared)
    p = cfg.placement
    mode = mode_for(p).name
    mine = [c for c in out if c.mode == mode and
            (c.sampler_chips, c.trainer_chips, c.chips_per_sampler, c.chips_per_trainer) ==
            (p.sampler_chips, p.trainer_chips, p.chips_per_sampler, p.chips_per_trainer)]
    if mine and p.sampler_chip_ids is None and p.trainer_chip_ids is None:
        for c in mine:
            c.as_configured = True
    else:
        out.insert(0, Candidate(mode, p.sampler_chips, p.trainer_chips, p.chips_per_sampler,
                                p.chips_per_trainer, reward_on=rm_places[0], as_configured=True))
    return out


def rank(cands: list[Candidate]) -> list[Candidate]:
    """Fits and runnable first, fastest step first; then ones that fit but `rltpu train` refuses here
    (tensor-parallel layouts, or what the real chips' runtimes refuse: shown, never the winner); ones
    that do not fit in memory keep their reason, after them, the nearest miss (peak / capacity) first."""
    def key(c: Candidate):
        if c.feasible:
            return (0 if c.runnable else 1, c.phases.step)
        over = max(c.peak_bytes().values()) / c.capacity if c.memory and c.capacity else float("inf")
        return (2, over)  # the nearest miss first

    return sorted(cands, key=key)


def evaluate_all(cfg: RunConfig, table: ChipTable, hw: Hardware, m: cm.ModelShape, w: cm.Workload,
                 detailed: bool = False) -> list[Candidate]:
    out = []
    for c in enumerate_candidates(cfg, table):
        try:
            out.append(evaluate(c, cfg, table, hw, m, w, detailed))
        except ConfigError as err:  # assign_roles cannot place it on these hosts
            if c.as_configured:
                raise
            c.feasible, c.reason = False, str(err)
            out.append(c)
    return rank(out)
