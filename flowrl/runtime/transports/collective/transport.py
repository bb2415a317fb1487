"""``CollectiveTransport``: trainer shards to generator shards, rank to rank, over torch.distributed.

LlamaRL's distributed direct memory access: every rank computes the same transfer plan
(:func:`flowrl.placement.resharding.plan_state`) from plain-data options (parameter shapes and dtypes,
the trainer layout, the generator layout), and each trainer rank sends each generator rank exactly
the slices of its own shards that the generator's shards need: one message per (trainer rank,
generator rank) pair and version, nothing gathered on one rank, no parameter server, every byte on
the wire once per destination that lacks it, and a rank that holds a block on both sides copies it
locally. Only point-to-point operations are used (``batch_isend_irecv``), on contiguous buffers, so
the same code is correct on gloo (CPU) and NCCL (GPU, with ``device="cuda:<i>"``).

No staging copy where none is needed (the rule is :func:`flowrl.placement.resharding.staging_copies`,
which the planner prices too): a block of at least ``direct_min_bytes`` whose slice of the trainer's
shard is contiguous is sent straight from that shard's storage; one whose slice of the generator's
shard is contiguous is received straight into the target; a strided slice goes through one copy on
its side, and small blocks are packed together (one copy on each side). The sender packs piece
i + 1 while piece i is on the wire; the receiver unpacks piece i while piece i + 1 arrives.
``stats()["bytes_staged"]`` counts the bytes that went through a staging copy.

Bounded send memory (as verl, NeMo-RL and TRL send bucket by bucket): a trainer rank packs into one
reused buffer of at most ``bucket_bytes`` (:mod:`~flowrl.runtime.transports.collective.send_buffer`),
not a copy of its share of the weights: pieces are cut to at most half of it
(``messages.piece_limit``), and a region is reused once the send posted from it completed. So a
publish that packs more than a bucket waits for the wire as it goes, and the rank's staging memory
is one bucket whatever its shards weigh (``stats()["send_buffer_bytes"]``). A rank that is also a
generator (colocated) stages its whole message instead: it sends from its ``fetch_into``, after its
``state`` may have changed.

Roles come from the layouts: a rank in the trainer layout publishes, a rank in the generator
layout fetches, a rank in both (colocated) does both.

Wire format: one message per (trainer rank, generator rank) pair and version, laid out by
:mod:`~flowrl.runtime.transports.collective.messages` (a 32-byte header, then the blocks, posted as
pieces). The receiver checks every header before posting any piece, so a target is never written by
a message of another version. A generator rank that needs no data from anyone still gets a
header-only message from one trainer rank, so every generator learns every version.

Pairing semantics (publish and fetch are collective):

- ``publish(state, version)`` (trainer ranks, with their *local shards*) announces ``version`` in
  the process group's store (key ``flowrl/collective/<channel>/<epoch>/v/<rank>``), sends the
  headers, then posts each piece's send, packing it first unless it goes straight from ``state``,
  and returns. If some piece went straight from ``state``, publish first waits (up to
  ``timeout_s``) until those bytes are out, since ``state`` may change once it returns: such a
  publish returns when the generators have taken the version (they must be receiving: a
  concurrent ``fetch_into`` or ``background_receive``). A version whose pieces were all packed is
  left in flight, as far as the send buffer holds it (beyond that, publish waits for the wire as it
  reuses the buffer, see above). Each version is delivered once to each generator rank, so at most one version is
  in flight per trainer rank: ``publish(v + 1)`` first waits until every destination has received
  ``v`` (backpressure; up to ``timeout_s``).
- ``fetch_into(target, newer_than)`` (generator ranks, with their *local shard targets*) reads the
  versions its source ranks announced. When all of them announced a version ``w`` it has not
  received, it receives ``w`` (blocking until the data is in, up to ``timeout_s``; the trainer is
  posting the sends): if ``w`` is newer than ``newer_than``, straight into ``target`` where a
  piece's slice of it is contiguous and of the published dtype and device, the rest through the
  staging buffers (unpacked piece by piece as they arrive), and returns ``w``; else into the
  staging buffers only, and returns None. The newest received version can be fetched again (a
  smaller ``newer_than``): from the staging buffers, and for the pieces received straight into a
  target, from that target (which the generator keeps as its weights; one it changes in place
  changes what a fetch of the same version again delivers). With nothing new announced it answers at once, or polls up to ``fetch_wait_s`` seconds
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
  raised by the next ``fetch_into``. (It has no target to receive into: everything is staged.)

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
from typing import Any, Literal

import msgspec
import torch
import torch.distributed as dist

from flowrl.errors import ConfigError, TransportError
from flowrl.placement.resharding import DIRECT_MIN_BYTES, ShardLayout, Transfer, local_shape, plan_state
from flowrl.runtime.transports.weight_transport import State, StateLayout, TensorSpec, check_state, check_target, check_version
from flowrl.runtime.transports.collective.messages import (
    DTYPES,
    HEADER_BYTES,
    MAGIC,
    Block,
    ParamSpec,
    Piece,
    Spec,
    align,
    build_messages,
    round_robin,
)
from flowrl.runtime.transports.collective.send_buffer import SendBuffer
from flowrl.transport_traits import BUILTINS

__all__ = ["CollectiveTransport", "DEFAULT_BUCKET_BYTES"]

#: A trainer rank's send buffer by default: a bucket as the field sizes them (vLLM's weight-sync group
#: sends 128 MiB ones: ``flowrl.operators.engines.vllm_sync``), pieces of up to 32 MiB.
DEFAULT_BUCKET_BYTES = 64 << 20

_POLL_S = (0.0005, 0.005)  # fetch_into's store polling: first and longest pause

#: Send works (and their buffers) still pending when their transport closed: kept referenced so that
#: gloo never writes from freed memory; they finish or fail when the process group is destroyed.
_ABANDONED: list[Any] = []

_NO_BYTES = torch.zeros(0, dtype=torch.uint8)  # a staging buffer before _buffers makes it (nothing reads it then)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr(), a.shape, a.stride(), a.dtype, a.device) == (b.data_ptr(), b.shape, b.stride(), b.dtype, b.device)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a flat uint8 tensor (what goes on the wire)."""
    return t.reshape(-1).view(torch.uint8)


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
        trainer_layout: one :class:`~flowrl.placement.resharding.ShardLayout` for every parameter, or
            name -> layout (structs or their dict form). Ranks are global ranks.
        generator_layout: likewise for the generator side.
        channel: names this transport's store keys and gloo tag; give each weight edge its own.
        timeout_s: the longest any call waits for other ranks (see the module docstring).
        fetch_wait_s: how long ``fetch_into`` polls for a new version before returning None.
        device: where the send/receive buffers live (``"cpu"`` for gloo, ``"cuda:<i>"`` for NCCL).
        chunk_bytes: blocks smaller than ``direct_min_bytes`` go packed in pieces of about this many
            bytes, so that packing, the wire and unpacking overlap; 0 packs all of a message's small blocks together.
        bucket_bytes: a trainer rank's send buffer (its staging memory for packed pieces); no piece is
            larger than half of it (a larger block goes in parts). At least 64.
        direct_min_bytes: a block of at least this many bytes is a message of its own, sent straight
            from the shard and received straight into the target where its slice is contiguous
            (``flowrl.placement.resharding.staging_copies``).
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
        bytes_staged: bytes this rank copied through a staging buffer (packing, unpacking, local blocks),
            once per copy; one sync sums over ranks to ``resharding.transfer_volume(...).copied_bytes``.
        send_bytes_per_version: payload bytes this rank sends per published version.
        bucket_bytes: the send buffer's size (``stats()["send_buffer_bytes"]`` is what it holds).
    """

    name = "collective"
    #: torch.distributed point-to-point between the edge's ranks, built per rank by the torchrun backend
    traits = BUILTINS["collective"]

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
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        direct_min_bytes: int = DIRECT_MIN_BYTES,
        rank: int | None = None,
        group: dist.ProcessGroup | None = None,
        store: dist.Store | None = None,
        handshake: bool = True,
        background_receive: bool = False,
    ) -> None:
        if bucket_bytes < 64:
            raise ConfigError(f"CollectiveTransport: bucket_bytes={bucket_bytes} must be at least 64 (the send buffer holds two aligned pieces)")
        names = sorted(params)
        specs = {n: p if isinstance(p, ParamSpec) else msgspec.convert(p, ParamSpec) for n, p in params.items()}
        self._spec = Spec(
            params={n: specs[n] for n in names},
            trainer=_layouts(trainer_layout, names, "trainer_layout"),
            generator=_layouts(generator_layout, names, "generator_layout"),
            chunk_bytes=int(chunk_bytes),  # both sides must cut messages into the same pieces
            direct_min_bytes=int(direct_min_bytes),
            bucket_bytes=int(bucket_bytes),  # both sides cut large blocks alike
        )
        self.bucket_bytes = int(bucket_bytes)
        if timeout_s <= 0:
            raise ConfigError(f"CollectiveTransport: timeout_s={timeout_s} must be > 0")
        self._timeout = timedelta(seconds=timeout_s)
        self._timeout_s = float(timeout_s)
        self._fetch_wait_s = float(fetch_wait_s)
        self._device = torch.device(device)
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
        m = build_messages(self._spec, self._plans, rank)
        self._sends, self._recvs, self._local = m.sends, m.recvs, m.local
        self._send_pieces, self._recv_pieces = m.send_pieces, m.recv_pieces
        self._sizes, self._local_bytes, self._sources = m.sizes, m.local_bytes, m.sources  # sizes: header included
        self.send_bytes_per_version = m.send_bytes_per_version

        # version state (see the module docstring)
        self._published = -1  # trainer side: last version published
        self._sent = -1  # trainer side: last version whose sends were posted
        self._send_works: list[Any] = []
        self._received = -1  # generator side: the version the staging buffers hold (complete)
        self._closed = False
        # staging buffers: made by the first publish or fetch (_buffers), empty before it and after close
        self._allocated = False
        self._headers: dict[int, torch.Tensor] = {}  # destination -> the header of this rank's message
        self._outbox: dict[int, torch.Tensor] = {}  # a dual rank's whole messages (see the module docstring)
        self._send_buffer: SendBuffer | None = None  # a trainer rank's packed pieces
        self._inbox: dict[int, torch.Tensor] = {}  # source -> the message it sends this rank
        self._local_out = _NO_BYTES  # a dual rank's own blocks, trainer shard to generator shard
        self._local_in: torch.Tensor | None = None  # a dual rank's: the local blocks of the version received

        self.bytes_sent = 0
        self.header_bytes_sent = 0
        self.bytes_received = 0
        self.bytes_copied_locally = 0
        self.bytes_staged = 0
        self._staging_s = 0.0  # seconds spent packing and unpacking (wire pieces only)
        self._direct: dict[tuple[int, int], torch.Tensor] = {}  # (source, piece start) -> target view it was received into
        self._counts = {"publishes": 0, "deliveries": 0, "exchanges": 0}
        self._lock = threading.Lock()
        self._layouts = {"trainer": self._layout("trainer"), "generator": self._layout("generator")}

        if store is None and dist.is_initialized():
            store = dist.distributed_c10d._get_default_store()
        if store is None:
            raise TransportError(f"CollectiveTransport {channel!r}: no store to announce versions in; pass store=")
        self._store: dist.Store = store
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
            "bytes_staged": self.bytes_staged,
            "staging_s": self._staging_s,
            "send_buffer_bytes": self._send_buffer_bytes(),
            "send_buffer_peak_bytes": self._send_buffer.peak_bytes if self._send_buffer is not None else 0,
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
        if self._allocated:
            return
        self._allocated = True
        dev = self._device
        if self._dual:  # it sends from its fetch_into, after ``state`` may have changed: the whole message is staged
            self._outbox = {d: torch.zeros(self._sizes[(self.rank, d)], dtype=torch.uint8, device=dev) for d in self._sends}
            self._headers = {d: box[:HEADER_BYTES] for d, box in self._outbox.items()}
        else:
            self._headers = {d: torch.zeros(HEADER_BYTES, dtype=torch.uint8, device=dev) for d in self._sends}
            wanted = sum(align(p.hi - p.lo) for ps in self._send_pieces.values() for p in ps)  # a small message: less
            doing = f"sending a piece to generator rank(s) {sorted(self._sends)} (its send buffer region is wanted again)"
            self._send_buffer = SendBuffer(min(self.bucket_bytes, wanted), dev, lambda works: self._wait(works, doing))
        self._inbox = {s: torch.zeros(self._sizes[(s, self.rank)], dtype=torch.uint8, device=dev) for s in self._recvs}
        self._local_out = torch.zeros(self._local_bytes, dtype=torch.uint8, device=dev)
        self._local_in = torch.zeros(self._local_bytes, dtype=torch.uint8, device=dev) if self._dual else None

    def _view(self, buf: torch.Tensor, block: Block, base: int = 0) -> torch.Tensor:
        """``block`` in ``buf``, a buffer that holds its message's bytes from ``base`` on."""
        dtype = DTYPES[self._spec.params[block.name].dtype]
        lo = block.offset - base
        return buf[lo : lo + block.nbytes].view(dtype).view(block.shape)

    def _send_buffer_bytes(self) -> int:
        """Bytes of send-side staging this rank holds: its send buffer, or a dual rank's messages."""
        held = self._send_buffer.allocated_bytes if self._send_buffer is not None else 0
        return held + sum(box.numel() for box in self._outbox.values())

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

    def _p2p(self, op: Any, peer: int, buf: torch.Tensor) -> dist.P2POp:
        return dist.P2POp(op, buf, peer=peer, group=self._group, tag=self._tag)

    def _header_sends(self) -> list[dist.P2POp]:
        """The header of this rank's message to each of its destinations (the first send of a version)."""
        self.header_bytes_sent += HEADER_BYTES * len(self._sends)
        return [self._p2p(dist.isend, d, self._headers[d]) for d in sorted(self._sends)]

    def _pack(self, state: State, piece: Piece, buf: torch.Tensor, base: int) -> torch.Tensor:
        """Copy a piece's blocks from ``state`` into ``buf`` (which holds the message from byte ``base``
        on); the piece's bytes there, to send."""
        start = time.perf_counter()
        for blk in piece.blocks:
            self._view(buf, blk, base).copy_(state[blk.name][blk.slices])
            self.bytes_staged += blk.nbytes
        self._staging_s += time.perf_counter() - start
        return buf[piece.lo - base : piece.hi - base]

    def _send_packed(self, state: State, dest: int, piece: Piece) -> None:
        """Pack a piece into a region of the send buffer (waiting for the sends that still read it)
        and post its send; the buffer keeps its works."""
        assert self._send_buffer is not None
        n = piece.hi - piece.lo
        lo, region = self._send_buffer.take(n)
        self._send_buffer.sent(lo, n, self._post([self._p2p(dist.isend, dest, self._pack(state, piece, region, piece.lo))]))

    def _drain_sends(self, version: int) -> None:
        """Wait until every send of ``version`` is out (each work once: headers and in-place sends here,
        packed pieces in the send buffer)."""
        doing = f"sending version {version} to generator rank(s) {sorted(self._sends)}"
        self._wait(self._send_works, doing)
        self._send_works = []
        if self._send_buffer is not None:
            self._send_buffer.drain()

    def _pending_sends(self) -> list[Any]:
        return self._send_works + (self._send_buffer.pending() if self._send_buffer is not None else [])

    def _direct_source(self, state: State, piece: Piece) -> torch.Tensor | None:
        """The bytes of a piece straight from the shard in ``state``, or None if it must be packed
        (the plan stages it, or this tensor's slice is strided or on another device)."""
        if not piece.direct:
            return None
        blk = piece.blocks[0]
        x = state[blk.name].detach()[blk.slices]
        return _bytes_of(x) if x.is_contiguous() and x.device == self._device else None

    def _direct_target(self, target: Mapping[str, torch.Tensor] | None, piece: Piece) -> torch.Tensor | None:
        """The view of ``target`` a piece can be received into, or None if it goes through staging
        (the plan stages it, or the target's slice is strided, of another dtype or on another device)."""
        if target is None or not piece.direct:
            return None
        blk = piece.blocks[0]
        x = target[blk.name]
        if x.dtype != DTYPES[self._spec.params[blk.name].dtype] or x.device != self._device:
            return None
        view = x.detach()[blk.slices]
        return view if view.is_contiguous() else None

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
        else:
            self._drain_sends(self._sent)
        for d in self._sends:
            header = torch.tensor([MAGIC, version, self._sizes[(self.rank, d)] - HEADER_BYTES, self.rank], dtype=torch.int64)
            self._headers[d].view(torch.int64).copy_(header)
        # announce first: the generators post their receives while the pieces are packed and sent
        self._store.add(f"{self._prefix}/v/{self.rank}", version - self._published)
        for b in self._local:
            self._view(self._local_out, b).copy_(state[b.name][b.slices])
            self.bytes_staged += b.nbytes
        if self._dual:  # a dual rank stages everything and sends from its fetch_into (see the module docstring)
            for d, piece in round_robin(self._send_pieces):
                self._pack(state, piece, self._outbox[d], 0)
        else:
            self._send_works += self._post(self._header_sends())
            borrowed = False
            for d, piece in round_robin(self._send_pieces):  # pack a piece, post it, pack the next meanwhile
                buf = self._direct_source(state, piece)
                borrowed |= buf is not None
                self.bytes_sent += sum(b.nbytes for b in piece.blocks)
                if buf is None:
                    self._send_packed(state, d, piece)
                else:
                    self._send_works += self._post([self._p2p(dist.isend, d, buf)])
            if borrowed:  # sent straight from ``state``, which may change once publish returns: wait for the wire
                self._drain_sends(version)
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
        """Receive ``version``: every header first (checked), then the pieces, straight into ``target``
        where :meth:`_direct_target` allows, else into the staging buffers (copied into ``target``, if
        given, as each piece arrives). A dual rank sends its staged pieces in the same two batches."""
        send = self._dual and self._sent < self._published
        if send and self._published != version:
            raise TransportError(f"{self._where}: internal error: staged version {self._published} but exchanging {version}")
        peers = sorted({*self._recvs, *(self._sends if send else ())})
        doing = f"exchanging version {version} with rank(s) {peers}"
        # 1. headers, both ways: no byte lands in ``target`` before every source is known to send ``version``
        ops = self._header_sends() if send else []
        ops += [self._p2p(dist.irecv, s, self._inbox[s][:HEADER_BYTES]) for s in sorted(self._recvs)]
        self._wait(self._post(ops), doing)
        for s, buf in self._inbox.items() if self.is_generator else ():
            magic, got, nbytes, src = buf[:HEADER_BYTES].view(torch.int64).tolist()
            expected = (MAGIC, version, self._sizes[(s, self.rank)] - HEADER_BYTES, s)
            if (magic, got, nbytes, src) != expected:
                raise TransportError(
                    f"{self._where}: message from rank {s} has header (magic, version, bytes, src) = "
                    f"{(magic, got, nbytes, src)}, expected {expected}; the ranks disagree on options or versions "
                    "(the same channel used by two transports?)"
                )
        # 2. the pieces (the same batch holds a dual rank's sends: NCCL needs both ways in one group)
        ops = []
        for d, piece in round_robin(self._send_pieces) if send else ():
            self.bytes_sent += sum(b.nbytes for b in piece.blocks)
            ops.append(self._p2p(dist.isend, d, self._outbox[d][piece.lo : piece.hi]))
        first_recv = len(ops)
        incoming = round_robin(self._recv_pieces) if self.is_generator else []
        direct: list[torch.Tensor | None] = []
        for s, piece in incoming:
            view = self._direct_target(target, piece)
            direct.append(view)
            ops.append(self._p2p(dist.irecv, s, _bytes_of(view) if view is not None else self._inbox[s][piece.lo : piece.hi]))
        works = self._post(ops)
        per_op = len(works) == len(ops)  # gloo: one work per op; NCCL: one work for the whole batch
        if not per_op:
            self._wait(works, doing)
        for i, ((s, piece), view) in enumerate(zip(incoming, direct)):
            if per_op:
                self._wait([works[first_recv + i]], doing)  # unpack piece i while the next ones arrive
            self.bytes_received += sum(b.nbytes for b in piece.blocks)
            if view is not None:
                self._direct[(s, piece.lo)] = view  # this version's copy is now that target's
            else:
                self._direct.pop((s, piece.lo), None)
                if target is not None:
                    self._deliver_piece(target, s, piece)
        if per_op:
            self._wait(works[:first_recv], doing)
        if send:
            self._sent = version
        if self._local_in is not None and self._local_bytes:
            self._local_in, self._local_out = self._local_out, self._local_in  # received; the next publish fills the other
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

    def _deliver_piece(self, target: Mapping[str, torch.Tensor], source: int, piece: Piece) -> None:
        """Copy a received piece into ``target``: from the staging buffer, or from the target it was
        received straight into (nothing to do when that is ``target`` itself)."""
        held = self._direct.get((source, piece.lo))
        start = time.perf_counter()
        for b in piece.blocks:
            dst = target[b.name][b.slices]
            src = held if held is not None else self._view(self._inbox[source], b)
            if held is not None and _same_memory(dst, held):
                continue
            dst.copy_(src)
            self.bytes_staged += b.nbytes
        self._staging_s += time.perf_counter() - start

    def _deliver_local(self, target: Mapping[str, torch.Tensor]) -> None:
        if not self._local:
            return
        assert self._local_in is not None  # only a dual rank copies blocks locally, and _buffers gave it local_in
        for b in self._local:
            target[b.name][b.other].copy_(self._view(self._local_in, b))
            self.bytes_staged += b.nbytes

    def _deliver(self, target: Mapping[str, torch.Tensor]) -> None:
        """Copy the newest received version into ``target`` (a fetch of a version received earlier)."""
        for s, pieces in self._recv_pieces.items():
            for piece in pieces:
                self._deliver_piece(target, s, piece)
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
        if drain_s > 0 and self._pending_sends() and self._lock.acquire(timeout=drain_s):
            try:
                deadline = time.monotonic() + drain_s
                pending = [w for w in self._pending_sends() if not w.is_completed()]
                while pending and time.monotonic() < deadline:
                    time.sleep(0.002)
                    pending = [w for w in pending if not w.is_completed()]
            finally:
                self._lock.release()
        if not self._lock.acquire(timeout=1.0):  # the receiver is stuck in a transfer: leave it its buffers
            self._closed = True
            _ABANDONED.append((self._send_works, self._headers, self._outbox, self._send_buffer, self._inbox))
            return
        try:
            if self._closed:
                return
            self._closed = True
            if self._pending_sends():
                _ABANDONED.append((self._send_works, self._headers, self._outbox, self._send_buffer))
            self._send_works = []
            self._headers, self._outbox, self._inbox = {}, {}, {}
            self._local_out, self._local_in = _NO_BYTES, None
            self._send_buffer = None
            self._direct = {}
        finally:
            self._lock.release()

    def __repr__(self) -> str:
        role = "trainer+generator" if self._dual else ("trainer" if self.is_trainer else "generator")
        return (
            f"CollectiveTransport(channel={self.channel!r}, rank={self.rank}, role={role}, "
            f"published={self._published}, received={self._received})"
        )
