"""Shared pieces of the estimates: the context they read, their result structs, and collective costs.

Collective costs (alpha-beta model, ring algorithms, ``bw`` already scaled by ``link_efficiency``)::

    all_reduce(bytes, n)     = 2 * (n - 1) / n * bytes / bw + 2 * ceil(log2 n) * latency
    all_gather(bytes, n)     =     (n - 1) / n * bytes / bw +     ceil(log2 n) * latency
    send(bytes)              =                   bytes / bw +                  latency

``bw`` and ``latency`` are the intra-host figures when every group along the axis lives on one
host, the inter-host ones otherwise (a group that straddles hosts is as slow as its NIC).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec

from flowrl.planners.cluster import ClusterSpec
from flowrl.planners.parallel import ParallelDims, spans_hosts
from flowrl.planners.tuning import Tuning
from flowrl.planners.workload import Workload

__all__ = [
    "all_to_all_s",
    "Context",
    "MemoryBreakdown",
    "NodeEstimate",
    "Link",
    "axis_link",
    "all_reduce_s",
    "all_gather_s",
    "send_s",
    "precision_bytes",
]

GiB = 1024**3


class Context(msgspec.Struct, frozen=True, kw_only=True):
    """What every estimate reads besides the node itself."""

    cluster: ClusterSpec
    workload: Workload
    tuning: Tuning


class MemoryBreakdown(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Bytes per device of one node.

    ``resident`` bytes (weights, gradients, optimizer states, and what an engine claims for the run:
    ``held``) stay allocated for the whole run, so colocated nodes add them up; ``transient`` bytes
    (activations, KV cache, workspace) live only while the node runs, so colocated nodes, which run
    one at a time, need only the largest.

    ``held``: the rest of what an engine claims when it starts and keeps until the run ends (vLLM
    on CUDA takes ``EngineCaps.cuda_memory_fraction`` of each GPU: its weights, then its KV cache pool
    and activations in ``held``), resident whether or not it generates.
    """

    weights: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0
    kv_cache: int = 0
    workspace: int = 0
    held: int = 0

    @property
    def resident(self) -> int:
        return self.weights + self.grads + self.optimizer + self.held

    @property
    def transient(self) -> int:
        return self.activations + self.kv_cache + self.workspace

    @property
    def total(self) -> int:
        return self.resident + self.transient


class NodeEstimate(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Predicted time per step and memory per device of one node on one mesh.

    Attributes:
        time_s: seconds of one step of this node (one batch generated, one optimizer step, ...).
        memory: bytes per device, by kind.
        breakdown: named parts of ``time_s`` (compute, communication, bubble, overhead, ...).
        notes: choices the estimate made (micro-batch, activation checkpointing, waves).
        feasible: False when it does not fit in device memory; ``problem`` then says by how much.
        problem: why it is infeasible ("" when feasible).
        steady_s: seconds per step in an asynchronous steady state when that differs from
            ``time_s`` (a continuous generator keeps its slots full across steps); None: ``time_s``.
    """

    time_s: float
    memory: MemoryBreakdown
    breakdown: dict[str, float] = msgspec.field(default_factory=dict)
    notes: tuple[str, ...] = ()
    feasible: bool = True
    problem: str = ""
    steady_s: float | None = None


class Link(msgspec.Struct, frozen=True):
    """Bandwidth (bytes/s, efficiency applied) and latency (s) of one communication path."""

    bandwidth: float
    latency: float


def axis_link(cluster: ClusterSpec, tuning: Tuning, devices: Sequence[int], dims: ParallelDims, axis: str) -> Link:
    """The link that collectives along ``axis`` of this mesh use (NIC if any group spans hosts)."""
    dev = cluster.device
    if spans_hosts(devices, dims, axis, cluster.devices_per_host):
        return Link(dev.inter_host_bandwidth * tuning.link_efficiency, dev.inter_host_latency_s)
    return Link(dev.intra_host_bandwidth * tuning.link_efficiency, dev.intra_host_latency_s)


def _log2(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


def all_reduce_s(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce of ``nbytes`` over ``n`` devices (0 for one device)."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / link.bandwidth + 2 * _log2(n) * link.latency


def all_gather_s(nbytes: float, n: int, link: Link) -> float:
    """Ring all-gather (or reduce-scatter) producing/consuming ``nbytes`` per device."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / link.bandwidth + _log2(n) * link.latency


def all_to_all_s(nbytes: float, n: int, link: Link) -> float:
    """All-to-all of ``nbytes`` per device over ``n`` devices: (n-1)/n of them leave, one message to each peer."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / link.bandwidth + (n - 1) * link.latency


def send_s(nbytes: float, link: Link) -> float:
    """Point-to-point transfer."""
    return nbytes / link.bandwidth + link.latency


_PRECISION_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1, "int8": 1, "int8-bf16": 1}


def precision_bytes(precision: str) -> int:
    """Bytes per element of a dtype name."""
    return _PRECISION_BYTES[precision]
