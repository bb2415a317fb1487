"""vLLM's calibrated figures in the estimates: the decode speed-up and the weight-sync rate come from
the tuning when set, else from the cluster's calibration (``CpuTerms.vllm_decode_speedup``,
``CpuTerms.vllm_sync_bandwidth``), else the fixed defaults; an old cluster file without them loads."""

from __future__ import annotations

import json

import msgspec
import pytest

from flowrl.errors import PlanError
from flowrl.planners.cluster import CpuTerms, cluster_to_json, parse_cluster
from flowrl.planners.estimate.generate import estimate_generate, vllm_decode_speedup
from flowrl.planners.estimate.sync import add_engine_load, vllm_sync_bandwidth
from flowrl.planners.parallel import ParallelDims
from flowrl.planners.tuning import VLLM_CPU_DECODE_SPEEDUP, VLLM_GROUP_BANDWIDTH, Tuning
from tests.planners.test_estimates import EXACT, TINY, _fields, _sync, ctx, device


@pytest.mark.parametrize(
    "tuned, calibrated, expected",
    [(None, 0.0, VLLM_CPU_DECODE_SPEEDUP), (None, 3.0, 3.0), (2.0, 3.0, 2.0)],
    ids=["default", "calibrated", "tuning-wins"],
)
def test_vllm_decodes_at_the_tuned_else_the_calibrated_else_the_default_speedup(tuned, calibrated, expected):
    dev = device(kind="cpu", vllm_decode_speedup=calibrated)
    c = ctx(dev=dev, tuning=Tuning(**{**_fields(EXACT), "vllm_cpu_decode_speedup": tuned}))
    assert vllm_decode_speedup(c) == expected
    builtin = estimate_generate(TINY, ParallelDims(), range(1), c, precision="float32")
    vllm = estimate_generate(TINY, ParallelDims(), range(1), c, precision="float32", engine="vllm")
    prefill = builtin.breakdown["prefill"]  # one decode step, no step overhead: the decode is the rest
    assert vllm.time_s == pytest.approx(prefill + (builtin.time_s - prefill) / expected)


@pytest.mark.parametrize(
    "tuned, calibrated, expected",
    [(None, 0.0, VLLM_GROUP_BANDWIDTH), (None, 0.8e9, 0.8e9), (0.5e9, 0.8e9, 0.5e9)],
    ids=["default", "calibrated", "tuning-wins"],
)
def test_the_hop_into_vllm_runs_at_the_tuned_else_the_calibrated_else_the_default_rate(tuned, calibrated, expected):
    c = ctx(dev=device(kind="cpu", vllm_sync_bandwidth=calibrated), tuning=Tuning(**{**_fields(EXACT), "vllm_group_bandwidth": tuned}))
    assert vllm_sync_bandwidth(c) == expected
    base = _sync("collective", c)
    est = add_engine_load(base, TINY, engine="vllm", transport="collective", dst_bytes_per_param=2.0, ctx=c)
    assert est.dst_only_s == pytest.approx(1352 * 2 / expected)  # P * the generator's bytes per parameter
    assert f"{expected / 1e9:.3g} GB/s" in est.note


def test_a_cluster_file_from_before_the_vllm_figures_loads_with_them_unmeasured(tmp_path):
    spec = parse_cluster("cpu:2")
    raw = json.loads(cluster_to_json(spec))
    for field in ("vllm_decode_speedup", "vllm_sync_bandwidth"):
        del raw["device"]["cpu"][field]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(raw))
    cpu = parse_cluster(str(path)).device.cpu
    assert (cpu.vllm_decode_speedup, cpu.vllm_sync_bandwidth) == (0.0, 0.0)


@pytest.mark.parametrize("field", ["vllm_decode_speedup", "vllm_sync_bandwidth"])
def test_a_negative_vllm_figure_is_refused(field):
    with pytest.raises(PlanError, match=f"CpuTerms: {field}=-1.0 must be a finite number >= 0"):
        CpuTerms(**{field: -1.0})


@pytest.mark.parametrize("field", ["vllm_cpu_decode_speedup", "vllm_group_bandwidth"])
def test_a_tuned_vllm_figure_must_be_positive(field):
    with pytest.raises(PlanError, match=f"tuning {field}=0"):
        msgspec.structs.replace(Tuning(), **{field: 0.0})
