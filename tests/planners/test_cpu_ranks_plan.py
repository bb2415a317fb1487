"""The planner prices benches/cluster.py's layout as torchrun runs it on CPU ranks: an FSDP2 policy's ranks
as one-thread processes, their collectives over gloo and not overlapped on a crowded host, and the
weights over the direct route into vLLM's workers (``planners/estimate/direct.py``)."""

from __future__ import annotations

import msgspec
import pytest

from flowrl.errors import PlanError
from flowrl.examples.hf_copy import ASSETS
from flowrl.graph.builder import GraphBuilder
from flowrl.graph.configs import HFModelConfig
from flowrl.modelspec import model_from_config
from flowrl.placement.weight_routes import direct_edges
from flowrl.planners.cluster import ClusterSpec, CpuTerms, cpu_device, parse_cluster
from flowrl.planners.estimate.common import Context, all_gather_s
from flowrl.planners.estimate.direct import estimate_direct_sync
from flowrl.planners.estimate.train import gloo_link, host_crowded, train_options
from flowrl.planners.parallel import ParallelDims
from flowrl.planners.plan import plan_graph
from flowrl.planners.tuning import GLOO_BANDWIDTH, Tuning
from flowrl.planners.workload import Workload

LAYOUT = "gen:d1@0 | policy:d2@1-2"
WORK = Workload(prompts_per_step=2, samples_per_prompt=4, prompt_len=8, gen_len=24)


def graph(*, engine: str = "vllm", sharding: str = "fsdp", **edge):
    """benches/cluster.py's graph on the HF example's tiny model: a generator, an FSDP2 policy, k = 1."""
    b = GraphBuilder("cpu_ranks", model=HFModelConfig(path=str(ASSETS), init="random", seed=0))
    prompts = b.source("prompts", data=str(ASSETS / "prompts.jsonl"), prompt_field="prompt", batch_size=2)
    gen = b.generator("gen", prompts, n_samples=4, max_new_tokens=24, temperature=1.0, engine=engine)
    score = b.scorer("reward", gen, fn="flowrl.examples.hf_copy:reward", inputs="text")
    aipo = b.loss("aipo", gen, score, objective="aipo", rho=4.0)
    policy = b.policy("policy", aipo, lr=1e-5, sharding=sharding)
    b.weights(policy, gen, max_staleness=1, **edge)
    return b.build()


def cluster(*, gloo: float = 0.0, cores: int = 2, devices: int = 3, shared: float = 1.0) -> ClusterSpec:
    """A calibrated-looking CPU: ``devices`` ranks on ``cores`` cores (benches/cluster.py: 3 on 2)."""
    terms = CpuTerms(
        flops_by_width=((32, 2e9), (1024, 4e9)), train_flops_by_width=((32, 1e9), (1024, 2e9)), thread_speedup=1.6,
        vllm_sync_bandwidth=0.5e9, gloo_by_bytes=((2**20, gloo),) if gloo else (), host_cores=cores, shared_slowdown=shared,
    )
    return ClusterSpec(name="cpu-test", hosts=1, devices_per_host=devices, device=cpu_device(cores=cores, memory_bytes=8 * 2**30, cpu=terms))


def plan(g, c: ClusterSpec, strategy: str = LAYOUT):
    return plan_graph(g, c, strategy=strategy, max_staleness=1, workload=WORK)


# -- training on CPU ranks ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec, vllm_workers, crowded",
    [("cpu:2", 0, False), ("cpu:2", 1, True), ("8xH100", 1, False), (None, 0, True)],
    ids=["a-core-per-rank", "plus-vllm-worker", "gpu", "3-ranks-on-2-cores"],
)
def test_a_host_is_crowded_when_its_ranks_and_vllm_workers_outnumber_its_cores(spec, vllm_workers, crowded):
    c = parse_cluster(spec) if spec else cluster()
    assert host_crowded(c, vllm_workers) is crowded


def test_an_fsdp_policy_on_cpu_ranks_computes_its_half_of_the_batch_at_the_one_core_rate():
    """Two one-thread processes: each rank's compute is half one process's on one core (not the whole
    batch over a threaded mesh's speed-up, as the local runtime runs a replicated CPU mesh)."""
    c = cluster()
    ctx = Context(cluster=c, workload=WORK, tuning=Tuning())
    model = model_from_config(graph().node("policy").model)

    def compute(dims: ParallelDims, sharding: str) -> float:
        options = train_options(model, dims, range(1, 1 + dims.dp), ctx, sharding=sharding, packing=None)
        return options.estimate(options.options[0]).breakdown["compute"]

    one = compute(ParallelDims(), "replicate")
    assert compute(ParallelDims(dp=2), "fsdp") == pytest.approx(one / 2, rel=1e-12)
    assert compute(ParallelDims(dp=2), "replicate") == pytest.approx(one / c.device.mesh_speedup(2, 3), rel=1e-12)


def test_the_fsdp_policys_collectives_run_at_the_calibrated_gloo_rate_with_no_overlap_on_a_crowded_host():
    """Three ranks and vLLM's worker on two cores: the forward's and the backward's gathers and the
    gradients' reduce-scatter each cost a whole gloo all-gather of the model, so the policy's time
    grows by exactly their bytes over the slower rate; with a free core, ``dp_overlap`` hides half."""
    g = graph()
    model = model_from_config(g.node("policy").model)
    fast, slow = (plan(g, cluster(gloo=rate)).placements["policy"] for rate in (0.4e9, 0.1e9))
    moved = 3 * model.params * 4 / 2  # 3 all-gathers of the float32 model, each rank receiving the other's half
    assert slow.time_s - fast.time_s == pytest.approx(moved / 0.1e9 - moved / 0.4e9, rel=1e-9)
    assert slow.breakdown["dp_comm"] == pytest.approx(moved / 0.1e9 + 3 * c_latency(), rel=1e-9)
    assert plan(g, cluster()).placements["policy"].breakdown["dp_comm"] == pytest.approx(moved / GLOO_BANDWIDTH + 3 * c_latency(), rel=1e-9)

    ctx = Context(cluster=cluster(gloo=0.1e9), workload=WORK, tuning=Tuning())
    crowded, free = (
        train_options(model, ParallelDims(dp=2), range(1, 3), ctx, sharding="fsdp", packing=None, crowded=flag) for flag in (True, False)
    )
    ratio = crowded.estimate(crowded.options[0]).breakdown["dp_comm"] / free.estimate(free.options[0]).breakdown["dp_comm"]
    assert ratio == pytest.approx(1 / (1 - Tuning().dp_overlap), rel=1e-12)


@pytest.mark.parametrize("sharding, apart", [("fsdp", True), ("replicate", False)], ids=["torchrun-processes", "one-process"])
def test_a_torchrun_jobs_meshes_share_the_cores_not_an_interpreter(sharding, apart):
    """``shared_slowdown`` is measured with two meshes in one process (one interpreter); a torchrun
    job's ranks are processes of their own: while both sides are busy they slow each other only as
    3 ranks time-share 2 cores (1.5x), whatever the in-process figure says."""
    g = graph(sharding=sharding)
    alone, shared = (plan(g, cluster(gloo=0.2e9, shared=s)) for s in (1.0, 2.5))
    assert (shared.step_s == alone.step_s) is apart
    if apart:
        (sync,) = alone.weight_syncs  # the direct route keeps both sides busy
        busy = sorted(alone.placements[n].time_s + sync.time_s for n in ("gen", "policy"))
        assert alone.step_s == pytest.approx(busy[0] * 1.5 + busy[1] - busy[0], rel=1e-12)


def c_latency() -> float:
    """One all-gather's latency term between two CPU ranks."""
    return all_gather_s(0.0, 2, gloo_link(Context(cluster=cluster(), workload=WORK, tuning=Tuning()), 1.0))


# -- the direct weight route -------------------------------------------------------------------------
def test_the_planner_prices_the_direct_route_for_the_edges_the_rule_sends_direct_and_names_it():
    g = graph()
    p = plan(g, cluster(gloo=0.2e9))
    (sync,) = p.weight_syncs
    model = model_from_config(g.node("gen").model)
    assert direct_edges(g, {"gen": (0,), "policy": (1, 2)}) == {("policy", "gen")}
    assert sync.note.startswith("direct route: the policy's ranks straight into vLLM's workers") and "FSDP2 rank gathers each bucket" in sync.note
    assert "staging" in sync.note and "then into vLLM" not in sync.note  # no hop
    assert (sync.bytes, sync.wire_bytes, sync.copied_bytes, sync.dst_only_s) == (int(model.params * 4), int(model.params * 4), 0, 0.0)
    gather = model.params * 4 / 2 / 0.2e9 + c_latency()
    assert sync.time_s == pytest.approx(gather + model.params * 4 / 0.5e9, rel=1e-9)  # every rank gathers, the lead broadcasts into vLLM

    hop = plan(graph(transport="collective"), cluster(gloo=0.2e9)).weight_syncs[0]  # a named transport takes the hop
    assert "then into vLLM over the weight-sync group" in hop.note and hop.dst_only_s > 0
    colocated = plan(g, cluster(gloo=0.2e9), "gen:d2@0-1 | policy:d2@0-1").weight_syncs[0]
    assert not colocated.note.startswith("direct route")


@pytest.mark.parametrize(
    "spec, sharding, direct",
    [("cpu", "fsdp", True), ("cpu", "replicate", False), ("4xA100", "replicate", True)],
    ids=["cpu-fsdp-torchrun", "cpu-local-backend", "gpu-torchrun"],
)
def test_the_direct_route_is_priced_where_the_plan_runs_as_a_torchrun_job(spec, sharding, direct):
    """Only a torchrun job has the route: a GPU plan, or a CPU plan with an FSDP2 policy; a replicated
    policy on a CPU runs under the local or process backend, where every vLLM edge takes the hop."""
    c = cluster(gloo=0.2e9) if spec == "cpu" else parse_cluster(spec)
    (sync,) = plan(graph(sharding=sharding), c).weight_syncs
    assert sync.note.startswith("direct route") is direct
    if direct and sharding == "replicate":
        assert "the policy's first rank sends alone" in sync.note


def test_one_broadcast_reaches_every_worker_of_every_generator_replica():
    """Several engines on the direct route (replicas, vLLM tp): the same broadcast, so the same time;
    the gather grows with a slower gloo rate and is absent for a replicated policy."""
    model = model_from_config(graph().node("gen").model)
    kw = dict(src="policy", dst="gen", transport="inprocess", src_devices=(1, 2), src_dims=ParallelDims(dp=2), dst_bytes_per_param=2, src_bytes_per_param=4)

    def direct(gen_dims: ParallelDims, *, gloo: float = 0.2e9, sharded: bool = True) -> float:
        ctx = Context(cluster=cluster(gloo=gloo, devices=8, cores=8), workload=WORK, tuning=Tuning())
        return estimate_direct_sync(model, dst_devices=tuple(range(3, 3 + gen_dims.dp * gen_dims.tp)), dst_dims=gen_dims, ctx=ctx, src_sharded=sharded, **kw).time_s

    one = direct(ParallelDims())
    assert direct(ParallelDims(dp=2)) == direct(ParallelDims(tp=2)) == direct(ParallelDims(dp=2, tp=2)) == one
    assert direct(ParallelDims(), gloo=0.1e9) > one > direct(ParallelDims(), sharded=False) == pytest.approx(model.params * 2 / 0.5e9, rel=1e-12)


def test_a_cluster_file_from_before_the_gloo_rate_loads_with_it_unmeasured(tmp_path):
    import json

    from flowrl.planners.cluster import cluster_to_json

    raw = json.loads(cluster_to_json(cluster(gloo=0.3e9)))
    del raw["device"]["cpu"]["gloo_by_bytes"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(raw))
    old = parse_cluster(str(path))
    assert old.device.cpu.gloo_by_bytes == ()
    ctx = Context(cluster=old, workload=WORK, tuning=Tuning())
    assert gloo_link(ctx, 2**20).bandwidth == GLOO_BANDWIDTH
    for table in (((2**20, -1.0),), ((2**26, 1e8), (2**20, 1e8))):
        with pytest.raises(PlanError, match=r"gloo_by_bytes=.* must be \(bytes >= 1, bytes/s > 0\) pairs, sizes strictly ascending"):
            CpuTerms(gloo_by_bytes=table)


def test_each_collective_runs_at_the_rate_measured_at_its_size():
    """gloo's rate falls with the size: an FSDP2 policy's gathers move a block at a time (its rate at a
    block's bytes), the direct route's gathers a tensor at a time (at an MLP weight's bytes)."""
    g = graph()
    model = model_from_config(g.node("policy").model)
    block, tensor = model.params * 4 / model.n_layers, model.ffn_dim * model.dim * 4
    assert tensor < block
    table = ((int(tensor), 0.4e9), (int(block), 0.1e9))  # the sizes themselves: no interpolation

    def rated(by_bytes):
        c = cluster()
        c = msgspec.structs.replace(c, device=msgspec.structs.replace(c.device, cpu=msgspec.structs.replace(c.device.cpu, gloo_by_bytes=by_bytes)))
        return plan(g, c)

    sized, at_block, at_tensor = rated(table), rated(((1, 0.1e9),)), rated(((1, 0.4e9),))
    assert sized.placements["policy"].time_s == pytest.approx(at_block.placements["policy"].time_s, rel=1e-12)
    assert sized.weight_syncs[0].time_s == pytest.approx(at_tensor.weight_syncs[0].time_s, rel=1e-12)
