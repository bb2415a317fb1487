"""The rates a weight sync into vLLM is priced at, each named with where it comes from.

Each target is priced with its own figures (``Rate``: bytes/s, latency, what it is, its source),
which the sync's note prints:

- **CPU ranks** (``DeviceKind.pinned``: a device is a core): the weight-sync group is gloo between
  processes of this host, at ``cpu_group_rate``: ``--set vllm_group_bandwidth``, else the cluster
  file's calibrated ``CpuTerms.vllm_sync_bandwidth`` (``flowrl calibrate --vllm``), else the
  project's measured default ``tuning.VLLM_GROUP_BANDWIDTH`` (``benches/weight_sync.py`` on a
  2-core CPU). It covers the broadcast and vLLM's reload, which overlap bucket by bucket there.
- **GPUs, the direct route** (``vllm_direct``: every member has a GPU of its own, the group is
  NCCL): ``nccl_rate`` over the cluster spec's link between the policy's and the generator's
  devices (``intra_host_bandwidth`` within a host, ``inter_host_bandwidth`` across hosts, each
  times ``Tuning.link_efficiency``, plus the link's latency), then vLLM's load from the received
  device buffers into its parameters at ``device_load_rate``: a copy on the device, read and
  written once (``2 x bytes``) at ``memory_bandwidth x memory_bandwidth_efficiency``.
- **GPUs, the hop** (``vllm_sync``: the generator's process and vLLM's worker share a GPU, which
  NCCL refuses, so the runtime's group is gloo over host memory there too): the broadcast from the
  generator's staging copy (host memory) at ``host_gloo_rate`` (``Tuning.host_gloo_bandwidth``, a
  documented figure, not this machine's: its attribute says where it comes from), then each worker's
  copy of its shard from its host buffers into its GPU parameters at ``host_load_rate``
  (``host_bandwidth``, PCIe, times ``link_efficiency``; a cluster spec without one, 0, leaves
  that term out and the note says so).

``--set vllm_group_bandwidth`` (a figure the user measured) replaces the group's rate on any
cluster. Only ``cpu_group_rate`` reads ``CpuTerms`` or the CPU-measured default, and the estimates
call it only for CPU ranks (``on_cpu_ranks``), so a rate measured on a CPU never prices a GPU
(``tests/planners/test_sync_rates.py`` checks it).

Example:
    >>> from flowrl.planners.cluster import parse_cluster
    >>> from flowrl.planners.tuning import Tuning
    >>> from flowrl.planners.workload import LLM_DEFAULTS
    >>> ctx = Context(cluster=parse_cluster("16xH100"), workload=LLM_DEFAULTS, tuning=Tuning())
    >>> print(nccl_rate(ctx, range(0, 8), range(8, 16)).describe())
    NCCL across hosts, 40 GB/s (H100 preset: inter_host_bandwidth 50 GB/s x link_efficiency 0.8)
    >>> print(device_load_rate(ctx).describe())
    vLLM's load into its parameters on the GPU (a device copy: read + write), 2.68 TB/s (H100 preset: memory_bandwidth 3.35 TB/s x memory_bandwidth_efficiency 0.8)
    >>> cpu = Context(cluster=parse_cluster("cpu:2"), workload=LLM_DEFAULTS, tuning=Tuning())
    >>> cpu_group_rate(cpu).source
    "the project's measured default (Tuning.vllm_group_bandwidth's, benches/weight_sync.py on a 2-core CPU)"
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from flowrl.planners.cluster import DEVICE_TRAITS, ClusterSpec
from flowrl.planners.estimate.common import Context
from flowrl.planners.tuning import HOST_GLOO_BANDWIDTH, VLLM_GROUP_BANDWIDTH

__all__ = ["Rate", "per_second", "cpu_group_rate", "nccl_rate", "link_rate", "host_gloo_rate", "device_load_rate", "host_load_rate", "on_cpu_ranks"]


class Rate(msgspec.Struct, frozen=True, kw_only=True):
    """A rate the planner prices a transfer at.

    Attributes:
        bytes_per_s: the rate.
        what: what moves at it (``"NCCL within a host"``).
        source: where the figure comes from (a preset's field, a calibration file, a tuning value).
        latency_s: a fixed cost per transfer (0: none modelled).
    """

    bytes_per_s: float
    what: str
    source: str
    latency_s: float = 0.0

    def seconds(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` at this rate, latency included."""
        return nbytes / self.bytes_per_s + self.latency_s

    def describe(self) -> str:
        """``what, N GB/s (source)``: how a note names it."""
        return f"{self.what}, {per_second(self.bytes_per_s)} ({self.source})"


def per_second(nbytes: float) -> str:
    """A rate in GB/s, or TB/s from 1000 GB/s up (``per_second(3.35e12)`` is ``'3.35 TB/s'``)."""
    return f"{nbytes / 1e12:.3g} TB/s" if nbytes >= 1e12 else f"{nbytes / 1e9:.3g} GB/s"


def on_cpu_ranks(cluster: ClusterSpec) -> bool:
    """Whether ``cluster``'s devices are CPU cores (the only devices calibrated CPU rates price)."""
    return DEVICE_TRAITS[cluster.device.kind].pinned


def _preset(ctx: Context) -> str:
    """How a note names the device figures' origin: a preset's, or a cluster file's."""
    dev = ctx.cluster.device
    return f"{dev.name} preset" if ctx.cluster.name.endswith(dev.name) else f"cluster {ctx.cluster.name!r}'s {dev.name}"


def _user(ctx: Context, what: str) -> Rate | None:
    """The user's ``--set vllm_group_bandwidth``, which replaces the weight-sync group's rate anywhere."""
    bw = ctx.tuning.vllm_group_bandwidth
    return None if bw is None else Rate(bytes_per_s=bw, what=what, source="--set vllm_group_bandwidth")


def cpu_group_rate(ctx: Context) -> Rate:
    """The weight-sync group between CPU processes (broadcast and vLLM's reload overlapped): the
    user's figure, else the cluster's calibrated one, else the project's measured default."""
    what = "into vLLM over the weight-sync group (gloo; its broadcast and vLLM's reload overlapped)"
    if user := _user(ctx, what):
        return user
    measured = ctx.cluster.device.cpu.vllm_sync_bandwidth
    if measured:
        return Rate(bytes_per_s=measured, what=what, source=f"calibrated: cluster {ctx.cluster.name!r}'s CpuTerms.vllm_sync_bandwidth, flowrl calibrate --vllm")
    return Rate(
        bytes_per_s=VLLM_GROUP_BANDWIDTH, what=what,
        source="the project's measured default (Tuning.vllm_group_bandwidth's, benches/weight_sync.py on a 2-core CPU)",
    )


def nccl_rate(ctx: Context, src_devices: Sequence[int], dst_devices: Sequence[int]) -> Rate:
    """The weight-sync group's NCCL between two meshes of GPUs (the direct route): the user's
    ``--set vllm_group_bandwidth``, else ``link_rate``."""
    return _user(ctx, "NCCL") or link_rate(ctx, src_devices, dst_devices)


def link_rate(ctx: Context, src_devices: Sequence[int], dst_devices: Sequence[int]) -> Rate:
    """The cluster spec's link between two meshes (within one host, or across hosts as soon as the
    two meshes' ends are on different hosts) times ``link_efficiency``: NCCL on GPUs."""
    c, t = ctx.cluster, ctx.tuning
    dev = c.device
    ends = (*src_devices[:1], *src_devices[-1:], *dst_devices[:1], *dst_devices[-1:])
    within = len({d // c.devices_per_host for d in ends}) == 1
    field, bw, latency = (
        ("intra_host_bandwidth", dev.intra_host_bandwidth, dev.intra_host_latency_s) if within
        else ("inter_host_bandwidth", dev.inter_host_bandwidth, dev.inter_host_latency_s)
    )
    return Rate(
        bytes_per_s=bw * t.link_efficiency, latency_s=latency,
        what=f"{'NCCL' if DEVICE_TRAITS[dev.kind].cuda else 'between processes'} {'within a host' if within else 'across hosts'}",
        source=f"{_preset(ctx)}: {field} {per_second(bw)} x link_efficiency {t.link_efficiency:g}",
    )


def host_gloo_rate(ctx: Context) -> Rate:
    """gloo over host memory between processes of a GPU host (the hop's weight-sync group there)."""
    what = "into vLLM's workers over the weight-sync group (gloo over host memory: the generator's process shares the GPU)"
    if user := _user(ctx, what):
        return user
    bw = ctx.tuning.host_gloo_bandwidth
    if bw != HOST_GLOO_BANDWIDTH:
        return Rate(bytes_per_s=bw, what=what, source="--set host_gloo_bandwidth")
    return Rate(bytes_per_s=bw, what=what, source="Tuning.host_gloo_bandwidth: gloo's TCP transport between two one-core processes, pytorch/gloo#248; not measured on this cluster")


def device_load_rate(ctx: Context) -> Rate:
    """vLLM's load of received device buffers into its parameters: a copy on the device, priced
    at the device's memory bandwidth for ``2 x bytes`` (``Rate.seconds`` of twice the bytes)."""
    dev, t = ctx.cluster.device, ctx.tuning
    return Rate(
        bytes_per_s=dev.memory_bandwidth * t.memory_bandwidth_efficiency, what=f"vLLM's load into its parameters on the {DEVICE_TRAITS[dev.kind].label} (a device copy: read + write)",
        source=f"{_preset(ctx)}: memory_bandwidth {per_second(dev.memory_bandwidth)} x memory_bandwidth_efficiency {t.memory_bandwidth_efficiency:g}",
    )


def host_load_rate(ctx: Context) -> Rate | None:
    """vLLM's load of host buffers (the gloo hop's) into its parameters on the GPU: over PCIe; None
    where the cluster spec gives no ``host_bandwidth``."""
    dev, t = ctx.cluster.device, ctx.tuning
    if dev.host_bandwidth <= 0:
        return None
    return Rate(
        bytes_per_s=dev.host_bandwidth * t.link_efficiency, what="vLLM's load from host buffers into its parameters on the GPU (PCIe)",
        source=f"{_preset(ctx)}: host_bandwidth {per_second(dev.host_bandwidth)} x link_efficiency {t.link_efficiency:g}",
    )
