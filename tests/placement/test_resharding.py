"""Resharding math: layouts and their checks, torch.chunk boxes, and transfer plans that tile every
destination shard exactly once with the minimum bytes (hypothesis over random layouts, and a numpy
simulation that moves real data by the plan)."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flowrl.errors import ConfigError
from flowrl.placement.resharding import (
    Replicate,
    Shard,
    ShardLayout,
    Transfer,
    box_numel,
    chunk_bounds,
    dp_replicas,
    dp_tp,
    fsdp,
    itemsize,
    local_box,
    local_shape,
    local_slice,
    minimum_bytes,
    plan_state,
    plan_transfer,
    replicated,
    sharded,
    tp_column,
    tp_row,
    wire_bytes,
)

# --- strategies ----------------------------------------------------------------------------------

shapes = st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple)


def _factorizations(n: int) -> list[tuple[int, ...]]:
    out = [(n,)]
    for a in range(2, n):
        if n % a == 0:
            out.append((a, n // a))
            for b in range(2, n // a):
                if (n // a) % b == 0:
                    out.append((a, b, n // a // b))
    return out


@st.composite
def layouts(draw, ndim: int, pool: int = 8) -> ShardLayout:
    """A random layout over 1..6 distinct ranks out of ``range(pool)``, any mesh, any placements."""
    n = draw(st.integers(1, 6))
    ranks = tuple(draw(st.permutations(range(pool)))[:n])
    mesh = draw(st.sampled_from(_factorizations(n)))
    choices = [Replicate(), *[Shard(dim=d) for d in range(ndim)]]
    placements = tuple(draw(st.sampled_from(choices)) for _ in mesh)
    order = draw(st.one_of(st.just(()), st.permutations(range(len(mesh))).map(tuple)))
    return ShardLayout(ranks=ranks, mesh_shape=mesh, placements=placements, shard_order=order)


@st.composite
def cases(draw):
    shape = draw(shapes)
    return shape, draw(layouts(len(shape))), draw(layouts(len(shape)))


def _coverage(shape: tuple[int, ...], boxes) -> np.ndarray:
    count = np.zeros(shape, dtype=np.int64)
    for box in boxes:
        count[tuple(slice(a, b) for a, b in box)] += 1
    return count


# --- layouts -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: ShardLayout(ranks=(), mesh_shape=(), placements=()), r"at least one rank"),
        (lambda: ShardLayout(ranks=(0, 0), mesh_shape=(2,), placements=(Replicate(),)), r"rank\(s\) \[0\] appear more than once"),
        (lambda: ShardLayout(ranks=(0, 1, 2), mesh_shape=(2, 2), placements=(Replicate(), Replicate())), r"2 \* 2 = 4 != len\(ranks\) = 3"),
        (lambda: ShardLayout(ranks=(0, 1), mesh_shape=(2,), placements=()), r"0 placement\(s\) for 1 mesh axes"),
        (lambda: ShardLayout(ranks=(0, -1), mesh_shape=(2,), placements=(Replicate(),)), r"integers >= 0"),
        (lambda: ShardLayout(ranks=(0,), mesh_shape=(0,), placements=(Replicate(),)), r"integer >= 1"),
        (lambda: ShardLayout(ranks=(0, 1), mesh_shape=(2,), placements=(Replicate(),), axis_names=("dp", "tp")), r"must name each"),
        (lambda: ShardLayout(ranks=(0, 1), mesh_shape=(2,), placements=(Replicate(),), shard_order=(1,)), r"permutation"),
        (lambda: Shard(dim=-1), r"dim must be an integer >= 0"),
        (lambda: dp_tp((0, 1, 2), dp=2, tp=2), r"dp\(2\) \* tp\(2\) = 4 != len\(ranks\) = 3"),
    ],
    ids=["no-ranks", "duplicate", "product", "placements", "negative-rank", "empty-axis", "axis-names", "order", "shard-dim", "dp-tp"],
)
def test_invalid_layouts_are_errors_with_the_values(make, match):
    with pytest.raises(ConfigError, match=match):
        make()


def test_errors_name_the_rank_and_the_dim():
    with pytest.raises(ConfigError, match=r"rank 5 is not in layout .* its ranks are \[0, 1\]"):
        local_slice(tp_column((0, 1)), (4,), 5)
    with pytest.raises(ConfigError, match=r"shards dim 1 but the tensor of shape \(4,\) has 1 dim"):
        local_slice(tp_row((0, 1)), (4,), 0)
    with pytest.raises(ConfigError, match=r"parameter 'b'"):
        plan_state({"b": ((4,), "float32")}, fsdp((0, 1)), tp_row((2, 3)))
    with pytest.raises(ConfigError, match=r"no layout for parameter 'b'"):
        plan_state({"b": ((4,), "float32")}, {"w": fsdp((0,))}, fsdp((1,)))
    with pytest.raises(ConfigError, match=r"unknown dtype 'float7'"):
        itemsize("float7")


def test_layouts_are_plain_data():
    layout = dp_tp((4, 5, 6, 7), dp=2, tp=2, tp_dim=0, fsdp=True)
    raw = msgspec.json.encode(layout)
    assert msgspec.json.decode(raw, type=ShardLayout) == layout
    assert b'"kind":"shard"' in raw
    assert str(layout) == "[dp=2,tp=2](S(0),S(0)) on ranks [4, 5, 6, 7] order=[1, 0]"


@pytest.mark.parametrize(
    ("layout", "shape", "boxes"),
    [
        (tp_column((0, 1, 2)), (5,), [((0, 2),), ((2, 4),), ((4, 5),)]),
        (fsdp((0, 1, 2, 3)), (5, 2), [((0, 2), (0, 2)), ((2, 4), (0, 2)), ((4, 5), (0, 2)), ((5, 5), (0, 2))]),
        (tp_row((3, 1)), (2, 4), [((0, 2), (0, 2)), ((0, 2), (2, 4))]),
        (dp_replicas((0, 1)), (3,), [((0, 3),), ((0, 3),)]),
        (replicated((0,)), (), [()]),
        (dp_tp((0, 1, 2, 3), dp=2, tp=2, tp_dim=1), (2, 4), [((0, 2), (0, 2)), ((0, 2), (2, 4))] * 2),
        # FSDP over TP on the same dim: tp splits first, dp nests inside each tp chunk
        (dp_tp((0, 1, 2, 3), dp=2, tp=2, tp_dim=0, fsdp=True), (8,), [((0, 2),), ((4, 6),), ((2, 4),), ((6, 8),)]),
        # the same placements in DTensor's default order: dp splits first
        (ShardLayout(ranks=(0, 1, 2, 3), mesh_shape=(2, 2), placements=(Shard(dim=0), Shard(dim=0))), (8,),
         [((0, 2),), ((2, 4),), ((4, 6),), ((6, 8),)]),
        (dp_tp((0, 1, 2, 3), dp=2, tp=2, tp_dim=1, fsdp=True), (4, 4), [((0, 2), (0, 2)), ((0, 2), (2, 4)), ((2, 4), (0, 2)), ((2, 4), (2, 4))]),
    ],
    ids=["tp3-uneven", "fsdp4-empty", "tp-row-rank-order", "dp", "scalar", "dp2xtp2", "fsdp-over-tp", "dtensor-order", "fsdp-x-tp-row"],
)
def test_local_boxes(layout, shape, boxes):
    assert [local_box(layout, shape, r) for r in layout.ranks] == boxes
    assert [local_slice(layout, shape, r) for r in layout.ranks] == [tuple(slice(a, b) for a, b in box) for box in boxes]


@given(size=st.integers(0, 40), parts=st.integers(1, 9))
def test_one_axis_splits_like_torch_chunk(size, parts):
    """DTensor and FSDP2 split with torch.chunk and pad the missing chunks with empty ones."""
    chunks = [c.tolist() for c in torch.arange(size).chunk(parts)] if size else []
    chunks += [[]] * (parts - len(chunks))
    layout = sharded(range(parts), 0)
    for r in range(parts):
        a, b = chunk_bounds(size, parts, r)
        assert list(range(a, b)) == chunks[r]
        assert local_shape(layout, (size,), r) == (len(chunks[r]),)


@given(case=cases())
def test_each_element_is_held_by_as_many_ranks_as_replicas(case):
    shape, layout, _ = case
    replicas = math.prod(s for s, p in zip(layout.mesh_shape, layout.placements) if isinstance(p, Replicate))
    count = _coverage(shape, [local_box(layout, shape, r) for r in layout.ranks])
    assert (count == replicas).all()


# --- transfer plans ------------------------------------------------------------------------------


@given(case=cases())
def test_plan_tiles_every_destination_once_from_a_holder_with_minimum_bytes(case):
    shape, src, dst = case
    plan = plan_transfer(shape, src, dst)
    for d in dst.ranks:
        want = local_box(dst, shape, d)
        into = [t for t in plan if t.dst_rank == d]
        count = _coverage(shape, [t.box for t in into])
        inside = np.zeros(shape, dtype=np.int64)
        inside[tuple(slice(a, b) for a, b in want)] = 1
        assert (count == inside).all(), f"rank {d}: its box is not tiled exactly once"
    for t in plan:
        have = local_box(src, shape, t.src_rank)
        want = local_box(dst, shape, t.dst_rank)
        assert t.numel > 0
        assert all(ha <= a and b <= hb and wa <= a and b <= wb for (a, b), (ha, hb), (wa, wb) in zip(t.box, have, want))
        assert t.src_box == tuple((a - o, b - o) for (a, b), (o, _) in zip(t.box, have))
        assert t.dst_box == tuple((a - o, b - o) for (a, b), (o, _) in zip(t.box, want))
        assert t.local == (t.src_rank == t.dst_rank)
    for dtype in ("float32", "bfloat16", torch.int64):
        assert wire_bytes(plan, dtype) == minimum_bytes(shape, dtype, src, dst)
    assert plan_transfer(shape, src, dst) == plan  # deterministic: every rank computes the same plan


@given(case=cases(), seed=st.integers(0, 2**16))
def test_moving_data_by_the_plan_reshards_exactly(case, seed):
    """Simulate the transport with numpy: source shards -> transfers -> destination shards == full slices."""
    shape, src, dst = case
    full = np.random.default_rng(seed).standard_normal(shape)
    have = {r: full[local_slice(src, shape, r)].copy() for r in src.ranks}
    got = {r: np.full(local_shape(dst, shape, r), np.nan) for r in dst.ranks}
    for t in plan_transfer(shape, src, dst):
        got[t.dst_rank][t.dst_slices()] = have[t.src_rank][t.src_slices()]
    for r in dst.ranks:
        assert np.array_equal(got[r], full[local_slice(dst, shape, r)])


@pytest.mark.parametrize(
    ("src", "dst", "shape", "expected"),
    [
        # the table: (bytes on the wire per version, float32)
        (replicated((0, 1)), tp_column((2, 3)), (8, 4), 8 * 4 * 4),
        (fsdp((0, 1)), tp_row((2, 3)), (8, 4), 8 * 4 * 4),
        (tp_column((0, 1)), tp_column((0, 1, 2, 3)), (8, 4), 3 * 2 * 4 * 4),  # only rank 0 holds its new rows already
        (fsdp((0, 1)), dp_replicas((2, 3)), (8, 4), 2 * 8 * 4 * 4),
        (fsdp((0, 1)), fsdp((0, 1)), (8, 4), 0),  # same layout, same ranks: nothing moves
        (fsdp((0, 1)), fsdp((1, 0)), (8, 4), 8 * 4 * 4),  # same layout, ranks swapped: everything moves
        (replicated((0, 1, 2, 3)), tp_row((3, 0, 5)), (8, 6), 8 * 2 * 4),  # only rank 5 lacks its shard
    ],
    ids=["replicated->tp2", "fsdp2->tp2", "tp2->tp4", "dp-replicas", "identity", "swap", "overlap"],
)
def test_minimum_bytes_of_the_table(src, dst, shape, expected):
    assert minimum_bytes(shape, "float32", src, dst) == expected
    assert wire_bytes(plan_transfer(shape, src, dst), "float32") == expected


def test_replicas_share_the_sending():
    """Four replicas feeding four tp ranks: each replica sends one shard (the least loaded one sends)."""
    plan = plan_transfer((8, 8), replicated((0, 1, 2, 3)), tp_column((4, 5, 6, 7)))
    assert [(t.src_rank, t.dst_rank) for t in plan] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    # and the balance holds across the parameters of a state
    plans = plan_state({f"p{i}": ((4, 4), "float32") for i in range(4)}, replicated((0, 1)), replicated((2,)))
    assert [t.src_rank for ts in plans.values() for t in ts] == [0, 1, 0, 1]


def test_a_rank_on_both_sides_copies_locally():
    plan = plan_transfer((4, 6), fsdp((0, 1)), tp_row((1, 2)))
    local = [t for t in plan if t.local]
    assert [(t.src_rank, t.box) for t in local] == [(1, ((2, 4), (0, 3)))]
    assert local[0].src_box == ((0, 2), (0, 3)) and local[0].dst_box == ((2, 4), (0, 3))
    assert all(isinstance(t, Transfer) for t in plan) and sum(t.numel for t in plan) == 24


def test_empty_and_scalar_tensors():
    assert plan_transfer((0, 4), fsdp((0, 1)), tp_row((2, 3))) == []
    (t,) = plan_transfer((), replicated((0,)), replicated((1,)))
    assert t.box == () and t.numel == 1 and t.src_slices() == ()
    assert minimum_bytes((), "bfloat16", replicated((0, 1)), replicated((1, 2))) == 2
    assert box_numel(()) == 1
