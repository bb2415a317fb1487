"""Weight-sync time per transport, including the resharding volume between trainer and generator layouts.

The generator needs the policy's P parameters in its own dtype (``wb`` bytes each) and layout.
Every one of its dp_g replicas needs a full copy, split over that replica's tp_g * pp_g devices::

    bytes        = P * wb
    per receiver = bytes / (tp_g * pp_g)                 # what one generator device must receive
    per sender   = bytes * dp_g / n_trainer_devices      # every byte leaves the trainer once per replica

By the transport's declared cost (``TransportTraits.cost``; the built-ins in brackets):

- ``"collective"`` [``collective``] (and, on GPU clusters, ``"memory"`` transports, which cannot cross devices
  there): direct rank-to-rank transfers (LlamaRL's DDMA): ``max(per receiver, per sender) / bw +
  latency``, over NVLink when trainer and generator share hosts, the NIC otherwise. Colocated with
  the same layout and dtype it is a local copy: ``per receiver / mem_bw``.
- ``"memory"`` on CPU: ``memory_copies`` copies of ``P * wb`` by one core (the runtime runs a node as
  one process with a thread per core, so there is one copy whatever dp says): one for ``inprocess``,
  two for ``shm`` (into the shared segment, out of it).
- ``"file"`` [``file``]: written once, read once per replica, through ``file_bandwidth``:
  ``bytes * (1 + dp_g) / file_bandwidth``.

A user transport declares its cost (the default is ``"collective"``); a name this process has not
registered is costed as ``"collective"``, and the estimate notes it.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from flowrl.errors import TransportError
from flowrl.planners.estimate.common import Context, Link
from flowrl.planners.modelspec import ModelSpec
from flowrl.planners.parallel import ParallelDims
from flowrl.runtime.transports.registry import TransportTraits, transport_traits

__all__ = ["SyncEstimate", "estimate_sync"]


class SyncEstimate(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One weight edge's transfer per step.

    Attributes:
        src, dst: the weight edge's ends (policy, generator).
        transport: the edge's transport name.
        bytes: bytes the generator's replicas receive in total (P * wb * dp_g).
        replicas: dp_g, the generator's data-parallel replicas (each receives a full copy).
        time_s: seconds one sync takes; both ends are busy for it unless ``sync_overlap`` hides part.
        note: how it was costed.
    """

    src: str
    dst: str
    transport: str
    bytes: int
    time_s: float
    replicas: int = 1
    note: str = ""


def _traits(transport: str) -> TransportTraits | None:
    """The transport's declared traits; None for a name this process has not registered."""
    try:
        return transport_traits(transport)
    except TransportError:
        return None


def estimate_sync(
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
) -> SyncEstimate:
    """Seconds to move the policy's weights into the generator's layout and dtype (module docstring)."""
    c, t = ctx.cluster, ctx.tuning
    dev = c.device
    total = model.params * dst_bytes_per_param
    received = int(total * dst_dims.dp)
    mem_bw = dev.memory_bandwidth * t.memory_bandwidth_efficiency
    traits = _traits(transport)
    if traits is not None and traits.cost == "file":
        time = total * (1 + dst_dims.dp) / t.file_bandwidth
        return SyncEstimate(src=src, dst=dst, transport=transport, bytes=received, replicas=dst_dims.dp, time_s=time, note="file system write + one read per replica")
    if dev.kind == "cpu" and traits is not None and traits.cost == "memory":
        copies = traits.memory_copies
        time = copies * total / mem_bw
        # on CPU the runtime runs a node as one process with an intra-op thread per core: one copy
        note = f"{copies} memory cop{'y' if copies == 1 else 'ies'} on one core"
        return SyncEstimate(src=src, dst=dst, transport=transport, bytes=int(total), replicas=1, time_s=time, note=note)
    note = "rank-to-rank reshard"
    if traits is None:
        note += f" (user transport {transport!r}, not registered in this process: costed as collective)"
    elif traits.cost == "memory":
        note += f" ({transport!r} cannot cross devices on a {dev.name} cluster: costed as collective)"
    same_mesh = tuple(src_devices) == tuple(dst_devices)
    if same_mesh and src_dims == dst_dims and src_bytes_per_param == dst_bytes_per_param:
        time = total / (dst_dims.tp * dst_dims.pp) / mem_bw
        return SyncEstimate(src=src, dst=dst, transport=transport, bytes=received, replicas=dst_dims.dp, time_s=time, note="same layout: local copy")
    hosts_src = {d // c.devices_per_host for d in (src_devices[0], src_devices[-1])} if src_devices else set()
    hosts_dst = {d // c.devices_per_host for d in (dst_devices[0], dst_devices[-1])} if dst_devices else set()
    one_host = len(hosts_src | hosts_dst) == 1
    link = (
        Link(dev.intra_host_bandwidth * t.link_efficiency, dev.intra_host_latency_s)
        if one_host
        else Link(dev.inter_host_bandwidth * t.link_efficiency, dev.inter_host_latency_s)
    )
    per_receiver = total / (dst_dims.tp * dst_dims.pp)
    per_sender = total * dst_dims.dp / max(1, len(src_devices))
    if not same_mesh and dst_bytes_per_param != src_bytes_per_param:
        note += f", cast to {dst_bytes_per_param:g} bytes/param before sending"
    time = max(per_receiver, per_sender) / link.bandwidth + link.latency
    return SyncEstimate(src=src, dst=dst, transport=transport, bytes=received, replicas=dst_dims.dp, time_s=time, note=note)
