"""Step time of a placed graph, synchronous and asynchronous, with a predicted timeline of one step.

Resources: nodes whose device sets overlap form one colocation group and run one at a time; each
host node (source, scorer) is its own resource (a host thread); a loss node runs inside its
policy's step (time 0, the policy's estimate includes it).

- **Synchronous** (max_staleness 0): one step is the graph run in topological order, each node
  starting when its producers are done and its resource is free, then every weight sync (which
  occupies the trainer's and the generator's resources). ``sync_step_s`` is the makespan: about
  G + score + T + W.
- **Asynchronous** (max_staleness >= 1): in steady state every resource works on its own batch
  (the generator one version ahead of the trainer), so a step lasts as long as the busiest
  resource: ``async_step_s = max over resources of (sum of its nodes' steady times (``steady``; a
  continuous generator's differs from its sync time, ``flowrl.planners.lengths``) + (1 - sync_overlap) * W
  for each weight sync it takes part in; the trainer's side without a vLLM generator's own hop into
  its workers, ``SyncEstimate.dst_only_s``)`` - about max(G + W, T + W) when disaggregated, and
  still G + T + W when colocated, since a colocation group cannot overlap with itself.
- **Sharing a host** (``shared_slowdown`` s > 1, a calibrated CPU: ``DeviceSpec.cpu.shared_slowdown``):
  colocation groups on one host slow each other down while they overlap, so the async step is
  ``shared_step_s`` of their busy times rather than their maximum: every group runs s times slower
  while another is busy and at full speed once it is alone (two groups, busy x <= y: ``y + (s - 1) * x``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

from flowrl.graph.ir import Graph
from flowrl.graph.kinds import KINDS
from flowrl.placement.layout import colocation_groups, device_ranges
from flowrl.planners.estimate.sync import SyncEstimate

__all__ = ["Span", "StepTimes", "step_times", "shared_step_s"]


class Span(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One piece of work in the predicted timeline of a step.

    Attributes:
        node: the node (or ``"src~>dst"`` for a weight sync).
        resource: the colocation group (``"devices 0-7"``) or host thread (``"host:reward"``) it occupies.
        what: the kind's span name (``flowrl.graph.kinds``: ``"generate"``, ``"score"``, ``"train"``,
            ``"reference"``, ``"prompts"``, ``"loss"``) or ``"weight sync"``.
        start_s, end_s: seconds from the start of the step.
    """

    node: str
    resource: str
    what: str
    start_s: float
    end_s: float


class StepTimes(msgspec.Struct, frozen=True, kw_only=True):
    """Both step times of one placement, their timelines and the bottleneck of the async one."""

    sync_step_s: float
    async_step_s: float
    sync_timeline: tuple[Span, ...]
    async_timeline: tuple[Span, ...]
    bottleneck: str
    busy_s: dict[str, float]


#: What a node's span is called: its kind's span name, the same as in the runtime's trace (``flowrl.graph.kinds``).
_WHAT = {kind: spec.span for kind, spec in KINDS.items()}


def _resource_names(devices: Mapping[str, Sequence[int]], graph: Graph) -> dict[str, str]:
    resources: dict[str, str] = {}
    for group in colocation_groups(devices):
        label = f"devices {_group_label([devices[n] for n in group])}"
        for n in group:
            resources[n] = label
    for node in graph.nodes:
        resources.setdefault(node.name, f"host:{node.name}")
    return resources


def _group_label(sets: Sequence[Sequence[int]]) -> str:
    ranges = [r for r in sets if isinstance(r, range) and r.step == 1]
    if len(ranges) == len(sets):
        lo, hi = min(r.start for r in ranges), max(r.stop for r in ranges)
        if sum(len(r) for r in ranges) >= hi - lo and _covers(ranges, lo, hi):
            return f"{lo}-{hi - 1}" if hi - lo > 1 else f"{lo}"
    return device_ranges(sorted({d for r in sets for d in r}))


def _covers(sets: Sequence[range], lo: int, hi: int) -> bool:
    reach = lo
    for r in sorted(sets, key=lambda r: r.start):
        if r.start > reach:
            return False
        reach = max(reach, r.stop)
    return reach >= hi


def shared_step_s(busy: Sequence[float], slowdown: float, *, widths: Sequence[int] = (), cores: int = 0) -> float:
    """Seconds until every one of ``busy`` (seconds of work each, alone) is done when they start
    together and each runs ``slowdown`` times slower while any other is still busy.

    With ``cores`` > 0 (the host's cores, which its ``widths[i]`` devices a group, one process or
    thread each, outnumber), the groups still busy also run ``sum of their widths / cores`` times
    slower when that is more: more ranks than cores time-share them.

    Example:
        >>> shared_step_s([2.0, 5.0], 1.5), shared_step_s([2.0, 5.0], 1.0), shared_step_s([3.0], 2.0)
        (6.0, 5.0, 3.0)
        >>> shared_step_s([2.0, 5.0], 1.2, widths=[1, 2], cores=2)  # 3 ranks on 2 cores: 1.5x while both run
        6.0
    """
    works = sorted((b, w) for b, w in zip(busy, widths or [1] * len(busy)) if b > 0)
    elapsed = done = 0.0
    for i, (work, _) in enumerate(works):
        active = works[i:]  # every unfinished one has done ``done`` seconds of its work
        factor = slowdown if len(active) > 1 else 1.0
        if cores > 0:
            factor = max(factor, sum(w for _, w in active) / cores)
        elapsed += (work - done) * factor
        done = work
    return elapsed


def step_times(
    graph: Graph,
    devices: Mapping[str, Sequence[int]],
    times: Mapping[str, float],
    syncs: Sequence[SyncEstimate],
    *,
    sync_overlap: float = 0.0,
    steady: Mapping[str, float] | None = None,
    order: Sequence[str] | None = None,
    producers: Mapping[str, Sequence[str]] | None = None,
    shared_slowdown: float = 1.0,
    host_cores: int = 0,
) -> StepTimes:
    """Predicted sync and async step times of a placed graph (see the module docstring).

    Args:
        devices: node -> device ids (empty for host nodes; a loss node has its policy's).
        times: node -> seconds per step.
        syncs: one estimate per weight edge.
        sync_overlap: fraction of each weight sync hidden behind compute in async mode.
        steady: node -> seconds per step in the async steady state, where it differs from ``times``.
        order, producers: the graph's topological order and producers, when the caller has them
            already (the search evaluates thousands of placements of one graph).
        shared_slowdown: how much slower colocation groups run while another is busy (they share
            one host: ``shared_step_s``); 1 for separate devices.
        host_cores: the one host's cores when its devices (ranks) outnumber them
            (``CpuTerms.host_cores``): groups busy together time-share them (``shared_step_s``'s
            ``cores``; the asynchronous step only); 0: a core per device.
    """
    resource = _resource_names(devices, graph)
    if order is None:
        order = [n.name for n in graph.topological_order()]
    if producers is None:
        producers = {n: [p.name for p in graph.producers(n)] for n in order}
    kinds = {n.name: n.kind for n in graph.nodes}

    # synchronous: list-schedule in topological order, then the weight syncs
    free: dict[str, float] = {}
    end: dict[str, float] = {}
    sync_spans: list[Span] = []
    for name in order:
        res = resource[name]
        ready = max((end[p] for p in producers[name]), default=0.0)
        start = max(ready, free.get(res, 0.0))
        stop = start + times.get(name, 0.0)
        end[name] = stop
        free[res] = stop
        sync_spans.append(Span(node=name, resource=res, what=_WHAT.get(kinds[name], kinds[name]), start_s=start, end_s=stop))
    for s in syncs:
        rs = {resource[s.src], resource[s.dst]}
        start = max([end.get(s.src, 0.0)] + [free.get(r, 0.0) for r in rs])
        stop = start + s.time_s
        for r in sorted(rs):
            free[r] = stop
            sync_spans.append(Span(node=f"{s.src}~>{s.dst}", resource=r, what="weight sync", start_s=start, end_s=stop))
    sync_step = max((sp.end_s for sp in sync_spans), default=0.0)

    # asynchronous: each resource busy with its own batch; the busiest sets the pace
    busy: dict[str, float] = {}
    async_spans: list[Span] = []
    steady = steady or {}
    for name in order:
        res = resource[name]
        t = steady.get(name, times.get(name, 0.0))
        start = busy.get(res, 0.0)
        busy[res] = start + t
        async_spans.append(Span(node=name, resource=res, what=_WHAT.get(kinds[name], kinds[name]), start_s=start, end_s=start + t))
    for s in syncs:
        for r in sorted({resource[s.src], resource[s.dst]}):
            # the generator's own hop (into vLLM's workers) keeps only its side busy (a colocated pair: both)
            exposed = (1.0 - sync_overlap) * (s.time_s if r == resource[s.dst] else s.time_s - s.dst_only_s)
            start = busy.get(r, 0.0)
            busy[r] = start + exposed
            async_spans.append(Span(node=f"{s.src}~>{s.dst}", resource=r, what="weight sync", start_s=start, end_s=start + exposed))
    async_step = max(busy.values(), default=0.0)
    if shared_slowdown > 1.0 or host_cores > 0:
        used: dict[str, set[int]] = {}  # each colocation group's devices
        for n, ids in devices.items():
            used.setdefault(resource.get(n, ""), set()).update(ids)
        groups = [(t, len(used.get(r, ())) or 1) for r, t in busy.items() if not r.startswith("host:")]
        shared = shared_step_s([t for t, _ in groups], shared_slowdown, widths=[w for _, w in groups], cores=host_cores)
        async_step = max(async_step, shared)

    bottleneck = _bottleneck(busy, async_spans, async_step)
    return StepTimes(
        sync_step_s=sync_step,
        async_step_s=async_step,
        sync_timeline=tuple(sync_spans),
        async_timeline=tuple(async_spans),
        bottleneck=bottleneck,
        busy_s=busy,
    )


def _bottleneck(busy: Mapping[str, float], spans: Sequence[Span], step: float) -> str:
    if not busy or step <= 0:
        return "nothing to do"
    res = max(sorted(busy), key=lambda r: busy[r])
    mine = [s for s in spans if s.resource == res and s.end_s > s.start_s]
    if not mine:
        return res
    top = max(mine, key=lambda s: s.end_s - s.start_s)
    share = (top.end_s - top.start_s) / step
    return f"{top.node} ({top.what} {top.end_s - top.start_s:.3g} s, {share:.0%} of the async step, on {res})"
