"""The measured CPU terms of the estimates (``DeviceSpec.flops_by_width``, ``thread_speedup``,
``decode_step_overhead_s``, ``train_step_overhead_s``), each checked against a hand-computed value."""

from __future__ import annotations

import pytest

from flowrl.errors import PlanError
from flowrl.planners.estimate.generate import estimate_generate
from flowrl.planners.estimate.train import estimate_train
from flowrl.planners.parallel import ParallelDims
from tests.planners.test_estimates import TINY, ctx, device


@pytest.mark.parametrize(
    "table, width, expected",
    [
        (((4, 1e9), (16, 3e9)), 8, 2e9),  # halfway in log(width)
        (((4, 1e9), (16, 3e9)), 2, 1e9),  # below the table: its first rate
        (((4, 1e9), (16, 3e9)), 64, 3e9),  # above: its last rate
        (((4, 1e9), (16, 3e12)), 64, 1e12),  # never above peak_flops
        ((), 8, 1e12),  # no table: peak_flops
    ],
    ids=["interpolated", "below", "above", "capped-by-peak", "no-table"],
)
def test_flops_at(table, width, expected):
    assert device(flops_by_width=table).flops_at(width) == pytest.approx(expected)


@pytest.mark.parametrize(
    "table", [((16, 1e9), (4, 1e9)), ((4, 0.0),), ((4, 1e9), (4, 2e9))], ids=["descending", "zero-rate", "repeated"]
)
def test_bad_flops_table_is_refused(table):
    with pytest.raises(PlanError, match="flops_by_width"):
        device(flops_by_width=table)


def test_train_compute_uses_the_rate_at_the_model_width():
    fast = estimate_train(TINY, ParallelDims(), range(1), ctx())
    slow = estimate_train(TINY, ParallelDims(), range(1), ctx(dev=device(flops_by_width=((8, 2.5e11),))))
    assert slow.breakdown["compute"] == pytest.approx(4 * fast.breakdown["compute"])  # 1e12 / 2.5e11


@pytest.mark.parametrize("speedup, expected", [(0.0, 4.0), (1.6, 1 + 0.6 * 3 / 7), (1.0, 1.0)], ids=["gpu-replicas", "measured", "no-gain"])
def test_mesh_speedup(speedup, expected):
    assert device(thread_speedup=speedup).mesh_speedup(4, 8) == pytest.approx(expected)


def test_cpu_mesh_is_one_replica_sped_up_by_threads():
    # thread_speedup 1.5 on a host of 2: a dp=2 mesh runs all 4 sequences in one replica, 1.5x faster
    # than one device; without it (GPU) each of 2 replicas runs 2 sequences
    one = estimate_train(TINY, ParallelDims(), range(1), ctx(dev=device(thread_speedup=1.5), per_host=2))
    mesh = estimate_train(TINY, ParallelDims(dp=2), range(2), ctx(dev=device(thread_speedup=1.5), per_host=2))
    assert mesh.time_s == pytest.approx(one.time_s / 1.5)
    assert mesh.breakdown["dp_comm"] == 0.0  # one replica: no gradient all-reduce
    gen_one = estimate_generate(TINY, ParallelDims(), range(1), ctx(dev=device(thread_speedup=1.5), per_host=2))
    gen_mesh = estimate_generate(TINY, ParallelDims(dp=2), range(2), ctx(dev=device(thread_speedup=1.5), per_host=2))
    assert gen_mesh.time_s == pytest.approx(gen_one.time_s / 1.5)
    assert gen_mesh.notes[0] == "batch 4 x 1 wave"


def test_decode_step_overhead_is_paid_per_decode_step():
    # WORK: 1 completion token, lock-step: 1 decode step
    base = estimate_generate(TINY, ParallelDims(), range(1), ctx())
    over = estimate_generate(TINY, ParallelDims(), range(1), ctx(dev=device(decode_step_overhead_s=1e-3)))
    assert over.time_s - base.time_s == pytest.approx(1e-3)
    assert over.breakdown["step_overhead"] == pytest.approx(1e-3)


def test_train_step_overhead_is_paid_once_per_optimizer_step():
    base = estimate_train(TINY, ParallelDims(), range(1), ctx())
    over = estimate_train(TINY, ParallelDims(), range(1), ctx(dev=device(train_step_overhead_s=2e-3)))
    assert over.time_s - base.time_s == pytest.approx(2e-3)
    assert over.breakdown["optimizer"] - base.breakdown["optimizer"] == pytest.approx(2e-3)
