"""``plan_graph``: the planner's driver, enumerate -> estimate -> search -> ``Plan`` (pure: no printing, no I/O).

The ``Plan``'s data and its forms (compact string, JSON) live in ``flowrl.planners.plan_data``;
they are re-exported here, the planner's public face::

    >>> from flowrl.examples import build_example
    >>> plan = plan_graph(build_example("llamarl"), "cpu:2", strategy="disaggregated")
    >>> str(plan)
    'gen:d1@0 | policy:d1@1'
    >>> {n: p.devices for n, p in parse_plan(str(plan)).items()}
    {'gen': (0,), 'policy': (1,)}

The compact form lists the nodes that hold devices as ``name:DIMS@DEVICES`` joined by ``" | "``:
``DIMS`` is ``ParallelDims.short()`` (``d4t2p2``; axes of size 1 left out, ``d1`` for one device),
``DEVICES`` comma-separated ranges (``0-7`` or ``0-3,8-11``). Loss nodes are left out (they
always run on their policy's mesh), and so are host nodes (sources, rule scorers). The same form
is accepted as a strategy: ``plan_graph(g, c, strategy="gen:t2@0-1 | policy:d2@2-3")`` estimates
that placement instead of searching.

The JSON form (``save_plan`` / ``load_plan``) is the whole struct through msgspec; loading
validates types, unknown fields and mesh shapes, and never executes code.
"""

from __future__ import annotations

from typing import Any

from flowrl.backend_traits import BACKENDS
from flowrl.errors import PlanError
from flowrl.graph.ir import Graph
from flowrl.planners.baseline import SYNC_BASELINE, BaselineResult, BaselineSystem, plan_baseline
from flowrl.planners.cluster import ClusterSpec, parse_cluster
from flowrl.planners.estimate.common import Context, MemoryBreakdown
from flowrl.modelspec import ModelSpec
from flowrl.planners.parallel import AXES, ParallelDims, hosts_per_group
from flowrl.planners.plan_data import (
    MAX_PLAN_BYTES,
    PLAN_VERSION,
    Alternative,
    NodePlacement,
    Plan,
    SearchStats,
    load_plan,
    parse_plan,
    plan_to_json,
    save_plan,
)
from flowrl.planners.runnable import check_expert_split, check_layout
from flowrl.planners.search import Candidate, Roles, evaluate_layout, resolve_roles, search_placements, why_lost
from flowrl.planners import strategies  # read when called: a strategy added there is known here
from flowrl.planners.tuning import make_tuning
from flowrl.planners.workload import Workload, check_context, default_workload

__all__ = [
    "Plan",
    "NodePlacement",
    "Alternative",
    "SearchStats",
    "PLAN_VERSION",
    "MAX_PLAN_BYTES",
    "plan_graph",
    "parse_plan",
    "save_plan",
    "load_plan",
    "plan_to_json",
]


# -- the entry point -------------------------------------------------------------------------------
def _manual_layout(graph: Graph, roles: Roles, cluster: ClusterSpec, text: str) -> dict[str, tuple[tuple[int, ...], ParallelDims]]:
    given = parse_plan(text)
    unknown = sorted(set(given) - set(roles.heavy))
    if unknown:
        raise PlanError(
            f"placement names {', '.join(map(repr, unknown))}, which are not device nodes of graph {graph.name!r}; "
            f"place exactly: {', '.join(roles.heavy)} (losses follow their policy, sources and scorers run on the host)"
        )
    missing = [n for n in roles.heavy if n not in given]
    if missing:
        raise PlanError(f"placement leaves out {', '.join(map(repr, missing))}; place every one of: {', '.join(roles.heavy)}")
    layout = {}
    for name in roles.heavy:
        p = given[name]
        if max(p.devices) >= cluster.n_devices:
            raise PlanError(f"placement puts {name!r} on device {max(p.devices)}, but cluster {cluster.name!r} has devices 0-{cluster.n_devices - 1}")
        p.dims.check(len(p.devices), roles.models[name], node=name)
        check_expert_split(name, p.dims)
        layout[name] = (p.devices, p.dims)
    return layout


def plan_graph(
    graph: Graph,
    cluster: ClusterSpec | str,
    *,
    strategy: str = "search",
    max_staleness: int | None = None,
    workload: Workload | None = None,
    model: ModelSpec | None = None,
    baseline: BaselineSystem | None = None,
    **tuning: Any,
) -> Plan:
    """Place every node of ``graph`` on ``cluster`` and predict its step time (pure: no I/O).

    Args:
        graph: the pipeline.
        cluster: a ``ClusterSpec`` or its string form (``"1024xH100"``, ``"cpu:2"``).
        strategy: ``"search"`` (the fastest of both families), ``"colocated"``, ``"disaggregated"``,
            or a compact placement (``"gen:d4@0-3 | policy:d4@4-7"``) to estimate as given.
        max_staleness: k the step time assumes; None: the smallest k of the graph's weight edges.
        workload: tokens per step; None: read from the graph (or ``LLM_DEFAULTS`` for published models).
        model: a model shape for every model-holding node (dry-runs of published models).
        baseline: the synchronous system the plan is compared with; None: ``SYNC_BASELINE``.
        **tuning: ``Tuning`` fields by name (``mfu_train=0.4``, ``gen_precision="float8"``).

    Raises:
        PlanError: no placement fits (naming the node, the device memory and how far over), a
            sequence (prompt + generation) longer than a model's context, or a bad strategy,
            cluster, placement or tuning name.
    """
    spec = parse_cluster(cluster) if isinstance(cluster, str) else cluster
    k = graph.max_staleness(max_staleness)
    if k < 0:
        raise PlanError(f"max_staleness={k} must be >= 0")
    ctx = Context(cluster=spec, workload=workload or default_workload(graph, model_override=model is not None), tuning=make_tuning(**tuning))
    roles = resolve_roles(graph, ctx, model)
    check_context(ctx.workload, roles.models)
    manual = ":" in strategy
    if not manual and strategy not in strategies.STRATEGIES:
        raise PlanError(f"unknown strategy {strategy!r}; strategies: {', '.join(strategies.STRATEGIES)}, or a placement like 'gen:d4@0-3 | policy:d4@4-7'")
    if manual:
        layout = _manual_layout(graph, roles, spec, strategy)
        check_layout(graph, spec, layout, backend=ctx.tuning.backend)  # an axis its node's program does not run where the plan runs: refused
        best = evaluate_layout(graph, ctx, roles, layout, max_staleness=k)
        if not best.feasible:
            raise PlanError(f"placement {strategy!r} does not fit: {best.problem}")
        ranked, stats = [best], SearchStats(evaluated=1)
    elif not roles.heavy:
        best = evaluate_layout(graph, ctx, roles, {}, max_staleness=k, family="colocated")
        ranked, stats = [best], SearchStats(evaluated=1)
    else:
        result = search_placements(graph, spec, ctx, roles, strategy=strategy, max_staleness=k)
        if not result.ranked:
            raise PlanError(_nothing_fits(graph, roles, ctx, spec, strategy, result.problems, result.fitted))
        miss = min(result.problems.values(), key=lambda e: e.memory.total).problem if result.problems else ""
        ranked, stats = result.ranked, SearchStats(
            evaluated=result.evaluated, infeasible=result.infeasible, closest_miss=miss, node_misses=result.node_misses
        )
        best = ranked[0]
    base = plan_baseline(graph, ctx, model=model, system=baseline or SYNC_BASELINE) if roles.heavy else None
    losers = ranked[1 : 1 + ctx.tuning.top_k]
    return _to_plan(graph, spec, ctx, roles, best, losers, stats, "manual" if manual else strategy, k, base)


def _why_none_fits(graph: Graph, roles: Roles, ctx: Context, strategy: str, problems: dict, fitted: set[str]) -> tuple[str, str]:
    """Why no placement fits (the node, the resource and the numbers) and what to try; the
    suggestions leave out what is already set (``--gen-precision float8``, a high ``memory_util``)."""
    float8 = bool(roles.gens) and all(roles.gen_dtype[g] == "float8" for g in roles.gens)
    fp8 = [] if float8 else ["--gen-precision float8 (half the weight bytes)"]
    never = {n: e for n, e in problems.items() if n not in fitted}
    name, closest = min((never or problems).items(), key=lambda kv: kv[1].memory.total) if problems else ("", None)
    near = closest is not None and closest.memory.total <= 0.95 * ctx.cluster.device.memory_bytes
    more_memory = ["--set memory_util=0.95"] if near and ctx.tuning.memory_util < 0.95 else []
    if never:
        assert closest is not None  # problems holds never's entries
        reason = f"closest miss: {closest.problem}"
        if name in roles.gens:
            hints = [*fp8, "more devices", "fewer --prompts-per-step (smaller KV cache)", *more_memory]
        elif name in roles.trainers and {"tp", "pp"} <= roles.runs_axes(name):
            hints = ["more devices (weights, gradients and optimizer states shard over tp * pp, the optimizer also over dp)", *more_memory]
        elif name in roles.trainers:  # its program splits no layer where the plan runs (flowrl.mesh_support): only dp shards it
            sharded = getattr(getattr(graph.node(name), "optimizer", None), "sharding", "") == "fsdp"
            shard = [] if sharded else [f"sharding='fsdp' on {name!r} (FSDP2: weights, gradients and optimizer states shard over its dp ranks)"]
            hints = [*shard, "more devices (its program runs only dp here: flowrl/mesh_support.py)", *more_memory]
        else:
            hints = ["more devices", *more_memory]
    elif closest is not None:
        reason = f"every node fits on some mesh, but no split fits them all at once, e.g. {closest.problem}"
        apart = ["the disaggregated strategy (no colocated state to share memory with)"] if strategy == "colocated" else []
        hints = ["more devices", *apart, *fp8, *more_memory]
    else:
        reason = "the graph's models admit no parallel dims on these device counts (tp must divide the heads, pp the layers)"
        hints = ["another device count"]
    return reason, ", or ".join(hints)


def _nothing_fits(graph: Graph, roles: Roles, ctx: Context, spec: ClusterSpec, strategy: str, problems: dict, fitted: set[str]) -> str:
    reason, hint = _why_none_fits(graph, roles, ctx, strategy, problems, fitted)
    head = f"no placement of graph {graph.name!r} fits on {spec.name} ({spec.n_devices} x {spec.device.name}) with strategy {strategy!r}"
    return f"{head}; {reason}\n  try: {hint}"


def _to_plan(
    graph: Graph,
    spec: ClusterSpec,
    ctx: Context,
    roles: Roles,
    best: Candidate,
    losers: list[Candidate],
    stats: SearchStats,
    strategy: str,
    k: int,
    base: BaselineResult | None,
) -> Plan:
    placements: dict[str, NodePlacement] = {}
    layout = best.layout
    for node in graph.nodes:
        name = node.name
        est = best.estimates.get(name)
        if name in layout:
            devices, dims = layout[name]
            devs = tuple(devices)
            offloaded = est.breakdown if est is not None else {}  # "offload/<o>": o's state waits in host memory meanwhile
            reserved = sum(
                0 if f"offload/{o}" in offloaded else _resident(best, o)
                for o in layout
                if o != name and _ranges_share(layout[o][0], devices)
            )
            placements[name] = NodePlacement(
                kind=node.kind,
                devices=devs,
                dims=dims,
                axes=AXES,
                mesh_shape=dims.mesh_shape,
                model=roles.models[name].name,
                time_s=est.time_s if est else 0.0,
                memory_bytes=int((est.memory.total if est else 0) + reserved),
                memory=est.memory if est else MemoryBreakdown(),
                breakdown=est.breakdown if est else {},
                notes=est.notes if est else (),
            )
        elif name in roles.loss_of and roles.loss_of[name] in layout:
            devices, dims = layout[roles.loss_of[name]]
            placements[name] = NodePlacement(
                kind=node.kind,
                devices=tuple(devices),
                dims=dims,
                axes=AXES,
                mesh_shape=dims.mesh_shape,
                notes=(f"runs inside {roles.loss_of[name]}'s training step; its cost is in that node's",),
            )
        else:
            placements[name] = NodePlacement(kind=node.kind, time_s=est.time_s if est else 0.0, notes=("host CPU",))
    steps = best.steps
    step = best.step_s
    baseline_s: float | None
    if base is None:  # no device nodes: the plan is its own baseline
        baseline_s, baseline_problem, subset, every = steps.sync_step_s, "", None, None
    else:  # the baseline's search (never slower with more devices); every device is LlamaRL's own comparison
        baseline_s = base.best_subset.steps.sync_step_s if base.best_subset else None
        baseline_problem, subset = base.problem, base.best_subset
        every = base.all_devices.steps.sync_step_s if base.all_devices else None
    alternatives = tuple(
        Alternative(
            placement=c.short(),
            family=c.family,
            step_s=c.step_s,
            sync_step_s=c.steps.sync_step_s,
            async_step_s=c.steps.async_step_s,
            reason=why_lost(c, best, roles),
        )
        for c in losers
    )
    models = {n: roles.models[n] for n in roles.heavy}
    warnings = tuple(w for name in layout if (w := _tp_across_hosts(name, layout[name], spec, strategy)))
    warnings += _offloads(placements)
    return Plan(
        graph=graph.name,
        cluster=spec.name,
        strategy=strategy,
        family=best.family,
        max_staleness=k,
        workload=ctx.workload,
        placements=placements,
        weight_syncs=best.syncs,
        sync_step_s=steps.sync_step_s,
        async_step_s=steps.async_step_s,
        step_s=step,
        speedup=steps.sync_step_s / steps.async_step_s if steps.async_step_s > 0 else 1.0,
        baseline_step_s=baseline_s,
        speedup_vs_baseline=(baseline_s / step) if baseline_s and step > 0 else None,
        baseline_problem=baseline_problem,
        baseline_system=base.system.name if base else "",
        baseline_subset_step_s=subset.steps.sync_step_s if subset else None,
        baseline_subset_devices=subset.split.gen_count if subset and subset.split else 0,
        baseline_all_devices_step_s=every,
        warnings=warnings,
        bottleneck=steps.bottleneck,
        timeline=steps.async_timeline if k >= 1 else steps.sync_timeline,
        alternatives=alternatives,
        search=stats,
        cluster_spec=spec,
        models=models,
        tuning=ctx.tuning,
        engines=dict(roles.gen_engine),
        shardings={n: s for n in roles.trainers if (s := getattr(getattr(graph.node(n), "optimizer", None), "sharding", None))},
    )


def _tp_across_hosts(name: str, placed: tuple[Any, ParallelDims], spec: ClusterSpec, strategy: str) -> str:
    """A warning when ``name``'s tensor-parallel groups span hosts (their per-layer all-reduces then use the NIC), else ``""``."""
    devices, dims = placed
    hosts = hosts_per_group(devices, dims, "tp", spec.devices_per_host) if dims.tp > 1 else 1
    if hosts == 1:
        return ""
    dev = spec.device
    intra, inter = dev.intra_host_bandwidth, dev.inter_host_bandwidth
    why = "as the placement gives it" if strategy == "manual" else "on its devices the search found no dims that fit with tp within one host"
    return (
        f"node {name!r}: each tensor-parallel group of {dims.tp} devices spans {hosts} hosts, so its all-reduces "
        f"(two per layer) cross hosts at {inter / 1e9:.3g} GB/s per device instead of {intra / 1e9:.3g} GB/s within a host "
        f"({intra / inter:.3g}x slower); {why}"
    )


def _offloads(placements: dict[str, NodePlacement]) -> tuple[str, ...]:
    """A warning when the plan fits only by moving colocated state aside: which backends do that."""
    moved = sorted({key.split("/", 1)[1] for p in placements.values() for key in p.breakdown if key.startswith("offload/")})
    if not moved:
        return ()
    able = ", ".join(b for b, traits in BACKENDS.items() if traits.offloads)
    return (
        f"this plan fits only with colocated offloading ({', '.join(moved)} moved aside while the node beside runs): run it "
        f"on one host with a backend that offloads ({able}: flowrl run --plan FILE --backend process); under torchrun its "
        "ranks keep their state (backend_traits('torchrun').offloads is False) and it does not fit",
    )


def _resident(c: Candidate, name: str) -> int:
    return c.estimates[name].memory.resident


def _ranges_share(a: Any, b: Any) -> bool:
    if isinstance(a, range) and isinstance(b, range):
        return max(a.start, b.start) < min(a.stop, b.stop)
    return not set(a).isdisjoint(b)
