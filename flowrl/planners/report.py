"""The human-readable form of a ``Plan``: a table of nodes, the step times, the bottleneck, the runners-up.

``format_plan(plan)`` returns text (it prints nothing); ``flowrl plan`` prints it.
"""

from __future__ import annotations

from flowrl.graph.nodes import IN_POLICY_KINDS
from flowrl.planners.plan import Plan, SearchStats
from flowrl.placement.layout import device_ranges
from flowrl.planners.units import format_bytes, format_seconds

__all__ = ["format_plan", "format_table", "format_search"]


def _table(rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for row in rows:
        cells = [c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(row)]
        out.append("  ".join(cells).rstrip())
    return out


def format_table(plan: Plan) -> list[str]:
    """One row per node: name, kind, devices, dp/tp/pp, memory per device, time per step, notes; and an
    ``ep`` column after dp where a node splits its experts (``ParallelDims.ep`` > 1)."""
    with_ep = any(p.dims.ep > 1 for p in plan.placements.values())
    axes = ("dp", "ep", "tp", "pp") if with_ep else ("dp", "tp", "pp")
    rows = [["node", "kind", "devices", *axes, "memory/device", "time/step", "notes"]]
    for name, p in plan.placements.items():
        if p.kind in IN_POLICY_KINDS:
            rows.append([name, p.kind, device_ranges(p.devices) if p.devices else "cpu", *[""] * len(axes), "", "", "inside the policy's step"])
        elif not p.devices:
            rows.append([name, p.kind, "cpu", *["-"] * len(axes), "-", format_seconds(p.time_s), ""])
        else:
            sizes = [str(getattr(p.dims, a)) for a in axes]
            rows.append([name, p.kind, device_ranges(p.devices), *sizes, format_bytes(p.memory_bytes), format_seconds(p.time_s), ", ".join(p.notes)])
    return _table(rows, right=set(range(3, 3 + len(axes) + 2)))


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def format_search(stats: SearchStats) -> list[str]:
    """What the search looked at, in counts that agree with the example it gives: the closest miss
    is one of the node meshes counted as not fitting (``SearchStats.node_misses``).

    Example:
        >>> for line in format_search(SearchStats(evaluated=26, infeasible=0, node_misses=3, closest_miss="node 'gen' ... 0.88 GiB over")):
        ...     print(line)
        search: 26 placements estimated in full; did not fit in memory: 0 placements or device splits, 3 node meshes
          the closest miss (one of the 3 node meshes): node 'gen' ... 0.88 GiB over
    """
    meshes = f"{stats.node_misses} node mesh{'' if stats.node_misses == 1 else 'es'}"
    line = (
        f"search: {_count(stats.evaluated, 'placement')} estimated in full; did not fit in memory: "
        f"{stats.infeasible} placement{'' if stats.infeasible == 1 else 's'} or device split{'' if stats.infeasible == 1 else 's'}, {meshes}"
    )
    return [line, f"  the closest miss (one of the {meshes}): {stats.closest_miss}"] if stats.closest_miss else [line]


def format_plan(plan: Plan) -> str:
    """The whole plan as text for a terminal (what ``flowrl plan`` prints)."""
    spec = plan.cluster_spec
    where = f"{plan.cluster}" + (f" ({spec.hosts} host{'s' if spec.hosts > 1 else ''} x {spec.devices_per_host} {spec.device.name})" if spec else "")
    models = sorted({m.name + (f" + LoRA adapters ({m.adapter_params / 1e6:.3g}M trained)" if m.adapter_params else "") for m in plan.models.values()})
    lines = [
        f"plan for graph {plan.graph!r} on {where}: strategy {plan.strategy} -> {plan.family}",
        f"workload: {plan.workload.short() if plan.workload else 'not estimated'}; model {', '.join(models) or '-'}; max_staleness {plan.max_staleness}",
        "",
    ]
    lines += format_table(plan)
    lines.append("")
    for s in plan.weight_syncs:
        copies = f"{format_bytes(s.bytes // max(1, s.replicas))} x {s.replicas} replicas" if s.replicas > 1 else format_bytes(s.bytes)
        lines.append(f"weight sync {s.src} ~> {s.dst} ({s.transport}): {copies}, {format_seconds(s.time_s)} ({s.note})")
    k = plan.max_staleness
    lines.append(
        f"predicted step: sync (k=0) {format_seconds(plan.sync_step_s)} | async (k>=1) {format_seconds(plan.async_step_s)} | "
        f"speedup {plan.speedup:.2f}x" + ("" if k >= 1 else "  [this graph runs synchronously: k=0]")
    )
    name = plan.baseline_system or "synchronous colocated baseline"
    if plan.baseline_step_s is not None and spec is not None:
        lines.append(
            f"baseline {name} on its best subset ({plan.baseline_subset_devices} of {spec.n_devices} devices): "
            f"{format_seconds(plan.baseline_step_s)}; this plan at k={k}: {format_seconds(plan.step_s)} ({plan.speedup_vs_baseline:.2f}x)"
        )
    elif spec is not None:
        why = f": {plan.baseline_problem}" if plan.baseline_problem else ""
        lines.append(f"baseline {name} on {spec.n_devices} devices or fewer: does not fit{why}")
    if plan.baseline_all_devices_step_s is not None and spec is not None and plan.step_s > 0:
        lines.append(
            f"baseline {name} on all {spec.n_devices} devices: "
            f"{format_seconds(plan.baseline_all_devices_step_s)} ({plan.baseline_all_devices_step_s / plan.step_s:.2f}x)"
        )
    lines.extend(f"warning: {w}" for w in plan.warnings)
    lines.append(f"bottleneck: {plan.bottleneck}")
    lines.append(f"placement: {plan}")
    if plan.alternatives:
        lines.append("runners-up:")
        for a in plan.alternatives:
            lines.append(f"  {a.placement}  [{a.family}]  {a.reason}")
    if plan.search.evaluated > 1:
        lines.extend(format_search(plan.search))
    return "\n".join(lines)
