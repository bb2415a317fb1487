"""Weight-sync time per transport, including the resharding volume between trainer and generator layouts.

The generator needs the policy's P parameters in its own dtype (``wb`` bytes each) and layout.
Every one of its dp_g replicas needs a full copy, split over that replica's tp_g * pp_g devices::

    bytes        = P * wb
    per receiver = bytes / (tp_g * pp_g)                 # what one generator device must receive
    per sender   = bytes * dp_g / n_trainer_devices      # every byte leaves the trainer once per replica

By the transport's declared cost (``TransportTraits.cost``; the built-ins in brackets):

- ``"collective"`` [``collective``] (and, on GPU clusters, ``"memory"`` transports, which cannot cross devices
  there): direct rank-to-rank transfers (LlamaRL's DDMA): ``max(max(per receiver, per sender) / bw,
  staged / mem_bw) + latency`` (packing is pipelined with the wire), over NVLink when trainer and generator share hosts, the NIC
  otherwise. The volumes are the runtime's own (``flowrl.placement.resharding.transfer_volume`` over
  the layouts the torchrun backend gives the collective transport, :func:`sync_params`): every
  trainer device a full replica, or with ``sharding="fsdp"`` its dim-0 FSDP shards (``resharding.fsdp``), the generator's blocks split as ``tensor_parallel`` splits them
  (embeddings, head and norms replicated on every tp rank); ``per receiver`` / ``per sender`` are the
  busiest rank's bytes, ``staged`` the busiest rank's staging copies (strided slices and blocks
  under 64 KiB). Colocated with the same layout and dtype it is a local copy: ``per receiver / mem_bw``.
- ``"memory"`` on CPU: ``memory_copies`` copies of ``P * wb`` by one core (the runtime runs a node as
  one process with a thread per core, so there is one copy whatever dp says): one for ``inprocess``,
  two for ``shm`` (into the shared segment, out of it).
- ``"file"`` [``file``]: written once, read once per replica, through ``file_bandwidth``:
  ``bytes * (1 + dp_g) / file_bandwidth``.

A LoRA policy (``ModelSpec.adapter_params`` = A) sends its adapters only, in float32 whatever the
generator's dtype, whole to every replica (each merges them into its own layers): ``A * 4 * dp_g``
bytes over the link (a memory copy of ``A * 4`` on CPU, a file written once and read per replica).

A vLLM generator adds a last hop (``add_engine_load``): its process holds the weights the
transport delivered (a staging copy in host memory) and sends them on into vLLM's workers, each
replica its own ``P * wb`` bytes at once, at the target's own rates (``estimate.rates``):

- CPU ranks: over the weight-sync group at ``rates.cpu_group_rate`` (the broadcast and vLLM's
  reload, overlapped bucket by bucket: ``Tuning.vllm_group_bandwidth`` when set, else the cluster's
  calibrated ``CpuTerms.vllm_sync_bandwidth``, ``flowrl calibrate --vllm``, else the project's
  measured 0.4 GB/s): ``P * wb / group``;
- GPUs: the group is gloo over host memory there too (vLLM's worker shares the generator's GPU),
  at ``rates.host_gloo_rate``, then each worker's load of its shard from host buffers into its
  parameters on the GPU, a term of its own, at ``rates.host_load_rate`` (PCIe):
  ``P * wb / gloo + P * wb / tp_g / pcie``;
- a ``file`` edge: written once more and read by the worker at ``file_bandwidth``.

The note names each rate and where it comes from. The hop is the
generator side's alone (``SyncEstimate.dst_only_s``): the trainer has published and goes on. An
edge on the direct route (``flowrl.placement.weight_routes``, in a plan that runs as a torchrun job)
has no hop: ``estimate/direct.py`` prices it instead of this module.

A user transport declares its cost (the default is ``"collective"``); a name this process has not
registered is costed as ``"collective"``, and the estimate notes it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

import msgspec

from flowrl.graph.engines import ENGINE_CAPS
from flowrl.planners.cluster import DEVICE_TRAITS
from flowrl.planners.estimate.common import Context, Link
from flowrl.modelspec import ModelSpec
from flowrl.planners.parallel import ParallelDims
from flowrl.planners.estimate.rates import cpu_group_rate, host_gloo_rate, host_load_rate, link_rate, on_cpu_ranks
from flowrl.planners.units import format_seconds
from flowrl.placement.layout import share_devices
from flowrl.placement.resharding import DIRECT_MIN_BYTES, ShardLayout, TransferVolume, dp_tp, fsdp, replicated, tp_column, tp_row, transfer_volume
from flowrl.transport_traits import traits_of

__all__ = ["SyncEstimate", "estimate_sync", "add_engine_load", "sync_params", "vllm_sync_bandwidth"]


class SyncEstimate(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One weight edge's transfer per step.

    Attributes:
        src, dst: the weight edge's ends (policy, generator).
        transport: the edge's transport name.
        bytes: bytes the generator's replicas receive in total (P * wb * dp_g with tp_g = 1; more with
            tp_g > 1, whose ranks each hold the replicated embeddings and norms).
        replicas: dp_g, the generator's data-parallel replicas (each receives a full copy).
        wire_bytes: of ``bytes``, those on the wire (the rest are local copies of colocated ranks);
            what the collective transport's ranks send, summed (0 where not costed as collective).
        copied_bytes: bytes through a staging copy, once per copy (the transport's ``bytes_staged``, summed).
        time_s: seconds one sync takes; both ends are busy for it unless ``sync_overlap`` hides part.
        note: how it was costed.
        dst_only_s: of ``time_s``, the seconds the generator's side spends alone once the transport
            delivered (the hop into a vLLM generator's workers, ``add_engine_load``): the trainer is
            free during them, so an asynchronous step charges them to the generator only.
    """

    src: str
    dst: str
    transport: str
    bytes: int
    time_s: float
    replicas: int = 1
    note: str = ""
    wire_bytes: int = 0
    copied_bytes: int = 0
    dst_only_s: float = 0.0


def sync_params(
    model: ModelSpec,
    src_devices: Sequence[int],
    dst_devices: Sequence[int],
    dst_dims: ParallelDims,
    *,
    layers: int,
    rest: bool = True,
    wb: int = 1,
    trainer_sharded: bool = False,
) -> tuple[dict[str, tuple[tuple[int, ...], str]], dict[str, ShardLayout], dict[str, ShardLayout]]:
    """Parameters and layouts the collective transport moves for ``model``: ``layers`` blocks, and with
    ``rest`` the embeddings, head and final norm (the planner prices one block and scales).

    The layouts are the torchrun backend's (``runtime.weights.torchrun_edges``): the trainer's devices each
    publish a full replica, or with ``trainer_sharded`` (an FSDP policy) their dim-0 shards
    (``resharding.fsdp``: ``torch.chunk`` rows, FSDP2's); the generator's first pipeline stage, ``dp x tp`` devices, splits the
    blocks as ``runtime.tensor_parallel`` does (q, k, v, w1, w3 by rows, wo, w2 by columns, norms replicated).

    Args:
        model: the generator's model shape.
        src_devices: the trainer's devices (ranks).
        dst_devices: the generator's devices (ranks), pipeline stage 0 first.
        dst_dims: the generator's parallel dims.
        layers: how many blocks to list.
        rest: list the embeddings, the output head (unless tied) and the final norm too.
        wb: bytes per element (an integer dtype size; the planner uses 1 and scales by its own).
        trainer_sharded: the policy runs ``sharding="fsdp"``.

    Returns:
        ``(params, trainer layouts, generator layouts)`` for ``resharding.transfer_volume`` or the transport.
    """
    dtype = {1: "uint8", 2: "bfloat16", 4: "float32", 8: "float64"}[wb]
    h, q, kv = model.dim, model.q_dim, model.n_kv_heads * model.head_dim
    f = model.mlp_params // (3 * h * model.n_layers)  # a mixture of experts: a block's experts as one MLP as wide (the bytes, not the tensors)
    if model.attention_params:  # attention that is not grouped-query (MLA): q, k, v, o as wide as its parameters
        q = kv = model.attention_params // (4 * h)
    ranks = tuple(dst_devices[: dst_dims.dp * dst_dims.tp])
    same = replicated(ranks, axis="dp" if dst_dims.tp == 1 else "tp")
    if dst_dims.tp == 1:
        column = row = same
    elif dst_dims.dp == 1:
        column, row = tp_column(ranks), tp_row(ranks)
    else:
        column, row = dp_tp(ranks, dp=dst_dims.dp, tp=dst_dims.tp, tp_dim=0), dp_tp(ranks, dp=dst_dims.dp, tp=dst_dims.tp, tp_dim=1)
    block = {"wq": ((q, h), column), "wk": ((kv, h), column), "wv": ((kv, h), column), "wo": ((h, q), row),
             "w1": ((f, h), column), "w3": ((f, h), column), "w2": ((h, f), row), "norm1": ((h,), same), "norm2": ((h,), same)}
    shapes: dict[str, tuple[tuple[int, ...], ShardLayout]] = {f"layers.{i}.{n}": v for i in range(layers) for n, v in block.items()}
    if rest:
        shapes |= {"embed": ((model.vocab_size, h), same), "norm": ((h,), same)}
        if not model.tie_embeddings:
            shapes["head"] = ((model.vocab_size, h), same)
    src = fsdp(tuple(src_devices)) if trainer_sharded and len(src_devices) > 1 else replicated(tuple(src_devices))
    params = {n: (shape, dtype) for n, (shape, _) in shapes.items()}
    return params, {n: src for n in shapes}, {n: lay for n, (_, lay) in shapes.items()}


@lru_cache(maxsize=256)
def _volume(
    model: ModelSpec, src_devices: tuple[int, ...], dst_devices: tuple[int, ...], dst_dims: ParallelDims, wb: float, sharded: bool = False
) -> TransferVolume:
    """``transfer_volume`` of the whole model in bytes of ``wb`` each: one block times the layers, plus the rest."""
    direct_min = math.ceil(DIRECT_MIN_BYTES / wb)  # elements of 1 "byte" below: the threshold in elements
    one = transfer_volume(*sync_params(model, src_devices, dst_devices, dst_dims, layers=1, rest=False, trainer_sharded=sharded), direct_min_bytes=direct_min)
    rest = transfer_volume(*sync_params(model, src_devices, dst_devices, dst_dims, layers=0, trainer_sharded=sharded), direct_min_bytes=direct_min)
    stages = max(1, dst_dims.pp)  # a rank of one pipeline stage holds 1/pp of the blocks
    scale = model.n_layers

    def total(a: int, b: int) -> int:
        return round((a * scale + b) * wb)

    def busiest(a: int, b: int) -> int:
        return round((a * scale / stages + b) * wb)

    return TransferVolume(
        wire_bytes=total(one.wire_bytes, rest.wire_bytes),
        local_bytes=total(one.local_bytes, rest.local_bytes),
        copied_bytes=total(one.copied_bytes, rest.copied_bytes),
        max_send_bytes=busiest(one.max_send_bytes, rest.max_send_bytes),
        max_recv_bytes=busiest(one.max_recv_bytes, rest.max_recv_bytes),
        max_copied_bytes=busiest(one.max_copied_bytes, rest.max_copied_bytes),
        max_pack_bytes=busiest(one.max_pack_bytes, rest.max_pack_bytes),
        max_unpack_bytes=busiest(one.max_unpack_bytes, rest.max_unpack_bytes),
    )


@lru_cache(maxsize=256)
def _disjoint_volume(model: ModelSpec, senders: int, dst_dims: ParallelDims, wb: float, sharded: bool = False) -> TransferVolume:
    """:func:`_volume` when no device is on both sides: priced on one generator replica fed by one trainer
    device, then scaled. Exact for the wire bytes, the copies and the busiest receiver (replicas receive
    alike, and with no local blocks the sender does not change what is staged); the busiest sender's
    share is the balanced one, ``wire / senders`` (the transport's least-loaded choice comes within a block of it).

    From FSDP shards (``sharded``) the senders matter (each holds dim-0 rows, so a generator block
    may come in pieces from several): one replica is priced fed by all ``senders`` shards, then scaled
    by the replicas, each of which receives alike.
    """
    dp = dst_dims.dp
    if sharded and senders > 1:
        tp = dst_dims.tp
        one = _volume(model, tuple(range(senders)), tuple(range(senders, senders + tp)), ParallelDims(tp=tp, pp=dst_dims.pp), wb, True)
        return TransferVolume(
            wire_bytes=one.wire_bytes * dp, local_bytes=0, copied_bytes=one.copied_bytes * dp,
            max_send_bytes=one.max_send_bytes * dp, max_recv_bytes=one.max_recv_bytes,
            max_copied_bytes=max(one.max_pack_bytes * dp, one.max_unpack_bytes),
            max_pack_bytes=one.max_pack_bytes * dp, max_unpack_bytes=one.max_unpack_bytes,
        )
    one = _volume(model, (0,), tuple(range(1, 1 + dst_dims.tp)), ParallelDims(tp=dst_dims.tp, pp=dst_dims.pp), wb)
    return TransferVolume(
        wire_bytes=one.wire_bytes * dp, local_bytes=0, copied_bytes=one.copied_bytes * dp,
        max_send_bytes=math.ceil(one.wire_bytes * dp / max(1, senders)), max_recv_bytes=one.max_recv_bytes,
        max_copied_bytes=max(math.ceil(one.max_pack_bytes * dp / max(1, senders)), one.max_unpack_bytes),
        max_pack_bytes=math.ceil(one.max_pack_bytes * dp / max(1, senders)), max_unpack_bytes=one.max_unpack_bytes,
    )


def _same_devices(a: Sequence[int], b: Sequence[int]) -> bool:
    """``tuple(a) == tuple(b)``, in O(1) for the ranges the search passes (meshes of 10^5 devices)."""
    if isinstance(a, range) and isinstance(b, range):
        return a == b
    return tuple(a) == tuple(b)


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
    src_sharded: bool = False,
) -> SyncEstimate:
    """Seconds to move the policy's weights into the generator's layout and dtype (module docstring);
    ``src_sharded``: the policy runs ``sharding="fsdp"`` and sends from its shards."""
    c, t = ctx.cluster, ctx.tuning
    dev = c.device
    if model.adapter_params:  # a LoRA policy sends its adapters, in float32, whatever the generator's dtype
        return _adapter_sync(model, src=src, dst=dst, transport=transport, src_devices=src_devices, dst_devices=dst_devices, dst_dims=dst_dims, ctx=ctx)
    total = model.params * dst_bytes_per_param
    received = int(total * dst_dims.dp)
    mem_bw = dev.memory_bandwidth * t.memory_bandwidth_efficiency
    traits = traits_of(transport)  # None: a name this process has not registered
    if traits is not None and traits.cost == "file":
        time = total * (1 + dst_dims.dp) / t.file_bandwidth
        return SyncEstimate(src=src, dst=dst, transport=transport, bytes=received, replicas=dst_dims.dp, time_s=time, note="file system write + one read per replica")
    if DEVICE_TRAITS[dev.kind].pinned and traits is not None and traits.cost == "memory":
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
    same_mesh = _same_devices(src_devices, dst_devices)
    if same_mesh and src_dims == dst_dims and src_bytes_per_param == dst_bytes_per_param and not src_sharded:
        time = total / (dst_dims.tp * dst_dims.pp) / mem_bw
        return SyncEstimate(src=src, dst=dst, transport=transport, bytes=received, replicas=dst_dims.dp, time_s=time, note="same layout: local copy")
    rate = link_rate(ctx, src_devices, dst_devices)
    link = Link(rate.bytes_per_s, rate.latency_s)
    volume = _disjoint_volume(model, len(src_devices), dst_dims, dst_bytes_per_param, src_sharded) if not share_devices(src_devices, dst_devices) else (
        _volume(model, tuple(src_devices), tuple(dst_devices), dst_dims, dst_bytes_per_param, src_sharded)
    )
    note += f" over {rate.describe()}"
    if src_sharded:
        note += " from FSDP shards"
    if not same_mesh and dst_bytes_per_param != src_bytes_per_param:
        note += f", cast to {dst_bytes_per_param:g} bytes/param before sending"
    # the transport packs piece i + 1 while piece i is on the wire: the copies overlap the transfer
    time = max(max(volume.max_recv_bytes, volume.max_send_bytes) / link.bandwidth, volume.max_copied_bytes / mem_bw) + link.latency
    return SyncEstimate(
        src=src, dst=dst, transport=transport, bytes=volume.wire_bytes + volume.local_bytes, replicas=dst_dims.dp,
        time_s=time, note=note, wire_bytes=volume.wire_bytes, copied_bytes=volume.copied_bytes,
    )


def vllm_sync_bandwidth(ctx: Context) -> float:
    """Bytes/s of the hop into vLLM's workers over the weight-sync group between CPU processes
    (``rates.cpu_group_rate``): the tuning's figure, else the cluster's calibrated one, else
    ``VLLM_GROUP_BANDWIDTH``. CPU ranks only: a GPU's hop is priced by ``add_engine_load``'s GPU terms."""
    return cpu_group_rate(ctx).bytes_per_s


def add_engine_load(
    est: SyncEstimate, model: ModelSpec, *, engine: str, transport: str, dst_bytes_per_param: float, ctx: Context,
    dst_dims: ParallelDims | None = None, **_: object,
) -> SyncEstimate:
    """``est`` plus the hop into a vLLM generator's workers (module docstring); ``est`` unchanged for
    the built-in engine, whose model the transport writes into directly. ``dst_dims``: the
    generator's dims (its ``tp`` workers each load a shard on a GPU; None: one worker).
    """
    if not ENGINE_CAPS[engine].weight_hop or model.adapter_params:  # a LoRA policy's adapters go as a peft directory: small, not priced
        return est
    t = ctx.tuning
    nbytes = model.params * dst_bytes_per_param
    traits = traits_of(transport)
    if traits is not None and traits.cost == "file":
        extra, hop = 2 * nbytes / t.file_bandwidth, f"then a file vLLM's worker reads ({t.file_bandwidth / 1e9:g} GB/s, write + read)"
    elif on_cpu_ranks(ctx.cluster):
        group = cpu_group_rate(ctx)
        extra, hop = group.seconds(nbytes), f"then {group.describe()}"
    else:
        group, load = host_gloo_rate(ctx), host_load_rate(ctx)
        shard = nbytes / max(1, dst_dims.tp if dst_dims else 1)
        wire = group.seconds(nbytes)
        extra, hop = wire, f"then {group.describe()} {format_seconds(wire)}"
        if load is None:
            hop += f"; vLLM's load into its parameters not priced (cluster {ctx.cluster.name!r} gives no host_bandwidth)"
        else:
            extra += load.seconds(shard)
            hop += f"; {load.describe()} {format_seconds(load.seconds(shard))}"
    return msgspec.structs.replace(est, time_s=est.time_s + extra, dst_only_s=est.dst_only_s + extra, note=f"{est.note}; {hop}")


def _adapter_sync(
    model: ModelSpec, *, src: str, dst: str, transport: str, src_devices: Sequence[int], dst_devices: Sequence[int], dst_dims: ParallelDims, ctx: Context
) -> SyncEstimate:
    """A LoRA policy's sync: ``adapter_params`` float32 values to each generator replica (no resharding:
    every replica merges the whole adapters into its own layers), over the link between the two meshes,
    or one memory copy on a CPU transport within a process; a file edge writes once, reads per replica."""
    c, t = ctx.cluster, ctx.tuning
    dev = c.device
    total = model.adapter_params * 4.0
    replicas = dst_dims.dp
    traits = traits_of(transport)
    if traits is not None and traits.cost == "file":
        return SyncEstimate(src=src, dst=dst, transport=transport, bytes=int(total * replicas), replicas=replicas,
                            time_s=total * (1 + replicas) / t.file_bandwidth, note="LoRA adapters only; file system write + one read per replica")
    if DEVICE_TRAITS[dev.kind].pinned and traits is not None and traits.cost == "memory":
        time = traits.memory_copies * total / (dev.memory_bandwidth * t.memory_bandwidth_efficiency)
        return SyncEstimate(src=src, dst=dst, transport=transport, bytes=int(total), replicas=1, time_s=time, note="LoRA adapters only; memory copy")
    rate = link_rate(ctx, src_devices, dst_devices)
    return SyncEstimate(src=src, dst=dst, transport=transport, bytes=int(total * replicas), replicas=replicas,
                        time_s=rate.seconds(total * replicas), note=f"LoRA adapters only, to every replica, over {rate.describe()}",
                        wire_bytes=int(total * replicas))
