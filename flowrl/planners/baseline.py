"""The synchronous baseline as a named, configurable system, planned beside flowrl's best placement.

LlamaRL measures its speedups against a DeepSpeed-Chat-like synchronous system. ``BaselineSystem``
names what such a system does, each choice a field, so a comparison says what it compares with:

- ``shared_layout``: generation and training share one mesh layout (one set of parallel dims on
  the same devices), as a hybrid engine does; False gives each phase its own dims on those devices;
- ``weight_sync``: ``"gather"``, the policy's shards are gathered into one full copy on one device
  and broadcast to every generator device (DeepSpeed-Chat's hybrid engine, OpenRLHF's rank-0
  broadcast)::

      gather = 2 * P * wb / bw + 2 * ceil(log2 n) * latency     # bw: NIC if the mesh spans hosts

  or ``"reshard"``, the transport's own rank-to-rank cost (``estimate_sync``);
- ``recompute_logprobs``: a forward pass for old-policy log-probs (PPO/GRPO; AIPO reads mu's);
- ``gen_precision``: None samples in the trainer's dtype (no quantization);
- ``batching``: ``"lockstep"`` generation (``flowrl.planners.lengths``).

Both time it on the best subset of the devices (``best_subset``: the fastest over the search's
device counts, ``strategies.candidate_counts``, which do not depend on the cluster size, so more
devices never make it slower; the plan's ``baseline_step_s``) and on every device of the cluster
(``all_devices``, the comparison LlamaRL makes, which more devices can make slower: Llama-3 405B
on 1008 H100s runs d18t8p7, on 1024 only d16t8p8 or another mesh of all 1024). A count is
searched with tensor-parallel groups within a host first, across hosts only when nothing fits on
it otherwise, count by count, so that rule too is the same on every cluster. Everything runs
synchronously (k = 0).

Example:
    >>> from flowrl.examples import build_example
    >>> from flowrl.planners.cluster import parse_cluster
    >>> from flowrl.modelspec import model_preset
    >>> from flowrl.planners.tuning import Tuning
    >>> from flowrl.planners.workload import LLM_DEFAULTS
    >>> ctx = Context(cluster=parse_cluster("64xH100"), workload=LLM_DEFAULTS, tuning=Tuning())
    >>> result = plan_baseline(build_example("llamarl"), ctx, model=model_preset("llama3-8b"))
    >>> result.all_devices.family, result.best_subset.steps.sync_step_s <= result.all_devices.steps.sync_step_s
    ('colocated', True)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from flowrl.errors import PlanError
from flowrl.graph.ir import Graph
from flowrl.planners.estimate.common import Context, Link
from flowrl.planners.estimate.sync import SyncEstimate, estimate_sync
from flowrl.planners.lengths import Batching, check_batching
from flowrl.modelspec import ModelSpec
from flowrl.planners.parallel import ParallelDims
from flowrl.planners.search import COLOCATED_FULL, Candidate, colocated_candidates, evaluator, resolve_roles
from flowrl.planners.strategies import DeviceSplit, candidate_counts

__all__ = ["BaselineSystem", "BaselineResult", "SYNC_BASELINE", "baseline_context", "gather_sync", "plan_baseline"]


class BaselineSystem(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A synchronous RL system to compare against (module docstring for each choice).

    Attributes:
        name: how comparisons call it.
        shared_layout: one set of parallel dims for generation and training.
        weight_sync: ``"gather"`` (one full copy gathered, then broadcast) or ``"reshard"``.
        recompute_logprobs: an extra forward pass per step for old-policy log-probs.
        gen_precision: the generator's weight dtype; None: the trainer's (no quantization).
        batching: the generator's batching mode.
    """

    name: str = "synchronous colocated (DeepSpeed-Chat-like)"
    shared_layout: bool = True
    weight_sync: Literal["gather", "reshard"] = "gather"
    recompute_logprobs: bool = True
    gen_precision: Literal["float32", "bfloat16", "float16", "float8"] | None = None
    batching: Batching = "lockstep"

    def __post_init__(self) -> None:
        check_batching(self.batching, f"baseline system {self.name!r}")
        if self.weight_sync not in ("gather", "reshard"):
            raise PlanError(f"baseline system {self.name!r}: weight_sync {self.weight_sync!r} is not one of gather, reshard")


#: The baseline LlamaRL compares against: shared layout, gather-based sync, recompute, no quantization, lock-step.
SYNC_BASELINE = BaselineSystem()


@dataclass(frozen=True)
class BaselineResult:
    """The baseline's best synchronous placement on every device and on the best subset (None: nothing fits)."""

    system: BaselineSystem
    all_devices: Candidate | None
    best_subset: Candidate | None
    problem: str = ""


def gather_sync(
    model: ModelSpec,
    *,
    src: str,
    dst: str,
    transport: str,
    src_devices: Sequence[int],
    src_dims: ParallelDims,
    dst_devices: Sequence[int],
    dst_dims: ParallelDims,
    dst_bytes_per_param: float,
    src_bytes_per_param: float,
    ctx: Context,
    src_sharded: bool = False,
) -> SyncEstimate:
    """A gather-based weight sync (module docstring): every byte of the model passes through one device twice
    (from FSDP shards, ``src_sharded``, as from replicas: the gather is the same bytes).

    Example:
        >>> from flowrl.planners.cluster import parse_cluster
        >>> from flowrl.modelspec import model_preset
        >>> from flowrl.planners.tuning import Tuning
        >>> from flowrl.planners.workload import LLM_DEFAULTS
        >>> ctx = Context(cluster=parse_cluster("16xH100"), workload=LLM_DEFAULTS, tuning=Tuning(link_efficiency=1.0))
        >>> d = ParallelDims(dp=2, tp=8)
        >>> est = gather_sync(model_preset("llama3-8b"), src="p", dst="g", transport="t", src_devices=range(16), src_dims=d,
        ...                   dst_devices=range(16), dst_dims=d, dst_bytes_per_param=2, src_bytes_per_param=2, ctx=ctx)
        >>> round(est.time_s, 3)   # 2 * 16.06 GB / 50 GB/s (two hosts: the NIC)
        0.642
    """
    c, t = ctx.cluster, ctx.tuning
    dev = c.device
    total = model.params * dst_bytes_per_param
    ends = [d for ds in (src_devices, dst_devices) if len(ds) for d in (ds[0], ds[-1])]
    n = max(len(src_devices), len(dst_devices))
    if n <= 1 and tuple(src_devices) == tuple(dst_devices):
        time = total / (dev.memory_bandwidth * t.memory_bandwidth_efficiency)
        return SyncEstimate(src=src, dst=dst, transport=transport, bytes=int(total), replicas=1, time_s=time, note="gather on one device: a local copy")
    one_host = len({d // c.devices_per_host for d in ends}) == 1
    link = (
        Link(dev.intra_host_bandwidth * t.link_efficiency, dev.intra_host_latency_s)
        if one_host
        else Link(dev.inter_host_bandwidth * t.link_efficiency, dev.inter_host_latency_s)
    )
    time = 2 * total / link.bandwidth + 2 * math.ceil(math.log2(n)) * link.latency
    return SyncEstimate(
        src=src, dst=dst, transport=transport, bytes=int(total * dst_dims.dp), replicas=dst_dims.dp, time_s=time,
        note=f"gather to one device, broadcast to {len(dst_devices)} ({'NVLink' if one_host else 'NIC'})",
    )


def baseline_context(ctx: Context, system: BaselineSystem) -> Context:
    """``ctx`` with the system's choices: its log-prob recompute, generator dtype and batching."""
    dtype = system.gen_precision or ctx.cluster.device.compute_dtype
    tuning = msgspec.structs.replace(ctx.tuning, recompute_logprobs=system.recompute_logprobs, gen_precision=dtype)
    workload = msgspec.structs.replace(ctx.workload, batching=system.batching)
    return Context(cluster=ctx.cluster, workload=workload, tuning=tuning)


def _best_on(ev: Any, count: int, shared: bool) -> Candidate | None:
    """The fastest synchronous placement of the system on devices ``0 .. count-1``."""
    r = ev.roles
    split = DeviceSplit(family="colocated", gen_start=0, gen_count=count, train_start=0, train_count=count)
    if shared:
        devices = range(count)
        ranked = ev.side_dims(r.heavy, devices)[:COLOCATED_FULL]
        found = [ev.evaluate({n: (devices, dims) for n in r.heavy}, "colocated", split) for _, dims in ranked]
    else:
        found = colocated_candidates(ev, split)
    feasible = [c for c in found if c.feasible]
    return min(feasible, key=lambda c: c.steps.sync_step_s) if feasible else None


def plan_baseline(graph: Graph, ctx: Context, *, model: ModelSpec | None = None, system: BaselineSystem = SYNC_BASELINE) -> BaselineResult:
    """The system's synchronous step on every device of ``ctx.cluster`` and on its best subset.

    Args:
        graph: the pipeline (its generators, policies and references are placed together).
        ctx: cluster, workload and tuning of the comparison (the system overrides its own choices).
        model: a model shape for every model-holding node (dry-runs of published models).
        system: what the baseline does.
    """
    bctx = baseline_context(ctx, system)
    roles = resolve_roles(graph, bctx, model, runnable=False)  # another system's layouts, not flowrl's runtime
    if not roles.heavy:
        return BaselineResult(system=system, all_devices=None, best_subset=None, problem="the graph has no device nodes")
    ev = evaluator(graph, roles, bctx, 0)
    if system.weight_sync == "gather":
        ev.sync_cost = gather_sync
    else:
        ev.sync_cost = estimate_sync
    n = ctx.cluster.n_devices
    counts = candidate_counts(n, ctx.tuning.split_multipliers)
    best: dict[int, Candidate | None] = {}
    problem = ""
    for mode in ("never", "when needed", "always"):  # tensor-parallel groups across hosts only when nothing else fits
        ev.allow_tp_across_hosts(mode)
        best[n] = _best_on(ev, n, system.shared_layout)
        if best[n] is not None:
            break
    if best[n] is None:
        never = {name: e for name, e in ev.problems.items() if name not in ev.fitted}
        closest = min((never or ev.problems).values(), key=lambda e: e.memory.total, default=None)
        problem = f"closest miss: {closest.problem}" if closest else "no parallel dims fit these devices"
    for mode in ("never", "when needed", "always"):  # count by count: a count that fits within hosts never tries across
        ev.allow_tp_across_hosts(mode)
        for count in counts:
            if best.get(count) is None:
                best[count] = _best_on(ev, count, system.shared_layout)
    subset = [b for b in (best[c] for c in counts) if b is not None]
    best_subset = min(subset, key=lambda c: (c.steps.sync_step_s, c.split.gen_count if c.split else 0)) if subset else None
    if best_subset is None and not problem:  # it fits on every device, on none of the counts searched
        problem = f"it fits on none of the device counts searched ({counts[0]}-{counts[-1]}, strategies.candidate_counts), only on all {n}"
    return BaselineResult(system=system, all_devices=best[n], best_subset=best_subset, problem=problem)
