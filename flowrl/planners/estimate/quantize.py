"""The trainer's cast of its weights to the generator's dtype before a weight sync (quantization cost).

When the generator samples in a narrower dtype than the trainer holds (LlamaRL: bf16 trainer, fp8
generator), every trainer device converts its own shard before sending it: one read to find each
tensor's scale (amax), one read and one write to convert, and a few operator launches per tensor::

    params_dev = P / (tp_t * pp_t)
    quantize   = params_dev * (2 * src_bytes + dst_bytes) / (mem_bw * memory_bandwidth_efficiency)
                 + param_tensors * QUANTIZE_OPS * kernel_overhead            # param_tensors = 9 L + 3

It adds to the sync (the generator cannot use the weights before they are cast). A sync between
equal dtypes costs nothing here.

Example:
    >>> from flowrl.planners.cluster import parse_cluster
    >>> from flowrl.modelspec import model_preset
    >>> from flowrl.planners.tuning import Tuning
    >>> from flowrl.planners.workload import LLM_DEFAULTS
    >>> ctx = Context(cluster=parse_cluster("8xH100"), workload=LLM_DEFAULTS, tuning=Tuning())
    >>> round(quantize_cost(model_preset("llama3-70b"), ParallelDims(tp=8), src_bytes=2, dst_bytes=1, ctx=ctx) * 1e3, 1)
    20.8
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from flowrl.planners.estimate.common import Context
from flowrl.planners.estimate.sync import SyncEstimate
from flowrl.modelspec import ModelSpec
from flowrl.planners.parallel import ParallelDims

__all__ = ["QUANTIZE_OPS", "quantize_cost", "add_quantization"]

#: Operator launches per tensor to quantize it: amax, scale, cast (a row-wise fp8 cast as in
#: torchao's ``float8`` conversion: one reduction and one fused scale-and-cast, plus the scale's write).
QUANTIZE_OPS = 3


def quantize_cost(model: ModelSpec, src_dims: ParallelDims, *, src_bytes: float, dst_bytes: float, ctx: Context) -> float:
    """Seconds for each trainer device to cast its shard from ``src_bytes`` to ``dst_bytes`` per parameter (0 if equal)."""
    if src_bytes == dst_bytes:
        return 0.0
    dev, t = ctx.cluster.device, ctx.tuning
    params_dev = model.params / (src_dims.tp * src_dims.pp)
    tensors = 9 * model.n_layers + 3
    return params_dev * (2 * src_bytes + dst_bytes) / (dev.memory_bandwidth * t.memory_bandwidth_efficiency) + tensors * QUANTIZE_OPS * dev.kernel_overhead_s


def add_quantization(
    est: SyncEstimate,
    model: ModelSpec,
    *,
    src_dims: ParallelDims,
    dst_bytes_per_param: float,
    src_bytes_per_param: float,
    ctx: Context,
    src_devices: Sequence[int] = (),
    **_: object,
) -> SyncEstimate:
    """``est`` with the trainer's cast (``quantize_cost``) added to its time and named in its note (none
    for a LoRA policy: its float32 adapters travel as they are and the generator merges them)."""
    if model.adapter_params:
        return est
    q = quantize_cost(model, src_dims, src_bytes=src_bytes_per_param, dst_bytes=dst_bytes_per_param, ctx=ctx)
    if q == 0.0:
        return est
    return msgspec.structs.replace(est, time_s=est.time_s + q, note=f"{est.note}; + {q * 1e3:.3g} ms to cast {src_bytes_per_param:g} -> {dst_bytes_per_param:g} bytes/param")
