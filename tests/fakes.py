"""An in-process stand-in for Ray and the chip-owning actors, so the controller runs without Ray.

``FakeRay`` has the slice of Ray's API the controller and its parts call (``get``, ``wait``,
``kill``, ``remote(cls).options(...).remote(...)``, ``exceptions``); a method call on a handle
runs at once in the caller's thread and its ref holds the result or the error. ``FakeActors``
is the actor group (``FakePlacement`` hands it to the controller): trainers that keep a small
weight vector and write real checkpoints, samplers over ``rltpu.sampling.fake.FakeBackend``,
weights passed through a shared dict; reward workers (keyed ``reward-worker-<slot>``), the health
monitor and the heartbeats are the real classes, in-process. ``fail(key, at)`` kills an actor when ``at`` is next called on it,
``hang(key, at)`` leaves that call unanswered with its heartbeat stuck in the phase, so the real
watchdog fences it.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np

from rltpu.chips.topology import Role
from rltpu.control.placement import Placement
from rltpu.observe.health import Heartbeat
from rltpu.sampling.fake import FakeBackend


class ActorDied(RuntimeError):
    """What a call on a dead actor raises (Ray: ``ActorDiedError``)."""


class GetTimeoutError(TimeoutError):
    pass


class FakeRef:
    def __init__(self):
        self.done = threading.Event()
        self.value = self.error = None

    def set(self, value=None, error: BaseException | None = None) -> "FakeRef":
        self.value, self.error = value, error
        self.done.set()
        return self


PHASES = {"generate": "sampling", "generate_eval": "sampling", "train_step": "training", "logprobs": "training",
          "values": "training", "push_weights": "syncing", "receive_weights": "syncing", "publish_local": "syncing",
          "save_checkpoint": "checkpointing", "load_checkpoint": "loading", "build": "compiling"}


class FakeHandle:
    def __init__(self, obj, key: str | None = None):
        self._obj, self._key = obj, key
        self._lock = threading.Lock()
        self._pending: list[FakeRef] = []
        self.dead: str | None = None
        self.hung = False
        self.fail_at: dict[str, int] = {}  # method -> calls that still succeed before the process dies
        self.hang_at: dict[str, int] = {}

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return SimpleNamespace(remote=lambda *a, **k: self._call(name, a, k))

    def _call(self, name: str, args, kwargs) -> FakeRef:
        ref = FakeRef()
        if self.dead:
            return ref.set(error=ActorDied(f"{self._key}: the actor died ({self.dead})"))
        if self._due(self.fail_at, name):
            self.die(f"failed in {name} (test)")
            return ref.set(error=ActorDied(f"{self._key}: the actor died in {name}"))
        if self.hung or self._due(self.hang_at, name):
            if not self.hung:  # the process stops answering; its heartbeat thread goes on, stuck in the phase
                self.hung = True
                hb = getattr(self._obj, "hb", None)
                if hb is not None:
                    hb.phase_name, hb.phase_since = PHASES.get(name, "sampling"), time.time() - 1e6
            self._pending.append(ref)
            return ref
        with self._lock:
            try:
                return ref.set(getattr(self._obj, name)(*args, **kwargs))
            except Exception as err:  # noqa: BLE001 - the caller's get raises it, as Ray's would
                return ref.set(error=err)

    @staticmethod
    def _due(plan: dict[str, int], name: str) -> bool:
        if name not in plan:
            return False
        plan[name] -= 1
        return plan[name] < 0

    def die(self, why: str) -> None:
        self.dead = why
        hb = getattr(self._obj, "hb", None)
        if hb is not None:
            hb.stop()
        for ref in self._pending:
            ref.set(error=ActorDied(f"{self._key}: the actor died ({why})"))
        self._pending = []


class FakeRay:
    """The calls the controller makes on the ``ray`` module."""

    exceptions = SimpleNamespace(GetTimeoutError=GetTimeoutError, RayActorError=ActorDied)

    def __init__(self, on_spawn=None):
        """``on_spawn(handle)``: told of every actor ``remote(cls)`` starts (the reward workers)."""
        self.killed: list[str] = []
        self.on_spawn = on_spawn

    def is_initialized(self) -> bool:
        return True

    def remote(self, cls):
        ray = self

        class _Class:
            def options(self, **_kw):
                return self

            def remote(self, *args, **kwargs):
                handle = FakeHandle(cls(*args, **kwargs), key=cls.__name__)
                if ray.on_spawn is not None:
                    ray.on_spawn(handle)
                return handle

        return _Class()

    def get(self, refs, timeout: float | None = None):
        single = isinstance(refs, FakeRef)
        end = None if timeout is None else time.monotonic() + timeout
        out = []
        for ref in [refs] if single else refs:
            if not ref.done.wait(None if end is None else max(end - time.monotonic(), 0)):
                raise GetTimeoutError(f"ray.get timed out after {timeout}s")
            if ref.error is not None:
                raise ref.error
            out.append(ref.value)
        return out[0] if single else out

    def wait(self, refs, num_returns: int = 1, timeout: float | None = None):
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            ready = [r for r in refs if r.done.is_set()][:num_returns]
            if len(ready) >= num_returns or (end is not None and time.monotonic() >= end):
                return ready, [r for r in refs if r not in ready]
            time.sleep(0.002)

    def kill(self, handle, no_restart: bool = True) -> None:
        if isinstance(handle, FakeHandle) and not handle.dead:
            self.killed.append(handle._key)
            handle.die("killed")


class _FakeHeartbeat(Heartbeat):
    def report(self) -> dict:  # pid 0: the supervisor never signals a real process (this one)
        return super().report() | {"pid": 0, "host": "fake-host"}


def fake_logits(params: dict | None, tokens, vocab: int) -> np.ndarray:
    """Logits that depend only on the weights: the sync probe sees whether both sides hold the same."""
    return FakeBackend(vocab, 0, 1, 1).probe_logits(tokens, None, None) if not params else \
        np.full((*np.shape(tokens), vocab), float(sum(np.asarray(v, np.float64).sum() for v in params.values())),
                np.float32)


class FakeTrainer:
    """One trainer rank: a weight vector moved by each batch's advantages, real checkpoint files."""

    def __init__(self, actors: "FakeActors", rank: int, colocated: bool):
        self.actors, self.rank, self.colocated = actors, rank, colocated
        self.w = np.zeros(4, np.float32)
        self.step = 0
        self.sampler: FakeBackend | None = None
        self.hb = _FakeHeartbeat("trainer", rank, lambda: {"step": self.step, "version": self.step})

    def identity(self) -> dict:
        return {"pid": 0}

    def report(self) -> dict:
        return {"group": "trainer", "rank": self.rank, "weight_version": self.step}

    def start_heartbeat(self, monitor, interval_s: float, incarnation: int) -> None:
        self.hb.start(monitor, interval_s, incarnation, {})

    def rendezvous(self) -> tuple[str, int]:
        return "127.0.0.1", 29500

    def init_process_groups(self, *args) -> None:
        self.actors.calls.append(("init_process_groups", self.rank, args[2]))

    def build(self, vocab: int, pad_id: int | None = None, eos_id: int | None = None, spec=None, cache_dir=None):
        self.vocab = vocab
        if self.colocated:
            self.sampler = FakeBackend(vocab, pad_id, eos_id, self.actors.max_new_tokens)
            return self.sampler.precompile()
        return None

    def train_step(self, batch: dict) -> dict:
        m = batch["loss_mask"]
        self.actors.batches.append((self.rank, {k: v for k, v in batch.items()}))
        self.w = self.w + 0.01 * float((batch["advantages"] * m).sum())
        self.step += 1
        tokens = float(m.sum())
        return {"tokens": tokens, "pg_sum": -float((batch["advantages"] * m).sum()), "kl_sum": 0.0,
                "entropy_sum": tokens, "clipped": 0.0, "logp_gap_sum": 0.0, "grad_norm": 1.0, "lr": 1e-3,
                "micro_batches": 1, "train_padding_frac": 0.0, "seconds": 1e-3}

    def logprobs(self, batch: dict, reference: bool = False) -> np.ndarray:
        return np.full(batch["tokens"].shape, -1.0, np.float32)

    def values(self, batch: dict) -> np.ndarray:
        return np.zeros(batch["tokens"].shape, np.float32)

    def mesh_position(self) -> int:
        return self.rank

    def join_sync(self, host, port, generation, position, *_rest) -> dict:
        self.actors.calls.append(("join_sync", f"trainer-{self.rank}", generation))
        return {}

    def push_weights(self, spec, version: int, positions=None) -> dict:
        self.actors.fabric.setdefault(version, {})[f"w{self.rank}"] = self.w.copy()
        return {"bytes": int(self.w.nbytes), "buckets": 1, "staged_bytes": 0}

    def publish_local(self, version: int) -> dict:
        self.sampler.set_params({f"w{r}": t.w.copy() for r, t in self.actors.live_trainers()}, version)
        return {"version": version, "gathered_bytes": 0, "copied_bytes": int(self.w.nbytes), "buckets": 0,
                "link_bytes": {"host": 0, "ici": 0, "dcn": 0}, "zero_copy": 0, "tensors": 1}

    def weight_version(self) -> int:
        return self.sampler.version if self.sampler else -1

    def generate(self, prompts, n: int, seed: int) -> dict:
        return self.sampler.generate(prompts, n, seed)

    def generate_eval(self, prompts, n: int, seed: int, greedy: bool) -> dict:
        return self.sampler.generate(prompts, n, seed, greedy=greedy)

    def probe_logits(self, tokens, position_ids, attention_mask):
        return fake_logits({f"w{r}": t.w for r, t in self.actors.live_trainers()}, tokens, self.vocab)

    def sampler_probe_logits(self, tokens, position_ids, attention_mask):
        return self.sampler.probe_logits(tokens, position_ids, attention_mask)

    def memory(self) -> dict:
        return {"rss_bytes": 1, "peak_rss_bytes": 1}

    def save_checkpoint(self, path: str, meta: dict) -> str:
        """Rank 0 writes the group's weights through the real checkpoint writer (sha256 and all)."""
        import torch

        from learner.checkpoint import save_checkpoint

        if self.rank == 0:
            w = {f"w{r}": torch.from_numpy(t.w.copy()) for r, t in self.actors.live_trainers()}
            save_checkpoint(path, {"model": w, "optimizer": {f"state.{k}.exp_avg": v * 0 for k, v in w.items()}},
                            dict(meta, trainer_step=self.step), keep=2)
        return path

    def load_checkpoint(self, path: str) -> dict:
        from learner.checkpoint import load_checkpoint

        model, _optim, meta = load_checkpoint(path)
        self.w, self.step = model[f"w{self.rank}"].numpy().copy(), int(meta["trainer_step"])
        return meta

    def shutdown(self) -> None:
        self.hb.stop()


class FakeSampler:
    """One sampler over the fake rollout backend; weights arrive through the shared fabric dict."""

    def __init__(self, actors: "FakeActors", rank: int):
        self.actors, self.rank = actors, rank
        self.engine: FakeBackend | None = None
        self.hb = _FakeHeartbeat("sampler", rank, lambda: {"version": self.engine.version if self.engine else -1})

    def identity(self) -> dict:
        return {"pid": 0}

    def report(self) -> dict:
        return {"group": "sampler", "rank": self.rank, "weight_version": self.weight_version()}

    def start_heartbeat(self, monitor, interval_s: float, incarnation: int) -> None:
        self.hb.start(monitor, interval_s, incarnation, {})

    def init_process_groups(self, *args) -> None:
        self.actors.calls.append(("init_process_groups", f"sampler-{self.rank}", args[2]))

    def build(self, vocab: int, pad_id: int, eos_id: int, spec, cache_dir=None) -> list:
        self.engine = FakeBackend(vocab, pad_id, eos_id, self.actors.max_new_tokens)
        return self.engine.precompile()

    def join_sync(self, host, port, generation, position, *_rest) -> dict:
        self.actors.calls.append(("join_sync", f"sampler-{self.rank}", generation))
        return {}

    def receive_weights(self, version: int, spec=None, positions=None) -> dict:
        params = self.actors.fabric[version]
        self.engine.set_params(params, version)
        n = sum(int(v.nbytes) for v in params.values())
        return {"version": version, "link_bytes": {"host": n, "ici": 0, "dcn": 0}, "zero_copy": 0,
                "tensors": len(params), "device_put_bytes": 0}

    def weight_version(self) -> int:
        return self.engine.version if self.engine else -1

    def generate(self, prompts, n: int, seed: int) -> dict:
        return self.engine.generate(prompts, n, seed)

    def generate_eval(self, prompts, n: int, seed: int, greedy: bool) -> dict:
        return self.engine.generate(prompts, n, seed, greedy=greedy)

    def probe_logits(self, tokens, position_ids, attention_mask):
        return self.engine.probe_logits(tokens, position_ids, attention_mask)

    def layout(self) -> dict:
        return {"rank": self.rank} | self.engine.describe()

    def shutdown(self) -> None:
        self.hb.stop()


class FakeActors:
    """The chip-owning actor group of one run: handles by key (``trainer-0``, ``sampler-1``)."""

    def __init__(self, max_new_tokens: int):
        self.ray = FakeRay(on_spawn=self._spawned_by_a_pool)
        self.max_new_tokens = max_new_tokens
        self.handles: dict[str, FakeHandle] = {}
        self.fabric: dict[int, dict] = {}  # version -> the trainers' pushed weights
        self.batches: list[tuple[int, dict]] = []  # (trainer rank, batch) of every train_step
        self.calls: list[tuple] = []
        self.spawned: list[str] = []
        self.doomed: dict[str, str] = {}  # key -> method every new process of it dies at

    def spawn(self, role: Role, rank: int, colocated: bool) -> FakeHandle:
        key = f"{role.value}-{rank}"
        obj = FakeTrainer(self, rank, colocated) if role == Role.TRAINER else FakeSampler(self, rank)
        self.handles[key] = h = FakeHandle(obj, key)
        if key in self.doomed:
            h.fail_at[self.doomed[key]] = 0
        self.spawned.append(key)
        return h

    def _spawned_by_a_pool(self, handle: FakeHandle) -> None:
        """Reward workers (the real class, in process) are keyed ``reward-worker-<slot>``, newest first."""
        if handle._key == "RewardFnWorker":
            handle._key = key = f"reward-worker-{handle._obj.rank}"
            self.handles[key] = handle
            self.spawned.append(key)

    def live_trainers(self):
        return sorted((int(k.split("-")[1]), h._obj) for k, h in self.handles.items() if k.startswith("trainer-"))

    def fail(self, key: str, at: str, after: int = 0, always: bool = False) -> None:
        """The current process of ``key`` dies at its ``at`` call after ``after`` more succeed;
        ``always``: so does every replacement, at its first ``at`` call."""
        self.handles[key].fail_at[at] = after
        if always:
            self.doomed[key] = at

    def hang(self, key: str, at: str, after: int = 0) -> None:
        """The current process of ``key`` stops answering at its ``at`` call after ``after`` more
        succeed; its heartbeat goes on, stuck in that call's phase, so the watchdog fences it."""
        self.handles[key].hang_at[at] = after


class FakePlacement(Placement):
    """The real chip plan (roles, ranks, TP) with ``FakeActors`` in place of Ray's placement group."""

    def __init__(self, cfg, mode, actors: FakeActors):
        super().__init__(cfg, mode)
        self.actors = actors

    def begin_cluster(self, address):
        pass  # no Ray: start_cluster hands over the fakes

    def start_cluster(self, address):
        self.ray, self.cluster_info = self.actors.ray, {"mode": "in-process fakes"}
        return self.ray

    def spawn_all(self) -> None:
        g = self.groups
        g.trainers = [self.new_actor(Role.TRAINER, r) for r in range(len(self.roles[Role.TRAINER]))]
        g.samplers = g.trainers if self.colocated else \
            [self.new_actor(Role.SAMPLER, r) for r in range(len(self.roles.get(Role.SAMPLER, [])))]
        g.rewarders = []

    def new_actor(self, role: Role, rank: int, incarnation: int = 0):
        return self.actors.spawn(role, rank, self.colocated)

    def claim_all(self) -> None:
        self.reports = [{"group": "trainer", "rank": r} for r in range(len(self.groups.trainers))]

    def replace(self, role: Role, rank: int, incarnation: int):
        self.ray.kill(self.groups.group(role)[rank])
        new = self.groups.group(role)[rank] = self.new_actor(role, rank, incarnation)
        return new

    def shutdown(self) -> None:
        for h in self.groups.processes():
            self.ray.kill(h)
