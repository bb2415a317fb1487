"""Colocated memory is what the runtime holds: vLLM on CUDA claims its share of each GPU for the run
(``EngineCaps.cuda_memory_fraction``, the ``gpu_memory_utilization`` the runtime passes), a plan says
what stays beside what and what it offloads or puts to sleep, it offloads only where the runtime
does (GPUs of one host, a backend that offloads; not across hosts, which only torchrun runs, and
torchrun does not offload), and a plan that does not fit is never chosen."""

from __future__ import annotations

import msgspec
import pytest

from flowrl.errors import PlanError
from flowrl.examples import build_example
from flowrl.examples.hf_copy import build_hf_copy
from flowrl.graph.engines import ENGINE_CAPS, VLLMConfig
from flowrl.graph.ir import Graph
from flowrl.graph.rewrite import with_engine
from flowrl.modelspec import model_preset
from flowrl.planners.cluster import ClusterSpec, parse_cluster
from flowrl.planners.estimate.generate import estimate_generate
from flowrl.planners.parallel import ParallelDims
from flowrl.planners.plan import plan_graph
from flowrl.planners.workload import LLM_DEFAULTS
from tests.planners.test_estimates import EXACT, TINY, ctx, device

VLLM = with_engine(build_example("hf_copy"), "vllm")
TUNING = {f: getattr(EXACT, f) for f in EXACT.__struct_fields__ if getattr(EXACT, f) is not None}
# bytes per device: TINY's policy (24.3 KB resident, 26.4 KB at its smallest peak: micro-batches of one)
# does not fit beside vLLM's 0.45 of it (20.7 KB), fits beside it asleep; vLLM fits beside the policy's state
M = 46_000


def test_vllm_on_a_gpu_holds_its_share_for_the_run_and_the_builtin_engine_what_it_uses():
    c = ctx()
    vllm = estimate_generate(TINY, ParallelDims(), range(1), c, precision="bfloat16", engine="vllm")
    claim = int(ENGINE_CAPS["vllm"].cuda_memory_fraction * c.cluster.device.memory_bytes)
    assert vllm.memory.total == vllm.memory.resident == claim and vllm.memory.transient == 0
    assert "holds 0.45 of each X for the run" in vllm.notes[1]
    builtin = estimate_generate(TINY, ParallelDims(), range(1), c, precision="bfloat16")
    assert builtin.memory.held == 0 and builtin.memory.total < claim
    cpu = estimate_generate(TINY, ParallelDims(), range(1), ctx(dev=device(kind="cpu")), precision="bfloat16", engine="vllm")
    assert cpu.memory.held == 0  # on a CPU vLLM's KV cache is sized per sequence, not a share of the device


def _cluster(hosts: int, per_host: int) -> ClusterSpec:
    return ClusterSpec(name=f"{hosts}x{per_host}", hosts=hosts, devices_per_host=per_host, device=device(memory_bytes=M, host_bandwidth=1e9))


def test_on_one_gpu_host_the_trainer_fits_beside_vllm_asleep_and_the_plan_says_so():
    plan = plan_graph(VLLM, _cluster(1, 1), strategy="gen:d1@0 | policy:d1@0", model=TINY, workload=ctx().workload, **TUNING)
    policy, gen = plan.placements["policy"], plan.placements["gen"]
    assert plan.placement().offload == ("gen",)
    weights = gen.memory.weights  # level-1 sleep moves the weights to host memory and frees the KV pool
    assert weights == TINY.params * 4  # the example samples in float32
    assert policy.breakdown["offload/gen"] == pytest.approx(2 * weights / 1e9, rel=1e-12)
    note = policy.notes[-1]
    assert note.startswith("colocated state offloaded: gen (asleep: frees") and "local or process backend" in note
    assert any("fits only with colocated offloading (gen moved aside" in w and "--backend process" in w for w in plan.warnings)
    assert gen.notes[-1].startswith("beside policy's") and "held on the same devices" in gen.notes[-1]
    for p in (policy, gen):  # what each node's devices hold while it runs, vLLM's claim counted while it is awake
        assert p.memory_bytes <= M


def test_across_hosts_nothing_is_offloaded_so_the_same_layout_does_not_fit():
    """Two replicas each, unsharded optimizer state (ZeRO-0): per device what the one-device plan
    above holds; on two hosts of one device the runtime could only run it under torchrun, which keeps it."""
    layout, tuning = "gen:d2@0-1 | policy:d2@0-1", {**TUNING, "zero_stage": 0}
    one_host = plan_graph(VLLM, _cluster(1, 2), strategy=layout, model=TINY, workload=ctx().workload, **tuning)
    assert one_host.placement().offload == ("gen",)
    with pytest.raises(PlanError, match=r"does not fit: .*nothing offloaded or asleep: its devices span hosts, which only torchrun runs, and torchrun does not offload"):
        plan_graph(VLLM, _cluster(2, 1), strategy=layout, model=TINY, workload=ctx().workload, **tuning)


@pytest.mark.parametrize(("model", "cluster"), [("qwen2.5-7b", "8xH100"), ("qwen2.5-32b", "4x8xH100")])
def test_the_chosen_colocated_plan_fits_with_vllms_share_counted(model, cluster):
    """The issue's plans: a 64.2 GiB generator and a 57.0 GiB policy on the same 80 GB devices, said
    nothing of; now each node's figure holds what stays beside it, within memory_util of the device."""
    graph = build_hf_copy(engine="vllm", lora=dict(r=8, alpha=16, target_modules=["q_proj", "v_proj"]))
    spec = parse_cluster(cluster)
    plan = plan_graph(graph, spec, model=model_preset(model), strategy="colocated", workload=LLM_DEFAULTS, gen_precision="bfloat16")
    budget = spec.device.memory_bytes * plan.tuning.memory_util
    claim = ENGINE_CAPS["vllm"].cuda_memory_fraction * spec.device.memory_bytes
    gen, policy = plan.placements["gen"], plan.placements["policy"]
    assert gen.memory.resident == int(claim)
    assert policy.memory_bytes == policy.memory.total + gen.memory.resident <= budget  # vLLM awake beside the trainer's step
    assert gen.memory_bytes == gen.memory.total + policy.memory.resident <= budget
    assert any("beside gen's 36.0 GiB held on the same devices" in n for n in policy.notes)


def test_the_planner_counts_the_generators_own_share_when_it_sets_one():
    """``gpu_memory_utilization`` on the generator is the share the runtime passes vLLM, so the plan
    holds that share for the run (and says so) instead of EngineCaps.cuda_memory_fraction."""
    c = ctx()
    own = estimate_generate(TINY, ParallelDims(), range(1), c, precision="bfloat16", engine="vllm", memory_fraction=0.3)
    assert own.memory.resident == int(0.3 * c.cluster.device.memory_bytes)
    assert "holds 0.3 of each X for the run" in own.notes[1]
    builtin = estimate_generate(TINY, ParallelDims(), range(1), c, precision="bfloat16", memory_fraction=0.3)
    assert builtin.memory.held == 0  # the built-in engine claims no share (and its node refuses the option)
    vllm = with_engine(build_hf_copy(), "vllm")
    nodes = tuple(msgspec.structs.replace(n, vllm=VLLMConfig(gpu_memory_utilization=0.3)) if n.kind == "generator" else n for n in vllm.nodes)
    graph = Graph(msgspec.structs.replace(vllm.spec, nodes=nodes))
    spec = parse_cluster("8xH100")
    plan = plan_graph(graph, spec, model=model_preset("qwen2.5-7b"), strategy="colocated", workload=LLM_DEFAULTS, gen_precision="bfloat16")
    assert plan.placements["gen"].memory.resident == int(0.3 * spec.device.memory_bytes)
    assert any("holds 0.3 of each" in n for n in plan.placements["gen"].notes)
