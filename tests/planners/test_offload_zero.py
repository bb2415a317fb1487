"""Memory and parallelism terms, by hand: offloading colocated state, ZeRO stages, uneven pipeline stages."""

from __future__ import annotations

import msgspec
import pytest

from flowrl.examples import build_example
from flowrl.planners.estimate.common import Context
from flowrl.planners.estimate.train import estimate_train
from flowrl.planners.parallel import ParallelDims
from flowrl.planners.search import evaluator, resolve_roles
from tests.planners.test_estimates import EXACT, TINY, ctx, device

P = 1352  # TINY's parameters
LLAMARL = build_example("llamarl")


# -- offloading ------------------------------------------------------------------------------------
def _gen_alone(c: Context) -> float:
    """Bytes per device of the example's generator (float32 weights) on its own."""
    return evaluator(LLAMARL, resolve_roles(LLAMARL, c, TINY), c, 0).node("gen", range(1), ParallelDims(), 0.0).memory.total


@pytest.mark.parametrize("offload", ["auto", "off"])
def test_offloading_colocated_state_by_hand(offload):
    """The generator fits beside the policy's weights (2 bytes/param) but not beside its gradients
    and optimizer states (4 + 12 bytes/param): the policy's whole state goes to host memory and back
    (as the runtime moves it: weights too, after the publish), 2 * (2 + 16) * P bytes; the plan's
    placement names the policy as offloaded."""
    probe = ctx(tuning=msgspec.structs.replace(EXACT, offload=offload))
    room = _gen_alone(probe) + 2 * P + 8  # gen's own bytes + the policy's weights, a little slack
    c = ctx(dev=device(memory_bytes=room, host_bandwidth=1e9), tuning=probe.tuning)
    ev = evaluator(LLAMARL, resolve_roles(LLAMARL, c, TINY), c, 0)
    alone = ev.node("gen", range(1), ParallelDims(), 0.0)
    est = ev.beside("gen", range(1), ParallelDims(), [("policy", ParallelDims())])
    if offload == "off":
        assert not est.feasible
        return
    assert est.feasible and est.breakdown["offload"] == pytest.approx(2 * 18 * P / 1e9)
    assert est.breakdown["offload/policy"] == est.breakdown["offload"]
    assert est.time_s == pytest.approx(alone.time_s + 2 * 18 * P / 1e9)
    assert "offloaded: policy" in est.notes[-1] and "--offload auto" in est.notes[-1]


def test_no_host_bandwidth_no_offload():
    c = ctx(dev=device(memory_bytes=int(_gen_alone(ctx()) + 2 * P + 8), host_bandwidth=0.0))
    ev = evaluator(LLAMARL, resolve_roles(LLAMARL, c, TINY), c, 0)
    assert not ev.beside("gen", range(1), ParallelDims(), [("policy", ParallelDims())]).feasible


# -- ZeRO stages ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "stage, weights, grads, optimizer",
    [(0, 2 * P, 4 * P, 12 * P), (1, 2 * P, 4 * P, 6 * P), (2, 2 * P, 2 * P, 6 * P), (3, P, 2 * P, 6 * P)],
    ids=["zero0", "zero1", "zero2", "zero3"],
)
def test_zero_stage_memory_by_hand(stage, weights, grads, optimizer):
    c = ctx(tuning=msgspec.structs.replace(EXACT, zero_stage=stage))
    mem = estimate_train(TINY, ParallelDims(dp=2), range(2), c).memory
    assert (mem.weights, mem.grads, mem.optimizer) == (weights, grads, optimizer)


def test_zero2_reduce_scatters_half_of_an_all_reduce():
    one = estimate_train(TINY, ParallelDims(dp=2), range(2), ctx(tuning=msgspec.structs.replace(EXACT, zero_stage=1)))
    two = estimate_train(TINY, ParallelDims(dp=2), range(2), ctx(tuning=msgspec.structs.replace(EXACT, zero_stage=2)))
    # all-reduce of 4P bytes over 2 on 1e10 B/s: 2 * 1/2 * 4P / 1e10; reduce-scatter: half
    assert one.breakdown["dp_comm"] == pytest.approx(4 * P / 1e10)
    assert two.breakdown["dp_comm"] == pytest.approx(2 * P / 1e10)


def test_zero3_gathers_parameters_per_micro_batch():
    c = ctx(tuning=msgspec.structs.replace(EXACT, zero_stage=3))
    est = estimate_train(TINY, ParallelDims(dp=2), range(2), c, micro_batch=1)
    m = 2  # 4 sequences over dp 2, one per micro-batch
    gather = 1 / 2 * 2 * P / 1e10  # all-gather of the 2P bytes of parameters over 2
    assert est.breakdown["dp_comm"] == pytest.approx(2 * P / 1e10 + m * 2 * gather)


# -- uneven pipeline stages --------------------------------------------------------------------------
THREE = msgspec.structs.replace(TINY, name="three", n_layers=3)


def test_uneven_stage_sets_the_pace_and_the_memory():
    """3 layers on 2 stages: the larger stage holds 2 layers, so it computes 2/3 of a token's FLOPs
    (not 1/2) and holds 2/3 of the parameters."""
    one = estimate_train(THREE, ParallelDims(), range(1), ctx(), micro_batch=4)
    two = estimate_train(THREE, ParallelDims(pp=2), range(2), ctx(), micro_batch=4)
    assert two.breakdown["compute"] == pytest.approx(one.breakdown["compute"] * 2 / 3)
    assert two.memory.weights == int(THREE.params * 2 / 3 * 2)


def test_a_plan_that_offloads_names_the_node_in_its_placement():
    """``Plan.placement().offload`` lists what the plan moved: what ``flowrl run --offload auto`` moves."""
    from flowrl.planners.cluster import ClusterSpec
    from flowrl.planners.plan import plan_graph

    from flowrl.graph.ir import Graph

    # micro-batches of one sequence: the policy's activations stay under the generator's KV cache and
    # workspace (the whole batch, what micro_batch_size 0 runs, holds more than the generator does)
    nodes = tuple(
        msgspec.structs.replace(n, optimizer=msgspec.structs.replace(n.optimizer, micro_batch_size=1)) if n.name == "policy" else n
        for n in LLAMARL.nodes
    )
    graph = Graph(msgspec.structs.replace(LLAMARL.spec, nodes=nodes))
    c = ctx()
    ev = evaluator(graph, resolve_roles(graph, c, TINY), c, 0)
    room = ev.node("policy", range(1), ParallelDims(), 0.0).memory.total + ev.resident("gen", ParallelDims()) + 8  # the policy fits beside gen
    assert room < _gen_alone(c) + 18 * P  # ... but gen not beside the policy's whole state
    cluster = ClusterSpec(name="c", hosts=1, devices_per_host=1, device=device(memory_bytes=room, host_bandwidth=1e9))
    tuning = {f: getattr(EXACT, f) for f in EXACT.__struct_fields__ if getattr(EXACT, f) is not None}
    plan = plan_graph(graph, cluster, strategy="gen:d1@0 | policy:d1@0", model=TINY, workload=c.workload, **tuning)
    assert plan.placement().offload == ("policy",)
    assert plan.placements["gen"].breakdown["offload/policy"] == pytest.approx(2 * 18 * P / 1e9)
    roomy = msgspec.structs.replace(cluster, device=device(memory_bytes=10**9, host_bandwidth=1e9))
    kept = plan_graph(LLAMARL, roomy, strategy="gen:d1@0 | policy:d1@0", model=TINY, workload=c.workload, **tuning)
    assert kept.placement().offload == ()  # room for both: nothing moves


def test_a_vllm_generator_asleep_frees_its_weights_and_a_builtin_one_nothing():
    """What the runtime does beside a trainer: vLLM's level-1 sleep moves its weights out and back;
    the built-in engine never sleeps."""
    from flowrl.graph.rewrite import with_engine

    c, d = ctx(), ParallelDims()
    assert evaluator(LLAMARL, resolve_roles(LLAMARL, c, TINY), c, 0).offloadable("gen", d) == 0.0
    vllm = with_engine(build_example("hf_copy"), "vllm")
    ev = evaluator(vllm, resolve_roles(vllm, c, TINY), c, 0)
    assert ev.offloadable("gen", d) == ev.resident("gen", d) > 0
