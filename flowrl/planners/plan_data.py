"""The ``Plan``'s data and forms: every node's device mesh, parallel dims, predicted times and memory; a compact string and JSON.

The driver that makes plans is ``flowrl.planners.plan.plan_graph``. What the runtime reads of a plan
is its ``Plan.placement()`` (``flowrl.placement``: each device node's devices and mesh).

Example:
    >>> p = parse_plan("gen:d1@0 | policy:d2@1-2")
    >>> {n: (q.devices, q.dims.short()) for n, q in p.items()}
    {'gen': ((0,), 'd1'), 'policy': ((1, 2), 'd2')}

The compact form lists the nodes that hold devices as ``name:DIMS@DEVICES`` joined by ``" | "``:
``DIMS`` is ``ParallelDims.short()`` (``d4t2p2``; axes of size 1 left out, ``d1`` for one device),
``DEVICES`` comma-separated ranges (``0-7`` or ``0-3,8-11``). Loss nodes are left out (they
always run on their policy's mesh), and so are host-CPU nodes (sources, rule scorers).

The JSON form (``save_plan`` / ``load_plan``) is the whole struct through msgspec; loading
validates types, unknown fields and mesh shapes, and never executes code.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import msgspec

from flowrl.errors import PlanError
from flowrl.fileio import decode_errors, write_atomic
from flowrl.graph.nodes import DEVICE_KINDS, IN_POLICY_KINDS, TRAINABLE_KINDS
from flowrl.placement.layout import AXES, NodeMesh, Placement, colocation_groups, device_ranges
from flowrl.planners.cluster import DEVICE_TRAITS, MAX_DEVICES, ClusterSpec
from flowrl.planners.estimate.common import MemoryBreakdown
from flowrl.planners.estimate.sync import SyncEstimate
from flowrl.modelspec import ModelSpec
from flowrl.planners.parallel import ParallelDims
from flowrl.planners.schedule import Span
from flowrl.planners.tuning import Tuning
from flowrl.planners.units import format_bytes, format_seconds
from flowrl.planners.workload import Workload

__all__ = [
    "Plan",
    "NodePlacement",
    "Alternative",
    "SearchStats",
    "PLAN_VERSION",
    "MAX_PLAN_BYTES",
    "parse_plan",
    "save_plan",
    "load_plan",
    "plan_to_json",
]

PLAN_VERSION = 1
_STRUCT = dict(frozen=True, kw_only=True, forbid_unknown_fields=True)


class NodePlacement(msgspec.Struct, **_STRUCT):
    """Where one node runs and what it is predicted to cost.

    Attributes:
        kind: the node's kind (``generator``, ``policy``, ``loss``, ``source`` ...).
        devices: device ids of its mesh in mesh order (``AXES``: pp outermost, tp innermost);
            empty for host nodes (sources, rule scorers), which run on the host CPU.
        dims: its parallel dims (dp * tp * pp == len(devices); ``ep``, a split of dp, becomes ``NodeMesh.ep``).
        axes: mesh axis names, ``("pp", "dp", "tp")``; empty for host nodes.
        mesh_shape: sizes along ``axes``.
        model: the model shape it was estimated with ("" for nodes without a model).
        time_s: predicted seconds of work per step (a loss node's time is inside its policy's).
        memory_bytes: predicted bytes per device while it runs, including the resident state
            (weights, optimizer) of nodes colocated with it.
        memory: its own bytes per device by kind.
        breakdown: named parts of ``time_s``.
        notes: choices the estimate made (micro-batch, checkpointing, waves, precision).
    """

    kind: str
    devices: tuple[int, ...] = ()
    dims: ParallelDims = ParallelDims()
    axes: tuple[str, ...] = ()
    mesh_shape: tuple[int, ...] = ()
    model: str = ""
    time_s: float = 0.0
    memory_bytes: int = 0
    memory: MemoryBreakdown = MemoryBreakdown()
    breakdown: dict[str, float] = {}
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.devices:
            if self.axes or self.mesh_shape:
                raise PlanError(f"a {self.kind} placement without devices cannot have mesh axes {self.axes} / shape {self.mesh_shape}")
            return
        if len(set(self.devices)) != len(self.devices) or min(self.devices) < 0:
            raise PlanError(f"a {self.kind} placement lists devices {self.devices}: ids must be distinct and >= 0")
        if tuple(self.axes) != AXES or tuple(self.mesh_shape) != self.dims.mesh_shape:
            raise PlanError(
                f"a {self.kind} placement has axes {self.axes} and mesh_shape {self.mesh_shape}; "
                f"expected axes {AXES} and shape {self.dims.mesh_shape} from dims {self.dims.short()}"
            )
        if self.dims.size != len(self.devices):
            raise PlanError(
                f"a {self.kind} placement: dp({self.dims.dp}) * tp({self.dims.tp}) * pp({self.dims.pp}) = {self.dims.size} "
                f"!= devices({len(self.devices)})"
            )


class Alternative(msgspec.Struct, **_STRUCT):
    """A candidate the search ranked below the chosen one, in compact form, with why it lost."""

    placement: str
    family: str
    step_s: float
    sync_step_s: float
    async_step_s: float
    reason: str


class SearchStats(msgspec.Struct, **_STRUCT):
    """How much the search looked at.

    Attributes:
        evaluated: placements estimated in full.
        infeasible: device splits or placements on which no layout fitted in memory.
        node_misses: node meshes (one node on one mesh, beside what shares it) that did not fit in
            memory; ``closest_miss`` is one of them, so it is set exactly when this is > 0.
        closest_miss: the node mesh that missed by the least (its node, memory need and excess).
    """

    evaluated: int = 0
    infeasible: int = 0
    closest_miss: str = ""
    node_misses: int = 0


class Plan(msgspec.Struct, **_STRUCT):
    """A placement of every node of a graph on a cluster, with its predicted cost.

    Attributes:
        graph: the graph's name.
        cluster: the cluster's name (``"1024xH100"``, ``"cpu:2"``, ``"cpu-calibrated"``).
        strategy: ``colocated``, ``disaggregated``, ``search`` or ``manual`` (a given placement).
        family: what the chosen placement is: ``colocated`` (every heavy node on one mesh),
            ``disaggregated`` (generators and trainers on disjoint meshes) or ``manual``.
        max_staleness: the k the step time assumes (0: synchronous).
        workload: tokens of one step (prompts, samples, prompt and generation lengths); None in a
            plan without predictions.
        placements: every node of the graph, loss nodes included (on their policy's mesh).
        weight_syncs: one predicted transfer per weight edge.
        sync_step_s: predicted step time with k = 0 on this placement (generate, score, train, sync in turn).
        async_step_s: predicted step time with k >= 1 on this placement (busiest colocation group).
        step_s: the one that applies at ``max_staleness``.
        speedup: ``sync_step_s / async_step_s``.
        baseline_step_s: the synchronous baseline system (``baseline_system``,
            ``flowrl.planners.baseline``) on its best subset of the devices, the search's device
            counts (never slower with more devices); None when it does not fit.
        speedup_vs_baseline: ``baseline_step_s / step_s``.
        baseline_problem: why the baseline does not fit (node, resource, numbers), when it does not.
        baseline_system: the baseline system's name.
        baseline_subset_step_s: the same figure as ``baseline_step_s``; baseline_subset_devices: how
            many devices that subset has.
        baseline_all_devices_step_s: the baseline on every device (LlamaRL's comparison), which
            more devices can make slower; None when it does not fit.
        warnings: what the user should know about the placement (a tensor-parallel group across hosts).
        bottleneck: the node that sets the pace of the async step, and its share of it.
        timeline: predicted spans of one step at ``max_staleness`` (async spans are steady state).
        alternatives: runners-up with the reason each lost (search strategies only).
        search: how many candidates were estimated.
        cluster_spec, models, tuning: everything the prediction used, so a plan file explains itself.
        engines, shardings: how the graph planned runs its device nodes beyond their models: each
            generator's engine, each trainer's sharding (``flowrl.planners.plan_match`` compares
            them with a run's graph: ``--engine`` / ``--sharding`` change them).
        version: the plan file format version.
    """

    graph: str
    cluster: str
    strategy: str
    family: str
    max_staleness: int
    workload: Workload | None
    placements: dict[str, NodePlacement]
    weight_syncs: tuple[SyncEstimate, ...] = ()
    sync_step_s: float = 0.0
    async_step_s: float = 0.0
    step_s: float = 0.0
    speedup: float = 1.0
    baseline_step_s: float | None = None
    speedup_vs_baseline: float | None = None
    baseline_problem: str = ""
    baseline_system: str = ""
    baseline_subset_step_s: float | None = None
    baseline_subset_devices: int = 0
    baseline_all_devices_step_s: float | None = None
    warnings: tuple[str, ...] = ()
    bottleneck: str = ""
    timeline: tuple[Span, ...] = ()
    alternatives: tuple[Alternative, ...] = ()
    search: SearchStats = SearchStats()
    cluster_spec: ClusterSpec | None = None
    models: dict[str, ModelSpec] = {}
    tuning: Tuning = Tuning()
    engines: dict[str, str] = {}
    shardings: dict[str, str] = {}
    version: int = PLAN_VERSION

    def __post_init__(self) -> None:
        if self.version != PLAN_VERSION:
            raise PlanError(f"plan format version {self.version} is not supported (this flowrl reads version {PLAN_VERSION}); re-plan")
        if self.cluster_spec is not None:
            n = self.cluster_spec.n_devices
            for name, p in self.placements.items():
                if p.devices and max(p.devices) >= n:
                    raise PlanError(f"plan places node {name!r} on device {max(p.devices)}, but cluster {self.cluster!r} has devices 0-{n - 1}")

    # -- what other parts of flowrl call ------------------------------------------------------
    def node_label(self, name: str) -> str:
        """One short line for pictures: ``"devices 0-3 · dp2 tp2 · 1.2 s · 10.5 GiB"``."""
        p = self._placement(name)
        if p.kind in IN_POLICY_KINDS:
            owner = next((n for n, q in self.placements.items() if q.kind in TRAINABLE_KINDS and q.devices == p.devices), "its policy")
            return f"in {owner}'s step · devices {device_ranges(p.devices)}" if p.devices else f"in {owner}'s step"
        if not p.devices:
            return f"host CPU · {format_seconds(p.time_s)}"
        axes = " ".join(f"{a}{getattr(p.dims, a)}" for a in ("dp", "ep", "tp", "pp") if getattr(p.dims, a) > 1) or "dp1"
        return f"devices {device_ranges(p.devices)} · {axes} · {format_seconds(p.time_s)} · {format_bytes(p.memory_bytes)}"

    def node_model(self, name: str) -> str:
        """The model ``name`` was planned with (``"llama3-70b"`` under ``--model``), ``""`` for a node without one."""
        return self._placement(name).model

    def picture_title(self) -> str:
        """The title of a picture of this plan: graph, cluster, the models planned, the step.

        Example:
            >>> from flowrl.examples import build_example
            >>> from flowrl.planners.plan import plan_graph
            >>> plan_graph(build_example("llamarl"), "cpu:2", strategy="colocated").picture_title().rsplit(": ", 1)[0]
            "'llamarl' on cpu:2 (1 host x 2 cpu), model 2L64d"
        """
        spec = self.cluster_spec
        where = f" ({spec.hosts} host{'s' if spec.hosts > 1 else ''} x {spec.devices_per_host} {spec.device.name})" if spec else ""
        models = sorted({p.model for p in self.placements.values() if p.model})
        model = f", model {', '.join(models)}" if models else ""
        return f"{self.graph!r} on {self.cluster}{where}{model}: {self.family}, {format_seconds(self.step_s)}/step at k={self.max_staleness}"

    def _pinned(self) -> bool:
        """Whether the runtime pins each node to its devices: a device is one core (``DeviceKind.pinned``)."""
        if self.cluster_spec is not None:
            return DEVICE_TRAITS[self.cluster_spec.device.kind].pinned
        return self.cluster.startswith("cpu")  # a plan file written without its cluster's figures

    def colocation_groups(self) -> list[list[str]]:
        """Node names that share any device (the runtime serialises each group); loss nodes included.

        Example:
            >>> from flowrl.examples import build_example
            >>> from flowrl.planners.plan import plan_graph
            >>> plan_graph(build_example("llamarl"), "cpu:2", strategy="colocated").colocation_groups()
            [['aipo', 'gen', 'policy']]
        """
        return colocation_groups({n: p.devices for n, p in self.placements.items()})

    def placement(self, *, source: str = "") -> Placement:
        """What the runtime executes of this plan: each device node's devices and mesh (losses run
        inside their policy, light nodes on the host); pinned to its cores when made for a CPU; the
        nodes the plan offloads beside a colocated node (``Placement.offload``, the ``offload/<node>``
        parts of the estimates' breakdowns).

        Example:
            >>> from flowrl.examples import build_example
            >>> from flowrl.planners.plan import plan_graph
            >>> str(plan_graph(build_example("llamarl"), "cpu:2", strategy="disaggregated").placement())
            'gen:d1@0 | policy:d1@1'
        """
        nodes = {
            n: NodeMesh(devices=p.devices, mesh_shape=p.mesh_shape, ep=p.dims.ep) for n, p in self.placements.items() if p.devices and p.kind in DEVICE_KINDS
        }
        offload = tuple(sorted({key.split("/", 1)[1] for p in self.placements.values() for key in p.breakdown if key.startswith("offload/")}))
        return Placement(
            nodes=nodes, strategy=self.strategy, pin=self._pinned(), source=source or f"plan ({self.strategy})", offload=offload,
        )

    def __str__(self) -> str:
        parts = [f"{n}:{p.dims.short()}@{device_ranges(p.devices)}" for n, p in self.placements.items() if p.devices and p.kind not in IN_POLICY_KINDS]
        return " | ".join(parts)

    def _placement(self, name: str) -> NodePlacement:
        try:
            return self.placements[name]
        except KeyError:
            raise PlanError(f"plan for graph {self.graph!r} has no node {name!r}; nodes: {', '.join(self.placements)}") from None


# -- compact string form --------------------------------------------------------------------------
_PART = re.compile(r"^(?P<name>[^\s|@]+):(?P<dims>[detp0-9]+)@(?P<devices>[0-9,\- ]+)$")


def _parse_devices(text: str, part: str) -> tuple[int, ...]:
    ids: list[int] = []
    for piece in text.replace(" ", "").split(","):
        if not piece:
            continue
        lo, _, hi = piece.partition("-")
        try:
            a, b = int(lo), int(hi) if hi else int(lo)
        except ValueError:
            raise PlanError(f"placement {part!r}: cannot read device range {piece!r}; write e.g. '0-7' or '0-3,8-11'") from None
        if b < a:
            raise PlanError(f"placement {part!r}: device range {piece!r} runs backwards")
        if b >= MAX_DEVICES or len(ids) + b - a >= MAX_DEVICES:  # before listing them: '0-99999999999' would fill the memory
            raise PlanError(f"placement {part!r}: device range {piece!r} goes past the {MAX_DEVICES} devices a plan can list")
        ids.extend(range(a, b + 1))
    if not ids:
        raise PlanError(f"placement {part!r} names no devices")
    return tuple(ids)


def parse_plan(text: str) -> dict[str, NodePlacement]:
    """The placements in a compact plan string (``"gen:d4t2@0-7 | policy:d8@8-15"``), without predictions.

    Raises:
        PlanError: naming the part that cannot be read and the expected form.
    """
    out: dict[str, NodePlacement] = {}
    for raw in text.split("|"):
        part = raw.strip()
        if not part:
            continue
        m = _PART.match(part)
        if not m:
            raise PlanError(f"cannot read placement {part!r}; write NODE:DIMS@DEVICES, e.g. 'gen:d4t2@0-7' (dims dp/tp/pp, devices as ranges)")
        name = m.group("name")
        if name in out:
            raise PlanError(f"placement string names node {name!r} twice")
        dims = ParallelDims.parse(m.group("dims"))
        devices = _parse_devices(m.group("devices"), part)
        if dims.size != len(devices):
            raise PlanError(f"placement {part!r}: dp({dims.dp}) * tp({dims.tp}) * pp({dims.pp}) = {dims.size} != devices({len(devices)})")
        out[name] = NodePlacement(kind="", devices=devices, dims=dims, axes=AXES, mesh_shape=dims.mesh_shape)
    if not out:
        raise PlanError(f"placement string {text!r} is empty; write e.g. 'gen:d4@0-3 | policy:d4@4-7'")
    return out


# -- JSON ------------------------------------------------------------------------------------------
_encoder = msgspec.json.Encoder(order="deterministic")

#: Plan files larger than this are refused before parsing.
MAX_PLAN_BYTES = 64 * 1024 * 1024


def plan_to_json(plan: Plan, *, indent: int = 2) -> str:
    """The plan as JSON text; ``load_plan`` reads it back equal."""
    raw = _encoder.encode(plan)
    return (msgspec.json.format(raw, indent=indent) if indent else raw).decode()


def save_plan(plan: Plan, path: str | os.PathLike[str]) -> None:
    """Write ``plan`` as JSON atomically (``flowrl.fileio.write_atomic``); ``PlanError`` naming the path otherwise."""
    write_atomic(path, plan_to_json(plan).encode() + b"\n", error=PlanError, what="plan ")


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """Read a plan file written by ``save_plan`` (or ``flowrl plan -o``); never executes code.

    Raises:
        PlanError: naming the file and what is wrong (missing, not JSON, wrong schema, bad mesh).
    """
    p = Path(path)
    if not p.is_file():
        raise PlanError(f"plan file {str(p)!r} does not exist; write one with 'flowrl plan GRAPH --cluster SPEC -o {p}'")
    try:
        size = p.stat().st_size
        if size > MAX_PLAN_BYTES:
            raise PlanError(f"plan file {str(p)!r} is {size} bytes, over the {MAX_PLAN_BYTES}-byte limit; is it a flowrl plan?")
        data = p.read_bytes()
    except OSError as exc:
        raise PlanError(f"cannot read plan file {str(p)!r}: {exc.strerror}") from None
    with decode_errors(PlanError, mismatch=f"plan file {str(p)!r} does not match the flowrl plan schema", invalid=f"plan file {str(p)!r} is not valid JSON"):
        try:
            return msgspec.json.decode(data, type=Plan)
        except PlanError as exc:  # a check in the structs' __post_init__ (mesh shapes, devices)
            raise PlanError(f"plan file {str(p)!r}: {exc}") from None
