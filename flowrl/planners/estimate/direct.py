"""The direct weight route's sync: the policy's ranks straight into vLLM's workers, no staging copy.

Which weight edges take it is one rule, ``flowrl.placement.weight_routes.direct_edges``, which the
torchrun runtime follows too (``runtime/weights/direct_route.direct_channels``): in a torchrun job,
an edge into a vLLM generator on ranks apart from the policy's, with the default transport, lock-step
batching and no LoRA. The route exists in a torchrun job only, so the planner takes a plan to run as
one (:func:`runs_as_ranks`) on a GPU cluster, or where a policy shards with FSDP2 (only torchrun
runs one); elsewhere (a CPU plan for the local or process backend) every vLLM edge takes the hop
(``sync.add_engine_load``).

One sync, with P parameters, ``pb`` bytes each in the policy's dtype and ``wb`` in the generator's::

    bytes     = P * wb                              # the model in the generator's dtype, broadcast once
    gather    = all_gather(P * pb, dp_t)            # an FSDP2 policy: every rank gathers each bucket,
                                                    # a tensor at a time (gloo between CPU ranks at its
                                                    # rate for an MLP weight's bytes, train.gloo_link;
                                                    # the dp axis's link on GPUs); a replicated policy: 0
    broadcast = P * wb / group                      # the lead's broadcast into the workers
    load      = 2 * P * wb / tp_g / device_memory   # GPUs: each worker's copy of its shard into vLLM's
                                                    # parameters, read + written (on CPU ranks: 0, the
                                                    # group's measured rate holds vLLM's reload)
    time      = gather + broadcast + load           # (+ the cast to wb: quantize.add_quantization)

The group's rate is the target's (``estimate.rates``): on CPU ranks gloo at ``rates.cpu_group_rate``
(the tuning's, else the calibrated, else the project's measured figure, vLLM's reload overlapped in
it); on GPUs NCCL (every member has a GPU of its own) at ``rates.nccl_rate``, the cluster spec's
link between the policy's devices and the generator's (NVLink within a host, the NIC across), and
vLLM's load a term of its own at ``rates.device_load_rate`` (the device's memory bandwidth). The
buckets are gathered and broadcast in turn (``vllm_direct.DirectSender``), so the terms add up.
The weight-sync group holds the lead and every worker of every generator replica (dp_g x tp_g: each
tp worker loads its own slices of what it receives), so one broadcast per bucket reaches them all
and the estimate does not grow with dp_g or tp_g (gloo's broadcast from one root on a CPU may: not
modelled). Both sides are busy for all of it (``SyncEstimate.dst_only_s`` = 0): the policy's ranks
gather and send while the generator waits; the hop's staging copy and its transfer into the
generator's rank are gone.

Example:
    >>> from flowrl.planners.cluster import parse_cluster
    >>> from flowrl.modelspec import model_preset
    >>> from flowrl.planners.tuning import Tuning
    >>> from flowrl.planners.workload import LLM_DEFAULTS
    >>> ctx = Context(cluster=parse_cluster("cpu:3"), workload=LLM_DEFAULTS, tuning=Tuning(vllm_group_bandwidth=0.5e9))
    >>> est = estimate_direct_sync(model_preset("qwen2.5-0.5b"), src="policy", dst="gen", transport="inprocess",
    ...     src_devices=(1, 2), src_dims=ParallelDims(dp=2), dst_devices=(0,), dst_dims=ParallelDims(),
    ...     dst_bytes_per_param=2, src_bytes_per_param=4, ctx=ctx, src_sharded=True)
    >>> est.bytes == est.wire_bytes == int(model_preset("qwen2.5-0.5b").params * 2), est.copied_bytes, est.dst_only_s
    (True, 0, 0.0)
    >>> print(est.note.split(";")[0])
    direct route: the policy's ranks straight into vLLM's workers over the weight-sync group, no staging copy
    >>> gpu = Context(cluster=parse_cluster("16xH100"), workload=LLM_DEFAULTS, tuning=Tuning())
    >>> est = estimate_direct_sync(model_preset("qwen2.5-7b"), src="policy", dst="gen", transport="inprocess",
    ...     src_devices=range(8, 16), src_dims=ParallelDims(dp=8), dst_devices=range(0, 8), dst_dims=ParallelDims(dp=4, tp=2),
    ...     dst_bytes_per_param=2, src_bytes_per_param=2, ctx=gpu)
    >>> print(est.note.split("; ")[1])
    broadcast: NCCL across hosts, 40 GB/s (H100 preset: inter_host_bandwidth 50 GB/s x link_efficiency 0.8) 381 ms
"""

from __future__ import annotations

from collections.abc import Sequence

from flowrl.modelspec import ModelSpec
from flowrl.planners.cluster import DEVICE_TRAITS, ClusterSpec
from flowrl.planners.estimate.common import Context, all_gather_s, axis_link
from flowrl.planners.estimate.rates import cpu_group_rate, device_load_rate, nccl_rate, on_cpu_ranks
from flowrl.planners.estimate.sync import SyncEstimate
from flowrl.planners.estimate.train import gloo_link
from flowrl.planners.parallel import ParallelDims
from flowrl.planners.units import format_seconds

__all__ = ["estimate_direct_sync", "runs_as_ranks"]


def runs_as_ranks(cluster: ClusterSpec, *, fsdp: bool) -> bool:
    """Whether the planner takes a plan on ``cluster`` to run as a torchrun job (where the direct route
    exists): on GPUs, or with a policy that shards with FSDP2 (``fsdp``), which only torchrun runs."""
    return DEVICE_TRAITS[cluster.device.kind].cuda or fsdp


def estimate_direct_sync(
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
    """Seconds of one sync over the direct route (module docstring); the arguments are ``estimate_sync``'s."""
    wire = model.params * dst_bytes_per_param
    note = "direct route: the policy's ranks straight into vLLM's workers over the weight-sync group, no staging copy"
    if on_cpu_ranks(ctx.cluster):
        group = cpu_group_rate(ctx)
        broadcast = group.seconds(wire)
        note += f"; broadcast + vLLM's reload: {group.describe()} {format_seconds(broadcast)}"
    else:
        group, load = nccl_rate(ctx, src_devices, dst_devices), device_load_rate(ctx)
        sent, loaded = group.seconds(wire), load.seconds(2 * wire / max(1, dst_dims.tp))
        broadcast = sent + loaded
        note += f"; broadcast: {group.describe()} {format_seconds(sent)}; {load.describe()} {format_seconds(loaded)}"
    gather = 0.0
    if src_sharded and src_dims.dp > 1:
        cpu = DEVICE_TRAITS[ctx.cluster.device.kind].pinned
        tensor = model.ffn_dim * model.dim * src_bytes_per_param  # gathered a tensor at a time; an MLP weight holds most bytes
        link = gloo_link(ctx, tensor) if cpu else axis_link(ctx.cluster, ctx.tuning, src_devices, src_dims, "dp")
        gather = all_gather_s(model.params * src_bytes_per_param, src_dims.dp, link)
        note += f"; every FSDP2 rank gathers each bucket ({'gloo, ' if cpu else ''}{link.bandwidth / 1e9:.3g} GB/s), the first broadcasts it"
    else:
        note += "; the policy's first rank sends alone"
    return SyncEstimate(
        src=src, dst=dst, transport=transport, bytes=int(wire), replicas=dst_dims.dp, time_s=gather + broadcast, note=note,
        wire_bytes=int(wire), copied_bytes=0,
    )
