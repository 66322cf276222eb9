"""The RL job: place chip-owning actor groups, then loop sample -> reward -> train -> sync.

    rltpu train configs/quickstart.yaml

One step (``Controller.step``), on-policy:
  1. the next ``prompts_per_step`` prompts are split over the sampler actors, each draws G
     completions per prompt with its compiled JAX program (weights of version v);
  2. rewards: each sampler's rows go to the CPU reward workers as soon as they arrive
     (``RewardPool``: deadlines, defaults, counters); the advantages of ``trainer.algorithm``'s
     registered estimator (``learner.losses.ESTIMATORS``) are computed here, after the passes it
     declares it needs (reference or own logprobs, the critic's values);
  3. the fixed-shape batch is split by rank over the FSDP2 trainer actors, which take one AdamW
     step (version v+1);
  4. the new weights go to every sampler (``WeightSync``);
  5. one line goes to ``metrics.jsonl`` (``records.step_record``).
A placement mode (``rltpu.control.modes``) owns what differs between placements: the step's
shape (``mode.step``: on-policy, or async where rollouts of steps k+1..k+s are generated while step
k trains), the weight handoff of step 4, and the actor classes; the loop here has no mode branches.

The controller owns its parts and wires them; each is a plain object with its own module:
``Placement`` (chips, placement group, actor handles, ``placement.json``), ``WeightSync``,
``Checkpoints``, ``PromptDraws`` + ``RolloutQueue`` (what was drawn, what is in flight), the
``RewardPool`` (rule rewards), the ``Evaluator`` (held-out eval) and the ``Supervisor`` (health,
fencing, replacement, rewind: it gets the placement and a ``Job`` of callables, not this object).
The placement comes through a factory, so the tests run this loop on in-process fakes
(``tests/fakes.py``). Every remote call is a visible method call on a named actor handle.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from learner.losses import LOSS_AGG_MODES, get_estimator, kl_estimate
from learner.reward_model import combine_rewards
from rltpu.config import ConfigError, RunConfig, save_config
from rltpu.control.batch import (build_train_batch, fill_dynamic_batch, keep_informative_groups, merge_generations,
                                 split_by_rank, split_prompts, train_layout)
from rltpu.control.checkpoints import Checkpoints
from rltpu.control.environments import EnvPool
from rltpu.control.interrupts import INTERRUPTS
from rltpu.control.evaluation import Evaluator
from rltpu.control.modes import PlacementMode, mode_for
from rltpu.control.placement import Placement, form_process_groups
from rltpu.control.records import StepTimes, step_record
from rltpu.control.rewards import (RayRewardWorkers, RewardBatch, RewardFailureError, RewardPool,
                                   decode_completions)
from rltpu.control.rollouts import PromptDraws, RolloutQueue
from rltpu.control.supervisor import Job, Supervisor
from rltpu.data.rewards import load_reward_fn
from rltpu.data.envs.base import load_env_class, make_env
from rltpu.data.sources import build_dataset, build_tokenizer, check_prompt_lengths, resolve_vocab, with_tokenizer_stops
from rltpu.observe.health import HealthError, PhaseTimeout, bounded_get
from rltpu.observe.ledger import Ledger
from rltpu.observe.log import get_logger
from rltpu.observe.loggers import build_loggers, check_loggers
from rltpu.observe.startup import actor_waits, first_step_report, launch_time, report_line
from rltpu.sync.collective import param_spec

logger = get_logger(__name__)


def owned_ray_temp_dir(ray, cfg: RunConfig, address: str | None) -> Path | None:
    """Ray's temp dir when this run made it (an embedded cluster without ``cluster.ray_temp_dir``:
    a fresh ``/tmp/rltpu-ray-*``), to be removed at shutdown; None otherwise (a joined cluster's or
    the user's own directory is never touched)."""
    if address or cfg.cluster.ray_temp_dir:
        return None
    try:
        path = Path(ray._private.worker._global_node.get_temp_dir_path())
    except Exception:  # noqa: BLE001 - Ray internals moved: leave the directory, as before
        return None
    return path if path.name.startswith("rltpu-ray-") and path.parent == Path("/tmp") else None


def control_plane_dead(ray, grace_s: float = 0.0) -> bool:
    """True when a process of the embedded Ray this driver started (GCS, raylet, monitor, dashboard,
    log monitor) has exited (within ``grace_s``: they may be exiting on the same signal as the
    driver). Measured after ``kill -TERM -- -PGID``: the log monitor and dashboard exit at once while
    the GCS lingers half shut down, and every call to it then waits 60 s. A joined cluster's
    processes are not ours to watch: False."""
    deadline = time.time() + grace_s
    while True:
        try:
            procs = ray._private.worker._global_node.all_processes
            dead = any(info.process.poll() is not None for infos in procs.values() for info in infos)
        except Exception:  # noqa: BLE001 - not started here, or Ray internals moved: the normal shutdown
            return False
        if dead or time.time() >= deadline:
            return dead
        time.sleep(0.1)


def kill_local_ray(ray) -> None:
    """SIGKILL what is left of this driver's embedded Ray (its workers fate-share with the raylet)."""
    try:
        ray._private.worker._global_node.kill_all_processes(check_alive=False, allow_graceful=False)
    except Exception:  # noqa: BLE001 - best effort: the process is about to exit
        pass


def remove_ray_temp(path: Path | None) -> None:
    """After ``ray.shutdown``: the run's Ray session files (logs, sockets, spilled objects) go, so
    runs do not pile up ``/tmp/rltpu-ray-*``. Best effort: a straggling Ray process may still write."""
    import shutil

    if path is None:
        return
    for _ in range(3):
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            return
        time.sleep(0.2)


def fabric_warning(host: str, port: int) -> str | None:
    """The line to print when the weight-sync fabric listens on a non-loopback address: torch's
    TCPStore and gloo have no authentication of their own, and Ray's token does not cover them."""
    from rltpu.config import is_loopback

    if is_loopback(host):
        return None
    return (f"rltpu: warning: the weight-sync fabric (torch.distributed TCPStore on {host}:{port}, gloo on ephemeral "
            f"ports) is unauthenticated: any host that reaches {host} can join it, read the weights or send "
            f"tensors (Ray's token does not cover it); run only on a trusted network or firewall these ports")


def check_algorithm(cfg: RunConfig) -> None:
    """``trainer.algorithm`` and ``trainer.loss_agg_mode`` against their registries in
    ``learner.losses`` (one line naming the registered ones); the ``critic:`` section present exactly
    when the estimator declares ``critic`` (the config schema cannot import the registry)."""
    try:
        est = get_estimator(cfg.trainer.algorithm)
    except ValueError as err:
        raise ConfigError(f"trainer.algorithm: {err}") from None
    if est.critic and cfg.critic is None:
        raise ConfigError(f"trainer.algorithm={est.name} needs a value model: add a 'critic:' section "
                          f"(e.g. critic: {{lr: 1e-3}}) or pick a critic-free algorithm (grpo, rloo, ...)")
    if cfg.critic is not None and not est.critic:
        from learner import losses  # the registry as it is now (a test may register one)

        users = ", ".join(name for name, e in losses.ESTIMATORS.items() if e.critic)
        raise ConfigError(f"a 'critic:' section is only used by an algorithm with a value model ({users}), not "
                          f"trainer.algorithm={est.name}; remove it or pick one of those")
    if est.critic and cfg.env is not None:
        raise ConfigError(f"env with trainer.algorithm={est.name} is not supported (its value model's GAE would "
                          f"run across the environment's masked tokens); use grpo, drgrpo, rloo or reinforce_pp")
    mode = cfg.trainer.resolved_loss_agg_mode
    if mode not in LOSS_AGG_MODES:
        raise ConfigError(f"trainer.loss_agg_mode: unknown {mode!r}; allowed: {', '.join(LOSS_AGG_MODES)}")


_CACHE_WARNED: set[str] = set()


def host_fingerprint() -> str:
    """The CPU's architecture and instruction-set flags, hashed: a home directory shared by hosts of
    other CPUs must not hand one host's CPU executables to another (JAX's key names no CPU features)."""
    import hashlib
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith(("flags", "Features"))), [])
    except OSError:
        flags = []
    text = " ".join([platform.machine(), platform.processor(), *sorted(flags)])
    return f"{platform.machine() or 'cpu'}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def user_compile_cache() -> str | None:
    """``$XDG_CACHE_HOME/rltpu/jax/<host>`` (default ``~/.cache/rltpu/jax/<host>``, ``host_fingerprint``),
    made private (0700), or None when it cannot be made or is not private to this user (a symlink,
    another owner, group- or world-writable): the cache holds native executables that the samplers load
    and run, so whoever can write it could run code in them. JAX keys each program by its HLO, compile
    options, devices, XLA flags and jax/jaxlib version, so runs of other models or shapes only add entries."""
    import stat

    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rltpu"
    path = base / "jax" / host_fingerprint()
    try:
        for d in (base, base / "jax", path):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = d.lstat()
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
                why = f"{d} is not a directory owned by this user and writable only by it"
                break
        else:
            return str(path)
    except (OSError, RuntimeError) as err:  # RuntimeError: no home directory
        why = f"{path} cannot be made ({getattr(err, 'strerror', None) or err})"
    if why not in _CACHE_WARNED:
        _CACHE_WARNED.add(why)
        logger.warning(f"rltpu: warning: the shared compile cache is off: {why}; programs are cached in the run "
                       f"directory (set sampler.compile_cache_dir to a private directory)")
    return None


class Controller:
    def __init__(self, cfg: RunConfig, address: str | None = None, resume: bool = False,
                 placement: Callable[[RunConfig, PlacementMode], Placement] = Placement,
                 mode: PlacementMode | None = None):
        """``placement``: builds the chip plan and the actors on it (Ray's placement group; the
        controller tests pass the in-process fakes of ``tests/fakes.py``). ``mode``: the placement
        mode (default: the one ``placement.mode`` / ``placement.staleness`` name)."""
        t_prepare = time.time()  # from the launch to here: "imports" (trace.json, the summary line)
        self.address, self.resume = address or cfg.cluster.address, resume
        self.mode = mode or mode_for(cfg.placement)
        self.run_dir = cfg.resolved_run_dir
        self.placement = placement(cfg, self.mode)  # the chip plan; raises before anything starts
        check_algorithm(cfg)  # trainer.algorithm names a registered estimator whose needs the config meets
        # imported here once so a bad path or keyword fails before Ray starts; the reward workers run it
        load_reward_fn(cfg.task.reward_fn, cfg.task.reward_kwargs)
        if cfg.env is not None:  # a bad path or kwargs fails here, before Ray starts
            make_env(load_env_class(cfg.env.path), cfg.env.kwargs)
        check_loggers(cfg)  # a configured logger's missing package fails before Ray starts
        # the quick checks held: Ray starts in the background while the slow ones below load the
        # tokenizer, the data and the checkpoint headers; one of them failing stops it again
        self.placement.begin_cluster(self.address)
        try:
            self._prepare(cfg)
        except BaseException:
            self.placement.abandon()
            raise
        # trace.json's clock starts at the process's launch: imports and this preparation are its first spans
        self.launched = self.supervisor.t0 = launch_time()
        self.first_step: dict | None = None  # first_step_report, once this process's first step is written
        for name, start, end in (("imports", self.launched, t_prepare), ("prepare", t_prepare, time.time())):
            self.supervisor.spans.append({"actor": "controller", "pid": os.getpid(), "phase": name, "start": start,
                                          "end": end, "step": self.step_idx})

    def abandon(self) -> None:
        """The CLI's checks after construction failed (the run directory is taken): stop the Ray that
        ``__init__`` began starting; nothing else has run."""
        self.placement.abandon()

    def _prepare(self, cfg: RunConfig) -> None:
        """The slow part of construction (the tokenizer, the data, the checkpoint's headers, the
        probe batch), while Ray starts; then the run's state, empty until ``start``."""
        # one factory for both data sources: the built-in task + char tokenizer, or a prompt file +
        # a Hugging Face tokenizer (whose extra EOS ids become sampler stop tokens)
        self.tokenizer = build_tokenizer(cfg)
        self.cfg = cfg = with_tokenizer_stops(cfg, self.tokenizer)
        self.placement.use_tokenizer_stops(cfg)
        self.vocab = resolve_vocab(cfg, self.tokenizer)
        bad = [t for t in cfg.sampler.stop_token_ids if t >= self.vocab]
        if bad:  # an id past the vocabulary never stops a row (or indexes past the logits)
            raise ConfigError(f"sampler.stop_token_ids has {bad[0]}, but the vocabulary has {self.vocab} ids "
                              f"(0..{self.vocab - 1}); remove it or use the tokenizer's id")
        self.rewards: RewardPool | None = None  # the CPU reward workers, started with Ray
        self.envs: EnvPool | None = None  # env: the environment workers (one per sampler), started with Ray
        # held-out evaluation: its file is read and checked here, before any actor starts
        self.evaluator = Evaluator(cfg.eval, cfg.sampler, self.tokenizer, cfg.seed,
                                   episodes=cfg.env is not None) if cfg.eval else None
        self.data = build_dataset(cfg, self.tokenizer)
        if hasattr(self.data, "check_lengths"):  # a prompt file: fail on a too-long row before any actor starts
            st = self.data.check_lengths(self.tokenizer, cfg.sampler)
            logger.info(f"rltpu: dataset {cfg.task.dataset}: {st['rows']} rows, prompt tokens "
                        f"{st['prompt_tokens_min']}/{st['prompt_tokens_mean']:.1f}/{st['prompt_tokens_max']} "
                        f"(min/mean/max)"
                        f"{', ' + str(st['truncated_rows']) + ' truncated' if st['truncated_rows'] else ''}")
        self.spec = param_spec(cfg.model, self.vocab, cfg.trainer.lora)  # LoRA: base + adapters
        if cfg.model.path:  # every tensor's name, shape and byte range, before any actor starts (headers only)
            from rltpu.models.hf.weights import CheckpointDir

            CheckpointDir(cfg.model.path).check(cfg.model, self.vocab)
        self.probe = self.probe_batch()
        self.version, self.step_idx = 0, 0
        self.draws = PromptDraws(self.data, Ledger(self.run_dir / "ledger.jsonl"))
        self.rollouts = RolloutQueue()  # rollouts drawn ahead of their step (async mode)
        self.interrupted_record: dict | None = None  # the metrics of a step interrupted after its update
        self.started = False  # start-up finished: the trainers hold the state this controller knows
        self.writer = None
        self.steps_run = 0  # steps this process ran (metrics.jsonl has every one; memory keeps a window)
        self.recent: deque[dict] = deque(maxlen=max(cfg.trainer.target_window, 5))
        self.data_before: dict | None = None  # the data cursor before the current step drew
        self.handle_signals = False  # the CLI sets it: SIGINT/SIGTERM -> KeyboardInterrupt (INTERRUPTS)
        self.ray = None
        self._ray_temp: Path | None = None  # Ray's session files in a /tmp/rltpu-ray-* this run made
        self.weights = None  # the mode's weight handoff
        self.checkpoints: Checkpoints | None = None
        self.compile_log, self.compile_summary = [], {}
        self._reward_parts: dict = {}
        # health monitor, fencing, replacement, rewind: it gets the placement and what it may ask of this run
        self.supervisor = Supervisor(cfg, self.run_dir, self.placement, Job(
            progress=lambda: (self.step_idx, self.version), build_samplers=self.build_samplers,
            build_trainers=self.build_trainers, rewind=self.rewind_to_checkpoint, redraw=self.draws.rewind,
            reward_health=lambda: self.rewards.health() if self.rewards is not None else None))

    @property
    def emulated(self) -> bool:
        return self.placement.emulated

    @property
    def phase(self) -> str:
        return self.supervisor.phase

    @phase.setter
    def phase(self, name: str) -> None:
        self.supervisor.set_phase(name, self.step_idx)
        if self.handle_signals and name != "checkpoint":
            INTERRUPTS.check()  # a signal whose KeyboardInterrupt was swallowed somewhere stops us here

    # -- start-up ------------------------------------------------------------------------------
    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        save_config(self.cfg, self.run_dir / "config.yaml")
        p = self.placement
        self.phase = "ray_start"  # the start-up phases are trace.json spans (rltpu.observe.startup.STARTUP)
        ray = self.ray = p.start_cluster(self.address)
        self._ray_temp = owned_ray_temp_dir(ray, self.cfg, self.address)
        self._restore_sigterm()
        self._check_interrupt()
        self.phase = "actors"
        p.spawn_all()
        p.claim_all()
        self._check_interrupt()
        self.phase = "rendezvous"
        g = p.groups
        d = self.cfg.health.deadlines
        self.weights = self.mode.handoff(ray, g, p.roles, self.spec, self.cfg.sync.timeout_s, d)
        # --resume PATH: the controller's resume is that checkpoint's path (rltpu.control.checkpoints)
        self.checkpoints = Checkpoints(ray, g, self.cfg, self.run_dir,
                                       source=self.resume if isinstance(self.resume, Path) else None)
        self.supervisor.start(ray, self.weights)
        # CPU-only reward workers: their processes start while the chip actors build
        self.rewards = RewardPool(self.cfg.task, RayRewardWorkers(ray, self.cfg.task), self.run_dir,
                                  startup_s=d.identity,
                                  label=f"env.path {self.cfg.env.path}" if self.cfg.env is not None else None)
        self.rewards.start()
        if self.cfg.env is not None:
            self.envs = EnvPool(ray, self.cfg, len(g.samplers))
            self.envs.start()
        # vLLM's samplers stay out of the default group: vLLM takes an initialized torch.distributed world as
        # its own and would wait for the trainers in it (weight sync has its own groups either way)
        members = g.trainers if self.cfg.sampler.backend == "vllm" else self.mode.process_group_members(g)
        master, port = form_process_groups(ray, g.trainers, members, p.trainer_tp, self.cfg.sync.timeout_s, d,
                                           "start-up")
        warning = fabric_warning(master, port)
        if warning:  # --address or cluster.allow_remote: Ray's token does not cover the sync fabric
            logger.warning(warning)
        self.phase = "build"
        builds = self.build_trainers()
        rm_vocab = bounded_get(ray, [r.build.remote() for r in g.rewarders], "loading", d, "the reward models")
        if rm_vocab and min(rm_vocab) < self.vocab:
            raise ConfigError(f"reward_model {self.cfg.reward_model.path} has vocab_size {min(rm_vocab)} < the "
                              f"policy's {self.vocab}; the reward model must share the policy's tokenizer")
        t_compile = time.perf_counter()
        compiles = builds if self.mode.samplers_built_by_trainers() else self.build_samplers(range(len(g.samplers)))
        bounded_get(ray, builds, "loading", d, "the trainer engines")
        self.compile_log = bounded_get(ray, compiles, "compiling", d, "the sampler programs")
        self._report_compiling(time.perf_counter() - t_compile)
        self._check_interrupt()
        self.phase = "first_sync"
        if self.resume:
            self._load_checkpoint(required=True)
        self.weights.join()
        self.weights.push(self.version)
        extra = {"compile_log": self.compile_log, "compiling": self.compile_summary,
                 "ray_temp_dir": str(self._ray_temp) if self._ray_temp else None} | self.mode.placement_extra(self)
        try:
            p.write(self.run_dir / "placement.json", extra)
        except OSError as err:  # a debug file: its failure is a warning, not the end of the job
            logger.warning(f"rltpu: warning: could not write placement.json ({err.strerror or err})")
        self._check_interrupt()
        self.phase = "idle"
        self.started = True
        self.supervisor.state = "running"

    def _check_interrupt(self) -> None:
        if self.handle_signals:
            INTERRUPTS.check()

    def _restore_sigterm(self) -> None:
        """``ray.init`` installs its own SIGTERM handler (sys.exit); put ours back, so a SIGTERM from
        here on takes the one interrupt path (checkpoint, exit 143)."""
        if self.handle_signals:
            INTERRUPTS.install()

    def _cache_dir(self) -> str | None:
        """The samplers' persistent compile cache: ``sampler.compile_cache_dir``, else the
        ``RLTPU_COMPILE_CACHE_DIR`` environment variable (one cache for many runs, e.g. a test suite),
        else the user's own cache (``user_compile_cache``: a second run of the same shapes loads its
        programs instead of compiling them), else ``<run_dir>/jax_cache``."""
        if not self.cfg.sampler.compile_cache:
            return None
        shared = self.cfg.sampler.compile_cache_dir or os.environ.get("RLTPU_COMPILE_CACHE_DIR") or user_compile_cache()
        return str(Path(shared).resolve()) if shared else str((self.run_dir / "jax_cache").resolve())

    def build_trainers(self) -> list:
        """Start every trainer's engine (and, where the mode says so, its in-process sampler, whose
        compile log the call returns); refs, so the caller can overlap them with other builds."""
        sampler_args = (self.vocab, self.tokenizer.pad_id, self.tokenizer.eos_id, self.spec, self._cache_dir())
        args = self.mode.trainer_build_args(self.vocab, sampler_args)
        return [t.build.remote(*args) for t in self.placement.groups.trainers]

    def build_samplers(self, ranks) -> list:
        """Compile the sampler engines of ``ranks`` (from the JAX disk cache when enabled); refs."""
        samplers = self.placement.groups.samplers
        return [samplers[r].build.remote(self.vocab, self.tokenizer.pad_id, self.tokenizer.eos_id, self.spec,
                                         self._cache_dir()) for r in ranks]

    def _report_compiling(self, wall_s: float) -> None:
        """The "compiling" phase, on its own: seconds per grid cell per sampler, and disk-cache loads."""
        for rank, log in enumerate(self.compile_log):
            cells = ", ".join(f"{r}x{p}x{t} {s:.1f}s{' (cache)' if hit else ''}" for r, p, t, s, hit in log)
            logger.info(f"rltpu: compiling: sampler {rank}: {cells}")
        self.compile_summary = {
            "wall_s": wall_s, "programs": sum(len(log) for log in self.compile_log),
            "cache_hits": sum(int(hit) for log in self.compile_log for *_, hit in log),
            "seconds": sum(s for log in self.compile_log for *_, s, _hit in log),
        }

    # -- one step ------------------------------------------------------------------------------
    def step(self) -> dict:
        """One step in the mode's shape (``rltpu.control.modes``): sample, score, train, sync."""
        return self.mode.step(self)

    def generate(self, shards: list, G: int, seed: int, submitted: dict | None = None, on_shard=None,
                  greedy_eval: bool | None = None) -> list[dict]:
        """Every sampler's shard (seed + rank); a shard whose sampler failed is redone, with the same
        seed, on its replacement. ``submitted``: rank -> (handle, ref) of calls already issued (async
        mode); one made on a process since replaced is redone without another recovery.
        ``on_shard(rank, out)`` runs as each shard arrives (its rewards start while others sample);
        ``greedy_eval`` not None: evaluation rows (``generate_eval``), never trained on."""
        samplers = self.placement.groups.samplers

        def call(r):
            s = samplers[r]
            if self.envs is not None:  # shards of examples: episodes played by the environment workers
                return s, self.envs.run(r, s, shards[r], G, seed + r, greedy_eval)
            if greedy_eval is None:
                return s, s.generate.remote(shards[r], G, seed + r)
            return s, s.generate_eval.remote(shards[r], G, seed + r, greedy_eval)

        outs: list = [None] * len(shards)
        todo = list(range(len(shards)))
        while todo:
            calls = submitted or {r: call(r) for r in todo}
            submitted, errors, stale = None, [], False
            waiting = {ref: r for r, (_handle, ref) in calls.items()}
            while waiting:  # in the order they finish
                ready, _ = self.ray.wait(list(waiting), num_returns=1, timeout=self._wait_s("sampling"))
                if not ready:  # health.enabled=false (or the watchdog itself stuck): never an endless wait
                    raise PhaseTimeout(f"no sampler shard arrived within health.deadlines.sampling="
                                       f"{self.cfg.health.deadlines.sampling:g}s + heartbeat_timeout_s (raise it "
                                       f"for a slow machine)")
                for ref in ready:
                    r = waiting.pop(ref)
                    try:
                        outs[r] = self.ray.get(ref, timeout=self._wait_s("sampling"))  # ready: local already
                    except Exception as err:  # noqa: BLE001
                        errors.append(err)
                        stale |= calls[r][0] is not samplers[r]  # already replaced after an earlier failure
                        continue
                    if on_shard is not None:
                        on_shard(r, outs[r])
            todo = [r for r in todo if outs[r] is None]
            env_replaced = bool(errors) and self.envs is not None and self.envs.replace_dead()
            if errors and not self.supervisor.heal(errors[0]) and not stale and not env_replaced:
                raise errors[0]
        return outs

    def submit_shards(self, shards: list, G: int, seed: int) -> dict:
        """Hand every sampler its shard and return at once: rank -> (handle, ref), for ``generate``."""
        samplers = self.placement.groups.samplers
        return {r: (s, self.envs.run(r, s, shards[r], G, seed + r) if self.envs is not None
                    else s.generate.remote(shards[r], G, seed + r)) for r, s in enumerate(samplers)}

    def get_probe(self, refs, what: str):
        """Wait on probe calls (layouts, memory reports) within ``health.deadlines.probe``."""
        return bounded_get(self.ray, refs, "probe", self.cfg.health.deadlines, what)

    # -- sample and score (on-policy) ---------------------------------------------------------------
    def sample_scored(self, G: int) -> tuple[dict, np.ndarray, list[dict], dict]:
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
            examples = self.draws.draw(n)  # next_batch(n), recording prompt ids for the ledger
            shards = self.shards(examples)
            seed = cfg.seed * 1_000_003 + self.step_idx * 131 + rounds * 7
            scoring = self.scoring(examples, G)  # each shard's rows go to the reward workers as they arrive
            outs = self.generate(shards, G, seed, on_shard=scoring.submit)  # a failed shard is redone
            gen = merge_generations(outs, self.tokenizer.pad_id)
            rewards = self.score(gen, scoring)
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

    def shards(self, examples: list[dict]) -> list[list]:
        """One shard per sampler: prompt ids, or (env) the examples, whose first prompt the
        environment's ``reset`` writes in the environment worker."""
        if self.envs is not None:
            return split_prompts(examples, len(self.placement.groups.samplers))
        prompt_ids = [self.data.encode(e, self.tokenizer) for e in examples]
        check_prompt_lengths(prompt_ids, examples, self.cfg.sampler)
        return split_prompts(prompt_ids, len(self.placement.groups.samplers))

    def scoring(self, examples: list[dict], G: int) -> "_ShardScoring":
        return _ShardScoring(self.rewards, self.tokenizer, split_prompts(examples, len(self.placement.groups.samplers)),
                             G, episodes=self.envs is not None)

    def score(self, gen: dict, scoring: "_ShardScoring") -> np.ndarray:
        """``task.reward_weight x reward_fn`` (from the reward workers; too many failed calls stop the
        job) plus, with a reward-model group, its scores (rows split over the reward actors).
        Component means go to this step's metrics."""
        rule = scoring.collect()
        try:
            self.rewards.check()
        except RewardFailureError as err:
            self.supervisor.state, self.supervisor.error = "failed", str(err)
            raise
        rm = None
        rewarders = self.placement.groups.rewarders
        if rewarders:
            layout = train_layout(gen)
            keys = ("tokens", "position_ids", "attention_mask")
            parts = np.array_split(np.arange(len(rule)), len(rewarders))
            rm = np.concatenate(self._get([r.score.remote(*(layout[k][idx] for k in keys))
                                           for r, idx in zip(rewarders, parts)], "scoring", "the reward models"))
        self._reward_parts = {"reward_rule_mean": float(rule.mean()),
                              "reward_model_mean": float(rm.mean()) if rm is not None else None}
        return combine_rewards(rule, rm, self.cfg.task.reward_weight, self.cfg.reward_model)

    # -- train, sync, metrics (both modes) ---------------------------------------------------------
    def train_and_sync(self, gen: dict, rewards: np.ndarray, outs: list[dict], ds: dict, t_step: float,
                        sample_s: float) -> dict:
        ray, cfg = self.ray, self.cfg
        trainers = self.placement.groups.trainers
        G = cfg.sampler.group_size
        tc = cfg.trainer
        kl = values = ref = old = None
        est = get_estimator(tc.algorithm)  # what it needs is asked for here, before the advantages
        if tc.kl_in_reward or est.reference or est.critic or est.old_logprobs:  # passes over the rollout
            layout = train_layout(gen)
            parts = self._per_trainer(layout)

            def per_row(method: str, *args, what: str) -> np.ndarray:
                refs = [getattr(t, method).remote(b, *args) for t, b in zip(trainers, parts)]
                return np.concatenate(self._per_shard(self._get(refs, "training", what)))

            if est.old_logprobs:  # the trainer's own logprobs of the rollout, before its update
                old = per_row("logprobs", False, what="the policy's logprobs")
                layout["old_logprobs"] = old * layout["loss_mask"]
            if tc.kl_in_reward or est.reference:  # the reference's logprobs
                ref = per_row("logprobs", True, what="the reference logprobs")
            if tc.kl_in_reward:  # the penalty shapes the advantages
                kl = kl_estimate(torch.from_numpy(layout["old_logprobs"]), torch.from_numpy(ref), tc.kl_estimator)
                kl = (kl * torch.from_numpy(layout["loss_mask"])).numpy()
            if est.critic:  # the critic's values (GAE)
                values = per_row("values", what="the critic's values")
        batch = build_train_batch(gen, rewards, G, tc.scale_rewards, estimator=tc.algorithm, kl=kl,
                                  kl_coef=tc.kl_coef, gamma=tc.gamma, values=values,
                                  lam=cfg.critic.gae_lambda if cfg.critic else 1.0,
                                  turn_credit=cfg.env is not None and cfg.env.credit == "turn",
                                  reference_logprobs=ref, old_logprobs=old)
        t1 = time.perf_counter()
        parts = self._per_trainer(batch)
        stats = sync = probe = refs = None
        train_s = 0.0
        try:
            # the batch reaching the trainers, the step count and the ledger line: all or none. A signal
            # during them is raised as the block ends, inside this try: the update is dispatched, so
            # the handler below counts it (a checkpoint of step k holds k updates and has k's line)
            with INTERRUPTS.deferred():
                refs = [t.train_step.remote(b) for t, b in zip(trainers, parts)]
                self.phase, self.step_idx = "train", self.step_idx + 1  # the update will land even if interrupted
                self.draws.commit(self.step_idx, self.version, int(np.min(gen["versions"])))
                self.rollouts.current = None
            stats = self._per_shard(self._get(refs, "training", "the trainers' update"))
            train_s = time.perf_counter() - t1
            self.version += 1
            self.phase = "sync"
            sync = self._sync_healing(self.version)  # a dead sampler is replaced and re-joined
            if cfg.sync.verify_every and self.step_idx % cfg.sync.verify_every == 0:
                self.phase = "probe"
                probe = self.weights.probe(self.probe)
        except KeyboardInterrupt:
            if refs is None:  # raised before the dispatch: nothing reached the trainers
                raise
            # the update lands anyway (the final checkpoint queues behind it on the trainers): count
            # it and log the step with the figures it has (sync/probe may be missing), so metrics
            # and checkpoint agree on the step
            if stats is None:
                stats = self._per_shard(self._get(refs, "training", "the interrupted step's update"))
                train_s = time.perf_counter() - t1
                self.version += 1
            try:
                self.interrupted_record = self._record(gen, rewards, outs, ds, batch, kl, stats, sync, probe,
                                                       StepTimes(t_step, sample_s, train_s))
            except Exception as err:  # noqa: BLE001 - the checkpoint matters more than this line
                logger.warning(f"rltpu: warning: no metrics line for interrupted step {self.step_idx} ({err})")
            raise
        return self._recorded(lambda: self._record(gen, rewards, outs, ds, batch, kl, stats, sync, probe,
                                                   StepTimes(t_step, sample_s, train_s)))

    def _recorded(self, make) -> dict:
        """The landed step's record, built with signals deferred and kept in ``interrupted_record``
        until the loop has written it: a signal between the update and the metrics line (here, at
        the next phase change, during eval) leaves the line to the stop path, so the checkpoint of
        step k and metrics.jsonl agree."""
        with INTERRUPTS.deferred():
            rec = make()
            self.interrupted_record = rec
        return rec

    def _wait_s(self, phase: str) -> float:
        """How long the driver waits on one call of ``phase``: its deadline plus the heartbeat timeout
        (so with health on the watchdog fences a hung actor first); an env shard is up to
        ``env.max_turns`` generate calls."""
        h = self.cfg.health
        turns = self.cfg.env.max_turns if self.cfg.env is not None and phase == "sampling" else 1
        return float(getattr(h.deadlines, phase)) * turns + h.heartbeat_timeout_s

    def _get(self, refs, phase: str, what: str):
        """``ray.get`` on the step path, bounded: a call that hangs with ``health.enabled=false`` ends
        in a one-line ``PhaseTimeout`` instead of waiting forever."""
        return bounded_get(self.ray, refs, phase, self.cfg.health.deadlines, what,
                           slack_s=self._wait_s(phase) - float(getattr(self.cfg.health.deadlines, phase)))

    def _per_trainer(self, batch: dict) -> list[dict]:
        """``split_by_rank`` over the data-parallel groups: the k ranks of a TP group
        (``placement.chips_per_trainer = k``) train on the same rows."""
        k = self.placement.trainer_tp
        parts = split_by_rank(batch, len(self.placement.groups.trainers) // k)
        return [parts[r // k] for r in range(len(parts) * k)]

    def _per_shard(self, results: list) -> list:
        """One result per data-parallel shard (the TP ranks of a group return the same one)."""
        return results[:: self.placement.trainer_tp]

    def _sync_healing(self, version: int) -> dict:
        try:
            return self.weights.push(version)
        except Exception as err:  # noqa: BLE001
            if not self.supervisor.heal(err):
                raise
            return self.weights.push(version)

    def _log_samples(self, gen: dict, rewards: np.ndarray) -> None:
        """``loggers.samples`` rows of this step as text (the first of each of that many prompt
        groups) to ``samples.jsonl``: what the policy writes, what the environment answered, and
        the reward. A debug record: a failed write is a warning."""
        n, G = self.cfg.loggers.samples, self.cfg.sampler.group_size
        rows = range(0, min(n * G, len(rewards)), G)
        tok = self.tokenizer
        out = []
        for r in rows:
            prompt = gen["prompt"][r][gen["prompt_mask"][r] > 0]
            resp = gen["tokens"][r, : gen["lengths"][r]]
            line = {"step": self.step_idx, "row": int(r), "reward": float(rewards[r]),
                    "prompt": tok.decode(prompt, stop_at_eos=False), "response": tok.decode(resp, stop_at_eos=False),
                    "response_tokens": int(len(resp))}
            if "policy_mask" in gen:  # multi-turn: one letter per response token, the policy's or the environment's
                line["turns"] = int(gen["turns"][r])
                line["policy_mask"] = "".join("p" if m else "e" for m in gen["policy_mask"][r, : gen["lengths"][r]])
            out.append(json.dumps(line) + "\n")
        try:
            with open(self.run_dir / "samples.jsonl", "a") as f:
                f.writelines(out)
        except OSError as err:
            logger.warning(f"rltpu: warning: could not write samples.jsonl ({err.strerror or err})")

    def _record(self, gen, rewards, outs, ds, batch, kl, stats, sync, probe, times: StepTimes) -> dict:
        if self.cfg.loggers.samples:
            self._log_samples(gen, rewards)
        ds = dict(ds, **self.mode.record_extra(self, sync))
        return step_record(self.cfg, step=self.step_idx, version=self.version, emulated=self.emulated, gen=gen,
                           rewards=rewards, outs=outs, n_samplers=len(self.placement.groups.samplers), extra=ds,
                           batch=batch, kl=kl, stats=stats, sync=sync, probe=probe, times=times,
                           reward_parts=self._reward_parts | self.rewards.step_metrics(), sync_generation=self.weights.generation,
                           sampler_weight_versions=self.weights.sampler_versions, data_cursor=self.data.cursor)

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

    # -- checkpoints ---------------------------------------------------------------------------
    def _untrained_data_state(self) -> dict:
        return self.rollouts.untrained_data_state(self.data)

    def save_checkpoint(self, data_state: dict | None = None) -> str:
        # the cursor sits before any rollout still in flight (async): a resume draws those prompts again
        return self.checkpoints.save(self.step_idx, self.version, data_state or self._untrained_data_state(),
                                     self.rollouts.prompts_in_flight())

    def _load_checkpoint(self, required: bool) -> bool:
        """The newest checkpoint whose files verify; the ledger voids any step after it."""
        found = self.checkpoints.load_latest(required)
        if found is None:
            return False
        path, meta = found
        self.step_idx, self.version = int(meta["step"]), int(meta["weight_version"])
        self.data.load_state_dict(meta["data"])
        self.draws.ledger.rollback(self.step_idx, f"resumed from {path.name} at step {self.step_idx}")
        return True

    def rewind_to_checkpoint(self) -> None:
        """After a trainer-group restart: back to the newest valid checkpoint, or to step 0."""
        if not self._load_checkpoint(required=False):
            self.step_idx, self.version = 0, 0
            self.data.load_state_dict(self.draws.initial)
            self.draws.ledger.rollback(0, "trainer group restarted with no checkpoint yet")
        self.draws.pending = []

    def _saved_final(self) -> bool:
        """Write the end-of-run checkpoint; False (after recovering) when a trainer failed during it
        and the job was rewound, so the loop runs the lost steps again."""
        try:
            self.phase = "checkpoint"
            self.save_checkpoint()
            return True
        except (HealthError, KeyboardInterrupt):
            raise
        except Exception as err:  # noqa: BLE001
            self.supervisor.recover(err, self.data.state_dict(), self.step_idx)
            return self.step_idx >= self.cfg.trainer.steps and self._saved_final()
        finally:
            self.phase = "idle"

    # -- the loop ------------------------------------------------------------------------------
    def _target_met(self, records: list[dict]) -> bool:
        tc = self.cfg.trainer
        recent = [r["reward_mean"] for r in records[-tc.target_window:]]
        return tc.target_reward is not None and len(recent) >= tc.target_window and \
            sum(recent) / len(recent) >= tc.target_reward

    def _reached_target(self, records: list[dict]) -> bool:
        """``trainer.target_reward``: the mean reward of the last ``target_window`` steps reached it."""
        tc = self.cfg.trainer
        recent = [r["reward_mean"] for r in records[-tc.target_window:]]
        if self._target_met(records):
            logger.info(f"rltpu: trainer.target_reward={tc.target_reward} reached at step {self.step_idx} "
                        f"(last-{tc.target_window} mean {sum(recent) / len(recent):.3f})")
            return True
        return False

    def run(self) -> list[dict]:
        """The step loop; returns the newest records (a window: metrics.jsonl holds every step).
        An interrupt propagates; the caller then runs ``stop_on_interrupt``."""
        cfg = self.cfg
        self.writer = build_loggers(cfg, self.run_dir, cfg.trainer.steps - self.step_idx)
        records = self.recent
        self.data_before = self.data.state_dict()
        while (self.step_idx < cfg.trainer.steps and not self._reached_target(list(records))) \
                or not self._saved_final():  # a failed final save rewinds
            self.data_before, self.phase, step_before = self.data.state_dict(), "idle", self.step_idx
            data_before = self.data_before
            self.draws.pending = []
            self.rewards.begin_step(self.step_idx + 1)  # a redone step counts its reward failures afresh
            try:
                rec = self.step()  # held in interrupted_record until written (_recorded)
                self.phase = "idle"
                rec = self._maybe_eval(rec, list(records))
                with INTERRUPTS.deferred():  # the line and "written" together
                    records.append(rec)
                    self.steps_run += 1
                    self.writer.write(rec)
                    self.interrupted_record = None
                if self.first_step is None:
                    self._report_first_step()
                if self.checkpoints.due(self.step_idx) and self.step_idx < cfg.trainer.steps:  # the last: _saved_final
                    self.phase = "checkpoint"
                    self.save_checkpoint()
                    self.phase = "idle"
            except (HealthError, KeyboardInterrupt):
                raise
            except Exception as err:  # noqa: BLE001 - an actor died or hung: replace, rewind, redo
                self.interrupted_record = None  # a rewind redoes the step; its line comes then
                self.phase = "idle"
                data_before, step_before = self.mode.failed_step_cursor(self, data_before, step_before)
                self.supervisor.recover(err, data_before, step_before)
            self.supervisor.maybe_write_trace()  # throttled; a failed write is a warning
        self._close_writer()
        return list(records)

    def _report_first_step(self) -> None:
        """This process's first step, written: its time from the launch by phase (the summary line),
        and trace.json written now so the start-up is on disk before the run goes on."""
        sup = self.supervisor
        actor_spans = []
        if sup.watch is not None:
            with sup.watch.lock:
                actor_spans = list(sup.watch.spans)
        self.first_step = first_step_report(list(sup.spans), actor_spans, self.launched, time.time(), self.step_idx)
        try:
            sup.write_trace()
        except OSError:  # a debug file: maybe_write_trace warns about a failed write
            pass

    def first_step_line(self) -> str | None:
        """The summary line's part on the first step (``rltpu.observe.startup.report_line``); the
        actors' compile and load spans that had not arrived at the first step are read again."""
        rep, watch = self.first_step, self.supervisor.watch
        if rep is None:
            return None
        if watch is not None and None in rep["actors_s"].values():
            with watch.lock:
                spans = list(watch.spans)
            rep["actors_s"] = {k: v if v is not None else actor_waits(spans, rep["step_start"])[k]
                               for k, v in rep["actors_s"].items()}
        return report_line(rep)

    # -- held-out evaluation (eval:) -----------------------------------------------------------------
    def _maybe_eval(self, rec: dict, records: list[dict]) -> dict:
        """After a step whose number is a multiple of ``eval.every_steps``, or the last one: the
        ``eval/*`` metrics join the step's record. A failure is a warning (training goes on); an
        interrupt keeps the step's record for the stop path."""
        ev = self.evaluator
        last = self.step_idx >= self.cfg.trainer.steps or self._target_met(records + [rec])
        if ev is None or not ev.due(self.step_idx, last):
            return rec
        try:
            self.phase = "eval"
            return rec | ev.run(self._eval_generate, self._eval_score, self.step_idx)
        except KeyboardInterrupt:
            self.interrupted_record = rec
            raise
        except HealthError:
            raise
        except Exception as err:  # noqa: BLE001 - evaluation must not cost the run
            logger.warning(f"rltpu: warning: evaluation at step {self.step_idx} failed ({type(err).__name__}: "
                           f"{str(err).strip().splitlines()[0][:200] if str(err).strip() else ''}); training goes on")
            return rec
        finally:
            self.phase = "idle"

    def _eval_generate(self, prompt_ids: list[list[int]], n: int, greedy: bool, seed: int) -> dict:
        """Evaluation prompts over the samplers, at most the largest batch bucket of rows per call."""
        samplers = self.placement.groups.samplers
        per_call = max(min(max(self.cfg.sampler.batch_buckets) // n, -(-len(prompt_ids) // len(samplers))), 1)
        pieces = [prompt_ids[i:i + per_call] for i in range(0, len(prompt_ids), per_call)]
        outs = []
        for i in range(0, len(pieces), len(samplers)):
            outs += self.generate(pieces[i:i + len(samplers)], n, seed + 1009 * i, greedy_eval=greedy)
        gen = merge_generations(outs, self.tokenizer.pad_id)
        if self.envs is not None:  # episodes arrive scored
            gen["rewards"] = np.concatenate([o["rewards"] for o in outs])
            gen["reward_kinds"] = [k for o in outs for k in o["reward_kinds"]]
        return gen

    def _eval_score(self, gen: dict, examples: list[dict]) -> tuple[np.ndarray, int]:
        """Scored by the reward workers like training rows, but not counted against the step
        (episodes: their returns, failed environment calls counted as failures)."""
        if "rewards" in gen:
            return gen["rewards"], sum(k != "ok" for k in gen["reward_kinds"])
        batch = self.rewards.submit(decode_completions(gen, self.tokenizer), examples)
        values = self.rewards.collect(batch, count=False)
        return values, sum(k != "ok" for k in batch.kinds)

    def stop_on_interrupt(self) -> str:
        """The one interrupt path (SIGINT or SIGTERM, any phase, progress display on or off): save a
        checkpoint of what the trainers really hold, log an interrupted step's line, close the
        loggers. Each part is guarded, so a failure in one (a display, a full disk) never skips the
        checkpoint. Returns the rest of the one line the CLI prints."""
        if not self.started or self.checkpoints is None:
            self._close_writer()
            kept = any((self.run_dir / d / "trainer_state.json").exists() for d in ("checkpoint", "checkpoint.prev"))
            where = self.phase if self.ray or self.phase == "ray_start" else "before Ray"
            return (f"during start-up ({where}); nothing trained in this run"
                    + (f"; the checkpoint in {self.run_dir} is kept (--resume)" if kept else
                       f"; run again (--resume also starts from step 0 here)"))
        phase = self.phase
        saved = None
        try:
            # the cursor: if the interrupted step never reached the trainers its prompts go back, so
            # a resume samples them again (async: before every untrained rollout)
            data_state = self.mode.interrupt_cursor(self, phase)
            self.phase = "checkpoint"
            self.save_checkpoint(data_state)
            saved = self.step_idx
        except Exception as err:  # noqa: BLE001 - report and keep the previous checkpoint
            why = f"could not write the checkpoint ({type(err).__name__}: {str(err).strip().splitlines()[0][:160] if str(err).strip() else ''}); the previous one is kept"
        if self.interrupted_record is not None:  # the step whose update landed mid-interrupt
            try:
                self.writer.write(self.interrupted_record) if self.writer else None
            except Exception:  # noqa: BLE001
                pass
            self.interrupted_record = None
        self._close_writer()
        if saved is None:
            return f"at step {self.step_idx} (in {phase}); {why}"
        return f"at step {saved} (in {phase}); checkpoint in {self.run_dir / 'checkpoint'} (continue with --resume)"

    def _close_writer(self) -> None:
        if self.writer is not None:
            try:
                self.writer.close()
            except Exception:  # noqa: BLE001 - a logger's close must not cost the checkpoint's line
                pass
            self.writer = None

    def shutdown(self, state: str = "finished") -> None:
        self._close_writer()  # a failed run's loggers too (the CLI ends the process without exit hooks)
        self.supervisor.stop(state)
        if self.rewards is not None:
            self.rewards.shutdown()
        if self.envs is not None:
            self.envs.shutdown()
        if self.ray is not None and control_plane_dead(self.ray, grace_s=0.2 if state == "stopped" else 0.0):
            # a signal to the whole process group (timeout, a scheduler's cancel, kill -- -PGID) stops the
            # embedded GCS and raylet too: every call placement.shutdown makes would then wait Ray's 60 s
            # for them and end the driver with exit 1. The checkpoint is written: stop what is left here.
            logger.warning("rltpu: Ray's own processes were stopped too (a signal to the whole process group?); not "
                           "waiting for them")
            kill_local_ray(self.ray)
        else:
            self.placement.shutdown()
        remove_ray_temp(self._ray_temp)


class _ShardScoring:
    """One sampling round's rule rewards: each sampler shard's rows are submitted to the pool the
    moment the shard arrives (``submit``, the ``on_shard`` hook); ``collect`` returns them in the
    merged (rank) order. A shard redone after a sampler failure simply replaces its batch."""

    def __init__(self, pool: RewardPool, tokenizer, example_shards: list[list[dict]], G: int, episodes: bool = False):
        self.pool, self.tokenizer, self.example_shards, self.G = pool, tokenizer, example_shards, G
        self.episodes = episodes  # env: the rows arrive scored (episode returns and failure kinds)
        self.batches: dict[int, RewardBatch] = {}

    def submit(self, rank: int, out: dict) -> None:
        exs = self.example_shards[rank]
        if self.episodes:
            rows = [exs[i // self.G] for i in range(len(out["rewards"]))]
            self.batches[rank] = self.pool.record(out["rewards"], out["reward_kinds"], out["reward_details"], rows)
            return
        texts = decode_completions(out, self.tokenizer)
        self.batches[rank] = self.pool.submit(texts, [exs[i // self.G] for i in range(len(texts))])

    def collect(self) -> np.ndarray:
        return np.concatenate([self.pool.collect(self.batches[r]) for r in sorted(self.batches)])
