"""Where every actor runs: the chip plan, one placement-group bundle per actor, the chip claims
checked against the plan, and ``placement.json``.

The plan (``assign_roles``) is made before Ray starts, so a placement that cannot exist fails
before anything is spawned; Ray's own assignment is then checked against it chip by chip.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from rltpu.chips.cluster import ClusterStart, PlacementError, start_or_join
from rltpu.chips.topology import (ChipTable, Role, assign_roles, check_disjoint, trainer_processes,
                                  unimplemented_parallelism)
from rltpu.config import ConfigError, RunConfig, sections_of
from rltpu.observe.health import bounded_get


def actor_env(cfg: RunConfig) -> dict[str, str]:
    """Env fixed at process start. JAX_PLATFORMS and libtpu's vars are set later by ``claim``
    (``rltpu.chips.backend``), before the engine imports JAX."""
    # no RAY_AUTH_MODE here: workers inherit the cluster's own auth settings (a token-protected
    # cluster's workers must keep token mode)
    return {"OMP_NUM_THREADS": str(cfg.backend.threads),
            # no device backend at ``import torch``: a real chip's process imports torch_tpu itself
            "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}


def form_process_groups(ray, trainers: list, members: list, trainer_tp: int, timeout_s: float, deadlines,
                        what: str) -> tuple[str, int]:
    """The trainers' rendezvous: trainer 0 picks the address, every member joins the default process
    group (the trainer ranks first, forming their own group; TP groups of ``trainer_tp`` ranks).
    At start-up and after a trainer-group restart; returns trainer 0's (host, port)."""
    master, port = bounded_get(ray, trainers[0].rendezvous.remote(), "rendezvous", deadlines,
                               f"{what}: trainer 0's address")
    bounded_get(ray, [a.init_process_groups.remote(master, port, len(members), r, len(trainers), timeout_s, trainer_tp)
                      for r, a in enumerate(members)], "rendezvous", deadlines, f"{what}: the process groups")
    return master, port


class ActorGroups:
    """The chip-owning actor handles by role, keyed ``"<role>-<rank>"`` for health and fencing.

    ``shared`` (a mode whose processes run both engines): the samplers *are* the trainer processes
    (the same list, so a replaced trainer is the replaced sampler) and are keyed once, as trainers.
    """

    def __init__(self, shared: bool):
        self.shared = shared
        self.trainers: list = []
        self.samplers: list = []
        self.rewarders: list = []

    def group(self, role: Role) -> list:
        return {Role.TRAINER: self.trainers, Role.SAMPLER: self.samplers, Role.REWARD: self.rewarders}[role]

    def keys(self) -> dict[str, tuple[Role, int]]:
        groups = [(Role.TRAINER, self.trainers), (Role.SAMPLER, self.samplers), (Role.REWARD, self.rewarders)]
        if self.shared:
            groups.pop(1)
        return {f"{role.value}-{r}": (role, r) for role, group in groups for r in range(len(group))}

    def handle(self, key: str):
        role, rank = self.keys()[key]
        return self.group(role)[rank]

    def processes(self) -> list:
        """Every chip-owning actor once (shared processes are both trainer and sampler)."""
        return self.trainers + ([] if self.shared else self.samplers) + self.rewarders


class Placement:
    """The chip table and role plan, the Ray cluster, the placement group and the actors on it."""

    def __init__(self, cfg: RunConfig, mode=None):
        """``mode``: the placement mode (``rltpu.control.modes``): which actor class runs each role."""
        from rltpu.control.modes import mode_for

        self.cfg = cfg
        self.mode = mode or mode_for(cfg.placement)
        self.colocated = self.mode.shares_processes
        self.table = ChipTable.build(cfg.cluster)
        problem = unimplemented_parallelism(cfg.placement.chips_per_sampler, cfg.placement.chips_per_trainer,
                                            mode=cfg.placement.mode)
        if problem:  # one line, exit 2: k chips per process that would leave k - 1 idle
            raise ConfigError(problem)
        self.roles = assign_roles(self.table, cfg.placement)  # raises before anything starts
        # trainer tensor parallelism: TorchTPU runs one process per chip, so each block of k chips
        # becomes k trainer processes, one TP group (ranks j*k .. j*k+k-1), dp = trainer chips / k
        self.trainer_tp = self.mode.trainer_tp()
        if self.trainer_tp > 1:
            from rltpu.models.tp_plan import tp_problem

            problem = tp_problem(cfg.model, self.trainer_tp)
            if problem:
                raise ConfigError(problem)
            self.roles[Role.TRAINER] = trainer_processes(self.roles[Role.TRAINER])
        self.groups = ActorGroups(self.colocated)
        self.emulated = self.table.emulated  # refined from the actors' own view of their nodes
        self.cluster_info: dict = {}
        self.reports: list[dict] = []  # each actor's claim report, in ``groups.processes()`` order
        self.slice_names: list[str] | None = None
        self.pg = None
        self.bundles: dict = {}  # (role, rank) -> (bundle index, chips): a replacement reuses them
        self.planned_chips: list = []
        self.launch_envs: list[dict[str, str]] | None = None  # real chips: TorchTPU's, per trainer rank
        self.ray = None
        self._starting: ClusterStart | None = None  # begin_cluster's background start

    def use_tokenizer_stops(self, cfg: RunConfig) -> None:
        """``cfg`` = this plan's config plus the tokenizer's extra stop ids (``with_tokenizer_stops``),
        for the ``sampler`` section each actor gets: they are known only once the tokenizer has
        loaded, which happens while Ray starts (``begin_cluster``). Anything else differing is a bug."""
        same_stops = cfg.sampler.model_copy(update={"stop_token_ids": self.cfg.sampler.stop_token_ids})
        if cfg.model_copy(update={"sampler": same_stops}) != self.cfg:
            raise ValueError("use_tokenizer_stops: the config differs in more than sampler.stop_token_ids")
        self.cfg = cfg

    def begin_cluster(self, address: str | None) -> None:
        """Start Ray in the background (``ClusterStart``) while the caller prepares; ``start_cluster``
        takes it over, ``abandon`` stops it if the caller fails first."""
        self._starting = ClusterStart(self.cfg.cluster, self.table, self._needed_chips(), address,
                                      self.cfg.resolved_run_dir)

    def _needed_chips(self) -> int:
        return sum(len(chips) for groups in self.roles.values() for chips in groups)

    def abandon(self) -> None:
        """A check failed after ``begin_cluster``: wait for Ray's start and stop what it started."""
        starting, self._starting = self._starting, None
        if starting is not None:
            starting.abandon()

    def start_cluster(self, address: str | None):
        """Start an embedded Ray with the chips emulated, or join ``address`` (or wait for the start
        ``begin_cluster`` began); returns ``ray``."""
        starting = self._starting
        if starting is not None:
            self.cluster_info = starting.result()  # (kept: its thread is released at shutdown)
        else:
            self.cluster_info = start_or_join(self.cfg.cluster, self.table, self._needed_chips(), address,
                                              self.cfg.resolved_run_dir)
        import ray

        self.ray = ray
        if self.cluster_info["mode"] == "joined" and not self.table.emulated:
            self._check_hosts_from_ray()
        self.slice_names = self._slice_names()
        return ray

    def _check_hosts_from_ray(self) -> None:
        """A joined TPU cluster: the hosts the plan assumed from ``cluster.topology`` must be the hosts Ray
        reports (labels and ``TPU`` resources of each node); one line naming the difference, else."""
        real = ChipTable.from_ray_nodes(self.cfg.cluster, self.ray.nodes())
        diff = self.table.same_layout(real)
        if diff:
            raise ConfigError(f"cluster.topology={self.cfg.cluster.topology} lays out hosts unlike the Ray cluster's "
                              f"TPU nodes ({diff}); fix cluster.* to match the slice")

    def _slice_names(self) -> list[str] | None:
        """Slice index -> the ``ray.io/tpu-slice-name`` label of its nodes, or None if unlabelled.

        Embedded clusters use the chip table's names; a joined cluster's slices are whatever its
        TPU VMs are called, taken in sorted order.
        """
        nodes = [n for n in self.ray.nodes() if n["Alive"]]
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

    def spawn_all(self) -> None:
        """One placement group, one bundle per actor, bundles in chip order on each host.

        Ray hands a bundle's TPU ids in bundle order on a fresh node, so ordering bundles by the
        planned chips makes Ray's assignment equal the plan; ``claim_all`` checks that it did.
        Chips the plan skips are covered by idle filler bundles so the order still lines up.
        """
        from ray.util.placement_group import placement_group

        classes = self.mode.actor_classes()
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
            self.ray.get(pg.ready(), timeout=120)
        except self.ray.exceptions.GetTimeoutError:
            raise PlacementError(
                f"Ray could not reserve {sum(b['TPU'] for b in bundles)} TPU chips in 120 s "
                f"(cluster has {self.cluster_info.get('tpu_chips')}); are other jobs holding chips?"
            ) from None
        actors = {Role.TRAINER: {}, Role.SAMPLER: {}, Role.REWARD: {}}
        self.pg, self.bundles = pg, {}
        for bundle, role, rank, chips in slots:
            self.bundles[(role, rank)] = (bundle, chips)
            actors[role][rank] = self.new_actor(role, rank)
            expected[(role, rank)] = chips
        g = self.groups
        g.trainers = [actors[Role.TRAINER][r] for r in range(len(actors[Role.TRAINER]))]
        g.samplers = [actors[Role.SAMPLER][r] for r in range(len(actors[Role.SAMPLER]))]
        g.rewarders = [actors[Role.REWARD][r] for r in range(len(actors[Role.REWARD]))]
        if self.colocated:  # the same handles (one list: a replaced trainer is the replaced sampler)
            g.samplers = g.trainers
        self.planned_chips = [expected[(Role.TRAINER, r)] for r in range(len(g.trainers))] + \
                             [expected[(Role.SAMPLER, r)] for r in range(len(actors[Role.SAMPLER]))] + \
                             [expected[(Role.REWARD, r)] for r in range(len(g.rewarders))]

    def new_actor(self, role: Role, rank: int, incarnation: int = 0):
        """Start ``role`` ``rank``'s process on its placement-group bundle (its chips)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle, chips = self.bundles[(role, rank)]
        cls = self.mode.actor_classes()[role]
        return self.ray.remote(cls).options(
            name=f"rltpu-{role.value}-{rank}-{os.getpid()}" + (f"-{incarnation}" if incarnation else ""),
            num_cpus=0, resources={"TPU": len(chips)},
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle),
            runtime_env={"env_vars": actor_env(self.cfg)},
        ).remote(rank, sections_of(self.cfg, cls.SECTIONS))  # only the parts it reads, as JSON data

    def chips_for(self, ident: dict) -> list:
        """Map Ray's assignment (node, TPU ids) to chip-table entries."""
        labels = next((n.get("Labels", {}) for n in self.ray.nodes() if n["NodeID"] == ident["node_id"]), {})
        host = int(labels.get("ray.io/tpu-worker-id", 0))
        slice_name = labels.get("ray.io/tpu-slice-name")
        sl = self.slice_names.index(slice_name) if self.slice_names and slice_name in self.slice_names else 0
        on_host = {c.index: c for c in self.table.chips_on(sl, host)}
        missing = [i for i in ident["ray_tpu_ids"] if i not in on_host]
        if missing:
            raise RuntimeError(f"Ray assigned TPU ids {missing} that the chip table has no entry for on host {host}")
        return [on_host[i] for i in ident["ray_tpu_ids"]]

    def claim_all(self) -> None:
        """Every actor proves which chips Ray gave it; they must be the planned ones, held by no other."""
        ray = self.ray
        actors = self.groups.processes()
        d = self.cfg.health.deadlines
        idents = bounded_get(ray, [a.identity.remote() for a in actors], "identity", d, "the actors' identity reports")
        if self.cfg.cluster.emulated is None:
            self.emulated = not all(i["tpu_present"] for i in idents)
        got = [self.chips_for(i) for i in idents]
        for planned, actual, ident in zip(self.planned_chips, got, idents):
            if [c.global_id for c in planned] != [c.global_id for c in actual]:
                raise PlacementError(
                    f"Ray gave pid {ident['pid']} TPU ids {ident['ray_tpu_ids']} but the plan wanted chips "
                    f"{[c.global_id for c in planned]}; another job may hold chips on this host"
                )
        self.launch_envs = self._launch_envs(got, idents) if not self.emulated else None
        self.reports = bounded_get(ray, [a.claim.remote(c, i, self.emulated, *self._launch_arg(Role.TRAINER, k))
                                         if k < len(self.groups.trainers) else a.claim.remote(c, i, self.emulated)
                                         for k, (a, c, i) in enumerate(zip(actors, got, idents))],
                                   "claim", d, "the actors' chip claims")
        check_disjoint(self.reports)  # from the actors' own reports: no chip held by two processes

    def _launch_envs(self, got: list, idents: list) -> list[dict[str, str]]:
        """Real chips: each trainer rank's TorchTPU launch variables, computed once for the whole
        group as ``set_tpu_launch_env`` would (same addresses and topology on every rank). Raises
        ConfigError (exit 2) for a group TorchTPU cannot run."""
        from rltpu.chips.launch import launch_env_for_group

        n_t = len(self.groups.trainers)
        hostnames = {(chips[0].slice, chips[0].host): ident["node_ip"] for chips, ident in zip(got[:n_t], idents[:n_t])}
        first = self.groups.trainers[0]

        def on_the_tpu_host(n: int) -> list[int]:  # single host: ports free where the trainers run
            return bounded_get(self.ray, first.free_ports.remote(n), "claim", self.cfg.health.deadlines,
                               "trainer 0's free slice-builder ports")

        return launch_env_for_group(self.cfg.cluster.generation, self.roles[Role.TRAINER], hostnames,
                                    pick_ports=on_the_tpu_host)

    def _launch_arg(self, role: Role, rank: int) -> list:
        """The extra ``claim`` argument of a trainer on real chips (a replacement reuses its rank's)."""
        return [self.launch_envs[rank]] if role == Role.TRAINER and self.launch_envs else []

    def replace(self, role: Role, rank: int, incarnation: int):
        """A new process for ``role`` ``rank`` on its old bundle (same chips, checked, claimed)."""
        from rltpu.observe.health import HealthError

        ray, key = self.ray, f"{role.value}-{rank}"
        try:
            ray.kill(self.groups.group(role)[rank], no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        new = self.new_actor(role, rank, incarnation)
        d = self.cfg.health.deadlines
        ident = bounded_get(ray, new.identity.remote(), "identity", d, f"{key}'s replacement identity")
        chips = self.chips_for(ident)
        planned = self.bundles[(role, rank)][1]
        if [c.global_id for c in chips] != [c.global_id for c in planned]:
            raise HealthError(f"replacement for {key} got chips {[c.global_id for c in chips]}, not its own "
                              f"{[c.global_id for c in planned]}; another job took them")
        report = bounded_get(ray, new.claim.remote(chips, ident, self.emulated, *self._launch_arg(role, rank)),
                             "claim", d, f"{key}'s replacement claim")
        self.groups.group(role)[rank] = new
        self.reports = [report if (r["group"], r["rank"]) == (role.value, rank) else r for r in self.reports]
        return new

    def write(self, path: Path, extra: dict) -> None:
        """``placement.json``: the cluster, the chip map, each actor's own report, plus ``extra``."""
        info = {"cluster": self.cluster_info, "emulated": self.emulated, "pod_type": self.table.pod_type,
                "mode": self.cfg.placement.mode, "staleness": self.cfg.placement.staleness,
                "chips": self.table.to_rows(), "actors": self.reports, **extra}
        path.write_text(json.dumps(info, indent=1, default=str))

    def shutdown(self) -> None:
        """Stop every actor (a last ``shutdown`` call each, then kill), release the chips, stop Ray."""
        try:
            self._shutdown()
        finally:
            starting, self._starting = self._starting, None
            if starting is not None and self.ray is None:
                # stopped (a signal, a failed check) before start_cluster took the start over: wait for
                # it and stop what it started, its /tmp/rltpu-ray-* included
                starting.abandon()
            elif starting is not None:  # Ray is down: its starting thread may end
                starting.release()

    def _shutdown(self) -> None:
        ray = self.ray
        if ray is None or not ray.is_initialized():
            return
        for a in self.groups.processes():
            try:
                ray.get(a.shutdown.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - best effort; the actor is killed next
                pass
            ray.kill(a)
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)
        _shutdown_keeping_signal_handlers(ray)
        from rltpu.chips.cluster import stop_emulated_nodes

        stop_emulated_nodes()  # the emulated worker nodes this process started, if any


def _shutdown_keeping_signal_handlers(ray) -> None:
    """``ray.shutdown()``, with the driver's signal handlers put back as soon as its core worker has
    disconnected: that puts SIGTERM's C-level action back to the default while Python still shows
    ours, and the rest of the shutdown (stopping the embedded cluster's processes, about a second)
    was a window where a SIGTERM killed the driver with no line (exit -15). Measured with the CLI:
    SIGTERM 1-2 s after the last step."""
    from rltpu.control.interrupts import INTERRUPTS

    node = getattr(getattr(getattr(ray, "_private", None), "worker", None), "_global_node", None)
    real = getattr(node, "kill_all_processes", None)
    if real is not None:
        def kill_all_processes(*args, **kwargs):
            INTERRUPTS.reassert()
            return real(*args, **kwargs)

        node.kill_all_processes = kill_all_processes
    try:
        ray.shutdown()
    finally:
        INTERRUPTS.reassert()
