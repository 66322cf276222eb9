"""Trainer -> sampler weight sync: sharded, bucketed, routed by slice, versioned, published atomically.

Participants of one sync are numbered ("sync ranks"): trainers ``0..M-1``, samplers ``M..M+N-1``.
Each generation of the fabric is its own set of standalone gloo process groups (own TCPStore
prefix, own timeout), independent of the FSDP world, so a sync that broke because a sampler died
is repaired by building generation ``g+1`` with a replacement in the dead sampler's seat.

One sync, in order (every participant runs the same schedule, so collectives line up):

    all:        handshake = all-gather [version, layout digest] on the control group; any mismatch:
                all-gather the layouts themselves, raise one line naming the first differing rank
                and tensor (nobody enters the payload phase)
    trainer r:  stream r = its own FSDP dim-0 shards (no gather), packed into flat byte buckets of
                ``bucket_bytes`` (pieces 64-byte aligned, big shards split across buckets, an int64
                checksum in each bucket's trailer); two buffers: bucket k+1 is packed while bucket k
                is on the wire (async broadcast)
    route:      stream r goes by one broadcast to the samplers of the trainer's slice and to one
                relay sampler per other slice (DCN, once per destination slice); each relay
                re-broadcasts it to the rest of its slice. Trainer (TorchTPU) and sampler (JAX) are
                two runtimes, so no byte uses ICI: a receive is counted ``host`` (same host, gloo
                over loopback through host memory) or ``dcn`` (another host); on real chips the
                trainer first stages its shards to host (``HostStaging``, one copy, reused buffers)
                and the sampler ``jax.device_put``s the staged tensors onto its devices
    samplers:   verify each bucket's checksum, copy its pieces into a staging arena (the new
                version, beside the live one; 64-byte aligned tensors, so JAX aliases them)
    all:        verdict = all-gather of [bad flag, stream, bucket]; publish only if nobody failed

Every wait has ``timeout_s``; a dead peer closes its sockets, so the others fail within it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch

from rltpu.sync.stores import host_store, hosted_store  # noqa: F401 - host_store: callers start the store here

ParamSpec = list[tuple[str, tuple[int, ...], str]]  # (name, full shape, sampler dtype name)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ALIGN_BYTES = 64  # JAX's CPU client aliases (zero-copy) DLPack buffers only at 64-byte alignment
TRAILER_BYTES = 64  # per bucket: int64 checksum, padded to keep the next buffer aligned


class WeightSyncError(RuntimeError):
    """A sync that did not publish: handshake mismatch, checksum failure, dead or slow peer."""


def param_spec(model_cfg, vocab_size: int, lora=None) -> ParamSpec:
    """Names, shapes and dtypes of the policy, in state-dict order (every parameter is in
    ``model.dtype``); with ``lora`` (a ``LoraConfig``) the adapters follow the base: a full sync."""
    from rltpu.models.spec import lora_shapes, param_shapes

    if getattr(model_cfg, "architecture", None) == "other":  # trainer.model_impl=hf: transformers' own names
        from rltpu.models.hf.auto import param_shapes_of

        shapes = dict(param_shapes_of(model_cfg.path))
    else:
        shapes = param_shapes(model_cfg, vocab_size)
    if lora is not None:
        shapes |= lora_shapes(model_cfg, lora, vocab_size, base=shapes)
    return [(k, tuple(shape), model_cfg.dtype) for k, shape in shapes.items()]


def adapter_spec(spec: ParamSpec) -> ParamSpec:
    """The LoRA adapters of ``spec``: what a sync after the first moves (the base never changes).
    The handshake's digest covers it like any spec, so both ends agree on the adapter layout."""
    from rltpu.models.spec import is_adapter

    return [e for e in spec if is_adapter(e[0])]


def spec_digest(spec: ParamSpec) -> int:
    h = hashlib.sha256(repr([(n, tuple(s), d) for n, s, d in spec]).encode()).digest()
    return int.from_bytes(h[:7], "little")  # fits in int64


def _align(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


def _numel(shape) -> int:
    return int(np.prod(shape)) if len(shape) else 1


def shard_rows(d0: int, world: int, rank: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of dim 0 that FSDP2 (``Shard(0)``, torch.chunk semantics) gives ``rank``."""
    c = -(-d0 // world)
    return min(rank * c, d0), min((rank + 1) * c, d0)


def trainer_rows(name: str, d0: int, n_trainers: int, rank: int, tp: int = 1) -> tuple[int, int]:
    """Rows ``[start, stop)`` of tensor ``name`` that trainer ``rank`` sends: its FSDP2 rows, or with
    tensor parallelism (``tp`` > 1, rank = dp index * tp + tp index) a block of whole rows:

    - split by rows (q/k/v, gate/up; ``rltpu.models.tp_plan.split_dim`` 0): the TP rank's rows, then
      its FSDP piece of those (what FSDP2 holds there, ``_StridedShard``): sent as held;
    - anything else: the FSDP piece over dp, then the TP rank's part of it. A tensor whole on every
      TP rank is sliced (a view), a column-split one (o_proj, down) is first turned into rows inside
      the TP group (``local_shards``). Each element goes once, from one rank.
    """
    if tp == 1:
        return shard_rows(d0, n_trainers, rank)
    from rltpu.models.tp_plan import split_dim

    d, t = divmod(rank, tp)
    outer, inner = ((tp, t), (n_trainers // tp, d)) if split_dim(name) == 0 else ((n_trainers // tp, d), (tp, t))
    a, b = shard_rows(d0, *outer)
    c, e = shard_rows(b - a, *inner)
    return a + c, a + e


# ---------------------------------------------------------------------------------------------
# the plan: per trainer rank, which shard pieces travel in which bucket


@dataclass(frozen=True)
class Piece:
    name: str
    offset: int  # byte offset in the message
    start: int  # element offset in the full (flattened) tensor
    numel: int
    wire: str  # dtype on the wire


@dataclass(frozen=True)
class Message:
    """One broadcast of a stream: a packed bucket (``slot`` 0/1: which of the two buffers), or a
    direct chunk (``slot`` -1: one piece, sent from the shard and received into the staging arena
    as is, no copy on either side)."""

    nbytes: int
    pieces: tuple[Piece, ...]
    slot: int

    @property
    def direct(self) -> bool:
        return self.slot < 0


def wire_dtype_of(dtype: str, wire: str) -> str:
    return dtype if wire == "auto" else wire


def direct_min_bytes(bucket_bytes: int) -> int:
    """Shard pieces at least this big skip packing (their own messages, chunked to the bucket size)."""
    return min(bucket_bytes // 4, 256 * 1024)


def plan_stream(spec: ParamSpec, n_trainers: int, rank: int, bucket_bytes: int, wire: str = "auto",
                tp: int = 1) -> list[Message]:
    """Trainer ``rank``'s shards (``trainer_rows``; ``tp``: the trainers' tensor-parallel degree), in
    spec order, as messages of at most ``bucket_bytes``.

    A piece whose wire dtype is the sampler's dtype and which is big enough goes direct, in chunks
    of at most a bucket; smaller (or converted) pieces are packed at 64-byte-aligned offsets into
    flat buckets, split at a bucket's end when they do not fit, so no buffer exceeds ``bucket_bytes``.
    A pure function of its arguments: senders and receivers compute it independently.
    """
    if bucket_bytes < 4 * ALIGN_BYTES:
        raise ValueError(f"sync bucket of {bucket_bytes} bytes is too small; use sync.bucket_mb >= 0.001")
    msgs, pieces, used, parity = [], [], 0, 0
    dmin = direct_min_bytes(bucket_bytes)
    cap = bucket_bytes // ALIGN_BYTES * ALIGN_BYTES  # a packed bucket ends aligned, inside the bucket

    def flush():
        nonlocal pieces, used, parity
        if pieces:
            msgs.append(Message(_align(used), tuple(pieces), parity))
            parity ^= 1
        pieces, used = [], 0

    for name, shape, dtype in spec:
        wd = wire_dtype_of(dtype, wire)
        isz = _DTYPES[wd].itemsize
        d0 = shape[0] if len(shape) else 1
        row = _numel(shape[1:]) if len(shape) else 1
        r0, r1 = trainer_rows(name, d0, n_trainers, rank, tp)
        start, left = r0 * row, (r1 - r0) * row
        if wd == dtype and left * isz >= dmin and (start * isz) % 8 == 0:
            chunk = cap // isz
            while left > 0:
                n = min(left, chunk)
                msgs.append(Message(n * isz, (Piece(name, 0, start, n, wd),), -1))
                start, left = start + n, left - n
            continue
        while left > 0:
            off = _align(used)
            room = (cap - off) // isz if off < cap else 0
            if room <= 0:
                flush()
                continue
            n = min(left, room)
            pieces.append(Piece(name, off, start, n, wd))
            used, start, left = off + n * isz, start + n, left - n
    flush()
    return msgs


def identity_positions(positions: list[int] | None, n_trainers: int) -> list[int]:
    """Each stream's mesh position (stream r = trainer rank r); None: rank r sits at position r.
    Raises WeightSyncError unless it is a permutation of the trainer ranks."""
    if positions is None:
        return list(range(n_trainers))
    positions = [int(p) for p in positions]
    if sorted(positions) != list(range(n_trainers)):
        raise WeightSyncError(f"trainer mesh positions {positions} are not a permutation of the {n_trainers} trainer "
                              f"ranks; every rank must hold one mesh position")
    return positions


def layout_digest(spec: ParamSpec, n_trainers: int, bucket_bytes: int, wire: str, tp: int = 1,
                  positions: list[int] | None = None) -> int:
    """What every participant must agree on besides the version (names, shapes, dtypes, plan inputs,
    the trainers' (dp, tp) mesh and each rank's position in it: which rows each stream carries
    depends on them)."""
    mesh = (n_trainers, bucket_bytes) if tp == 1 else (n_trainers, bucket_bytes, n_trainers // tp, tp)
    pos = identity_positions(positions, n_trainers)
    if pos != list(range(n_trainers)):
        mesh = (*mesh, *pos)
    return spec_digest([("__plan__", mesh, wire), *spec])


def staging_layout(spec: ParamSpec) -> tuple[dict[str, int], int]:
    """Byte offset of each full tensor in a sampler's staging arena (64-byte aligned), and its size."""
    offs, used = {}, 0
    for name, shape, dtype in spec:
        used = _align(used)
        offs[name] = used
        used += _numel(shape) * _DTYPES[dtype].itemsize
    return offs, _align(used)


def _checksum(msg: torch.Tensor) -> int:
    """Wrapping int64 sum of the message's 8-byte words (tail bytes added singly): one vectorised
    read pass; the same on both ends because every message starts 8-byte aligned there."""
    b = msg.view(torch.uint8) if msg.dtype != torch.uint8 else msg
    n8 = b.numel() // 8 * 8
    total = int(b[:n8].view(torch.int64).sum()) if n8 else 0
    if n8 < b.numel():
        total += int(b[n8:].sum())
    return (total + 2**63) % 2**64 - 2**63  # back into int64 range


# ---------------------------------------------------------------------------------------------
# the route: from slices of trainers and samplers to groups and link classes


@dataclass
class Route:
    """Groups (members as sync ranks, root first) and who receives each stream from where.

    ``recv_from[(p, r)]``: the group on which sync rank ``p`` receives stream ``r``;
    ``forwards[p]``: ``(r, group)`` pairs a relay re-broadcasts after receiving.
    """

    n_trainers: int
    slices: list[int]  # slice of each sync rank
    groups: dict[str, tuple[int, ...]] = field(default_factory=dict)
    recv_from: dict[tuple[int, int], str] = field(default_factory=dict)
    forwards: dict[int, list[tuple[int, str]]] = field(default_factory=dict)
    relays: dict[int, int] = field(default_factory=dict)  # slice -> relay sync rank

    @property
    def size(self) -> int:
        return len(self.slices)


def plan_route(trainer_slices: list[int], sampler_slices: list[int]) -> Route:
    """Each stream crosses DCN at most once per destination slice, then fans out over ICI.

    Stream ``r`` (trainer ``r`` on slice ``t``): one broadcast group ``t{r}`` = the trainer, every
    sampler on slice ``t``, and the relay (lowest sampler) of each other slice. Per other slice
    ``s``: ``f{s}.{t}`` = its relay plus its other samplers, carrying the streams from slice ``t``.
    """
    M = len(trainer_slices)
    rt = Route(M, list(trainer_slices) + list(sampler_slices))
    by_slice: dict[int, list[int]] = {}
    for j, s in enumerate(sampler_slices):
        by_slice.setdefault(s, []).append(M + j)
    rt.relays = {s: ps[0] for s, ps in sorted(by_slice.items())}
    for r, t in enumerate(trainer_slices):
        direct = by_slice.get(t, [])
        remote = [rt.relays[s] for s in sorted(by_slice) if s != t]
        g = f"t{r}"
        rt.groups[g] = (r, *direct, *remote)
        for p in (*direct, *remote):
            rt.recv_from[(p, r)] = g
        for s in sorted(by_slice):
            if s == t or len(by_slice[s]) < 2:
                continue
            f = f"f{s}.{t}"
            rt.groups.setdefault(f, tuple(by_slice[s]))
            rt.forwards.setdefault(rt.relays[s], []).append((r, f))
            for p in by_slice[s][1:]:
                rt.recv_from[(p, r)] = f
    rt.groups["ctl"] = tuple(range(rt.size))
    return rt


LINKS = ("host", "dcn", "ici")  # the link classes a sync byte is counted on


def link_of(route: Route, p: int, group: str, hosts: list[int] | None = None) -> str:
    """Link of sync rank ``p`` receiving on ``group``: ``host`` when its sender is on the same host
    (gloo over loopback, i.e. through host memory), ``dcn`` when it is on another host. Never ``ici``:
    a TorchTPU trainer and a JAX sampler are two runtimes, so their bytes cannot use ICI (ICI carries
    only the collectives inside one runtime, e.g. FSDP). Without ``hosts``, one host per slice."""
    root = route.groups[group][0]
    where = hosts if hosts is not None else route.slices
    return "host" if where[root] == where[p] else "dcn"


def route_link_bytes(route: Route, stream_bytes: list[int], hosts: list[int] | None = None) -> dict[str, int]:
    """Bytes each link class carries for one sync, from the route alone (what receivers should count)."""
    out = dict.fromkeys(LINKS, 0)
    for (p, r), g in route.recv_from.items():
        out[link_of(route, p, g, hosts)] += stream_bytes[r]
    return out


# ---------------------------------------------------------------------------------------------
# the fabric: one generation of standalone gloo groups

class SyncFabric:
    """The process groups of one generation that this participant belongs to.

    Groups are created in one global order (sorted names); each constructor blocks until all its
    members arrive, and a common order makes that deadlock-free.
    """

    def __init__(self, host: str, port: int, generation: int, me: int, route: Route, timeout_s: float,
                 bind: str | None = None, host_key: str | None = None):
        """``host:port``: the rendezvous store (sync rank 0's). ``bind``: this process's own address for
        its gloo sockets (default ``host``, right only on one machine); ``host_key``: which host this
        process is on (default ``bind``), all-gathered so each byte is counted on the link it took."""
        import torch.distributed as dist
        from torch.distributed import ProcessGroupGloo

        self.generation, self.me, self.route, self.timeout_s = generation, me, route, timeout_s
        self.bind = bind or host
        self.timeout = timedelta(seconds=timeout_s)
        store = hosted_store(host, port) or dist.TCPStore(host, port, None, False, self.timeout)
        self.groups: dict[str, tuple[object, int]] = {}  # name -> (pg, my rank in it)
        dev = ProcessGroupGloo.create_device(hostname=self.bind)
        for name in sorted(route.groups):
            members = route.groups[name]
            if me not in members:
                continue
            opts = ProcessGroupGloo._Options()
            opts._devices = [dev]
            opts._timeout = self.timeout
            opts._threads = 2
            prefixed = dist.PrefixStore(f"rltpu-sync/g{generation}/{name}", store)
            try:
                pg = ProcessGroupGloo(prefixed, members.index(me), len(members), opts)
            except Exception as e:
                self.close()
                raise WeightSyncError(
                    f"weight sync generation {generation}: sync rank {me} could not join group {name} "
                    f"(members {list(members)}) within {timeout_s:g}s: {e}") from e
            self.groups[name] = (pg, members.index(me))
        key = int.from_bytes(hashlib.sha256((host_key or self.bind).encode()).digest()[:7], "little")
        self.hosts = [int(t) for t in self.allgather(torch.tensor([key], dtype=torch.int64), "the host exchange")]

    def pg(self, name: str):
        return self.groups[name][0]

    def close(self) -> None:
        """Abort this generation's groups (after a failure their sockets may be half-dead)."""
        for pg, _ in self.groups.values():
            with contextlib.suppress(Exception):  # best effort; the next generation does not need them
                pg.abort()
        self.groups = {}

    # -- collectives with deadlines --------------------------------------------------------------
    def wait(self, work, what: str) -> None:
        try:
            work.wait(self.timeout)
        except Exception as e:
            raise WeightSyncError(
                f"weight sync generation {self.generation}: sync rank {self.me} failed in {what} "
                f"(a peer died or missed the {self.timeout_s:g}s sync.timeout_s): {str(e).splitlines()[0][:200]}"
            ) from e

    def allgather(self, t: torch.Tensor, what: str) -> list[torch.Tensor]:
        pg = self.pg("ctl")
        out = [torch.empty_like(t) for _ in range(pg.size())]
        self.wait(pg.allgather([out], [t]), what)
        return out


# ---------------------------------------------------------------------------------------------
# handshake and verdict


def _who(route: Route, p: int) -> str:
    return f"trainer {p}" if p < route.n_trainers else f"sampler {p - route.n_trainers}"


def _first_difference(a: tuple | None, b: tuple | None) -> str:
    if a is None or b is None:
        return "unreadable handshake details (not the JSON layout; a foreign or corrupt peer)"
    (va, na, ba, wa, sa), (vb, nb, bb, wb, sb) = a, b
    if va != vb:
        return f"version {vb} vs {va}"
    if (na, ba, wa) != (nb, bb, wb):
        return f"plan (trainers, bucket bytes, wire dtype) {(nb, bb, wb)} vs {(na, ba, wa)}: sync configs disagree"
    for i in range(max(len(sa), len(sb))):
        x = sa[i] if i < len(sa) else None
        y = sb[i] if i < len(sb) else None
        if x != y:
            name = (y or x)[0]
            fmt = lambda e: "missing" if e is None else f"{e[0]} {tuple(e[1])} {e[2]}"
            return f"first differing tensor {name!r}: {fmt(y)} vs {fmt(x)}; trainer and sampler model configs disagree"
    return "layouts differ"


def decode_details(raw: bytes) -> tuple:
    """A peer's handshake details (JSON: version, trainers, bucket bytes, wire dtype, layout); bytes
    that are not that shape become a layout nobody matches, never code that runs."""
    try:
        v, n, b, w, spec = json.loads(raw.decode("utf-8"))
        return v, n, b, w, [(str(e[0]), list(e[1]), str(e[2])) for e in spec]
    except (ValueError, TypeError, UnicodeDecodeError, IndexError, KeyError):
        return None


def handshake(fabric: SyncFabric, version: int, spec: ParamSpec, bucket_bytes: int, wire: str, tp: int = 1,
              positions: list[int] | None = None) -> None:
    """Everyone agrees on (version, layout) or everyone raises the same one-line error. ``tp``: the
    trainers' tensor-parallel degree as this participant knows it (a trainer: its mesh);
    ``positions``: each trainer rank's mesh position as this participant knows it."""
    route = fabric.route
    mine = torch.tensor([version, layout_digest(spec, route.n_trainers, bucket_bytes, wire, tp, positions)],
                        dtype=torch.int64)
    got = [tuple(int(x) for x in t) for t in fabric.allgather(mine, "the handshake")]
    if all(g == got[0] for g in got):
        return
    # JSON, never pickle: these bytes come from peers over an unauthenticated store
    trainers = route.n_trainers if tp == 1 else f"{route.n_trainers} as dp {route.n_trainers // tp} x tp {tp}"
    pos = identity_positions(positions, route.n_trainers)
    if pos != list(range(route.n_trainers)):
        trainers = f"{trainers} at mesh positions {pos}"
    detail = json.dumps([version, trainers, bucket_bytes, wire,
                         [[n, list(s), str(d)] for n, s, d in spec]]).encode()
    n = torch.tensor([len(detail)], dtype=torch.int64)
    sizes = [int(x) for x in fabric.allgather(n, "the handshake details")]
    buf = torch.zeros(max(sizes), dtype=torch.uint8)
    buf[: len(detail)] = torch.frombuffer(bytearray(detail), dtype=torch.uint8)
    details = [decode_details(bytes(t.numpy()[:k]))
               for t, k in zip(fabric.allgather(buf, "the handshake details"), sizes)]
    p = next(i for i, g in enumerate(got) if g != got[0])
    raise WeightSyncError(
        f"weight sync v{version}: {_who(route, p)} (sync rank {p}) disagrees with {_who(route, 0)}: "
        f"{_first_difference(details[0], details[p])}; nothing sent")


def _verdict(fabric: SyncFabric, version: int, bad: tuple[int, int, int]) -> None:
    got = [tuple(int(x) for x in t) for t in fabric.allgather(torch.tensor(bad, dtype=torch.int64), "the verdict")]
    for p, (flag, r, k) in enumerate(got):
        if flag:
            raise WeightSyncError(
                f"weight sync v{version}: {_who(fabric.route, p)} got bucket {k} of trainer {r}'s stream with a "
                f"bad checksum; every sampler keeps its previous version")


# ---------------------------------------------------------------------------------------------
# trainer side


def local_shards(model: torch.nn.Module, names, tp: int = 1, tp_rank: int = 0) -> dict[str, torch.Tensor]:
    """This rank's FSDP2 shards (DTensor ``to_local()``; no gather), or whole tensors without FSDP.

    With tensor parallelism (``tp`` > 1, this rank's index ``tp_rank`` in its TP group) each piece is
    made the block of whole rows ``trainer_rows`` names: row-split tensors as held; tensors whole on
    every TP rank sliced to this rank's part (a view); column-split ones (o_proj, down) redistributed
    inside the TP group from columns to rows (one all-to-all each, a new shard-sized tensor: every
    trainer rank must call this together). No rank ever holds more than its own share."""
    from torch.distributed.tensor import Shard

    sd = model.state_dict()
    out = {}
    for n in names:
        t = sd[n]
        if tp > 1 and hasattr(t, "placements"):
            if t.placements[-1] == Shard(1):  # column-split over tp: trade columns for rows in the TP group
                t = t.redistribute(t.device_mesh, (*t.placements[:-1], Shard(0))).to_local()
            elif t.device_mesh.ndim == 1 or not t.placements[-1].is_shard():  # whole on every TP rank
                local = t.to_local()
                a, b = shard_rows(local.shape[0], tp, tp_rank)
                t = local[a:b]
            else:  # row-split over tp, then FSDP rows
                t = t.to_local()
        out[n] = (t.to_local() if hasattr(t, "to_local") else t).detach()
    return out


def _buffer(bufs: list, i: int, nbytes: int) -> torch.Tensor:
    if bufs[i] is None:
        bufs[i] = torch.empty(nbytes, dtype=torch.uint8)
    return bufs[i]


def send_shards(fabric: SyncFabric, shards: dict[str, torch.Tensor], spec: ParamSpec, version: int,
                bucket_bytes: int, wire: str = "auto", tp: int = 1, positions: list[int] | None = None) -> dict:
    """Run on every trainer rank (sync rank ``r``): handshake, stream ``r``, its checksums, the verdict.
    ``shards``: ``local_shards`` of the same ``tp`` (the rows ``trainer_rows`` names for this rank's
    mesh position). ``positions[r]``: trainer rank r's position in the trainer mesh, which need not
    be r (TorchTPU's ``topology_aware_mesh`` orders v5e/v6e chips as a ring): stream r carries the
    rows of position ``positions[r]`` and receivers place them by position, not by rank.

    At most two messages are in flight; packed buckets alternate between two buffers, so the
    next bucket is packed while the previous one is on the wire. Direct chunks go from the shard's
    own memory (a copy only when its dtype is not the wire's or it is not 8-byte aligned).
    """
    t0 = time.perf_counter()
    route, r = fabric.route, fabric.me
    handshake(fabric, version, spec, bucket_bytes, wire, tp, positions)
    pos = identity_positions(positions, route.n_trainers)[r]
    plan = plan_stream(spec, route.n_trainers, pos, bucket_bytes, wire, tp)
    base, flat = {}, {}
    for name, shape, _dtype in spec:  # element offset of this rank's shard in the full tensor
        d0 = shape[0] if len(shape) else 1
        row = _numel(shape[1:]) if len(shape) else 1
        r0, r1 = trainer_rows(name, d0, route.n_trainers, pos, tp)
        t = shards[name]
        if t.numel() != (r1 - r0) * row:
            raise WeightSyncError(
                f"weight sync v{version}: trainer {r}'s shard of {name!r} (mesh position {pos}) has {t.numel()} "
                f"elements, expected rows "
                f"[{r0}, {r1}) of {tuple(shape)} ({'FSDP2 Shard(0)' if tp == 1 else f'FSDP x TP, tp={tp}'}); the "
                f"trainer is not sharded as the plan assumes")
        base[name], flat[name] = r0 * row, t.detach().reshape(-1)
    pg, _ = fabric.groups[f"t{r}"]
    # message k may use buffer k % 2: its previous user, message k-2, is waited for first
    bufs: list[torch.Tensor | None] = [None, None]  # allocated on first use: at most 2 x bucket_bytes
    works, sums, sent, pack_s = [], [], 0, 0.0
    for k, m in enumerate(plan):
        if k >= 2:
            fabric.wait(works[k - 2], f"message {k - 2} of stream {r}")  # <= 2 in flight
        tp = time.perf_counter()
        if m.direct:
            pc = m.pieces[0]
            lo = pc.start - base[pc.name]
            msg = flat[pc.name][lo: lo + pc.numel]
            if msg.dtype != _DTYPES[pc.wire] or msg.data_ptr() % 8:
                msg = _buffer(bufs, k % 2, bucket_bytes)[: m.nbytes].view(_DTYPES[pc.wire]).copy_(msg)
        else:
            msg = _buffer(bufs, k % 2, bucket_bytes)[: m.nbytes]
            for pc in m.pieces:
                lo = pc.start - base[pc.name]
                msg[pc.offset: pc.offset + pc.numel * _DTYPES[pc.wire].itemsize].view(_DTYPES[pc.wire]).copy_(
                    flat[pc.name][lo: lo + pc.numel])
        sums.append(_checksum(msg))
        pack_s += time.perf_counter() - tp
        works.append(pg.broadcast(msg, 0))
        sent += m.nbytes
    for k in range(max(0, len(plan) - 2), len(plan)):
        fabric.wait(works[k], f"message {k} of stream {r}")
    if plan:
        fabric.wait(pg.broadcast(torch.tensor(sums, dtype=torch.int64), 0), f"the checksums of stream {r}")
    _verdict(fabric, version, (0, 0, 0))
    return {"bytes": sent, "buckets": len(plan), "seconds": time.perf_counter() - t0, "pack_seconds": pack_s,
            "version": version, "buffer_bytes": sum(x.numel() for x in bufs if x is not None)}


# ---------------------------------------------------------------------------------------------
# sampler side


def receive_staged(fabric: SyncFabric, spec: ParamSpec, version: int, bucket_bytes: int, wire: str = "auto",
                   on_message=None, trainer_tp: int = 1,
                   positions: list[int] | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Run on every sampler: receive all streams into a fresh staging arena (the live version is
    untouched), forward as relay, verify checksums, agree on the verdict. Returns the new full
    tensors (views of the arena, 64-byte aligned) only when every sampler verified every message.

    ``on_message(stream, k)`` runs after each received message (tests use it to die mid-sync).
    ``trainer_tp``: the trainers' tensor-parallel degree (``placement.chips_per_trainer``); which rows
    each stream carries depends on it, and the handshake refuses a disagreement. ``positions``: each
    trainer rank's mesh position (``send_shards``); stream r is placed as position ``positions[r]``.
    """
    t0 = time.perf_counter()
    route, me = fabric.route, fabric.me
    M = route.n_trainers
    handshake(fabric, version, spec, bucket_bytes, wire, trainer_tp, positions)
    pos = identity_positions(positions, M)
    offs, total = staging_layout(spec)
    arena = torch.empty(total, dtype=torch.uint8)
    dest = {n: arena[offs[n]: offs[n] + _numel(s) * _DTYPES[d].itemsize].view(_DTYPES[d]) for n, s, d in spec}
    inbound = []  # (stream, pg, group, plan, two packed buffers)
    for r in range(M):
        g = route.recv_from.get((me, r))
        plan = plan_stream(spec, M, pos[r], bucket_bytes, wire, trainer_tp)
        if g is None or not plan:
            continue
        inbound.append((r, fabric.pg(g), g, plan, [None, None]))
    fwd = {r: fabric.pg(g) for r, g in route.forwards.get(me, [])}
    links = dict.fromkeys(LINKS, 0)
    works: dict[tuple[int, int], object] = {}
    msgs: dict[tuple[int, int], torch.Tensor] = {}

    def target(r, bufs, m):
        if m.direct:
            pc = m.pieces[0]
            return dest[pc.name][pc.start: pc.start + pc.numel]
        return _buffer(bufs, m.slot, bucket_bytes)[: m.nbytes]

    def post(k):
        for r, pg, _g, plan, bufs in inbound:
            if k < len(plan):
                msgs[(r, k)] = t = target(r, bufs, plan[k])
                works[(r, k)] = pg.broadcast(t, 0)  # root: the group's first member

    sums = {r: [] for r, *_ in inbound}
    received, unpack_s = 0, 0.0
    n_rounds = max((len(p) for _, _, _, p, _ in inbound), default=0)
    post(0)
    for k in range(n_rounds):
        post(k + 1)  # a packed buffer is reused two packed messages later: that one is done by now
        for r, _pg, g, plan, _bufs in inbound:
            if k >= len(plan):
                continue
            m = plan[k]
            fabric.wait(works.pop((r, k)), f"message {k} of stream {r}")
            msg = msgs.pop((r, k))
            fw = fwd[r].broadcast(msg, 0) if r in fwd else None
            tu = time.perf_counter()
            received += m.nbytes
            links[link_of(route, me, g, fabric.hosts)] += m.nbytes
            sums[r].append(_checksum(msg))
            if not m.direct:
                for pc in m.pieces:
                    dest[pc.name][pc.start: pc.start + pc.numel].copy_(
                        msg[pc.offset: pc.offset + pc.numel * _DTYPES[pc.wire].itemsize].view(_DTYPES[pc.wire]))
            unpack_s += time.perf_counter() - tu
            if fw is not None:
                fabric.wait(fw, f"forwarding message {k} of stream {r}")
            if on_message is not None:
                on_message(r, k)
    bad = (0, 0, 0)
    for r, pg, _g, plan, _bufs in inbound:
        want = torch.empty(len(plan), dtype=torch.int64)
        fabric.wait(pg.broadcast(want, 0), f"the checksums of stream {r}")
        if r in fwd:
            fabric.wait(fwd[r].broadcast(want, 0), f"forwarding the checksums of stream {r}")
        diff = [k for k, (a, b) in enumerate(zip(sums[r], want.tolist())) if a != b]
        if diff and not bad[0]:
            bad = (1, r, diff[0])
    _verdict(fabric, version, bad)
    out = {n: dest[n].view(tuple(s)) for n, s, _ in spec}
    return out, {"bytes": received, "buckets": sum(len(p) for _, _, _, p, _ in inbound), "version": version,
                 "seconds": time.perf_counter() - t0, "unpack_seconds": unpack_s, "link_bytes": links,
                 "forwarded_streams": sorted(fwd)}


# ---------------------------------------------------------------------------------------------
# into JAX


class HostStaging:
    """Trainer side of a cross-runtime sync: shards on a device (TorchTPU ``tpu``) are copied once
    into host buffers that are kept and reused every sync; host (CPU) shards pass through untouched,
    so on emulated chips nothing is copied and ``staged_bytes`` is 0."""

    def __init__(self):
        self.buffers: dict[str, torch.Tensor] = {}

    def stage(self, shards: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
        out, copied = {}, 0
        for name, t in shards.items():
            if t.device.type == "cpu":
                out[name] = t
                continue
            buf = self.buffers.get(name)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = self.buffers[name] = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            buf.copy_(t)  # the one device-to-host copy
            out[name] = buf
            copied += t.numel() * t.element_size()
        return out, copied


def _host_array(t: torch.Tensor):
    """A numpy view of a host tensor (bf16 through ml_dtypes, which JAX uses), no copy."""
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.contiguous().view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    return t.contiguous().numpy()


def device_put_params(tensors: dict[str, torch.Tensor], shardings: dict | None = None) -> tuple[dict, int]:
    """Sampler side on real chips: staged host tensors -> ``jax.device_put`` onto the sampler's devices,
    each tensor with its sharding (default: the first local device). Returns arrays and the bytes that
    landed on devices (a tensor-parallel sampler: each device's slices, replicated tensors once per device)."""
    import jax

    default = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    out = {k: jax.device_put(_host_array(t), (shardings or {}).get(k, default)) for k, t in tensors.items()}
    jax.block_until_ready(list(out.values()))  # the staging arena may be reused after this returns
    return out, sum(s.data.nbytes for a in out.values() for s in a.addressable_shards)


def torch_to_jax(tensors: dict[str, torch.Tensor]) -> dict:
    """Zero-copy where DLPack allows (aligned, supported dtype); JAX copies otherwise."""
    import jax

    return {k: jax.dlpack.from_dlpack(v.contiguous()) for k, v in tensors.items()}


def count_zero_copy(tensors: dict[str, torch.Tensor], arrays: dict) -> int:
    """How many JAX arrays alias their torch buffer (no copy was made); on CPU, where pointers
    are comparable."""
    n = 0
    for k, t in tensors.items():
        try:
            n += int(arrays[k].unsafe_buffer_pointer() == t.data_ptr())
        except Exception:  # noqa: BLE001 - non-CPU or sharded arrays: not comparable, count as copied
            pass
    return n
