"""Each target's weight sync into vLLM is priced with its own rates, named in the note with their
source (``flowrl.planners.estimate.rates``): NCCL over the cluster spec's links and vLLM's load at
the device's memory bandwidth for the direct route on GPUs, gloo over host memory plus the PCIe
load for the hop on GPUs, and this machine's calibrated (or measured default) gloo rate only for
CPU ranks. A rate measured on a CPU never prices a GPU cluster."""

from __future__ import annotations

import math

import msgspec
import pytest

from flowrl.examples.hf_copy import build_hf_copy
from flowrl.modelspec import model_preset
from flowrl.planners.cluster import CpuTerms, parse_cluster
from flowrl.planners.estimate.common import Context
from flowrl.planners.estimate.direct import estimate_direct_sync
from flowrl.planners.estimate.sync import SyncEstimate, add_engine_load
from flowrl.planners.parallel import ParallelDims
from flowrl.planners.plan import plan_graph
from flowrl.planners.tuning import HOST_GLOO_BANDWIDTH, Tuning
from flowrl.planners.workload import LLM_DEFAULTS

# a handful of float64 operations, each rounding by at most half an ulp of its result
REL = 8 * math.ulp(1.0)
QWEN7 = model_preset("qwen2.5-7b")
H100 = parse_cluster("16xH100").device  # 2 hosts of 8


def _ctx(cluster: str = "16xH100", **tuning: object) -> Context:
    return Context(cluster=parse_cluster(cluster), workload=LLM_DEFAULTS, tuning=Tuning(**tuning))


def _direct(ctx: Context, src: range, dst: range, dims: ParallelDims) -> SyncEstimate:
    return estimate_direct_sync(
        QWEN7, src="policy", dst="gen", transport="inprocess", src_devices=src, src_dims=ParallelDims(dp=len(src)),
        dst_devices=dst, dst_dims=dims, dst_bytes_per_param=2, src_bytes_per_param=2, ctx=ctx,
    )


@pytest.mark.parametrize(
    ("src", "dst", "bandwidth", "latency", "field"),
    [
        (range(4, 8), range(0, 4), H100.intra_host_bandwidth, H100.intra_host_latency_s, "intra_host_bandwidth 450 GB/s"),
        (range(8, 16), range(0, 8), H100.inter_host_bandwidth, H100.inter_host_latency_s, "inter_host_bandwidth 50 GB/s"),
    ],
    ids=["within-a-host", "across-hosts"],
)
def test_the_direct_route_on_gpus_is_nccl_over_the_links_then_vllms_load_by_hand(src, dst, bandwidth, latency, field):
    ctx, dims = _ctx(), ParallelDims(dp=2, tp=2)
    est = _direct(ctx, src, dst, dims)
    nbytes = QWEN7.params * 2
    wire = nbytes / (bandwidth * 0.8) + latency  # link_efficiency 0.8
    load = 2 * (nbytes / 2) / (H100.memory_bandwidth * 0.8)  # each tp worker copies its half, read + written
    assert est.time_s == pytest.approx(wire + load, rel=REL)
    assert f"H100 preset: {field} x link_efficiency 0.8" in est.note
    assert "vLLM's load into its parameters on the GPU" in est.note and "memory_bandwidth 3.35 TB/s" in est.note
    assert "gloo" not in est.note


def test_the_hop_on_gpus_is_gloo_over_host_memory_then_the_pcie_load_by_hand():
    ctx, dims = _ctx(), ParallelDims(dp=2, tp=4)
    base = SyncEstimate(src="policy", dst="gen", transport="inprocess", bytes=0, time_s=1.0, note="rank-to-rank reshard")
    est = add_engine_load(base, QWEN7, engine="vllm", transport="inprocess", dst_bytes_per_param=2, ctx=ctx, dst_dims=dims)
    nbytes = QWEN7.params * 2
    hop = nbytes / HOST_GLOO_BANDWIDTH + (nbytes / 4) / (H100.host_bandwidth * 0.8)
    assert est.time_s == pytest.approx(1.0 + hop, rel=REL) and est.dst_only_s == pytest.approx(hop, rel=REL)
    assert "Tuning.host_gloo_bandwidth" in est.note and "pytorch/gloo#248" in est.note
    assert "H100 preset: host_bandwidth 64 GB/s x link_efficiency 0.8" in est.note
    faster = add_engine_load(base, QWEN7, engine="vllm", transport="inprocess", dst_bytes_per_param=2, ctx=_ctx(host_gloo_bandwidth=4e9), dst_dims=dims)
    assert faster.dst_only_s == pytest.approx(nbytes / 4e9 + (nbytes / 4) / (H100.host_bandwidth * 0.8), rel=REL)
    assert "4 GB/s (--set host_gloo_bandwidth)" in faster.note and "pytorch/gloo#248" not in faster.note


def test_the_users_group_rate_replaces_the_groups_on_any_cluster():
    est = _direct(_ctx(vllm_group_bandwidth=2e9), range(4, 8), range(0, 4), ParallelDims(dp=4))
    nbytes = QWEN7.params * 2
    assert est.time_s == pytest.approx(nbytes / 2e9 + 2 * nbytes / (H100.memory_bandwidth * 0.8), rel=REL)
    assert "2 GB/s (--set vllm_group_bandwidth)" in est.note


@pytest.mark.parametrize(("terms", "source"), [(CpuTerms(), "the project's measured default"), (CpuTerms(vllm_sync_bandwidth=0.7e9), "calibrated: cluster 'cpu:3'")])
def test_cpu_ranks_use_the_calibrated_else_the_measured_default_gloo_rate(terms, source):
    cluster = parse_cluster("cpu:3")
    cluster = msgspec.structs.replace(cluster, device=msgspec.structs.replace(cluster.device, cpu=terms))
    ctx = Context(cluster=cluster, workload=LLM_DEFAULTS, tuning=Tuning())
    small = model_preset("qwen2.5-0.5b")
    est = estimate_direct_sync(
        small, src="policy", dst="gen", transport="inprocess", src_devices=(1, 2), src_dims=ParallelDims(dp=2),
        dst_devices=(0,), dst_dims=ParallelDims(), dst_bytes_per_param=4, src_bytes_per_param=4, ctx=ctx,
    )
    rate = terms.vllm_sync_bandwidth or 0.4e9
    assert est.time_s == pytest.approx(small.params * 4 / rate, rel=REL)
    assert source in est.note and "gloo" in est.note


def _cpu_rates_absurd(monkeypatch, cluster: str):
    """``cluster`` whose ``CpuTerms`` claim absurd gloo and vLLM-sync rates (1 byte/s), with the
    CPU-measured defaults made absurd too."""
    import flowrl.planners.estimate.rates as rates
    import flowrl.planners.estimate.train as train

    monkeypatch.setattr(rates, "VLLM_GROUP_BANDWIDTH", 1.0)
    monkeypatch.setattr(train, "GLOO_BANDWIDTH", 1.0)
    spec = parse_cluster(cluster)
    return msgspec.structs.replace(spec, device=msgspec.structs.replace(spec.device, cpu=CpuTerms(vllm_sync_bandwidth=1.0, gloo_by_bytes=((1, 1.0),))))


@pytest.mark.parametrize(
    ("graph", "strategy"),
    [
        (build_hf_copy(engine="vllm"), "gen:d2t2@0-3 | policy:d4@4-7"),  # the direct route (NCCL)
        (build_hf_copy(engine="vllm"), "gen:d2t2@0-3 | policy:d4@0-3"),  # colocated: the hop (gloo over host memory)
        (build_hf_copy(engine="vllm"), "search"),
    ],
    ids=["direct", "hop", "search"],
)
def test_a_cpu_measured_rate_never_prices_a_gpu_cluster(monkeypatch, graph, strategy):
    clean = plan_graph(graph, "8xH100", model=QWEN7, strategy=strategy)
    polluted = plan_graph(graph, _cpu_rates_absurd(monkeypatch, "8xH100"), model=QWEN7, strategy=strategy)
    assert [s.time_s for s in polluted.weight_syncs] == [s.time_s for s in clean.weight_syncs]
    assert polluted.step_s == clean.step_s and str(polluted) == str(clean)
    assert all("measured default" not in s.note and "calibrated" not in s.note for s in clean.weight_syncs)


def test_the_same_pollution_moves_a_cpu_plan(monkeypatch):
    """The check above can fail: on CPU ranks those rates are the ones used."""
    graph = build_hf_copy(engine="vllm")
    strategy = "gen:d1@0 | policy:d1@1"
    clean = plan_graph(graph, "cpu:2", strategy=strategy)
    polluted = plan_graph(graph, _cpu_rates_absurd(monkeypatch, "cpu:2"), strategy=strategy)
    assert polluted.weight_syncs[0].time_s > 1000 * clean.weight_syncs[0].time_s
