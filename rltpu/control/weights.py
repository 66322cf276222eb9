"""The driver's side of weight sync over the fabric: build its generations, push a version, probe it.

Every trainer streams its shards and every sampler stages and publishes atomically
(``rltpu.sync.collective``). On any failure every sampler keeps its previous version, recorded in
``sampler_versions``, and the supervisor re-joins survivors and replacements in a new generation.
This is the disaggregated modes' weight handoff; a placement mode may bring its own
(``rltpu.control.modes``).
"""

from __future__ import annotations

import time

import numpy as np

from rltpu.chips.topology import Role
from rltpu.sync.collective import WeightSyncError, adapter_spec


class WeightSync:
    def __init__(self, ray, groups, roles: dict, spec, timeout_s: float, deadlines=None):
        """``groups``: the placement's ``ActorGroups``; ``deadlines``: ``health.deadlines``; rendezvous,
        join_sync and probe calls wait at most their entry."""
        self.ray, self.groups, self.roles, self.spec = ray, groups, roles, spec
        self.timeout_s = timeout_s
        self.deadlines = deadlines
        self.store: tuple[str, int] | None = None  # trainer 0's TCPStore (host, port)
        self.positions: list[int] | None = None  # each trainer rank's mesh position, read at the first push
        self.generation = 0
        self.sampler_versions: list[int] = []
        # LoRA: after a full sync only the adapters move; every new generation (start, a replaced
        # sampler) starts with a full one, so a late joiner gets the base once, then adapters
        self.adapters = adapter_spec(spec)
        self.need_full = True

    def _get(self, refs, phase: str, what: str):
        if self.deadlines is None:
            return self.ray.get(refs)
        from rltpu.observe.health import bounded_get

        return bounded_get(self.ray, refs, phase, self.deadlines, what)

    def forget_store(self) -> None:
        """The store lived in trainer 0: after the trainer group restarts, rendezvous afresh (and read
        the new group's mesh positions again)."""
        self.store = None
        self.positions = None

    def join(self) -> None:
        """Build the next weight-sync generation (standalone gloo groups on trainer 0's store, routed
        by slice). Called at start and after a failed sync, once dead samplers were replaced."""
        g = self.groups
        if self.store is None:
            self.store = self._get(g.trainers[0].rendezvous.remote(), "rendezvous", "trainer 0's sync store")
            self.generation = 0
            self.sampler_versions = [-1] * len(g.samplers)
        self.need_full = True
        self.positions = None  # a replaced trainer group may lay out its mesh differently
        self.generation += 1
        t_sl = [chips[0].slice for chips in self.roles[Role.TRAINER]]
        s_sl = [chips[0].slice for chips in self.roles[Role.SAMPLER]]
        args = lambda p: (*self.store, self.generation, p, t_sl, s_sl, self.timeout_s)  # noqa: E731
        self._get([a.join_sync.remote(*args(p)) for p, a in enumerate(g.trainers + g.samplers)], "join_sync",
                  f"weight-sync generation {self.generation}")

    def push(self, version: int) -> dict:
        """Weights of ``version`` to every sampler; seconds, bytes and the route each byte took."""
        t0 = time.perf_counter()
        g = self.groups
        spec = self.spec if self.need_full or not self.adapters else self.adapters
        if self.positions is None:  # the trainer mesh's rank layout: TorchTPU's is not rank order
            self.positions = self._get([t.mesh_position.remote() for t in g.trainers], "syncing",
                                       "the trainers' mesh positions")
        refs = [t.push_weights.remote(spec, version, self.positions) for t in g.trainers]
        refs += [s.receive_weights.remote(version, spec, self.positions) for s in g.samplers]
        try:
            out = self.ray.get(refs)
        except Exception as e:
            alive = []
            for i, s in enumerate(g.samplers):
                try:
                    self.sampler_versions[i] = int(self.ray.get(s.weight_version.remote(), timeout=30))
                    alive.append(i)
                except Exception:  # noqa: BLE001 - a dead sampler: its version is unknown
                    self.sampler_versions[i] = -1
            raise WeightSyncError(
                f"weight sync v{version} failed ({str(e).splitlines()[-1][:300]}); sampler versions now "
                f"{self.sampler_versions} (alive: {alive}); replace dead samplers and join again") from e
        sent, received = out[: len(g.trainers)], out[len(g.trainers):]
        self.sampler_versions = [int(r["version"]) for r in received]
        self.need_full = False
        return {"seconds": time.perf_counter() - t0, "bytes": sum(x["bytes"] for x in sent),
                "adapter_only": spec is self.adapters,
                "buckets": sum(x["buckets"] for x in sent),
                # the route each received byte took: host (loopback on one host), DCN between hosts;
                # ICI never carries bytes between a torch trainer and a JAX sampler
                "host_bytes": sum(r["link_bytes"]["host"] for r in received),
                "ici_bytes": sum(r["link_bytes"]["ici"] for r in received),
                "dcn_bytes": sum(r["link_bytes"]["dcn"] for r in received),
                "staged_bytes": sum(x.get("staged_bytes", 0) for x in sent),  # device -> host copies
                "device_put_bytes": sum(r.get("device_put_bytes", 0) for r in received),
                "zero_copy_frac": sum(r["zero_copy"] for r in received) / max(sum(r["tensors"] for r in received), 1)}

    def probe(self, batch: tuple[np.ndarray, np.ndarray, np.ndarray]) -> float:
        """Max |logit diff| between trainer and every sampler on ``batch`` (catches sync bugs)."""
        g = self.groups
        t_logits = self._get([t.probe_logits.remote(*batch) for t in g.trainers], "probe", "the trainers' probe")[0]
        s_logits = self._get([s.probe_logits.remote(*batch) for s in g.samplers], "probe", "the samplers' probe")
        return float(max(probe_gap(t_logits, s, batch[0], batch[2]) for s in s_logits))


def probe_gap(t_logits: np.ndarray, s_out: np.ndarray, tokens: np.ndarray, mask: np.ndarray) -> float:
    """Max |trainer - sampler| on the probe. A sampler's (R, L, V) logits are compared as they are; an
    (R, L) answer (vLLM's backend: it hands out logprobs, not logits) holds log p(token j+1 | <= j),
    compared with the trainer's log-softmax at the same tokens."""
    mask = mask.astype(bool)
    if s_out.ndim == 3:
        return float(np.abs(s_out[mask] - t_logits[mask]).max())
    z = t_logits.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    lp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    t_tok = np.take_along_axis(lp[:, :-1], tokens[:, 1:, None].astype(np.int64), -1)[..., 0]
    both = mask[:, :-1] & mask[:, 1:]
    return float(np.abs(s_out[:, :-1][both] - t_tok[both]).max())
