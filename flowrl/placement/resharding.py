"""Resharding math: how a parameter is split over ranks, and which slices move between two layouts.

Pure functions over plain data (no torch, no torch.distributed): the collective weight transport
(``flowrl.runtime.transports.collective``) plans with them, the planner can price a weight sync with
them, and the tests check their properties without starting a process.

A :class:`ShardLayout` says, in the spirit of DTensor, how one parameter lies over a set of ranks:
the ranks form a mesh (``mesh_shape``, row-major over ``ranks``, innermost axis last) and each mesh
axis either replicates the tensor or shards one tensor dim::

    ShardLayout(ranks=(0, 1, 2, 3), mesh_shape=(2, 2), axis_names=("dp", "tp"),
                placements=(Replicate(), Shard(dim=1)))     # 2 dp replicas of a tp2 row split

Splits follow ``torch.chunk`` (which DTensor and FSDP2 use too): a dim of size ``n`` over ``k`` ranks
gives chunks of ``ceil(n / k)`` elements, the last ones shorter or *empty* (``n=5, k=4`` gives
``2, 2, 1, 0``). When several mesh axes shard the same dim, the splits nest in ``shard_order``
(mesh axes left to right by default, as DTensor does; FSDP2 on top of tensor parallelism splits the
tp axis first, see :func:`dp_tp`).

A *box* is the block of a tensor a rank holds: one ``(start, stop)`` pair per dim, in global
coordinates. :func:`plan_transfer` lists the :class:`Transfer` s that give every destination rank
its box: every destination element arrives exactly once, from one source rank holding it (the least
loaded replica so far, ties to the earlier rank in the layout: deterministic, so every rank computes
the same plan), and a rank holding the data on both sides copies it locally (no bytes on the wire).
:func:`minimum_bytes` is what every destination rank needs and does not already hold; a plan's wire
bytes (:func:`wire_bytes`) equal it.

What a transfer costs besides the wire is decided here too, once, for the transport and the planner:
:func:`staging_copies` says whether a block goes through a staging copy on the sending side (its
slice of the source shard is strided, or it is small and packed with its neighbours) and on the
receiving side (likewise for the destination shard); :func:`transfer_volume` sums a whole plan
(wire bytes, local bytes, bytes copied, the busiest rank's share). The collective transport sends
and receives by these rules and counts what it did; the planner prices a weight sync with
:func:`transfer_volume`.

Example:
    >>> src, dst = fsdp((0, 1)), tp_row((2, 3))
    >>> local_slice(dst, (4, 6), 3)
    (slice(0, 4, None), slice(3, 6, None))
    >>> [(t.src_rank, t.dst_rank, t.box) for t in plan_transfer((4, 6), src, dst)]
    [(0, 2, ((0, 2), (0, 3))), (1, 2, ((2, 4), (0, 3))), (0, 3, ((0, 2), (3, 6))), (1, 3, ((2, 4), (3, 6)))]
    >>> minimum_bytes((4, 6), "float32", src, dst)
    96
    >>> transfer_volume({"w": ((4, 6), "float32")}, src, dst, direct_min_bytes=0).copied_bytes  # sender slices are strided
    96
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Any

import msgspec

from flowrl.errors import ConfigError

__all__ = [
    "Box",
    "Replicate",
    "Shard",
    "AxisPlacement",
    "ShardLayout",
    "Transfer",
    "replicated",
    "dp_replicas",
    "sharded",
    "tp_column",
    "tp_row",
    "fsdp",
    "dp_tp",
    "chunk_bounds",
    "local_box",
    "local_slice",
    "local_shape",
    "box_numel",
    "intersect",
    "plan_transfer",
    "plan_state",
    "wire_bytes",
    "minimum_bytes",
    "itemsize",
    "DIRECT_MIN_BYTES",
    "is_contiguous",
    "staging_copies",
    "TransferVolume",
    "transfer_volume",
]

#: A block of a tensor: one ``(start, stop)`` pair per dim, stop exclusive.
Box = tuple[tuple[int, int], ...]

_STRUCT = dict(frozen=True, kw_only=True, forbid_unknown_fields=True)

#: Bytes per element of the dtype names flowrl moves (torch/numpy dtypes carry ``itemsize`` themselves).
_ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
    "complex128": 16, "complex64": 8,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}


class Replicate(msgspec.Struct, tag="replicate", tag_field="kind", **_STRUCT):
    """Every rank along this mesh axis holds the same data."""

    def __str__(self) -> str:
        return "R"


class Shard(msgspec.Struct, tag="shard", tag_field="kind", **_STRUCT):
    """The ranks along this mesh axis split tensor dim ``dim`` (``torch.chunk`` sizes).

    Attributes:
        dim: the tensor dim that is split (>= 0).
    """

    dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or self.dim < 0:
            raise ConfigError(f"Shard(dim={self.dim!r}): dim must be an integer >= 0 (negative dims are not resolved)")

    def __str__(self) -> str:
        return f"S({self.dim})"


AxisPlacement = Replicate | Shard


class ShardLayout(msgspec.Struct, cache_hash=True, **_STRUCT):  # hashed often by the cached box functions
    """How one parameter lies over ``ranks``: a mesh of ranks and one placement per mesh axis.

    Attributes:
        ranks: the ranks of the mesh, row-major over ``mesh_shape`` (the last axis varies fastest).
            Ranks are those of the process group the layout is used with (global ranks for the
            collective transport). No rank appears twice.
        mesh_shape: size of each mesh axis; their product is ``len(ranks)``.
        placements: for each mesh axis, ``Replicate()`` or ``Shard(dim)``.
        axis_names: optional names of the mesh axes (``"dp"``, ``"tp"``), for messages and printing.
        shard_order: the mesh axes in the order their splits apply when several shard one dim
            (a permutation of ``range(len(mesh_shape))``); empty means left to right.
    """

    ranks: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    placements: tuple[AxisPlacement, ...]
    axis_names: tuple[str, ...] = ()
    shard_order: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        where = f"ShardLayout(ranks={list(self.ranks)}, mesh_shape={self.mesh_shape})"
        if not self.ranks:
            raise ConfigError(f"{where}: a layout needs at least one rank")
        if any(not isinstance(r, int) or r < 0 for r in self.ranks):
            raise ConfigError(f"{where}: ranks must be integers >= 0")
        if len(set(self.ranks)) != len(self.ranks):
            dup = sorted({r for r in self.ranks if self.ranks.count(r) > 1})
            raise ConfigError(f"{where}: rank(s) {dup} appear more than once; a rank holds one box of a layout")
        if any(not isinstance(s, int) or s < 1 for s in self.mesh_shape):
            raise ConfigError(f"{where}: every mesh axis size must be an integer >= 1")
        if math.prod(self.mesh_shape) != len(self.ranks):
            eq = " * ".join(map(str, self.mesh_shape)) or "1"
            raise ConfigError(f"{where}: {eq} = {math.prod(self.mesh_shape)} != len(ranks) = {len(self.ranks)}")
        if len(self.placements) != len(self.mesh_shape):
            raise ConfigError(
                f"{where}: {len(self.placements)} placement(s) for {len(self.mesh_shape)} mesh axes; give one per axis"
            )
        if self.axis_names and len(self.axis_names) != len(self.mesh_shape):
            raise ConfigError(f"{where}: axis_names {self.axis_names} must name each of the {len(self.mesh_shape)} mesh axes")
        if self.shard_order and sorted(self.shard_order) != list(range(len(self.mesh_shape))):
            raise ConfigError(
                f"{where}: shard_order {self.shard_order} must be a permutation of the mesh axes "
                f"{tuple(range(len(self.mesh_shape)))} (or empty for left to right)"
            )

    @property
    def order(self) -> tuple[int, ...]:
        """The mesh axes in the order their splits apply."""
        return self.shard_order or tuple(range(len(self.mesh_shape)))

    def coords(self, rank: int) -> tuple[int, ...]:
        """The mesh coordinates of ``rank``.

        Raises:
            ConfigError: if ``rank`` is not in the layout.
        """
        flat = _positions(self).get(rank)
        if flat is None:
            raise ConfigError(f"rank {rank} is not in layout {self}; its ranks are {list(self.ranks)}")
        out = []
        for size in reversed(self.mesh_shape):
            out.append(flat % size)
            flat //= size
        return tuple(reversed(out))

    def max_dim(self) -> int:
        """The largest tensor dim a placement shards, -1 if none (a tensor needs more dims than this)."""
        return max((p.dim for p in self.placements if isinstance(p, Shard)), default=-1)

    def __str__(self) -> str:
        names = self.axis_names or tuple(f"ax{i}" for i in range(len(self.mesh_shape)))
        mesh = ",".join(f"{n}={s}" for n, s in zip(names, self.mesh_shape))
        text = f"[{mesh}]({','.join(map(str, self.placements))}) on ranks {list(self.ranks)}"
        return text + (f" order={list(self.shard_order)}" if self.shard_order else "")


@lru_cache(maxsize=1024)
def _positions(layout: ShardLayout) -> dict[int, int]:
    """rank -> its position in ``layout.ranks`` (layouts may hold thousands of ranks; they are frozen)."""
    return {r: i for i, r in enumerate(layout.ranks)}


class Transfer(msgspec.Struct, **_STRUCT):
    """One block moving from ``src_rank``'s shard to ``dst_rank``'s shard.

    Attributes:
        src_rank: the rank that sends (holds ``box`` in the source layout).
        dst_rank: the rank that receives (needs ``box`` in the destination layout).
        box: the block in global coordinates.
        src_box: the same block in the coordinates of the source rank's local shard.
        dst_box: the same block in the coordinates of the destination rank's local shard.
    """

    src_rank: int
    dst_rank: int
    box: Box
    src_box: Box
    dst_box: Box

    @property
    def local(self) -> bool:
        """True when the rank holds the block on both sides: a local copy, nothing on the wire."""
        return self.src_rank == self.dst_rank

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.box)

    @property
    def numel(self) -> int:
        return box_numel(self.box)

    def src_slices(self) -> tuple[slice, ...]:
        """Index of the block in the source rank's local shard."""
        return tuple(slice(a, b) for a, b in self.src_box)

    def dst_slices(self) -> tuple[slice, ...]:
        """Index of the block in the destination rank's local shard."""
        return tuple(slice(a, b) for a, b in self.dst_box)


# --- layouts for the common cases --------------------------------------------------------------


def replicated(ranks: Iterable[int], *, axis: str = "dp") -> ShardLayout:
    """Every rank holds the whole tensor."""
    ranks = tuple(ranks)
    return ShardLayout(ranks=ranks, mesh_shape=(len(ranks),), placements=(Replicate(),), axis_names=(axis,))


def dp_replicas(ranks: Iterable[int]) -> ShardLayout:
    """Data-parallel replicas (plain DDP, or generator replicas): the whole tensor on every rank."""
    return replicated(ranks, axis="dp")


def sharded(ranks: Iterable[int], dim: int, *, axis: str = "tp") -> ShardLayout:
    """Tensor dim ``dim`` split over ``ranks`` (``torch.chunk`` sizes), rank order = chunk order."""
    ranks = tuple(ranks)
    return ShardLayout(ranks=ranks, mesh_shape=(len(ranks),), placements=(Shard(dim=dim),), axis_names=(axis,))


def tp_column(ranks: Iterable[int]) -> ShardLayout:
    """Column-parallel tensor parallelism: an ``nn.Linear`` weight ``[out, in]`` split on dim 0 (its outputs)."""
    return sharded(ranks, 0, axis="tp")


def tp_row(ranks: Iterable[int]) -> ShardLayout:
    """Row-parallel tensor parallelism: an ``nn.Linear`` weight ``[out, in]`` split on dim 1 (its inputs)."""
    return sharded(ranks, 1, axis="tp")


def fsdp(ranks: Iterable[int]) -> ShardLayout:
    """FSDP2 / ZeRO-3: every parameter split on dim 0 over the data-parallel ranks (``torch.chunk`` sizes)."""
    return sharded(ranks, 0, axis="dp")


def dp_tp(ranks: Sequence[int], *, dp: int, tp: int, tp_dim: int = 0, fsdp: bool = False) -> ShardLayout:
    """A ``dp x tp`` mesh, tp innermost (``tp`` consecutive ranks form a tensor-parallel group, as in
    ``flowrl.planners.parallel``), tensor parallelism splitting ``tp_dim``.

    With ``fsdp=True`` the dp axis also shards dim 0 of each tp shard (FSDP2 over TP); when
    ``tp_dim == 0`` too, the tp split applies first and the dp split nests inside each tp chunk.

    Raises:
        ConfigError: if ``dp * tp != len(ranks)``.
    """
    ranks = tuple(ranks)
    if dp * tp != len(ranks):
        raise ConfigError(f"dp_tp: dp({dp}) * tp({tp}) = {dp * tp} != len(ranks) = {len(ranks)} ({list(ranks)})")
    dp_place: AxisPlacement = Shard(dim=0) if fsdp else Replicate()
    order = (1, 0) if fsdp and tp_dim == 0 else ()
    return ShardLayout(
        ranks=ranks,
        mesh_shape=(dp, tp),
        placements=(dp_place, Shard(dim=tp_dim)),
        axis_names=("dp", "tp"),
        shard_order=order,
    )


# --- boxes ---------------------------------------------------------------------------------------


def chunk_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of chunk ``index`` when ``size`` elements are split into ``parts`` like ``torch.chunk``.

    Chunks hold ``ceil(size / parts)`` elements; the last ones are shorter or empty.

    >>> [chunk_bounds(5, 4, i) for i in range(4)]
    [(0, 2), (2, 4), (4, 5), (5, 5)]
    """
    step = -(-size // parts) if parts else 0
    start = min(index * step, size)
    return start, min(start + step, size)


def _check_shape(shape: Sequence[int], layout: ShardLayout, what: str) -> tuple[int, ...]:
    shape = tuple(shape)
    if any(not isinstance(s, int) or s < 0 for s in shape):
        raise ConfigError(f"{what}: shape {shape} must be non-negative integers")
    if layout.max_dim() >= len(shape):
        raise ConfigError(
            f"{what}: layout {layout} shards dim {layout.max_dim()} but the tensor of shape {shape} has "
            f"{len(shape)} dim(s); shard a dim < {len(shape)} or replicate it"
        )
    return shape


def local_box(layout: ShardLayout, shape: Sequence[int], rank: int) -> Box:
    """The block of a tensor of ``shape`` that ``rank`` holds under ``layout``, in global coordinates.

    Raises:
        ConfigError: if ``rank`` is not in the layout or the layout shards a dim the tensor lacks.
    """
    return _local_box(layout, tuple(shape), rank)


@lru_cache(maxsize=1 << 16)
def _local_box(layout: ShardLayout, shape: tuple[int, ...], rank: int) -> Box:
    """:func:`local_box`, cached: the planner asks for the same boxes of thousands of ranks again and again."""
    shape = _check_shape(shape, layout, "local_box")
    coords = layout.coords(rank)
    box = [(0, n) for n in shape]
    for axis in layout.order:
        place = layout.placements[axis]
        if isinstance(place, Shard):
            lo, hi = box[place.dim]
            a, b = chunk_bounds(hi - lo, layout.mesh_shape[axis], coords[axis])
            box[place.dim] = (lo + a, lo + b)
    return tuple(box)


def local_slice(layout: ShardLayout, shape: Sequence[int], rank: int) -> tuple[slice, ...]:
    """The index of ``rank``'s shard in the full tensor: ``full[local_slice(...)]`` is its local tensor.

    Uneven splits follow ``torch.chunk`` (see :func:`chunk_bounds`): a rank may hold an empty shard.

    >>> local_slice(tp_column((0, 1, 2)), (5,), 2)
    (slice(4, 5, None),)
    """
    return tuple(slice(a, b) for a, b in local_box(layout, shape, rank))


def local_shape(layout: ShardLayout, shape: Sequence[int], rank: int) -> tuple[int, ...]:
    """The shape of ``rank``'s local shard."""
    return tuple(b - a for a, b in local_box(layout, shape, rank))


def box_numel(box: Box) -> int:
    return math.prod(b - a for a, b in box)


def intersect(a: Box, b: Box) -> Box | None:
    """The common block of two boxes, or None if they share no element."""
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in out) else out


def _relative(box: Box, origin: Box) -> Box:
    return tuple((a - o, b - o) for (a, b), (o, _) in zip(box, origin))


# --- transfer plans ------------------------------------------------------------------------------


def itemsize(dtype: Any) -> int:
    """Bytes per element of ``dtype``: a name (``"bfloat16"``) or anything with ``itemsize`` (torch, numpy).

    Raises:
        ConfigError: for an unknown dtype name.
    """
    size = getattr(dtype, "itemsize", None)
    if isinstance(size, int):
        return size
    name = str(dtype).removeprefix("torch.")
    if name not in _ITEMSIZE:
        raise ConfigError(f"unknown dtype {dtype!r}; known names: {sorted(_ITEMSIZE)}")
    return _ITEMSIZE[name]


def _plan_one(
    shape: tuple[int, ...], src: ShardLayout, dst: ShardLayout, size: int, load: dict[int, int]
) -> list[Transfer]:
    src_boxes = {r: local_box(src, shape, r) for r in src.ranks}
    holders: dict[Box, list[int]] = {}
    for r in src.ranks:  # distinct source boxes (they tile the tensor), each with its replicas in layout order
        if box_numel(src_boxes[r]):
            holders.setdefault(src_boxes[r], []).append(r)
    # per source box, its replicas by (load, position in the layout): the least loaded first, ties to the
    # earlier rank; a heap, as thousands of ranks may hold a box. A rank holds one box of a parameter, so
    # only its own heap sees its load change while this parameter is planned.
    heaps: dict[Box, list[tuple[int, int, int]]] = {}
    out: list[Transfer] = []
    for d in dst.ranks:
        want = local_box(dst, shape, d)
        if not box_numel(want):
            continue
        for sbox, ranks in holders.items():
            common = intersect(want, sbox)
            if common is None:
                continue
            if d in ranks:
                sender = d
            else:
                if sbox not in heaps:
                    heaps[sbox] = [(load.get(r, 0), i, r) for i, r in enumerate(ranks)]
                    heapq.heapify(heaps[sbox])
                _, i, sender = heapq.heappop(heaps[sbox])
                load[sender] = load.get(sender, 0) + box_numel(common) * size
                heapq.heappush(heaps[sbox], (load[sender], i, sender))
            out.append(
                Transfer(
                    src_rank=sender,
                    dst_rank=d,
                    box=common,
                    src_box=_relative(common, src_boxes[sender]),
                    dst_box=_relative(common, want),
                )
            )
    return out


def plan_transfer(shape: Sequence[int], src: ShardLayout, dst: ShardLayout) -> list[Transfer]:
    """The blocks that turn a tensor of ``shape`` laid out as ``src`` into the layout ``dst``.

    Every element of every destination shard is covered by exactly one transfer, whose source rank
    holds it; a destination rank that holds an element in ``src`` copies it locally. Among replicas
    the least loaded so far (in elements sent) sends, ties to the earlier rank of ``src.ranks``.
    Destination ranks in ``dst.ranks`` order, source blocks in ``src.ranks`` order.

    Raises:
        ConfigError: if a layout shards a dim the tensor lacks.
    """
    shape = _check_shape(shape, src, "plan_transfer (source)")
    _check_shape(shape, dst, "plan_transfer (destination)")
    return _plan_one(shape, src, dst, 1, {})


def plan_state(
    params: Mapping[str, tuple[Sequence[int], Any]],
    src: ShardLayout | Mapping[str, ShardLayout],
    dst: ShardLayout | Mapping[str, ShardLayout],
) -> dict[str, list[Transfer]]:
    """:func:`plan_transfer` for every parameter, balancing replica load (in bytes) over all of them.

    Args:
        params: name -> ``(shape, dtype)``; planned in sorted name order, so every rank agrees.
        src: one layout for every parameter, or name -> layout.
        dst: likewise for the destination.
    """
    load: dict[int, int] = {}
    plans: dict[str, list[Transfer]] = {}
    for name in sorted(params):
        shape, dtype = params[name]
        s, d = _pick(src, name), _pick(dst, name)
        shape = _check_shape(shape, s, f"parameter {name!r} (source)")
        _check_shape(shape, d, f"parameter {name!r} (destination)")
        plans[name] = _plan_one(shape, s, d, itemsize(dtype), load)
    return plans


def _pick(layouts: ShardLayout | Mapping[str, ShardLayout], name: str) -> ShardLayout:
    if isinstance(layouts, ShardLayout):
        return layouts
    if name not in layouts:
        raise ConfigError(f"no layout for parameter {name!r}; layouts are given for {sorted(layouts)}")
    return layouts[name]


def wire_bytes(transfers: Iterable[Transfer], dtype: Any) -> int:
    """Bytes a plan puts on the wire (local copies excluded)."""
    size = itemsize(dtype)
    return sum(t.numel * size for t in transfers if not t.local)


def minimum_bytes(shape: Sequence[int], dtype: Any, src: ShardLayout, dst: ShardLayout) -> int:
    """Bytes every destination rank needs and does not already hold in ``src``, summed over ranks.

    No plan can move less: a destination element missing locally must arrive once.
    """
    shape = _check_shape(shape, src, "minimum_bytes (source)")
    _check_shape(shape, dst, "minimum_bytes (destination)")
    total = 0
    held = set(src.ranks)
    for d in dst.ranks:
        want = local_box(dst, shape, d)
        have = intersect(want, local_box(src, shape, d)) if d in held else None
        total += box_numel(want) - (box_numel(have) if have is not None else 0)
    return total * itemsize(dtype)


# --- what a transfer costs besides the wire ------------------------------------------------------

#: Blocks smaller than this are packed with their neighbours into one staged message (one copy on
#: each side) rather than sent as a message of their own: per-message costs dominate below it.
DIRECT_MIN_BYTES = 64 << 10


def is_contiguous(box: Box, shape: Sequence[int]) -> bool:
    """Whether ``box`` (local coordinates) is one contiguous run of a row-major tensor of ``shape``.

    True when every dim after the first partial one is whole and every dim before it has extent 1
    (an empty or one-element box is contiguous).

    >>> is_contiguous(((0, 2), (0, 6)), (4, 6)), is_contiguous(((0, 4), (0, 3)), (4, 6)), is_contiguous(((1, 2), (0, 3)), (4, 6))
    (True, False, True)
    """
    extents = [b - a for a, b in box]
    if math.prod(extents) <= 1:
        return True
    first = next(i for i, e in enumerate(extents) if e != 1)  # leading dims of extent 1 do not matter
    return all(e == n for e, n in zip(extents[first + 1 :], shape[first + 1 :]))


def staging_copies(
    transfer: Transfer,
    src_shape: Sequence[int],
    dst_shape: Sequence[int],
    nbytes: int,
    *,
    dual_sender: bool = False,
    direct_min_bytes: int = DIRECT_MIN_BYTES,
) -> tuple[int, int]:
    """Staging copies of one transfer's bytes: ``(on the sending side, on the receiving side)``, 0 or 1 each.

    The collective transport sends a block straight from the source shard when its slice is
    contiguous and receives it straight into the destination shard when that slice is; otherwise the
    block passes through a staging buffer on that side. Blocks under ``direct_min_bytes`` are packed
    together (staged on both sides). A local block (a rank holding it on both sides) is copied at
    publish (the state may change afterwards) and delivered at fetch: (1, 1). A sender that is also a
    generator rank (``dual_sender``) stages everything it sends (its sends go out from its fetch).

    Args:
        transfer: one block of a plan.
        src_shape: the shape of the source rank's local shard (contiguous, as published).
        dst_shape: the shape of the destination rank's local shard (contiguous, as fetched into).
        nbytes: the block's bytes.
        dual_sender: the source rank is also a destination rank of the same transport.
        direct_min_bytes: the smallest block sent as a message of its own.

    Returns:
        ``(sender copies, receiver copies)``.
    """
    if transfer.local or nbytes < direct_min_bytes:
        return 1, 1
    send = 1 if dual_sender or not is_contiguous(transfer.src_box, src_shape) else 0
    return send, 0 if is_contiguous(transfer.dst_box, dst_shape) else 1


class TransferVolume(msgspec.Struct, **_STRUCT):
    """What one weight sync moves and copies, summed over a plan (:func:`transfer_volume`).

    Attributes:
        wire_bytes: bytes on the wire (equals :func:`minimum_bytes` summed over the parameters).
        local_bytes: bytes a rank holding them on both sides copies locally.
        copied_bytes: bytes through a staging copy, once per copy (a block staged on both sides counts twice).
        max_send_bytes: the most bytes any one rank sends.
        max_recv_bytes: the most bytes any one rank receives.
        max_copied_bytes: the most bytes any one rank copies through staging (its packs and unpacks).
        max_pack_bytes: the most bytes any one rank packs (copies before sending, local blocks included).
        max_unpack_bytes: the most bytes any one rank unpacks (copies after receiving, local blocks included).
    """

    wire_bytes: int = 0
    local_bytes: int = 0
    copied_bytes: int = 0
    max_send_bytes: int = 0
    max_recv_bytes: int = 0
    max_copied_bytes: int = 0
    max_pack_bytes: int = 0
    max_unpack_bytes: int = 0

    @property
    def copies_per_byte(self) -> float:
        """Staging copies per byte delivered (wire and local)."""
        return self.copied_bytes / max(1, self.wire_bytes + self.local_bytes)


def transfer_volume(
    params: Mapping[str, tuple[Sequence[int], Any]],
    src: ShardLayout | Mapping[str, ShardLayout],
    dst: ShardLayout | Mapping[str, ShardLayout],
    *,
    direct_min_bytes: int = DIRECT_MIN_BYTES,
) -> TransferVolume:
    """The wire bytes, local bytes and staging copies of one sync of ``params`` from ``src`` to ``dst``.

    The plan is :func:`plan_state`'s and the copies :func:`staging_copies`', as the collective
    transport does them (with contiguous shards on both sides).

    Args:
        params: name -> ``(full shape, dtype)``.
        src: one layout for every parameter, or name -> layout.
        dst: likewise for the destination.
        direct_min_bytes: the smallest block sent as a message of its own.
    """
    plans = plan_state(params, src, dst)
    dst_ranks = {r for n in params for r in _pick(dst, n).ranks}
    wire = local = copied = 0
    sent: dict[int, int] = {}
    got: dict[int, int] = {}
    staged: dict[int, int] = {}
    packed: dict[int, int] = {}
    unpacked: dict[int, int] = {}
    for name, transfers in plans.items():
        shape, dtype = params[name]
        s, d = _pick(src, name), _pick(dst, name)
        size = itemsize(dtype)
        for t in transfers:
            nbytes = t.numel * size
            pack, unpack = staging_copies(
                t, local_shape(s, shape, t.src_rank), local_shape(d, shape, t.dst_rank), nbytes,
                dual_sender=t.src_rank in dst_ranks, direct_min_bytes=direct_min_bytes,
            )
            copied += (pack + unpack) * nbytes
            staged[t.src_rank] = staged.get(t.src_rank, 0) + pack * nbytes
            staged[t.dst_rank] = staged.get(t.dst_rank, 0) + unpack * nbytes
            packed[t.src_rank] = packed.get(t.src_rank, 0) + pack * nbytes
            unpacked[t.dst_rank] = unpacked.get(t.dst_rank, 0) + unpack * nbytes
            if t.local:
                local += nbytes
                continue
            wire += nbytes
            sent[t.src_rank] = sent.get(t.src_rank, 0) + nbytes
            got[t.dst_rank] = got.get(t.dst_rank, 0) + nbytes
    return TransferVolume(
        wire_bytes=wire, local_bytes=local, copied_bytes=copied,
        max_send_bytes=max(sent.values(), default=0), max_recv_bytes=max(got.values(), default=0),
        max_copied_bytes=max(staged.values(), default=0),
        max_pack_bytes=max(packed.values(), default=0),
        max_unpack_bytes=max(unpacked.values(), default=0),
    )
