"""Calibration: ``measure`` on this machine gives valid figures; ``calibrated_cluster`` turns them into a cluster spec (pure)."""

from __future__ import annotations

import msgspec
import pytest

from flowrl.calibration.measure import WIDTHS, Measurements, calibrated_cluster, measure
from flowrl.errors import PlanError
from flowrl.planners.cluster import cluster_to_json, parse_cluster


def test_calibrated_cluster_is_pure_and_round_trips(tmp_path):
    m = Measurements(matmul_flops=50e9, copy_bandwidth=5e9, op_overhead_s=3e-6, cores=4, memory_bytes=16 * 2**30)
    c = calibrated_cluster(m, cores=2)
    assert (c.name, c.n_devices) == ("cpu-calibrated", 2)
    assert (c.device.peak_flops, c.device.memory_bandwidth, c.device.kernel_overhead_s) == (50e9, 5e9, 3e-6)
    assert c.device.memory_bytes == 4 * 2**30
    path = tmp_path / "cpu.json"
    path.write_bytes(cluster_to_json(c))
    assert parse_cluster(str(path)) == c


def test_measure_returns_positive_figures():
    m = measure(matmul_size=32, copy_mib=1, repeats=1)
    assert m.matmul_flops > 0 and m.copy_bandwidth > 0 and m.op_overhead_s > 0
    for table in (m.cpu.flops_by_width, m.cpu.decode_flops_by_width, m.cpu.train_flops_by_width):
        assert [w for w, _ in table] == list(WIDTHS) and all(rate > 0 for _, rate in table)
    assert m.cpu.thread_speedup > 0 and m.cpu.gen_thread_speedup > 0 and m.cpu.shared_slowdown >= 1 and m.cpu.decode_step_overhead_s >= 0 and m.cpu.slot_row_overhead_s >= 0
    rows = m.cpu.decode_rows_fraction  # decode on 1, 4 and 16 rows against the table's rows at the widest width
    assert [r for r, _ in rows] == [1, 4, 16] and all(f > 0 for _, f in rows)
    assert 1e-11 < m.cpu.adamw_s_per_param < 1e-6  # seconds per parameter of an AdamW step
    calibrated_cluster(m)  # every measured figure is a valid DeviceSpec field
    assert msgspec.json.decode(msgspec.json.encode(m), type=Measurements) == m


@pytest.mark.parametrize("statistic", [pytest.param("median", marks=pytest.mark.slow), pytest.param("best", marks=pytest.mark.slow)])  # --runslow (CI time; test_measure_returns_positive_figures measures with the default median)
def test_measure_with_every_core_busy(statistic):
    m = measure(matmul_size=32, copy_mib=1, repeats=2, statistic=statistic)
    assert m.matmul_flops > 0 and m.cores >= 1


def test_measure_refuses_an_unknown_statistic():
    with pytest.raises(PlanError, match="statistic 'mean' is not one of median, best"):
        measure(statistic="mean")
