"""Expert parallelism's all-to-all: the rate a policy's token exchange is priced at, named with where it comes from.

A mixture-of-experts policy at ``ep > 1`` (``ParallelDims.ep``) sends each MoE layer's tokens to the
ranks holding their experts and back, one all-to-all each way per pass (``estimate.train``'s
``ep_comm``). Each target is priced with its own figures, and the policy's note says which:

- **CPU ranks** (``DeviceKind.pinned``): gloo between processes of this host, at the rate ``flowrl
  calibrate --gloo`` measured for an ``all_to_all_single`` of that many bytes
  (``CpuTerms.gloo_all_to_all_by_bytes``, interpolated at the size), else its all-gather /
  reduce-scatter rate at that size (``gloo_by_bytes``), else ``tuning.GLOO_BANDWIDTH``, the project's
  uncalibrated default. A rate achieved: no ``link_efficiency``. A message smaller than the smallest
  size measured takes that size's time (``smallest_priced``): below it gloo's time is its latency,
  which a rate scaled down to a few bytes would price at nothing (each MoE layer's forward sends its
  per-expert token counts, a few hundred bytes, before the tokens).
- **GPUs**: NCCL over the cluster spec's link along the dp axis (the ep groups are dp ranks:
  ``intra_host_bandwidth`` within a host, ``inter_host_bandwidth`` as soon as a dp group spans
  hosts), times ``Tuning.link_efficiency``. A rate measured on a CPU never prices a GPU.

Example:
    >>> from flowrl.planners.cluster import parse_cluster
    >>> from flowrl.planners.parallel import ParallelDims
    >>> from flowrl.planners.tuning import Tuning
    >>> from flowrl.planners.workload import LLM_DEFAULTS
    >>> gpu = Context(cluster=parse_cluster("8xH100"), workload=LLM_DEFAULTS, tuning=Tuning())
    >>> print(all_to_all_rate(gpu, range(8), ParallelDims(dp=8, ep=8), 2**20).describe())
    NCCL within a host, 360 GB/s (H100 preset: intra_host_bandwidth 450 GB/s x link_efficiency 0.8)
    >>> cpu = Context(cluster=parse_cluster("cpu:2"), workload=LLM_DEFAULTS, tuning=Tuning())
    >>> all_to_all_rate(cpu, range(2), ParallelDims(dp=2, ep=2), 2**20).source
    "tuning.GLOO_BANDWIDTH, the project's default: not calibrated (flowrl calibrate --gloo measures gloo's all-to-all)"
"""

from __future__ import annotations

from collections.abc import Sequence

from flowrl.planners.cluster import DEVICE_TRAITS
from flowrl.planners.estimate.common import Context, Link
from flowrl.planners.estimate.rates import Rate, link_rate
from flowrl.planners.parallel import ParallelDims, axis_groups, spans_hosts
from flowrl.planners.tuning import GLOO_BANDWIDTH

__all__ = ["all_to_all_rate", "as_link", "smallest_priced"]


def all_to_all_rate(ctx: Context, devices: Sequence[int], dims: ParallelDims, nbytes: float) -> Rate:
    """The rate of one all-to-all of ``nbytes`` per rank among an ep group of ``dims`` on ``devices`` (module docstring)."""
    c = ctx.cluster
    dev = c.device
    if DEVICE_TRAITS[dev.kind].pinned:
        what = "gloo all-to-all between CPU ranks"
        measured = dev.cpu.gloo_all_to_all_rate(nbytes)
        if measured:
            source = f"calibrated: cluster {c.name!r}'s CpuTerms.gloo_all_to_all_by_bytes at {nbytes / 2**10:.0f} KiB, flowrl calibrate --gloo"
            return Rate(bytes_per_s=measured, what=what, source=source, latency_s=dev.intra_host_latency_s)
        gather = dev.cpu.gloo_rate(nbytes)
        if gather:
            source = f"calibrated: cluster {c.name!r}'s gloo all-gather rate (CpuTerms.gloo_by_bytes; no all-to-all measured: flowrl calibrate --gloo)"
            return Rate(bytes_per_s=gather, what=what, source=source, latency_s=dev.intra_host_latency_s)
        source = "tuning.GLOO_BANDWIDTH, the project's default: not calibrated (flowrl calibrate --gloo measures gloo's all-to-all)"
        return Rate(bytes_per_s=GLOO_BANDWIDTH, what=what, source=source, latency_s=dev.intra_host_latency_s)
    if len(devices) == dims.size and spans_hosts(devices, dims, "dp", c.devices_per_host):
        group = axis_groups(devices, dims, "dp")[0]
        return link_rate(ctx, group[:1], group[-1:])
    return link_rate(ctx, devices[:1], devices[:1])


def smallest_priced(ctx: Context) -> int:
    """Bytes below which an all-to-all costs what one of this many bytes does (module docstring): the
    smallest size ``flowrl calibrate --gloo`` timed the all-to-all at on CPU ranks; 0 elsewhere."""
    dev = ctx.cluster.device
    table = dev.cpu.gloo_all_to_all_by_bytes
    return table[0][0] if DEVICE_TRAITS[dev.kind].pinned and table else 0


def as_link(rate: Rate) -> Link:
    """``rate`` as the ``Link`` that ``estimate.common``'s collectives take."""
    return Link(rate.bytes_per_s, rate.latency_s)
