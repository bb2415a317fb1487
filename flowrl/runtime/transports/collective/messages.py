"""The collective transport's messages: which block of which parameter travels in which message, where.

Every rank computes the same transfer plan (:func:`flowrl.placement.resharding.plan_state`) from the
same :class:`Spec`, so every rank lays the messages out alike without exchanging anything: one
message per (trainer rank, generator rank) pair and version, a 32-byte header of four int64
``(magic, version, payload_bytes, src_rank)`` first, then the blocks in plan order (parameters in
sorted name order), each 16-byte aligned. A message is posted as *pieces*: each block of at least
``direct_min_bytes`` alone (it may skip the staging buffer, see
:func:`flowrl.placement.resharding.staging_copies`), runs of smaller blocks together up to
``chunk_bytes``, and no piece larger than half of ``bucket_bytes`` (:func:`piece_limit`): a larger
block is cut along its first dim of extent > 1 into parts, each a piece of its own, so that a
sender's one send buffer of ``bucket_bytes`` holds a piece being packed and one on the wire. Sender
and receiver cut alike, since the cut depends only on the plan.

Example (one 8 x 8 float32 matrix, FSDP over ranks 0, 1 -> dim-0 tp over ranks 2, 3, seen by rank 0):
    >>> from flowrl.placement.resharding import fsdp, plan_state, tp_column
    >>> spec = Spec(params={"w": ParamSpec(shape=(8, 8))}, trainer={"w": fsdp((0, 1))},
    ...             generator={"w": tp_column((2, 3))}, chunk_bytes=0, direct_min_bytes=64)
    >>> m = build_messages(spec, plan_state({"w": ((8, 8), "float32")}, spec.trainer, spec.generator), rank=0)
    >>> {dest: [(b.name, b.offset, b.nbytes) for b in blocks] for dest, blocks in m.sends.items()}
    {2: [('w', 32, 128)]}
    >>> m.sizes[(0, 2)], m.send_bytes_per_version
    (160, 128)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import msgspec

from flowrl.errors import ConfigError
from flowrl.placement.resharding import ShardLayout, Transfer, local_shape, staging_copies
from flowrl.runtime.wire import DTYPES as WIRE_DTYPES

__all__ = [
    "DTYPES", "HEADER_BYTES", "MAGIC", "Block", "Messages", "ParamSpec", "Piece", "Spec",
    "align", "build_messages", "piece_limit", "pieces", "round_robin", "split",
]

HEADER_BYTES = 32
MAGIC = int.from_bytes(b"FLOWRL01", "little")
_ALIGN = 16

#: Dtype names a parameter may declare: the ones that cross processes (``flowrl.runtime.wire``).
DTYPES = WIRE_DTYPES


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


class Spec(msgspec.Struct, frozen=True, kw_only=True):
    """Everything every rank must agree on; its digest is compared in the handshake."""

    params: dict[str, ParamSpec]
    trainer: dict[str, ShardLayout]
    generator: dict[str, ShardLayout]
    chunk_bytes: int
    direct_min_bytes: int
    bucket_bytes: int = 0  # a sender's send buffer; pieces are at most half of it (0: pieces uncut)


class Block(NamedTuple):
    """One block of one parameter inside a message's staging buffer."""

    name: str
    offset: int  # byte offset in the staging buffer
    nbytes: int
    shape: tuple[int, ...]
    slices: tuple[slice, ...]  # where the block lies in this rank's local shard (source or destination side)
    other: tuple[slice, ...]  # local copies only: the destination-side index
    direct: bool  # the plan sends (receives) it straight from (into) the shard: ``staging_copies`` says 0 on this side


class Piece(NamedTuple):
    """Bytes ``[lo, hi)`` of one message's staging buffer, posted as one send/receive: one block of at
    least ``direct_min_bytes`` (which may skip the staging buffer), or a run of smaller blocks packed."""

    lo: int
    hi: int
    blocks: tuple[Block, ...]

    @property
    def direct(self) -> bool:
        return len(self.blocks) == 1 and self.blocks[0].direct


def align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def piece_limit(bucket_bytes: int) -> int:
    """The most bytes of one piece when a sender's send buffer holds ``bucket_bytes``: half of it,
    rounded down to the alignment, so that one piece is packed while the one before is on the wire
    (0: no limit).

    >>> piece_limit(64 << 20) == 32 << 20, piece_limit(100), piece_limit(0)
    (True, 48, 0)
    """
    return max(_ALIGN, bucket_bytes // 2 // _ALIGN * _ALIGN) if bucket_bytes > 0 else 0


def split(block: Block, max_bytes: int) -> list[Block]:
    """``block`` cut into parts of at most ``max_bytes`` along its first dim of extent > 1 (then the
    next, for a part of one row that is still larger): each part is a run of the block's bytes, and a
    part of a slice that is contiguous in its shard is contiguous there too.

    >>> b = Block("w", 32, 4 * 6 * 5, (6, 5), (slice(2, 8), slice(0, 5)), (), True)
    >>> [(p.offset, p.nbytes, p.shape, p.slices[0]) for p in split(b, 48)]
    [(32, 40, (2, 5), slice(2, 4, None)), (72, 40, (2, 5), slice(4, 6, None)), (112, 40, (2, 5), slice(6, 8, None))]
    """
    if max_bytes <= 0 or block.nbytes <= max_bytes:
        return [block]
    k = next(i for i, n in enumerate(block.shape) if n > 1)  # a block of one element is never larger
    unit = block.nbytes // block.shape[k]  # bytes per index along dim k
    step = max(1, max_bytes // unit)
    out: list[Block] = []
    for i in range(0, block.shape[k], step):
        j = min(i + step, block.shape[k])
        where = block.slices[k]
        part = block._replace(
            offset=block.offset + i * unit, nbytes=(j - i) * unit,
            shape=(*block.shape[:k], j - i, *block.shape[k + 1 :]),
            slices=(*block.slices[:k], slice(where.start + i, where.start + j), *block.slices[k + 1 :]),
        )
        out += split(part, max_bytes)
    return out


def pieces(blocks: list[Block], chunk_bytes: int, direct_min: int, max_bytes: int = 0) -> list[Piece]:
    """Cut a message's blocks into pieces: a block of ``direct_min`` bytes or more alone, smaller
    neighbours together up to ``chunk_bytes`` (0: no limit), no piece over ``max_bytes`` (0: no
    limit; a larger block is cut by :func:`split`, each part a piece of its own). Depends only on the
    plan, so sender and receiver cut alike."""
    out: list[Piece] = []
    run: list[Block] = []

    def close_run() -> None:
        if run:
            out.append(Piece(run[0].offset, run[-1].offset + run[-1].nbytes, tuple(run)))
            run.clear()

    for b in blocks:
        if b.nbytes >= direct_min or (max_bytes and b.nbytes > max_bytes):
            close_run()
            out += [Piece(p.offset, p.offset + p.nbytes, (p,)) for p in split(b, max_bytes)]
            continue
        if run and max_bytes and b.offset + b.nbytes - run[0].offset > max_bytes:
            close_run()
        run.append(b)
        if chunk_bytes > 0 and b.offset + b.nbytes - run[0].offset >= chunk_bytes:
            close_run()
    close_run()
    return out


def round_robin(pieces: dict[int, list[Piece]]) -> list[tuple[int, Piece]]:
    """(peer, piece) in the order they are posted: piece 0 of every peer, then piece 1, ... (keeps peers busy)."""
    longest = max((len(c) for c in pieces.values()), default=0)
    return [(peer, cs[i]) for i in range(longest) for peer, cs in sorted(pieces.items()) if i < len(cs)]


class Messages(NamedTuple):
    """One rank's share of the plan, laid out as messages.

    Attributes:
        sends: destination rank -> the blocks this rank sends it (empty: a header-only message).
        recvs: source rank -> the blocks this rank receives from it.
        local: blocks this rank copies from its own trainer shard to its own generator shard
            (``offset`` in the local staging buffer, ``slices`` source-side, ``other`` destination-side).
        sizes: (source, destination) -> message bytes, header included, for every pair of the plan.
        local_bytes: the local staging buffer's size.
        send_pieces: destination -> the pieces the sends are posted as.
        recv_pieces: source -> the pieces the receives are posted as.
        sources: the ranks whose announced version this generator rank waits for (its remote
            sources, and itself if it also trains).
        send_bytes_per_version: payload bytes this rank sends per version.
    """

    sends: dict[int, list[Block]]
    recvs: dict[int, list[Block]]
    local: list[Block]
    sizes: dict[tuple[int, int], int]
    local_bytes: int
    send_pieces: dict[int, list[Piece]]
    recv_pieces: dict[int, list[Piece]]
    sources: list[int]
    send_bytes_per_version: int


def build_messages(spec: Spec, plans: Mapping[str, list[Transfer]], rank: int) -> Messages:
    """Lay ``rank``'s transfers out as messages (every rank computes every pair's size alike).

    Args:
        spec: the options every rank agreed on.
        plans: parameter name -> its transfers (``resharding.plan_state`` of ``spec``).
        rank: this process's global rank.

    Returns:
        The blocks, pieces and sizes of this rank's messages.
    """
    trainer_ranks = sorted({r for lay in spec.trainer.values() for r in lay.ranks})
    generator_ranks = sorted({r for lay in spec.generator.values() for r in lay.ranks})
    sends: dict[int, list[Block]] = {}
    recvs: dict[int, list[Block]] = {}
    local: list[Block] = []
    offsets: dict[tuple[int, int], int] = {}
    local_off = 0
    load = {r: 0 for r in trainer_ranks}
    fed: set[int] = set()
    direct_min = spec.direct_min_bytes
    for name, transfers in plans.items():
        param = spec.params[name]
        size = DTYPES[param.dtype].itemsize
        src, dst = spec.trainer[name], spec.generator[name]
        for t in transfers:
            nbytes = t.numel * size
            if t.local:
                if t.src_rank == rank:
                    local.append(Block(name, local_off, nbytes, t.shape, t.src_slices(), t.dst_slices(), False))
                    local_off = align(local_off + nbytes)
                continue
            load[t.src_rank] += nbytes
            fed.add(t.dst_rank)
            key = (t.src_rank, t.dst_rank)
            off = offsets.get(key, HEADER_BYTES)
            offsets[key] = align(off + nbytes)
            if rank not in key:
                continue
            pack, unpack = staging_copies(  # the same rule the planner prices (resharding.transfer_volume)
                t, local_shape(src, param.shape, t.src_rank), local_shape(dst, param.shape, t.dst_rank), nbytes,
                dual_sender=t.src_rank in generator_ranks, direct_min_bytes=direct_min,
            )
            if t.src_rank == rank:
                sends.setdefault(t.dst_rank, []).append(Block(name, off, nbytes, t.shape, t.src_slices(), (), not pack))
            if t.dst_rank == rank:
                recvs.setdefault(t.src_rank, []).append(Block(name, off, nbytes, t.shape, t.dst_slices(), (), not unpack))
    # Generator ranks that receive nothing and are no trainer learn each version from a header-only message.
    for g in generator_ranks:
        if g in fed or g in trainer_ranks:
            continue
        feeder = min(trainer_ranks, key=lambda r: (load[r], r))
        load[feeder] += 1
        offsets[(feeder, g)] = HEADER_BYTES
        if feeder == rank:
            sends[g] = []
        if g == rank:
            recvs[feeder] = []
    dual = rank in trainer_ranks and rank in generator_ranks
    cap = piece_limit(spec.bucket_bytes)
    return Messages(
        sends=sends,
        recvs=recvs,
        local=local,
        sizes=offsets,
        local_bytes=local_off,
        send_pieces={d: pieces(bl, spec.chunk_bytes, direct_min, cap) for d, bl in sends.items()},
        recv_pieces={s: pieces(bl, spec.chunk_bytes, direct_min, cap) for s, bl in recvs.items()},
        sources=sorted(recvs) + ([rank] if dual else []),
        send_bytes_per_version=sum(b.nbytes for blocks in sends.values() for b in blocks),
    )
