"""The placement search: estimate every enumerated candidate, keep the feasible, rank by predicted step time.

Pipeline (pure functions, no printing or I/O)::

    device_splits(strategy)            # strategies.py: which devices each side gets
      -> per side, every ParallelDims  # parallel.py: tp | heads, pp | layers, product == devices
      -> estimate each node            # estimate/: time and memory per device
      -> step_times                    # schedule.py: sync and async step, timeline
      -> rank                          # fastest feasible first, one best candidate per device split

Pruning keeps the search fast on 10,000 devices: per disaggregated split, each side keeps its
``SIDE_TOP`` fastest dims on its own and only their ``SIDE_TOP**2`` pairs are costed together
(weight sync); per colocated split, every generator dims is paired with the ``COLOCATED_TRAIN_TOP``
fastest trainer dims, and the ``COLOCATED_FULL`` best pairs by G + T get a full evaluation.
Estimates are memoised per (node, devices, dims, reserved memory).

A tensor-parallel group all-reduces twice per layer, so it is kept within one host: on each device
split, dims whose tp groups span hosts are searched only for a side that fits on it no other way,
and for every side only when nothing fits on the split otherwise (so the rule, like the splits, is
the same on every cluster size: ``strategies``; the plan then warns).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from flowrl.backend_traits import BACKENDS
from flowrl.errors import PlanError
from flowrl.graph.engines import DEFAULT_ENGINE, ENGINE_CAPS
from flowrl.graph.ir import Graph
from flowrl.graph.kinds import KINDS
from flowrl.planners.cluster import DEVICE_TRAITS, ClusterSpec
from flowrl.planners.estimate.common import Context, MemoryBreakdown, NodeEstimate, precision_bytes
from flowrl.planners.estimate.generate import engine_claim, estimate_generate
from flowrl.planners.estimate.quantize import add_quantization
from flowrl.planners.estimate.direct import estimate_direct_sync, runs_as_ranks
from flowrl.planners.estimate.sync import SyncEstimate, add_engine_load, estimate_sync
from flowrl.planners.estimate.train import TrainOptions, host_crowded, pick_fitting, train_options, zero_stage
from flowrl.modelspec import ModelSpec
from flowrl.planners.kind_table import ESTIMATORS, PLAN_ROLES
from flowrl.planners.roles import NodeRole
from flowrl.planners.parallel import DIM_AXES, ParallelDims, enumerate_dims, spans_hosts, stage_fraction
from flowrl.planners.runnable import NodeRule, expert_split_runs, fits_splits, node_axes, node_rules
from flowrl.planners.schedule import StepTimes, step_times
from flowrl.planners import strategies
from flowrl.planners.strategies import DeviceSplit
from flowrl.planners.units import format_bytes
from flowrl.placement.layout import device_ranges
from flowrl.placement.weight_routes import direct_edges

__all__ = [
    "Roles",
    "Candidate",
    "SearchResult",
    "resolve_roles",
    "evaluate_layout",
    "evaluator",
    "colocated_candidates",
    "search_placements",
    "why_lost",
]

SIDE_TOP = 3
COLOCATED_TRAIN_TOP = 6
COLOCATED_FULL = 4

Layout = Mapping[str, tuple[Sequence[int], ParallelDims]]


@dataclass(frozen=True)
class Roles:
    """What the planner needs to know about each node of a graph.

    Attributes:
        gens, trainers, refs: heavy nodes by side, from the kinds table: ``side="generator"`` (generators);
            ``side="trainer"`` and ``publishes_weights`` or ``trains`` (policies, critics); the other trainer-side kinds,
            forward-only models costed with the training side (references, reward models).
        loss_of: loss node -> the policy it runs inside.
        models: heavy node -> its model shape.
        gen_dtype: generator -> weight dtype; param_bytes: bytes per trainer parameter.
        gen_engine: generator -> its engine (``GeneratorNode.engine``: ``"builtin"`` or ``"vllm"``).
        gen_memory: generator -> the share of each GPU it set its engine to claim (``VLLMConfig.
            gpu_memory_utilization``); absent: the engine's (``EngineCaps.cuda_memory_fraction``).
        recompute: policy -> whether its step runs the extra no-gradient log-prob forward (the
            trainer's rule, ``flowrl.graph.objectives.recomputes_logprobs``, or ``Tuning``'s override).
        iterations: policy -> (passes over a batch, optimizer steps a batch) (``OptimizerConfig``).
        micro_batch: policy -> its optimizer's micro-batch (0: the estimate chooses).
        last_logits: forward-only nodes that compute the logits of each sequence's last position
            only (a judge reading p(yes) vs p(no)).
        extra_tokens: forward-only node -> tokens it reads per sequence beyond the prompt and the
            completion: a regex judge's answer (``max_new_tokens``), costed as a forward over them
            (the same FLOPs as decoding them; a decode's per-step memory traffic is not counted).
        axes: heavy node -> the mesh axes its program runs at size > 1 where the plan runs
            (``flowrl.planners.runnable.node_axes``); None: every axis (another system's layouts: the baseline).
    """

    gens: tuple[str, ...]
    trainers: tuple[str, ...]
    refs: tuple[str, ...]
    loss_of: dict[str, str]
    models: dict[str, ModelSpec]
    gen_dtype: dict[str, str]
    param_bytes: float
    recompute: dict[str, bool]
    iterations: dict[str, tuple[int, int]]
    micro_batch: dict[str, int]
    gen_engine: dict[str, str] = field(default_factory=dict)
    gen_memory: dict[str, float] = field(default_factory=dict)
    last_logits: frozenset[str] = frozenset()
    extra_tokens: dict[str, int] = field(default_factory=dict)
    axes: dict[str, frozenset[str]] | None = None
    rules: dict[str, NodeRule] | None = None

    @property
    def heavy(self) -> tuple[str, ...]:
        return self.gens + self.trainers + self.refs

    def runs_axes(self, name: str) -> frozenset[str]:
        """The mesh axes heavy node ``name``'s program runs at size > 1 (``axes``; None: every axis)."""
        return frozenset(DIM_AXES) if self.axes is None else self.axes.get(name, frozenset(DIM_AXES))

    def side_axes(self, side: Sequence[str]) -> frozenset[str]:
        """The axes some node of ``side`` runs over several devices: the side's dims range over them, and a
        node that does not run a side's dims goes on its first device alone (``place``)."""
        wide = [self.runs_axes(n) for n in side]
        return frozenset.union(*wide) if wide else frozenset()

    def runs_dims(self, name: str, dims: ParallelDims) -> bool:
        """Whether heavy node ``name``'s program runs ``dims`` as planned: each axis of size > 1 (``axes``),
        no combination its program refuses and a model it can split (``rules``; None: any)."""
        if not {a for a in DIM_AXES if getattr(dims, a) > 1} <= self.runs_axes(name) or not expert_split_runs(dims):
            return False
        rule = self.rules.get(name) if self.rules is not None else None
        if rule is None:
            return True
        return rule.allows(dims) and (rule.kind == "generator" or fits_splits(self.models[name], dims))  # a generator's tp splits the MLP unevenly

    def side_allows(self, side: Sequence[str], dims: ParallelDims) -> bool:
        """Whether the nodes of ``side`` that must hold the side's dims run them: its generators and
        the weight-publishing trainers (a policy); the others (a reference, a critic) may go on the
        first device alone (``place``)."""
        return all(self.runs_dims(n, dims) for n in side if n in self.gens or n in self.loss_of.values())

    def place(self, name: str, devices: Sequence[int], dims: ParallelDims) -> tuple[Sequence[int], ParallelDims]:
        """Where node ``name`` goes on its side's ``devices`` with the side's ``dims``: there, or, when its
        program does not run those dims (``runs_dims``), on the first device alone."""
        if len(devices) <= 1 or self.runs_dims(name, dims):
            return devices, dims
        return devices[:1], ParallelDims()

    @property
    def train_side(self) -> tuple[str, ...]:
        return self.trainers + self.refs


def resolve_roles(graph: Graph, ctx: Context, model: ModelSpec | None = None, *, runnable: bool = True) -> Roles:
    """Sides, model shapes and per-node options of ``graph``; ``model`` overrides every node's shape.

    With ``runnable``, each node's ``Roles.axes`` are those its program runs where a plan on
    ``ctx.cluster`` runs (``flowrl.planners.runnable.node_axes``, read from ``flowrl.mesh_support``
    here and nowhere else in the search); without, every axis (a system other than flowrl's runtime).

    Each device node's side comes from its kind's table entry (``KindSpec.side``; a trainer-side
    kind that publishes weights trains, the others run a forward pass) and its model and options
    from the kind's planner role (``flowrl.planners.kind_table.PLAN_ROLES``); a kind that runs inside its policy's
    step (a loss) goes with the weight-publishing node it feeds.

    Raises:
        PlanError: a device kind with no planner role, or a generator-side
            node whose role gives no weight dtype.
    """
    gens, trainers, refs = [], [], []
    models: dict[str, ModelSpec] = {}
    gen_dtype: dict[str, str] = {}
    gen_engine: dict[str, str] = {}
    gen_memory: dict[str, float] = {}
    recompute: dict[str, bool] = {}
    iterations: dict[str, tuple[int, int]] = {}
    micro: dict[str, int] = {}
    loss_of: dict[str, str] = {}
    last: set[str] = set()
    extra: dict[str, int] = {}
    for node in graph.nodes:
        spec = KINDS[node.kind]
        if spec.runs_on != "devices":
            continue
        if node.kind not in PLAN_ROLES:
            raise PlanError(
                f"node {node.name!r}: kind {node.kind!r} runs on devices but has no planner role; add its "
                "(node, graph, ctx, model) -> flowrl.planners.roles.NodeRole function to flowrl.planners.kind_table.PLAN_ROLES"
            )
        role: NodeRole = PLAN_ROLES[node.kind](node, graph, ctx, model)
        models[node.name] = role.model
        if spec.side == "generator":
            if not role.dtype:
                raise PlanError(f"node {node.name!r}: the planner role of generator-side kind {node.kind!r} gives no weight dtype (NodeRole.dtype)")
            gens.append(node.name)
            gen_dtype[node.name] = role.dtype
            gen_engine[node.name] = role.engine
            if role.memory_fraction:
                gen_memory[node.name] = role.memory_fraction
        elif spec.publishes_weights or spec.trains:  # it trains (a policy, a critic)
            trainers.append(node.name)
            micro[node.name] = role.micro_batch
            recompute[node.name] = role.recompute
            iterations[node.name] = role.iterations
        else:  # a forward pass of its model, like a reference's
            refs.append(node.name)
            if role.last_logits:
                last.add(node.name)
            if role.extra_tokens:
                extra[node.name] = role.extra_tokens
    for node in graph.nodes:
        if KINDS[node.kind].runs_on == "policy":
            users = [u.name for u in graph.users(node.name) if KINDS[u.kind].publishes_weights]
            if users:
                loss_of[node.name] = users[0]
            elif trainers:
                loss_of[node.name] = trainers[0]
    param_bytes = ctx.tuning.param_bytes or ctx.cluster.device.dtype_bytes
    return Roles(
        gens=tuple(gens),
        trainers=tuple(trainers),
        refs=tuple(refs),
        loss_of=loss_of,
        models=models,
        gen_dtype=gen_dtype,
        param_bytes=param_bytes,
        recompute=recompute,
        iterations=iterations,
        micro_batch=micro,
        gen_engine=gen_engine,
        gen_memory=gen_memory,
        last_logits=frozenset(last),
        extra_tokens=extra,
        axes=node_axes(graph, ctx.cluster, backend=ctx.tuning.backend) if runnable else None,
        rules=node_rules(graph, ctx.cluster, backend=ctx.tuning.backend) if runnable else None,
    )


@dataclass(frozen=True)
class Candidate:
    """One fully estimated placement."""

    family: str
    split: DeviceSplit | None
    layout: dict[str, tuple[Sequence[int], ParallelDims]]
    estimates: dict[str, NodeEstimate]
    syncs: tuple[SyncEstimate, ...]
    steps: StepTimes
    max_staleness: int
    feasible: bool
    problem: str = ""

    @property
    def step_s(self) -> float:
        """The step time this placement runs at: async when max_staleness >= 1, else sync."""
        return self.steps.async_step_s if self.max_staleness >= 1 else self.steps.sync_step_s

    def side_times(self, roles: Roles) -> dict[str, float]:
        """Seconds per step of each part: generation, training side, weight sync, host work."""
        e = self.estimates
        return {
            "generation": sum(e[n].time_s for n in roles.gens),
            "training": sum(e[n].time_s for n in roles.train_side),
            "weight sync": sum(s.time_s for s in self.syncs),
            "cpu": max((e[n].time_s for n in e if n not in roles.heavy), default=0.0),
        }

    def short(self) -> str:
        parts = [f"{n}:{d.short()}@{device_ranges(devs)}" for n, (devs, d) in self.layout.items()]
        return " | ".join(parts)


@dataclass
class SearchResult:
    """Ranked feasible candidates (best first) and what the search saw: placements estimated in full
    (``evaluated``), device splits or placements on which nothing fitted (``infeasible``), node meshes
    estimated that did not fit in memory (``node_misses``: one node on one mesh beside what it shares
    it with, each counted once), for each node its infeasible estimate that needed the least memory
    (``problems``: one of the ``node_misses``), and the nodes that fit on at least one mesh (``fitted``)."""

    ranked: list[Candidate]
    evaluated: int = 0
    infeasible: int = 0
    node_misses: int = 0
    problems: dict[str, NodeEstimate] = field(default_factory=dict)
    fitted: set[str] = field(default_factory=set)


class _Evaluator:
    """Memoised estimates for one (graph, cluster, workload, tuning); the search's only state."""

    def __init__(self, graph: Graph, roles: Roles, ctx: Context, max_staleness: int) -> None:
        self.graph, self.roles, self.ctx, self.k = graph, roles, ctx, max_staleness
        self._train: dict[tuple, TrainOptions] = {}
        self._nodes: dict[tuple, NodeEstimate] = {}
        self._sides: dict[tuple, list[tuple[float, ParallelDims]]] = {}
        self.dph = ctx.cluster.devices_per_host
        self.order = [n.name for n in graph.topological_order()]
        self.producers = {n: [p.name for p in graph.producers(n)] for n in self.order}
        self.problems: dict[str, NodeEstimate] = {}
        self.fitted: set[str] = set()
        self.evaluated = 0
        self.node_misses = 0  # node estimates that did not fit (each memo key once): what ``problems`` holds the least of
        #: when side_dims offers tp groups that span hosts: "never" (the search's first pass), "when
        #: needed" (a side on which nothing else fits), "always" (the last pass)
        self.tp_across_hosts = "never"
        #: nodes beside the models (sources, scorers, losses), costed by their kind's estimator (``kind_table.ESTIMATORS``)
        self.cpu_side = {n.name: _cpu_estimate(n.kind, ctx) for n in graph.nodes if n.name not in roles.heavy}
        #: weight-sync cost: the transport's (``estimate_sync``, plus ``quantize_cost``) unless a
        #: system (``baseline.BaselineSystem``) replaces it; same arguments as ``estimate_sync``
        self.sync_cost: Callable[..., SyncEstimate] = _sync_with_quantization
        #: the host's processes outnumber its cores (``train.host_crowded``): vLLM's workers, one per vLLM generator at least
        self.crowded = host_crowded(ctx.cluster, sum(ENGINE_CAPS[e].weight_hop for e in roles.gen_engine.values()))
        #: the plan runs as a torchrun job, where vLLM edges may take the direct route (``estimate.direct``)
        self.ranks = runs_as_ranks(ctx.cluster, fsdp=any(self._sharding(n) == "fsdp" for n in roles.heavy)) or ctx.tuning.backend == "torchrun"


    def allow_tp_across_hosts(self, mode: str) -> None:
        """Set ``tp_across_hosts`` (``"never"``, ``"when needed"``, ``"always"``); side rankings are kept per mode."""
        self.tp_across_hosts = mode

    # -- per node ---------------------------------------------------------------------------------
    def train_opts(self, name: str, devices: Sequence[int], dims: ParallelDims) -> TrainOptions:
        key = (name, _mesh_key(devices, dims, self.dph), dims)
        if key not in self._train:
            r = self.roles
            ctx = self.ctx
            if r.extra_tokens.get(name):  # a regex judge also reads its answer
                ctx = msgspec.structs.replace(ctx, workload=msgspec.structs.replace(ctx.workload, prompt_len=ctx.workload.prompt_len + r.extra_tokens[name]))
            self._train[key] = train_options(
                r.models[name],
                dims,
                devices,
                ctx,
                forward_only=name in r.refs,
                recompute_logprobs=r.recompute.get(name, False),
                micro_batch=r.micro_batch.get(name, 0),
                sharding=self._sharding(name),
                last_logits=name in r.last_logits,
                iterations=r.iterations.get(name, (1, 1))[0],
                updates=r.iterations.get(name, (1, 1))[1],
                packing=self._packing(name),
                crowded=self.crowded,
            )
        return self._train[key]

    def _packing(self, name: str) -> bool | None:
        """The node's ``packing`` (a policy's ``OptimizerConfig.packing``, a reference's
        ``ReferenceConfig.packing``; False for another kind). The default, None, packs with every family
        flowrl trains, all of which take packed rows, as the runtime's ``packs`` decides (the family
        table needs torch, which the planner does not import; ``tests/planners/test_packing_estimate.py``
        checks the two agree); ``train_options`` prices it."""
        node = self.graph.node(name) if name in self.graph else None
        config = getattr(node, "optimizer", None) or getattr(node, "reference", None)
        return False if config is None else config.packing

    def _sharding(self, name: str) -> str:
        """The node's ``OptimizerConfig.sharding`` (``"replicate"`` for a node without an optimizer)."""
        optimizer = getattr(self.graph.node(name), "optimizer", None) if name in self.graph else None
        return getattr(optimizer, "sharding", "replicate")

    def resident(self, name: str, dims: ParallelDims) -> float:
        """Bytes per device a node keeps allocated for the whole run (weights, grads, optimizer; an
        engine that claims its share of a GPU at start, that share: ``generate.engine_claim``)."""
        r = self.roles
        model = r.models[name]
        p_dev = model.params * stage_fraction(model.n_layers, dims.pp) / dims.tp  # the largest stage
        if name in r.gens:
            return engine_claim(r.gen_engine.get(name, DEFAULT_ENGINE), self.ctx, r.gen_memory.get(name, 0.0)) or p_dev * precision_bytes(r.gen_dtype[name])
        if name in r.refs:
            return p_dev * r.param_bytes
        t = self.ctx.tuning
        ob = t.optimizer_bytes or (12 if r.param_bytes <= 2 else 8)
        zero, dp = zero_stage(t, self._sharding(name)), dims.dp
        trained = p_dev * model.trained_params / model.params  # a LoRA policy's gradients and optimizer state: its adapters'
        return p_dev * r.param_bytes / (dp if zero >= 3 else 1) + trained * (t.grad_bytes / (dp if zero >= 2 else 1) + ob / (dp if zero >= 1 else 1))

    def offloadable(self, name: str, dims: ParallelDims) -> float:
        """Bytes per device of ``resident`` that wait in host memory while another node runs, as the
        runtime moves them (``flowrl.runtime.programs.offload``): a trainer's whole state (parameters,
        gradients, optimizer states, after its weights are published), a vLLM generator's claim
        (level-1 sleep: weights to host memory, KV cache freed; on CUDA only, where vLLM has a sleep
        mode). Nothing of other nodes: a critic, which trains but publishes no weights, stays
        resident (the runtime does not offload it)."""
        if name in self.roles.trainers and KINDS[self.graph.node(name).kind].publishes_weights:
            return self.resident(name, dims)
        cuda = DEVICE_TRAITS[self.ctx.cluster.device.kind].cuda
        if name in self.roles.gens and cuda and ENGINE_CAPS[self.roles.gen_engine.get(name, DEFAULT_ENGINE)].sleeps:
            return self.resident(name, dims)
        return 0.0

    def moved_bytes(self, name: str, dims: ParallelDims) -> float:
        """Bytes per device an offloaded node moves to host memory and back: a trainer its whole
        state; a sleeping engine its weights only (level 1 drops its KV cache, freed, not moved)."""
        r = self.roles
        if name in r.gens:
            model = r.models[name]
            return model.params * stage_fraction(model.n_layers, dims.pp) / dims.tp * precision_bytes(r.gen_dtype[name])
        return self.resident(name, dims)

    def beside(self, name: str, devices: Sequence[int], dims: ParallelDims, others: Sequence[tuple[str, ParallelDims]]) -> NodeEstimate:
        """``node`` on devices it shares with ``others`` (name, dims), which hold their resident state.

        When it does not fit and ``offload`` allows, the others' offloadable state goes to host
        memory while it runs: memory is this node's phase plus what stays resident, and the step
        pays the move out and back, ``2 * offloaded / host_bandwidth`` (``breakdown["offload"]``;
        ``breakdown["offload/<other>"]`` each other's share, which ``Plan.placement()`` turns into
        ``Placement.offload``, what a run with ``offload="auto"`` moves). The runtime offloads only
        on a backend that does (``backend_traits``: not torchrun, which the planner takes a GPU plan
        to run as) and where a move frees device memory (not on CPU cores), and vLLM sleeps only on
        CUDA: elsewhere every colocated node keeps its state, and a node that does not fit beside
        it does not fit. A colocated estimate's notes say which: what was moved, or what stays
        held beside it and why nothing moved.
        """
        reserved = sum(self.resident(o, d) for o, d in others)
        est = self.node(name, devices, dims, reserved)
        host_bw = self.ctx.cluster.device.host_bandwidth
        no_offload = _no_offload(self.ctx, devices) if others else ""
        if others and (est.feasible or no_offload):
            kept = ", ".join(f"{o}'s {format_bytes(self.resident(o, d))}" for o, d in others)
            notes = (*est.notes, f"beside {kept} held on the same devices")
            if est.feasible:
                return msgspec.structs.replace(est, notes=notes)
            return msgspec.structs.replace(est, notes=notes, problem=f"{est.problem}; nothing offloaded or asleep: {no_offload}")
        if est.feasible or not others:
            return est
        freed = {o: self.offloadable(o, d) for o, d in others}
        if sum(freed.values()) <= 0:
            return est
        lighter = self.node(name, devices, dims, reserved - sum(freed.values()))
        if not lighter.feasible:
            return est
        # what crosses to host memory and back: a trainer's whole state; an engine asleep, its weights (its KV cache is dropped)
        each = {o: self.moved_bytes(o, d) for o, d in others if freed[o] > 0}
        moved = sum(each.values())
        move = 2 * moved / host_bw
        names = ", ".join(
            f"{o} ({f'asleep: frees {format_bytes(freed[o])}, moves its weights {format_bytes(b)}' if o in self.roles.gens else f'state {format_bytes(b)}'})"
            for o, b in each.items()
        )
        return msgspec.structs.replace(
            lighter,
            time_s=lighter.time_s + move,
            steady_s=None if lighter.steady_s is None else lighter.steady_s + move,
            breakdown={**lighter.breakdown, "offload": move, **{f"offload/{o}": 2 * b / host_bw for o, b in each.items()}},
            notes=(
                *lighter.notes,
                f"colocated state offloaded: {names}, {format_bytes(moved)} out and back over {host_bw / 1e9:.3g} GB/s "
                "(what `flowrl run --offload auto` moves on the local or process backend, which offload (torchrun does not): "
                "a trainer's parameters, gradients and optimizer state after its publish; a vLLM engine in level-1 sleep, its weights to host memory and its KV cache freed)",
            ),
        )

    def node(self, name: str, devices: Sequence[int], dims: ParallelDims, reserved: float) -> NodeEstimate:
        r = self.roles
        model = r.models[name]
        key = (name, _mesh_key(devices, dims, self.dph), dims, round(reserved))
        est = self._nodes.get(key)
        if est is not None:
            return est
        if name in r.gens:
            est = estimate_generate(
                model, dims, devices, self.ctx, precision=r.gen_dtype[name], reserved_bytes=reserved, node=name,
                engine=r.gen_engine.get(name, DEFAULT_ENGINE), memory_fraction=r.gen_memory.get(name, 0.0),
            )
        else:
            what = f"{model.name} {'forward' if name in r.refs else 'training'} on {dims.short()}"
            est = pick_fitting(self.train_opts(name, devices, dims), self.ctx, reserved, node=name, what=what)
        self._nodes[key] = est
        if est.feasible:
            self.fitted.add(name)
        else:
            self.node_misses += 1
            seen = self.problems.get(name)
            if seen is None or est.memory.total < seen.memory.total:
                self.problems[name] = est
        return est

    # -- whole layouts ----------------------------------------------------------------------------
    def evaluate(self, layout: Layout, family: str, split: DeviceSplit | None = None) -> Candidate:
        self.evaluated += 1
        r = self.roles
        names = list(layout)
        estimates: dict[str, NodeEstimate] = {}
        for name in names:
            devices, dims = layout[name]
            others = [(o, layout[o][1]) for o in names if o != name and _shares(layout[o][0], devices)]
            estimates[name] = self.beside(name, devices, dims, others)
        estimates.update(self.cpu_side)
        for loss, policy in r.loss_of.items():
            estimates[loss] = NodeEstimate(time_s=0.0, memory=MemoryBreakdown(), notes=(f"runs inside {policy}'s step",))
        syncs = []
        pipelined = {n for n in names if layout[n][1].pp > 1}  # a pipeline's stages take the hop (weight_routes)
        direct = direct_edges(self.graph, {n: layout[n][0] for n in names}, pipelined=pipelined) if self.ranks else frozenset()
        for edge in self.graph.weight_edges:
            if edge.src not in layout or edge.dst not in layout:
                continue
            (sd, sdims), (dd, ddims) = layout[edge.src], layout[edge.dst]
            dst_bytes = precision_bytes(r.gen_dtype[edge.dst]) if edge.dst in r.gens else r.param_bytes
            cost = _direct_with_quantization if (edge.src, edge.dst) in direct else self.sync_cost
            sync = cost(
                r.models[edge.dst],
                src=edge.src,
                dst=edge.dst,
                transport=edge.transport,
                src_devices=sd,
                src_dims=sdims,
                dst_devices=dd,
                dst_dims=ddims,
                dst_bytes_per_param=dst_bytes,
                src_bytes_per_param=r.param_bytes,
                ctx=self.ctx,
                src_sharded=self._sharding(edge.src) == "fsdp",
            )
            if (edge.src, edge.dst) in direct:  # no hop: the policy's ranks sent into vLLM's workers
                syncs.append(sync)
                continue
            engine = r.gen_engine.get(edge.dst, DEFAULT_ENGINE)  # the runtime's last hop into a vLLM generator's workers, whatever the system's sync
            syncs.append(
                add_engine_load(sync, r.models[edge.dst], engine=engine, transport=edge.transport, dst_bytes_per_param=dst_bytes, ctx=self.ctx, dst_dims=ddims)
            )
        placed = {n: layout[n][0] for n in names}
        placed.update({loss: layout[p][0] for loss, p in r.loss_of.items() if p in layout})
        times = {n: e.time_s for n, e in estimates.items()}
        feasible = all(e.feasible for e in estimates.values())
        if not feasible:
            times = {n: (t if math.isfinite(t) else 0.0) for n, t in times.items()}
        steady = {n: e.steady_s for n, e in estimates.items() if e.steady_s is not None and math.isfinite(e.steady_s)}
        cluster = self.ctx.cluster
        # meshes on one host share it; a torchrun job's meshes are processes of their own, sharing no
        # interpreter (``shared_slowdown`` is measured in one process), only the cores (``host_cores``)
        shared = cluster.device.cpu.shared_slowdown if cluster.hosts == 1 and not self.ranks else 1.0
        cores = cluster.device.cpu.host_cores
        oversubscribed = cores if cluster.hosts == 1 and 0 < cores < cluster.devices_per_host else 0  # more ranks than cores
        steps = step_times(
            self.graph, placed, times, syncs, sync_overlap=self.ctx.tuning.sync_overlap, steady=steady, order=self.order, producers=self.producers,
            shared_slowdown=shared, host_cores=oversubscribed,
        )
        problem = next((e.problem for e in estimates.values() if not e.feasible), "")
        return Candidate(
            family=family,
            split=split,
            layout={n: layout[n] for n in names},
            estimates=estimates,
            syncs=tuple(syncs),
            steps=steps,
            max_staleness=self.k,
            feasible=feasible,
            problem=problem,
        )

    # -- one side at a time -----------------------------------------------------------------------
    def side_dims(self, side: Sequence[str], devices: range) -> list[tuple[float, ParallelDims]]:
        """Dims valid for every node of ``side`` on ``devices``, with the side's standalone time (feasible only), fastest first."""
        if not side:
            return []
        key = (tuple(side), _key(devices, self.dph), self.tp_across_hosts)
        if key not in self._sides:
            self._sides[key] = self._side_dims(side, devices)
        return self._sides[key]

    def _side_dims(self, side: Sequence[str], devices: range) -> list[tuple[float, ParallelDims]]:
        r = self.roles
        models = [r.models[n] for n in side]
        # only the axes the side's programs run where the plan runs (Roles.axes: flowrl.planners.runnable); a CPU mesh
        # with a measured thread speedup is one process with n intra-op threads (the local backend's dp: no tp or pp)
        options = [
            d for d in enumerate_dims(len(devices), models[0], axes=r.side_axes(side))
            if all(m.n_heads % d.tp == 0 and d.pp <= m.n_layers for m in models[1:]) and r.side_allows(side, d)
        ]
        ranked = []
        for dims in options:
            total, ok = 0.0, True
            for name in side:
                est = self.beside(name, *r.place(name, devices, dims), [(o, r.place(o, devices, dims)[1]) for o in side if o != name])
                if not est.feasible:
                    ok = False
                    break
                total += est.time_s
            if ok:
                ranked.append((total, dims))
        ranked.sort(key=lambda x: (x[0], x[1].tp, x[1].pp))
        if self.tp_across_hosts == "always":
            return ranked
        within = [(t, d) for t, d in ranked if d.tp == 1 or not spans_hosts(devices, d, "tp", self.dph)]
        return within or ranked if self.tp_across_hosts == "when needed" else within


def _no_offload(ctx: Context, devices: Sequence[int]) -> str:
    """Why the runtime would move no colocated state aside for nodes sharing ``devices``
    (``flowrl.runtime.programs.offload``), or ``""`` where it does: on GPUs of one host, run by a backend that
    offloads (``backend_traits(...).offloads``: local, process; ``Tuning.offload`` "auto")."""
    dev, c = ctx.cluster.device, ctx.cluster
    if DEVICE_TRAITS[dev.kind].pinned:
        return "on CPU cores host memory is device memory: a move frees nothing"
    if ctx.tuning.offload == "off":
        return "--set offload=off"
    if dev.host_bandwidth <= 0:
        return f"cluster {c.name!r} gives no host_bandwidth"
    if devices and devices[0] // c.devices_per_host != devices[-1] // c.devices_per_host:
        backends = [b for b in BACKENDS if BACKENDS[b].offloads]
        return f"its devices span hosts, which only torchrun runs, and torchrun does not offload (backends that do: {', '.join(backends)})"
    return ""


def _cpu_estimate(kind: str, ctx: Context) -> NodeEstimate:
    if kind not in ESTIMATORS:
        raise PlanError(f"kind {kind!r} runs beside the devices but has no estimator; add its (kind, ctx) -> NodeEstimate function to flowrl.planners.kind_table.ESTIMATORS")
    return ESTIMATORS[kind](kind, ctx)


def _sync_with_quantization(model: ModelSpec, **kwargs: Any) -> SyncEstimate:
    """``estimate_sync`` (the transport's transfer) plus the trainer's cast to the generator's dtype
    (``kwargs``: both functions' keyword arguments, passed through)."""
    est = estimate_sync(model, **kwargs)
    return add_quantization(est, model, **kwargs)


def _direct_with_quantization(model: ModelSpec, **kwargs: Any) -> SyncEstimate:
    """``estimate_direct_sync`` (the direct route into vLLM's workers) plus the trainer's cast to the generator's dtype."""
    est = estimate_direct_sync(model, **kwargs)
    return add_quantization(est, model, **kwargs)


def evaluator(graph: Graph, roles: Roles, ctx: Context, max_staleness: int) -> _Evaluator:
    """A fresh memoising evaluator (``evaluate(layout, family)``, ``side_dims(side, devices)``) for other searches."""
    return _Evaluator(graph, roles, ctx, max_staleness)


def _mesh_key(devices: Sequence[int], dims: ParallelDims, devices_per_host: int) -> object:
    """Memo key of one node's estimate on a mesh: an estimate sees its devices only through which
    axes' groups straddle hosts (``estimate.common.axis_link``), so meshes that agree on those
    three facts share it, wherever on the cluster they start."""
    if isinstance(devices, range) and devices.step == 1:
        return tuple(
            getattr(dims, axis) > 1 and spans_hosts(devices, dims, axis, devices_per_host) for axis in ("tp", "pp", "dp")
        )
    return tuple(devices)


def _key(devices: Sequence[int], devices_per_host: int) -> object:
    """Memo key of a mesh: estimates see devices only through which groups straddle hosts, so a
    contiguous block is fully described by its offset within a host and its length."""
    if isinstance(devices, range) and devices.step == 1:
        return ("block", devices.start % devices_per_host, len(devices))
    return tuple(devices)


def _shares(a: Sequence[int], b: Sequence[int]) -> bool:
    if isinstance(a, range) and isinstance(b, range):
        return max(a.start, b.start) < min(a.stop, b.stop)
    return not set(a).isdisjoint(b)


def evaluate_layout(graph: Graph, ctx: Context, roles: Roles, layout: Layout, *, max_staleness: int, family: str = "manual") -> Candidate:
    """Estimate one given placement (``flowrl plan --strategy 'gen:d4@0-3 | policy:d4@4-7'``)."""
    return _Evaluator(graph, roles, ctx, max_staleness).evaluate(layout, family)


def _layout(roles: Roles, split: DeviceSplit, gen_dims: ParallelDims | None, train_dims: ParallelDims | None) -> dict:
    layout: dict[str, tuple[Sequence[int], ParallelDims]] = {}
    for n in roles.gens:
        assert gen_dims is not None  # None only for a side without nodes
        layout[n] = roles.place(n, split.gen_devices, gen_dims)
    for n in roles.train_side:
        assert train_dims is not None  # as gen_dims
        layout[n] = roles.place(n, split.train_devices, train_dims)
    return layout


def colocated_candidates(ev: _Evaluator, split: DeviceSplit) -> list[Candidate]:
    """The best few placements of a colocated split, each side with its own dims (``COLOCATED_FULL`` of them)."""
    r = ev.roles
    devices = split.gen_devices
    gen_opts = [d for _, d in ev.side_dims(r.gens, devices)] if r.gens else [None]
    train_opts = [d for _, d in ev.side_dims(r.train_side, devices)][:COLOCATED_TRAIN_TOP] if r.train_side else [None]
    if not gen_opts or not train_opts:
        return []
    scored = []
    for gd in gen_opts:
        for td in train_opts:
            layout = _layout(r, split, gd, td)
            total, ok = 0.0, True
            for name, (devs, dims) in layout.items():
                est = ev.beside(name, devs, dims, [(o, layout[o][1]) for o in layout if o != name])
                if not est.feasible:
                    ok = False
                    break
                total += est.time_s
            if ok:
                scored.append((total, layout))
    scored.sort(key=lambda x: x[0])
    return [ev.evaluate(layout, "colocated", split) for _, layout in scored[:COLOCATED_FULL]]


def _disaggregated(ev: _Evaluator, split: DeviceSplit) -> list[Candidate]:
    r = ev.roles
    gen_opts = [d for _, d in ev.side_dims(r.gens, split.gen_devices)][:SIDE_TOP]
    train_opts = [d for _, d in ev.side_dims(r.train_side, split.train_devices)][:SIDE_TOP]
    return [ev.evaluate(_layout(r, split, gd, td), "disaggregated", split) for gd in gen_opts for td in train_opts]


#: Per split family (``strategies.DeviceSplit.family``): how its candidates are found, and a lower
#: bound of its step from each side's best time (colocated phases add up; disjoint ones overlap).
#: ``DeviceSplit.family`` is a Literal of exactly these keys; a new family needs an entry in both.
_SEARCH_SPLIT: dict[str, Callable[[_Evaluator, DeviceSplit], list[Candidate]]] = {"colocated": colocated_candidates, "disaggregated": _disaggregated}
_LOWER_BOUND: dict[str, Callable[[float, float], float]] = {"colocated": lambda g, t: g + t, "disaggregated": max}


def search_placements(graph: Graph, cluster: ClusterSpec, ctx: Context, roles: Roles, *, strategy: str, max_staleness: int) -> SearchResult:
    """Every candidate of ``strategy``, estimated; feasible ones ranked by predicted step time.

    One candidate per device split survives (the fastest dims for it), so the runners-up differ in
    how devices are divided rather than in a tp degree. Splits are visited in order of a lower
    bound on their step (each side's fastest standalone time over every dims: ``max(G, T)`` when the
    sides are disjoint, ``G + T`` when colocated) and the visit stops once no remaining split can enter
    the top ``top_k + 1``: branch and bound, exact for the ranking it returns. Tensor-parallel groups
    that span hosts are searched on a split only for a side that fits on it no other way, and on
    every side of a split whose sides fit alone but no candidate fits them together: a rule of the
    split alone, so every candidate on a cluster is one on a larger cluster too (``tests/planners/test_monotone.py``).
    """
    ev = _Evaluator(graph, roles, ctx, max_staleness)
    return _search(ev, cluster, strategy)


def _split_mode(ev: _Evaluator, split: DeviceSplit, modes: Sequence[str]) -> str | None:
    """The first of ``modes`` under which every side of ``split`` has dims that fit (None: none):
    tensor-parallel groups across hosts are searched on a split only when nothing fits on it without them."""
    r = ev.roles
    for mode in modes:
        ev.allow_tp_across_hosts(mode)
        if (not r.gens or ev.side_dims(r.gens, split.gen_devices)) and (not r.train_side or ev.side_dims(r.train_side, split.train_devices)):
            return mode
    return None


def _search(ev: _Evaluator, cluster: ClusterSpec, strategy: str, modes: Sequence[str] = ("never", "when needed", "always")) -> SearchResult:
    ctx, roles = ev.ctx, ev.roles
    splits = strategies.device_splits(
        strategy,
        cluster.n_devices,
        ctx.tuning.split_multipliers,
        devices_per_host=cluster.devices_per_host,
        has_generator=bool(roles.gens),
        has_trainer=bool(roles.train_side),
    )
    bounded: list[tuple[float, int, DeviceSplit, str]] = []
    infeasible = 0
    for i, split in enumerate(splits):
        mode = _split_mode(ev, split, modes)
        if mode is None:
            infeasible += 1
            continue
        ev.allow_tp_across_hosts("always")  # every dims: a lower bound of the split's candidates, its fallback's too (below)
        g = ev.side_dims(roles.gens, split.gen_devices)
        t = ev.side_dims(roles.train_side, split.train_devices)
        g0, t0 = (g[0][0] if g else 0.0), (t[0][0] if t else 0.0)
        bounded.append((_LOWER_BOUND[split.family](g0, t0), i, split, mode))
    bounded.sort(key=lambda x: (x[0], x[1]))
    keep = ctx.tuning.top_k + 1
    best_per_split: list[Candidate] = []
    steps: list[float] = []
    for bound, _, split, mode in bounded:
        if len(steps) >= keep and bound >= steps[keep - 1]:
            break
        ev.allow_tp_across_hosts(mode)
        found = _SEARCH_SPLIT[split.family](ev, split)
        if mode != "always" and not any(c.feasible for c in found):  # its sides fit alone, not together: tp across hosts on it too
            ev.allow_tp_across_hosts("always")
            found = _SEARCH_SPLIT[split.family](ev, split)
        feasible = [c for c in found if c.feasible]
        infeasible += len(found) - len(feasible)
        if not found:
            infeasible += 1
        if feasible:
            best = min(feasible, key=_rank)
            best_per_split.append(best)
            bisect.insort(steps, best.step_s)
    best_per_split.sort(key=_rank)
    return SearchResult(
        ranked=best_per_split, evaluated=ev.evaluated, infeasible=infeasible, node_misses=ev.node_misses, problems=dict(ev.problems), fitted=set(ev.fitted)
    )


def _rank(c: Candidate) -> tuple[float, float, int]:
    """Fastest step first; ties go to the faster synchronous step, then to fewer devices."""
    split = c.split
    used = 0 if split is None else split.gen_count + (split.train_count if split.family == "disaggregated" else 0)
    return (round(c.step_s, 12), c.steps.sync_step_s, used)


def why_lost(loser: Candidate, winner: Candidate, roles: Roles) -> str:
    """One line: how much slower ``loser`` is predicted to be than ``winner``, and which part makes it so."""
    if not loser.feasible:
        return f"does not fit: {loser.problem}"
    a, b = loser.step_s, winner.step_s
    pct = (a / b - 1) * 100 if b > 0 else 0.0
    lt, wt = loser.side_times(roles), winner.side_times(roles)
    part = max(lt, key=lambda k: lt[k] - wt[k])
    text = f"step {a:.3g} s vs {b:.3g} s (+{pct:.0f}%)"
    if lt[part] > wt[part]:
        text += f": {part} {lt[part]:.3g} s vs {wt[part]:.3g} s"
    if loser.family == "colocated" and winner.family == "disaggregated" and loser.max_staleness >= 1:
        text += "; colocated phases cannot overlap"
    return text
