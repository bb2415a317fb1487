"""The collective weight transport: trainer shards to generator shards, rank to rank, over torch.distributed.

LlamaRL's distributed direct memory access: every rank computes the same transfer plan
(:func:`flowrl.runtime.resharding.plan_state`) from plain-data options (parameter shapes and dtypes,
the trainer layout, the generator layout), and each trainer rank sends each generator rank exactly
the slices of its own shards that the generator's shards need: one message per (trainer rank,
generator rank) pair and version, nothing gathered on one rank, no parameter server, every byte on
the wire once per destination that lacks it, and a rank that holds a block on both sides copies it
locally. Only point-to-point operations are used (``batch_isend_irecv``), on contiguous buffers, so
the same code is correct on gloo (CPU) and NCCL (GPU, with ``device="cuda:<i>"``).

Roles come from the layouts: a rank in the trainer layout publishes, a rank in the generator
layout fetches, a rank in both (colocated) does both.

Wire format (per pair and version): one ``uint8`` buffer, a 32-byte header of four int64
``(magic, version, payload_bytes, src_rank)`` (payload bytes with alignment padding) followed by the blocks in plan order (parameters in
sorted name order), each 16-byte aligned. A message goes as pieces of about ``chunk_bytes`` (whole
blocks; the same split on both sides, matched in order), so that the sender copies piece i + 1 while
piece i is on the wire and the receiver copies piece i into its target while piece i + 1 arrives.
A generator rank that needs no data from anyone still gets a header-only message from one trainer
rank, so every generator learns every version.

Pairing semantics (publish and fetch are collective):

- ``publish(state, version)`` (trainer ranks, with their *local shards*) announces ``version`` in
  the process group's store (key ``flowrl/collective/<channel>/<epoch>/v/<rank>``), copies the
  outgoing blocks into send buffers piece by piece, posting each piece's send as it is copied, and
  returns. Each version is delivered once to each generator rank, so at most one version is in
  flight per trainer rank: ``publish(v + 1)`` first waits until every destination has received
  ``v`` (backpressure; up to ``timeout_s``). This is the one departure from "publish costs one
  copy": it waits when the generators lag a version.
- ``fetch_into(target, newer_than)`` (generator ranks, with their *local shard targets*) reads the
  versions its source ranks announced. When all of them announced a version ``w`` it has not
  received, it receives ``w`` into its own staging buffers (blocking until the data is in, up to
  ``timeout_s``; the trainer is posting the sends). Then, as the contract says, it copies the
  newest received version into ``target`` (piece by piece as they arrive) and returns it if it is
  newer than ``newer_than``, else returns None; the staging buffers keep that version, so it can be
  fetched again. With nothing new announced it answers at once, or polls up to ``fetch_wait_s`` seconds
  (a constructor option, 0 by default: the runtime's generator polls on its own deadline).
  ``target`` is only written inside ``fetch_into``, after every message's header was checked to
  carry the version: a generator never sees a torn state (except after a ``TransportError``
  raised mid-transfer, when pieces of the new version may be in it and the job must stop anyway).
- A rank holding both roles posts its sends inside its own ``fetch_into``, batched with its
  receives (NCCL deadlocks on two ranks that each send before receiving from the other); its
  ``publish`` only stages the copy. So its peers' fetches complete when it fetches; if it publishes
  twice without fetching, the second publish first exchanges the staged version.
- Both sides must keep calling: a generator that stops fetching stalls the trainers one version
  later; a trainer that stops publishing leaves generators on their last version.
- ``background_receive=True`` (what the torchrun backend uses) lifts the first half: on a generator
  rank a daemon thread receives every announced version into the staging buffers as soon as all of
  its sources announced it (the same exchange ``fetch_into`` runs, under the same lock), and
  ``fetch_into`` copies the newest staged version into ``target``. A trainer's ``publish`` then
  waits only for the wire, never for the generator's next step: a generator that is busy sampling,
  blocked by backpressure, colocated with the trainer (serialised steps) or finished with its
  last step no longer stalls the trainers. The cost is one more copy (staging -> target) per
  delivery that no longer overlaps the wire. An error in the thread (a peer died, a timeout) is
  raised by the next ``fetch_into``.

Timeouts (no rank hangs forever): the constructor waits up to ``timeout_s`` for every
participating rank to construct the transport with the same options (a handshake over the store,
which also catches ranks whose options differ); ``publish`` waits up to ``timeout_s`` for the
previous version to be received; ``fetch_into`` waits up to ``timeout_s`` for announced data to
arrive. Each wait raises :class:`~flowrl.errors.TransportError` naming the ranks and the version.
The process group's own timeout (``init_process_group(timeout=...)``) bounds everything else; on
NCCL, ``Work.wait`` only orders streams, so there the process group timeout (watchdog) is the bound.
After a timeout the process group's state is undefined: the job should stop.

Several instances may share a process group if each has its own ``channel`` (its gloo tag and store
keys); NCCL ignores tags, so there give each instance its own group or use them one at a time. The
first ``batch_isend_irecv`` on an NCCL group must involve all of the group's ranks: pass a group of
exactly the participating ranks, or run one collective on it first. Calls on one rank are serialised
by a lock (a colocated rank may publish and fetch from two threads); a dual rank's ``fetch_into``
holds it while it waits for its peers.

Example (every rank of a 4-rank gloo group, 2 trainer ranks with FSDP -> 2 generator ranks with tp2):
    >>> t = CollectiveTransport(params={"w": {"shape": [8, 8], "dtype": "float32"}},
    ...                         trainer_layout=fsdp((0, 1)), generator_layout=tp_row((2, 3)))  # doctest: +SKIP
    >>> t.publish({"w": full[local_slice(fsdp((0, 1)), (8, 8), rank)]}, 0)   # on ranks 0, 1  # doctest: +SKIP
    >>> t.fetch_into({"w": my_shard}, newer_than=-1)                          # on ranks 2, 3  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import threading
import time
import zlib
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Literal, NamedTuple

import msgspec
import torch
import torch.distributed as dist

from flowrl.errors import ConfigError, TransportError
from flowrl.runtime.resharding import ShardLayout, Transfer, local_shape, plan_state
from flowrl.runtime.transports.base import State, StateLayout, TensorSpec, check_state, check_target, check_version
from flowrl.runtime.transports.registry import TransportTraits
from flowrl.runtime.wire import DTYPES as WIRE_DTYPES

__all__ = ["CollectiveTransport", "ParamSpec", "HEADER_BYTES", "DTYPES"]

HEADER_BYTES = 32
_MAGIC = int.from_bytes(b"FLOWRL01", "little")
_ALIGN = 16
_POLL_S = (0.0005, 0.005)  # fetch_into's store polling: first and longest pause

#: Dtype names a parameter may declare: the ones that cross processes (``flowrl.runtime.wire``).
DTYPES = WIRE_DTYPES

#: Send works (and their buffers) still pending when their transport closed: kept referenced so that
#: gloo never writes from freed memory; they finish or fail when the process group is destroyed.
_ABANDONED: list[Any] = []


class ParamSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Full (unsharded) shape and dtype of one parameter.

    Attributes:
        shape: the full tensor's shape.
        dtype: one of :data:`DTYPES`: the dtype of the published shards (fetch targets may differ: they are cast).
    """

    shape: tuple[int, ...]
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"ParamSpec: dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
        if any(not isinstance(s, int) or s < 0 for s in self.shape):
            raise ConfigError(f"ParamSpec: shape {self.shape} must be non-negative integers")


class _Spec(msgspec.Struct, frozen=True, kw_only=True):
    """Everything every rank must agree on; its digest is compared in the handshake."""

    params: dict[str, ParamSpec]
    trainer: dict[str, ShardLayout]
    generator: dict[str, ShardLayout]
    chunk_bytes: int


class _Block(NamedTuple):
    """One block of one parameter inside a message buffer."""

    name: str
    offset: int  # byte offset in the buffer
    nbytes: int
    shape: tuple[int, ...]
    slices: tuple[slice, ...]  # where the block lies in this rank's local shard (source or destination side)
    other: tuple[slice, ...]  # local copies only: the destination-side index


class _Chunk(NamedTuple):
    """A byte range ``[lo, hi)`` of one message, posted as one send/receive: whole blocks, the header in the first."""

    lo: int
    hi: int
    blocks: tuple[_Block, ...]


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _chunks(blocks: list[_Block], total: int, chunk_bytes: int) -> list[_Chunk]:
    """Split a message at block boundaries into pieces of at least ``chunk_bytes`` (0: one piece)."""
    out: list[_Chunk] = []
    lo, cur = 0, []
    for b in blocks:
        cur.append(b)
        end = _align(b.offset + b.nbytes)
        if chunk_bytes > 0 and end - lo >= chunk_bytes and end < total:
            out.append(_Chunk(lo, end, tuple(cur)))
            lo, cur = end, []
    out.append(_Chunk(lo, total, tuple(cur)))
    return out


def _round_robin(chunks: dict[int, list[_Chunk]]) -> list[tuple[int, _Chunk]]:
    """(peer, chunk) in the order they are posted: chunk 0 of every peer, then chunk 1, ... (keeps peers busy)."""
    longest = max((len(c) for c in chunks.values()), default=0)
    return [(peer, cs[i]) for i in range(longest) for peer, cs in sorted(chunks.items()) if i < len(cs)]


def _layouts(value: Any, names: list[str], what: str) -> dict[str, ShardLayout]:
    """One layout for every parameter, or name -> layout; structs or their plain-dict form."""
    if isinstance(value, ShardLayout):
        return {n: value for n in names}
    if isinstance(value, Mapping) and "ranks" in value and set(value) != set(names):
        one = msgspec.convert(value, ShardLayout)
        return {n: one for n in names}
    if isinstance(value, Mapping):
        missing, extra = sorted(set(names) - set(value)), sorted(set(value) - set(names))
        if missing or extra:
            raise ConfigError(
                f"CollectiveTransport: {what} must be one layout or one per parameter; "
                f"missing layouts for {missing}, layouts for unknown parameters {extra}"
            )
        return {n: v if isinstance(v, ShardLayout) else msgspec.convert(v, ShardLayout) for n, v in value.items()}
    raise ConfigError(f"CollectiveTransport: {what} must be a ShardLayout or a mapping, got {type(value).__name__}")


class CollectiveTransport:
    """Weights from trainer shards to generator shards over torch.distributed; see the module docstring.

    Args:
        params: name -> :class:`ParamSpec` (or its dict form ``{"shape": [...], "dtype": "float32"}``):
            the *full* shapes.
        trainer_layout: one :class:`~flowrl.runtime.resharding.ShardLayout` for every parameter, or
            name -> layout (structs or their dict form). Ranks are global ranks.
        generator_layout: likewise for the generator side.
        channel: names this transport's store keys and gloo tag; give each weight edge its own.
        timeout_s: the longest any call waits for other ranks (see the module docstring).
        fetch_wait_s: how long ``fetch_into`` polls for a new version before returning None.
        device: where the send/receive buffers live (``"cpu"`` for gloo, ``"cuda:<i>"`` for NCCL).
        chunk_bytes: messages go in pieces of about this many bytes (whole blocks), so that copying
            into send buffers, the wire and copying into the target overlap; 0 sends each message whole.
        rank: this process's global rank (default ``dist.get_rank()``).
        group: the process group (default the world).
        store: the store used to announce versions (default the default process group's store).
        handshake: wait at construction until every participating rank constructed the transport
            with the same options.
        background_receive: on a generator rank, receive every announced version in a daemon
            thread (see the module docstring); ``fetch_into`` then only delivers.

    Raises:
        ConfigError: for options that do not describe a valid plan.
        TransportError: if this rank is in neither layout, or the handshake fails.

    Attributes:
        bytes_sent: payload bytes this rank has put on the wire (headers excluded).
        header_bytes_sent: header bytes this rank has put on the wire.
        bytes_received: payload bytes this rank has received.
        bytes_copied_locally: bytes this rank copied from its own trainer shards to its generator shards.
        send_bytes_per_version: payload bytes this rank sends per published version.
    """

    name = "collective"
    #: torch.distributed point-to-point between the edge's ranks, built per rank by the torchrun backend
    traits = TransportTraits(crosses_processes=True, crosses_hosts=True, collective=True, cost="collective")

    def __init__(
        self,
        *,
        params: Mapping[str, ParamSpec | Mapping[str, Any]],
        trainer_layout: Any,
        generator_layout: Any,
        channel: str = "weights",
        timeout_s: float = 300.0,
        fetch_wait_s: float = 0.0,
        device: str = "cpu",
        chunk_bytes: int = 8 << 20,
        rank: int | None = None,
        group: dist.ProcessGroup | None = None,
        store: dist.Store | None = None,
        handshake: bool = True,
        background_receive: bool = False,
    ) -> None:
        names = sorted(params)
        specs = {n: p if isinstance(p, ParamSpec) else msgspec.convert(p, ParamSpec) for n, p in params.items()}
        self._spec = _Spec(
            params={n: specs[n] for n in names},
            trainer=_layouts(trainer_layout, names, "trainer_layout"),
            generator=_layouts(generator_layout, names, "generator_layout"),
            chunk_bytes=int(chunk_bytes),  # both sides must cut messages into the same pieces
        )
        if timeout_s <= 0:
            raise ConfigError(f"CollectiveTransport: timeout_s={timeout_s} must be > 0")
        self._timeout = timedelta(seconds=timeout_s)
        self._timeout_s = float(timeout_s)
        self._fetch_wait_s = float(fetch_wait_s)
        self._device = torch.device(device)
        self._chunk_bytes = self._spec.chunk_bytes
        self._group = group
        self.channel = channel
        self._tag = zlib.crc32(channel.encode()) % (1 << 20) + 1
        if rank is None:
            if not dist.is_initialized():
                raise TransportError("CollectiveTransport needs an initialized process group (dist.init_process_group) or rank=")
            rank = dist.get_rank()
        self.rank = rank
        self._where = f"collective {channel!r} rank {rank}"

        self._plans = plan_state(
            {n: (s.shape, s.dtype) for n, s in self._spec.params.items()}, self._spec.trainer, self._spec.generator
        )
        self.trainer_ranks = sorted({r for lay in self._spec.trainer.values() for r in lay.ranks})
        self.generator_ranks = sorted({r for lay in self._spec.generator.values() for r in lay.ranks})
        self.is_trainer = rank in self.trainer_ranks
        self.is_generator = rank in self.generator_ranks
        if not (self.is_trainer or self.is_generator):
            raise TransportError(
                f"CollectiveTransport {channel!r}: rank {rank} is in neither the trainer ranks {self.trainer_ranks} "
                f"nor the generator ranks {self.generator_ranks}; construct it only on participating ranks"
            )
        self._dual = self.is_trainer and self.is_generator
        self._build_messages()

        # version state (see the module docstring)
        self._published = -1  # trainer side: last version published
        self._sent = -1  # trainer side: last version whose sends were posted
        self._send_works: list[Any] = []
        self._received = -1  # generator side: the version the staging buffers hold (complete)
        self._closed = False
        self._outbox: dict[int, torch.Tensor] | None = None
        self._inbox: dict[int, torch.Tensor] | None = None
        self._local_out: torch.Tensor | None = None
        self._local_in: torch.Tensor | None = None

        self.bytes_sent = 0
        self.header_bytes_sent = 0
        self.bytes_received = 0
        self.bytes_copied_locally = 0
        self._counts = {"publishes": 0, "deliveries": 0, "exchanges": 0}
        self._lock = threading.Lock()
        self._layouts = {"trainer": self._layout("trainer"), "generator": self._layout("generator")}

        self._store = store if store is not None else (dist.distributed_c10d._get_default_store() if dist.is_initialized() else None)
        if self._store is None:
            raise TransportError(f"CollectiveTransport {channel!r}: no store to announce versions in; pass store=")
        epoch = self._store.add(f"flowrl/collective/{channel}/epoch/{rank}", 1)
        self._prefix = f"flowrl/collective/{channel}/{epoch}"
        if handshake:
            self._handshake()
        self._pump_error: BaseException | None = None
        self._pump_stop = threading.Event()
        self._pump: threading.Thread | None = None
        if background_receive and self.is_generator:
            self._pump = threading.Thread(target=self._receive_loop, name=f"flowrl-collective-{channel}", daemon=True)
            self._pump.start()

    # --- plan -> messages ------------------------------------------------------------------------

    def _build_messages(self) -> None:
        """This rank's blocks: per destination (sends), per source (receives), and local copies."""
        me = self.rank
        sends: dict[int, list[_Block]] = {}
        recvs: dict[int, list[_Block]] = {}
        local: list[_Block] = []
        offsets: dict[tuple[int, int], int] = {}
        local_off = 0
        load = {r: 0 for r in self.trainer_ranks}
        fed: set[int] = set()
        for name, transfers in self._plans.items():
            spec = self._spec.params[name]
            size = DTYPES[spec.dtype].itemsize
            for t in transfers:
                nbytes = t.numel * size
                if t.local:
                    if t.src_rank == me:
                        local.append(_Block(name, local_off, nbytes, t.shape, t.src_slices(), t.dst_slices()))
                        local_off = _align(local_off + nbytes)
                    continue
                load[t.src_rank] += nbytes
                fed.add(t.dst_rank)
                key = (t.src_rank, t.dst_rank)
                off = offsets.get(key, HEADER_BYTES)
                offsets[key] = _align(off + nbytes)
                if t.src_rank == me:
                    sends.setdefault(t.dst_rank, []).append(_Block(name, off, nbytes, t.shape, t.src_slices(), ()))
                if t.dst_rank == me:
                    recvs.setdefault(t.src_rank, []).append(_Block(name, off, nbytes, t.shape, t.dst_slices(), ()))
        # Generator ranks that receive nothing and are no trainer learn each version from a header-only message.
        for g in self.generator_ranks:
            if g in fed or g in self.trainer_ranks:
                continue
            src = min(self.trainer_ranks, key=lambda r: (load[r], r))
            load[src] += 1
            offsets[(src, g)] = HEADER_BYTES
            if src == me:
                sends[g] = []
            if g == me:
                recvs[src] = []
        self._sends = sends
        self._recvs = recvs
        self._send_chunks = {d: _chunks(bl, offsets[(me, d)], self._chunk_bytes) for d, bl in sends.items()}
        self._recv_chunks = {s: _chunks(bl, offsets[(s, me)], self._chunk_bytes) for s, bl in recvs.items()}
        self._local = local
        self._sizes = offsets  # (src, dst) -> message bytes, header included
        self._local_bytes = local_off
        self.send_bytes_per_version = sum(b.nbytes for blocks in sends.values() for b in blocks)
        # the ranks whose announced version a generator waits for: its remote sources, and itself if dual
        self._sources = sorted(recvs) + ([me] if self._dual else [])

    def local_shapes(self, role: Literal["trainer", "generator"]) -> dict[str, tuple[int, ...]]:
        """Name -> shape of the local shards this rank publishes (``"trainer"``) or fetches into."""
        layouts = self._spec.trainer if role == "trainer" else self._spec.generator
        return {
            n: local_shape(layouts[n], self._spec.params[n].shape, self.rank)
            for n in self._spec.params
            if self.rank in layouts[n].ranks
        }

    def message_sizes(self) -> dict[tuple[int, int], int]:
        """(source rank, destination rank) -> bytes of their message per version, header and padding included."""
        return dict(self._sizes)

    def plan(self) -> dict[str, list[Transfer]]:
        """The transfer plan every rank computed (name -> transfers), for inspection and tests."""
        return dict(self._plans)

    def stats(self) -> dict[str, Any]:
        """Counters of this rank: bytes on the wire, local copies, publishes, deliveries."""
        return {
            "rank": self.rank,
            "bytes_sent": self.bytes_sent,
            "header_bytes_sent": self.header_bytes_sent,
            "bytes_received": self.bytes_received,
            "bytes_copied_locally": self.bytes_copied_locally,
            "published": self._published,
            "received": self._received,
            **self._counts,
        }

    # --- store: handshake and announcements --------------------------------------------------------

    def _handshake(self) -> None:
        digest = hashlib.sha256(msgspec.json.encode(self._spec)).hexdigest()[:16]
        ranks = sorted({*self.trainer_ranks, *self.generator_ranks})
        self._store.set(f"{self._prefix}/hello/{self.rank}", digest)
        keys = [f"{self._prefix}/hello/{r}" for r in ranks]
        try:
            self._store.wait(keys, self._timeout)
        except Exception as exc:  # DistStoreError / RuntimeError on timeout
            missing = [r for r, k in zip(ranks, keys) if not self._store.check([k])]
            raise TransportError(
                f"{self._where}: rank(s) {missing} did not construct "
                f"the transport within {self._timeout_s:.0f} s (participants {ranks}); construct it on every "
                "trainer and generator rank, or raise timeout_s"
            ) from exc
        digests = {r: self._store.get(k).decode() for r, k in zip(ranks, keys)}
        differ = sorted(r for r, d in digests.items() if d != digest)
        if differ:
            raise TransportError(
                f"{self._where}: rank(s) {differ} were constructed with other params or "
                f"layouts than this rank (option digests {digests}); pass the same options on every rank"
            )

    def _announced(self, rank: int) -> int:
        return int(self._store.add(f"{self._prefix}/v/{rank}", 0)) - 1

    def _available(self) -> int:
        """The newest version every source of this generator rank has announced (-1 if none)."""
        return min(self._published if r == self.rank else self._announced(r) for r in self._sources)

    # --- buffers -----------------------------------------------------------------------------------

    def _buffers(self) -> None:
        if self._outbox is not None:
            return
        dev = self._device
        self._outbox = {d: torch.zeros(self._sizes[(self.rank, d)], dtype=torch.uint8, device=dev) for d in self._sends}
        self._inbox = {s: torch.zeros(self._sizes[(s, self.rank)], dtype=torch.uint8, device=dev) for s in self._recvs}
        self._local_out = torch.zeros(self._local_bytes, dtype=torch.uint8, device=dev)
        self._local_in = torch.zeros(self._local_bytes, dtype=torch.uint8, device=dev) if self._dual else None

    def _view(self, buf: torch.Tensor, block: _Block) -> torch.Tensor:
        dtype = DTYPES[self._spec.params[block.name].dtype]
        return buf[block.offset : block.offset + block.nbytes].view(dtype).view(block.shape)

    # --- checks ------------------------------------------------------------------------------------

    def _layout(self, role: Literal["trainer", "generator"]) -> StateLayout:
        specs = [
            TensorSpec(name=n, dtype=self._spec.params[n].dtype, shape=shape, offset=0, nbytes=0)
            for n, shape in self.local_shapes(role).items()
        ]
        return StateLayout(tensors=tuple(specs), nbytes=0)

    def _check_tensors(self, tensors: Mapping[str, torch.Tensor], role: Literal["trainer", "generator"], version: int) -> None:
        """The shared checks of ``base`` (same messages as every transport), against this rank's shards."""
        try:
            if role == "trainer":
                check_state(self._where, self._layouts[role], tensors, version)
            else:
                check_target(self._where, self._layouts[role], tensors)
        except TransportError as exc:
            raise TransportError(
                f"{exc} (here the layout is rank {self.rank}'s {role} shards of the full shapes in `params`: "
                f"see CollectiveTransport.local_shapes({role!r}))"
            ) from None

    def _wait(self, works: list[Any], doing: str) -> None:
        try:
            for w in works:
                w.wait(self._timeout)
        except Exception as exc:
            raise TransportError(
                f"{self._where}: {doing} did not complete within "
                f"{self._timeout_s:.0f} s ({type(exc).__name__}: {exc}); a peer is slow, stopped calling, or died. "
                "The process group is now unusable: stop the job"
            ) from exc

    def _send_op(self, peer: int, chunk: _Chunk) -> dist.P2POp:
        self.bytes_sent += sum(b.nbytes for b in chunk.blocks)
        self.header_bytes_sent += HEADER_BYTES if chunk.lo == 0 else 0
        return dist.P2POp(dist.isend, self._outbox[peer][chunk.lo : chunk.hi], peer=peer, group=self._group, tag=self._tag)

    def _recv_op(self, peer: int, chunk: _Chunk) -> dist.P2POp:
        return dist.P2POp(dist.irecv, self._inbox[peer][chunk.lo : chunk.hi], peer=peer, group=self._group, tag=self._tag)

    def _post(self, ops: list[dist.P2POp]) -> list[Any]:
        """Post ``ops`` as one batch; the works (one per op on gloo, one for the batch on NCCL)."""
        try:
            return dist.batch_isend_irecv(ops) if ops else []
        except Exception as exc:  # a peer's connection is gone
            peers = sorted({op.peer for op in ops})
            raise TransportError(
                f"{self._where}: could not post sends/receives to rank(s) {peers} ({type(exc).__name__}: {exc}); "
                "a peer died or an earlier timeout closed the connection. The process group is unusable: stop the job"
            ) from exc

    # --- trainer side ------------------------------------------------------------------------------

    def publish(self, state: State, version: int) -> None:
        """Send this trainer rank's blocks of ``state`` (its local shards) as ``version``.

        Raises:
            TransportError: if ``version`` does not exceed the last one, ``state`` does not hold this
                rank's shards, this rank is no trainer, or the previous version was not received in time.
        """
        self._check_open("publish")
        if not self.is_trainer:
            raise TransportError(
                f"{self._where}: rank {self.rank} is a generator rank only; publish on the trainer ranks {self.trainer_ranks}"
            )
        check_version(self._where, version, self._published)
        self._check_tensors(state, "trainer", version)
        with self._lock, torch.no_grad():
            self._publish(state, version)

    def _publish(self, state: State, version: int) -> None:
        self._buffers()
        if self._dual:
            if self._sent < self._published:  # the staged version never went out: exchange it first
                self._exchange(self._published)
        elif self._send_works:
            late = sorted(self._sends)
            self._wait(self._send_works, f"sending version {self._sent} to generator rank(s) {late}")
            self._send_works = []
        for d in self._sends:
            header = torch.tensor([_MAGIC, version, self._sizes[(self.rank, d)] - HEADER_BYTES, self.rank], dtype=torch.int64)
            self._outbox[d][:HEADER_BYTES].view(torch.int64).copy_(header)
        # announce first: the generators post their receives while the pieces are copied and sent
        self._store.add(f"{self._prefix}/v/{self.rank}", version - self._published)
        for b in self._local:
            self._view(self._local_out, b).copy_(state[b.name][b.slices])
        for d, chunk in _round_robin(self._send_chunks):  # copy a piece, post it, copy the next meanwhile
            for b in chunk.blocks:
                self._view(self._outbox[d], b).copy_(state[b.name][b.slices])
            if not self._dual:  # a dual rank sends from its fetch_into (see the module docstring)
                self._send_works += self._post([self._send_op(d, chunk)])
        if not self._dual:
            self._sent = version
        self._published = version
        self._counts["publishes"] += 1

    def latest_version(self) -> int:
        """Generator ranks: the newest version all of this rank's sources announced; trainer ranks: the last published."""
        self._check_open("latest_version")
        with self._lock:
            return self._available() if self.is_generator else self._published

    # --- generator side ----------------------------------------------------------------------------

    def _exchange(self, version: int, target: Mapping[str, torch.Tensor] | None = None) -> None:
        """Receive ``version`` into the staging buffers (on a dual rank, send the staged blocks in the same
        batch); with ``target``, copy each piece into it as soon as it is in (after every header checked)."""
        send = self._dual and self._sent < self._published
        if send and self._published != version:
            raise TransportError(f"{self._where}: internal error: staged version {self._published} but exchanging {version}")
        ops = [self._send_op(d, c) for d, c in _round_robin(self._send_chunks)] if send else []
        first_recv = len(ops)
        pieces = _round_robin(self._recv_chunks) if self.is_generator else []
        ops += [self._recv_op(s, c) for s, c in pieces]
        works = self._post(ops)
        peers = sorted({*self._recvs, *(self._sends if send else ())})
        doing = f"exchanging version {version} with rank(s) {peers}"
        per_op = len(works) == len(ops)  # gloo: one work per op; NCCL: one work for the whole batch
        if not per_op:
            self._wait(works, doing)
        recv_works = works[first_recv:] if per_op else []
        if per_op:  # the first piece of every message: its header (a gloo work must be waited only once)
            self._wait([w for w, (_, c) in zip(recv_works, pieces) if c.lo == 0], doing)
        for s, buf in self._inbox.items() if self.is_generator else ():
            magic, got, nbytes, src = buf[:HEADER_BYTES].view(torch.int64).tolist()
            expected = (_MAGIC, version, self._sizes[(s, self.rank)] - HEADER_BYTES, s)
            if (magic, got, nbytes, src) != expected:
                raise TransportError(
                    f"{self._where}: message from rank {s} has header (magic, version, bytes, src) = "
                    f"{(magic, got, nbytes, src)}, expected {expected}; the ranks disagree on options or versions "
                    "(the same channel used by two transports?)"
                )
        for i, (s, chunk) in enumerate(pieces):
            if per_op and chunk.lo != 0:
                self._wait([recv_works[i]], doing)
            self.bytes_received += sum(b.nbytes for b in chunk.blocks)
            if target is not None:
                self._deliver_chunk(target, s, chunk)
        if per_op:
            self._wait(works[:first_recv], doing)
        if send:
            self._sent = version
        if self._local_in is not None and self._local_bytes:
            self._local_in.copy_(self._local_out)
            self.bytes_copied_locally += sum(b.nbytes for b in self._local)
            if target is not None:
                self._deliver_local(target)
        if self.is_generator:
            self._received = version
            self._counts["exchanges"] += 1

    def fetch_into(self, target: Mapping[str, torch.Tensor], *, newer_than: int = -1) -> int | None:
        """Copy the newest version into ``target`` (this rank's local shards) and return it.

        Receives a newly announced version first (see the module docstring); the newest received
        version stays in the staging buffers, so a later call with a smaller ``newer_than`` gets it again.
        Returns None if nothing newer than ``newer_than`` is there (after polling up to ``fetch_wait_s``).

        Raises:
            TransportError: if ``target`` does not hold this rank's shards, this rank is no generator, or
                announced data did not arrive within ``timeout_s``.
        """
        self._check_open("fetch_into")
        if not self.is_generator:
            raise TransportError(
                f"{self._where}: rank {self.rank} is a trainer rank only; fetch on the generator ranks {self.generator_ranks}"
            )
        self._check_tensors(target, "generator", -1)
        deadline = time.monotonic() + self._fetch_wait_s
        pause = _POLL_S[0]
        while True:
            with self._lock, torch.no_grad():
                self._raise_pump_error()
                self._buffers()
                avail = self._available()
                delivered = False
                if avail > self._received:
                    delivered = avail > newer_than
                    self._exchange(avail, target if delivered else None)
                if self._received > newer_than:
                    if not delivered:
                        self._deliver(target)
                    self._counts["deliveries"] += 1
                    return self._received
            if time.monotonic() >= deadline:
                return None
            time.sleep(pause)
            pause = min(2 * pause, _POLL_S[1])

    # --- background receiving ------------------------------------------------------------------

    def _receive_loop(self) -> None:
        """The ``background_receive`` thread: receive each newly announced version into the staging buffers."""
        pause = _POLL_S[0]
        while not self._pump_stop.is_set():
            got = False
            try:
                with self._lock, torch.no_grad():
                    if self._closed:
                        return
                    self._buffers()
                    avail = self._available()
                    if avail > self._received:
                        self._exchange(avail)
                        got = True
            except BaseException as exc:  # noqa: BLE001 - raised by the next fetch_into
                if not self._closed:
                    self._pump_error = exc
                return
            pause = _POLL_S[0] if got else min(2 * pause, _POLL_S[1])
            self._pump_stop.wait(pause)

    def _raise_pump_error(self) -> None:
        exc = self._pump_error
        if exc is None:
            return
        if isinstance(exc, TransportError):
            raise TransportError(f"{exc} (in the background receiver)") from exc
        raise TransportError(f"{self._where}: the background receiver failed: {type(exc).__name__}: {exc}") from exc

    def _deliver_chunk(self, target: Mapping[str, torch.Tensor], source: int, chunk: _Chunk) -> None:
        for b in chunk.blocks:
            target[b.name][b.slices].copy_(self._view(self._inbox[source], b))

    def _deliver_local(self, target: Mapping[str, torch.Tensor]) -> None:
        for b in self._local:
            target[b.name][b.other].copy_(self._view(self._local_in, b))

    def _deliver(self, target: Mapping[str, torch.Tensor]) -> None:
        """Copy the staged version into ``target``."""
        for s, chunks in self._recv_chunks.items():
            for chunk in chunks:
                self._deliver_chunk(target, s, chunk)
        self._deliver_local(target)

    # --- lifetime ----------------------------------------------------------------------------------

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise TransportError(f"{self._where}: {op}() called after close(); open a new transport")

    def close(self, *, drain_s: float = 0.0) -> None:
        """Drop the buffers. With ``drain_s``, first wait up to that long for this rank's last sends to
        be received (a background receiver takes them at once). Sends still pending (nobody fetched the
        last version) are kept alive until the process group is destroyed, so that gloo never reads
        freed memory. The background receiver, if any, is stopped; if it is stuck in a transfer (a peer
        died) for more than a second, its buffers are left to it. Idempotent."""
        self._pump_stop.set()
        if self._pump is not None and self._pump is not threading.current_thread():
            self._pump.join(timeout=1.0)
        if drain_s > 0 and self._send_works and self._lock.acquire(timeout=drain_s):
            try:
                deadline = time.monotonic() + drain_s
                pending = [w for w in self._send_works if not w.is_completed()]
                while pending and time.monotonic() < deadline:
                    time.sleep(0.002)
                    pending = [w for w in pending if not w.is_completed()]
            finally:
                self._lock.release()
        if not self._lock.acquire(timeout=1.0):  # the receiver is stuck in a transfer: leave it its buffers
            self._closed = True
            _ABANDONED.append((self._send_works, self._outbox, self._inbox))
            return
        try:
            if self._closed:
                return
            self._closed = True
            if self._send_works:
                _ABANDONED.append((self._send_works, self._outbox))
            self._send_works = []
            self._outbox = self._inbox = self._local_out = self._local_in = None
        finally:
            self._lock.release()

    def __repr__(self) -> str:
        role = "trainer+generator" if self._dual else ("trainer" if self.is_trainer else "generator")
        return (
            f"CollectiveTransport(channel={self.channel!r}, rank={self.rank}, role={role}, "
            f"published={self._published}, received={self._received})"
        )
