"""The synchronous baseline as a named system, the quantization cost of a sync, and the property that
more devices never make a predicted step slower (hypothesis)."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowrl.errors import PlanError
from flowrl.examples import build_example
from flowrl.planners.baseline import BaselineSystem, baseline_context, gather_sync, plan_baseline
from flowrl.planners.cluster import ClusterSpec
from flowrl.planners.estimate.common import Context
from flowrl.planners.estimate.quantize import QUANTIZE_OPS, quantize_cost
from flowrl.planners.parallel import ParallelDims
from flowrl.planners.plan import plan_graph
from flowrl.planners.tuning import Tuning
from flowrl.planners.workload import Workload
from tests.planners.test_estimates import TINY, WORK, ctx, device

LLAMARL = build_example("llamarl")


def _sync_args(src_devices, dst_devices, dims=ParallelDims(), src_bytes=2, dst_bytes=2):
    return dict(src="policy", dst="gen", transport="collective", src_devices=src_devices, src_dims=dims, dst_devices=dst_devices,
                dst_dims=dims, dst_bytes_per_param=dst_bytes, src_bytes_per_param=src_bytes)


@pytest.mark.parametrize(
    "hosts, per_host, bandwidth",
    [(1, 4, 1e10), (2, 2, 1e9)],
    ids=["one-host-nvlink", "two-hosts-nic"],
)
def test_gather_sync_by_hand(hosts, per_host, bandwidth):
    c = ctx(hosts=hosts, per_host=per_host)
    est = gather_sync(TINY, **_sync_args(range(4), range(4), ParallelDims(dp=4)), ctx=c)
    assert est.time_s == pytest.approx(2 * 1352 * 2 / bandwidth)  # in, then out, of one device; no latency here


def test_gather_sync_on_one_device_is_a_copy():
    est = gather_sync(TINY, **_sync_args(range(1), range(1)), ctx=ctx())
    assert est.time_s == pytest.approx(1352 * 2 / 1e11)


def test_quantization_cost_by_hand():
    dev = device(kernel_overhead_s=1e-6)
    c = ctx(dev=dev)
    # each of tp*pp = 2 trainer devices reads 2 bytes/param twice (amax, cast) and writes 1
    expected = 1352 / 2 * (2 * 2 + 1) / 1e11 + (9 * 2 + 3) * QUANTIZE_OPS * 1e-6
    assert quantize_cost(TINY, ParallelDims(tp=2), src_bytes=2, dst_bytes=1, ctx=c) == pytest.approx(expected)
    assert quantize_cost(TINY, ParallelDims(tp=2), src_bytes=2, dst_bytes=2, ctx=c) == 0.0


def test_search_adds_quantization_to_the_sync():
    bf16 = plan_graph(LLAMARL, "16xH100", workload=_SMALL, model=_8B, gen_precision="bfloat16", strategy="gen:d8@0-7 | policy:d8@8-15")
    fp8 = plan_graph(LLAMARL, "16xH100", workload=_SMALL, model=_8B, gen_precision="float8", strategy="gen:d8@0-7 | policy:d8@8-15")
    assert "to cast 2 -> 1 bytes/param" in fp8.weight_syncs[0].note
    assert "cast" not in bf16.weight_syncs[0].note


def test_baseline_context_applies_the_systems_choices():
    system = BaselineSystem(recompute_logprobs=True, batching="lockstep")
    c = baseline_context(ctx(work=msgspec.structs.replace(WORK, batching="continuous")), system)
    assert (c.tuning.recompute_logprobs, c.tuning.gen_precision, c.workload.batching) == (True, "bfloat16", "lockstep")


def test_shared_layout_gives_every_node_the_same_dims():
    result = plan_baseline(LLAMARL, _tiny_ctx(2, 2), model=TINY)
    layout = result.all_devices.layout
    assert len({dims for _, dims in layout.values()}) == 1 and len({tuple(d) for d, _ in layout.values()}) == 1
    assert result.all_devices.syncs[0].note.startswith("gather")


def test_baseline_system_refuses_unknown_choices():
    with pytest.raises(PlanError, match="batching 'paged'"):
        BaselineSystem(batching="paged")


# -- more devices never make a predicted step slower -------------------------------------------------
from flowrl.modelspec import model_preset  # noqa: E402

_8B = model_preset("llama3-8b")
_SMALL = Workload(prompts_per_step=16, samples_per_prompt=4, prompt_len=128, gen_len=128)


def _tiny_ctx(hosts: int, per_host: int) -> Context:
    cluster = ClusterSpec(name=f"{hosts}x{per_host}", hosts=hosts, devices_per_host=per_host, device=device(kernel_overhead_s=1e-6))
    return Context(cluster=cluster, workload=Workload(prompts_per_step=8, samples_per_prompt=4, prompt_len=6, gen_len=6), tuning=Tuning())


@settings(max_examples=12, deadline=None)
@given(per_host=st.sampled_from([1, 2, 4]), hosts=st.integers(1, 6), more=st.integers(1, 6))
def test_more_devices_never_slower(per_host, hosts, more):
    small, large = _tiny_ctx(hosts, per_host), _tiny_ctx(hosts + more, per_host)
    plans = [plan_graph(LLAMARL, c.cluster, workload=c.workload, model=TINY) for c in (small, large)]
    assert plans[1].step_s <= plans[0].step_s * (1 + 1e-9)
    assert plans[1].baseline_subset_step_s <= plans[0].baseline_subset_step_s * (1 + 1e-9)
    sync = [plan_graph(LLAMARL, c.cluster, workload=c.workload, model=TINY, max_staleness=0) for c in (small, large)]
    assert sync[1].step_s <= sync[0].step_s * (1 + 1e-9)
