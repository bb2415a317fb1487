"""What a plan may propose: the backend a cluster implies and, per node, the mesh axes its program runs there.

The planner proposes only layouts the runtime executes. Which axes a node's program runs is
``flowrl.mesh_support.MESH_SUPPORT``'s answer for its kind (a generator's engine) on the backend the
plan will run under, which the cluster implies (``plan_backend``):

- a policy with ``sharding="fsdp"``, or GPUs: ``torchrun`` (FSDP2 runs only there; on GPUs a node's
  one process uses one GPU, ``flowrl.runtime.control.executor_placement``);
- one device: ``local`` (no mesh has an axis of size > 1);
- a CPU whose ``flowrl calibrate`` terms give a thread speed-up (``CpuTerms.thread_speedup`` > 0): the
  planner prices a mesh of ``n`` cores as one process with ``n`` intra-op threads, which is what the
  one-process backends run (``local``, ``process``), so ``local``;
- any other cluster of several devices (GPUs, or CPU cores priced as one rank each): ``torchrun``,
  the backend whose programs span devices (a rank per device; ``flowrl.runtime.backends.torchrun.backend``).

``node_axes`` is read once per plan (``search.resolve_roles`` keeps it in ``Roles.axes``); the search
enumerates only those axes for each node (``parallel.enumerate_dims``), and a node whose program runs
none over several devices goes on the first device of its side alone; ``node_rules`` (``Roles.rules``)
drops the side's dims a node's program refuses in combination (``mesh_support.COMBINATIONS``: a policy's
pp beside tp, its dp beside tp without FSDP2, ...) or cannot split its model into (``fits_splits``: tp
dividing the heads, kv heads and MLP width, as the runtime requires). ``check_layout`` refuses a
compact placement (``--strategy 'gen:t2@0-1 | ...'``) with an axis its node does not run.

Example:
    >>> from flowrl.examples import build_example
    >>> from flowrl.planners.cluster import parse_cluster
    >>> plan_backend(parse_cluster("8xH100")), plan_backend(parse_cluster("cpu:1"))
    ('torchrun', 'local')
    >>> axes = node_axes(build_example("llamarl_ref"), parse_cluster("8xH100"))
    >>> {n: sorted(a) for n, a in axes.items()}
    {'gen': ['dp', 'tp'], 'ref': ['tp'], 'policy': ['dp', 'ep', 'pp', 'tp']}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flowrl.errors import PlanError
from flowrl.graph.kinds import KINDS
from flowrl.mesh_support import MESH_AXES, allowed, node_facts, refusal, runnable_axes

if TYPE_CHECKING:
    from flowrl.graph.ir import Graph
    from flowrl.planners.cluster import ClusterSpec
    from flowrl.modelspec import ModelSpec
    from flowrl.planners.parallel import ParallelDims

__all__ = ["plan_backend", "plan_device", "node_axes", "NodeRule", "node_rules", "check_layout", "expert_split_runs", "check_expert_split"]


def plan_backend(cluster: ClusterSpec, *, fsdp: bool = False, backend: str = "") -> str:
    """The backend a plan on ``cluster`` runs under (module docstring); ``fsdp``: a policy shards with FSDP2;
    ``backend``: the one the user named (``Tuning.backend``, ``flowrl plan --backend`` / ``--emit``), else implied."""
    from flowrl.planners.estimate.direct import runs_as_ranks

    if backend:
        return backend
    if runs_as_ranks(cluster, fsdp=fsdp):
        return "torchrun"
    if cluster.n_devices <= 1 or cluster.device.cpu.thread_speedup > 0:
        return "local"
    return "torchrun"


def plan_device(cluster: ClusterSpec) -> str:
    """The torch device type of ``cluster``'s devices: ``"cuda"`` or ``"cpu"``."""
    from flowrl.planners.cluster import DEVICE_TRAITS

    return "cuda" if DEVICE_TRAITS[cluster.device.kind].cuda else "cpu"


def node_axes(graph: Graph, cluster: ClusterSpec, *, backend: str = "") -> dict[str, frozenset[str]]:
    """Device node -> the axes its program runs at size > 1 under ``plan_backend(cluster)`` (``mesh_support``)."""
    fsdp = any(getattr(getattr(n, "optimizer", None), "sharding", "") == "fsdp" for n in graph.nodes)
    backend, device = plan_backend(cluster, fsdp=fsdp, backend=backend), plan_device(cluster)
    return {
        n.name: runnable_axes(n.kind, backend, engine=getattr(n, "engine", None), device=device)
        for n in graph.nodes
        if KINDS[n.kind].runs_on == "devices"
    }


@dataclass(frozen=True)
class NodeRule:
    """What one node's program runs where the plan runs: ``mesh_support.allowed`` for its kind,
    engine and settings (``node_facts``: FSDP2, LoRA, packing, a syncing reference) on ``backend``."""

    kind: str
    backend: str
    device: str
    engine: str | None = None
    facts: frozenset[str] = frozenset()

    def allows(self, dims: ParallelDims) -> bool:
        """Whether the node runs ``dims`` as planned: its axes, and no refused combination of them
        (``mesh_support.COMBINATIONS``), nor a model the program cannot split (``model``: see ``fits_splits``)."""
        return allowed(self.kind, self.backend, {a: getattr(dims, a, 1) for a in MESH_AXES}, facts=self.facts, engine=self.engine, device=self.device)


def fits_splits(model: ModelSpec, dims: ParallelDims) -> bool:
    """Whether ``tp`` divides what a tensor-parallel program splits (the heads, the kv heads and the MLP
    width: ``runtime.parallel.tp_train`` refuses the others) and ``pp`` is at most the layers."""
    tp = dims.tp
    if tp > 1 and (model.n_heads % tp or model.n_kv_heads % tp or model.ffn_dim % tp or (model.expert_ffn_dim and model.expert_ffn_dim % tp)):
        return False
    return dims.pp <= model.n_layers


def node_rules(graph: Graph, cluster: ClusterSpec, *, backend: str = "") -> dict[str, NodeRule]:
    """Device node -> its ``NodeRule`` under ``plan_backend(cluster)`` (what ``check_meshes`` would let run)."""
    fsdp = any(getattr(getattr(n, "optimizer", None), "sharding", "") == "fsdp" for n in graph.nodes)
    backend, device = plan_backend(cluster, fsdp=fsdp, backend=backend), plan_device(cluster)
    return {
        n.name: NodeRule(kind=n.kind, backend=backend, device=device, engine=getattr(n, "engine", None), facts=node_facts(n))
        for n in graph.nodes
        if KINDS[n.kind].runs_on == "devices"
    }


def check_layout(graph: Graph, cluster: ClusterSpec, layout: Mapping[str, tuple[Sequence[int], ParallelDims]], *, backend: str = "") -> None:
    """Refuse a given layout with an axis of size > 1 that its node's program does not run where the plan runs.

    Raises:
        PlanError: ``mesh_support.refusal``'s message (the node, the axis and its size, what would run
            instead and the fix), naming the backend the cluster implies.
    """
    fsdp = any(getattr(getattr(n, "optimizer", None), "sharding", "") == "fsdp" for n in graph.nodes)
    backend, device = plan_backend(cluster, fsdp=fsdp, backend=backend), plan_device(cluster)
    for name, (devices, dims) in layout.items():
        node = graph.node(name)
        mesh = {a: getattr(dims, a, 1) for a in MESH_AXES if getattr(dims, a, 1) > 1}
        message = refusal(node.kind, name, mesh, backend, devices=list(devices), engine=getattr(node, "engine", None), device=device, facts=node_facts(node))
        if message is not None:
            raise PlanError(f"{message} (a plan on {cluster.name} runs under {backend}: flowrl.planners.runnable)")


def expert_split_runs(dims: ParallelDims) -> bool:
    """Whether the runtime builds ``dims``' expert split: ``ep`` 1 (every rank holds every expert), or ``ep``
    equal to the policy's ``dp`` (each rank 1/dp of the experts). A smaller ``ep`` > 1, groups of ranks
    holding replicas of an expert group, is priced by ``estimate.train`` but not built
    (``runtime.parallel.expert_parallel.check_expert_mesh`` refuses it), so the search skips it.

    Example:
        >>> from flowrl.planners.parallel import ParallelDims
        >>> [expert_split_runs(ParallelDims(dp=8, ep=e)) for e in (1, 4, 8)]
        [True, False, True]
    """
    return dims.ep in (1, dims.dp)


def check_expert_split(name: str, dims: ParallelDims) -> None:
    """Refuse a given layout whose ``ep`` the runtime does not build (``expert_split_runs``), naming the node, its dp and ep, and the fix.

    Raises:
        PlanError: the node, its ``dp`` and ``ep``, and the meshes that run.
    """
    if not expert_split_runs(dims):
        raise PlanError(
            f"node {name!r} has ep={dims.ep} beside dp={dims.dp} ({dims.short()}): the runtime splits the experts over every dp rank "
            f"(ep = dp) or over none; give it d{dims.dp}e{dims.dp} where {dims.dp} divides its experts, or d{dims.dp} (flowrl.planners.runnable)"
        )

