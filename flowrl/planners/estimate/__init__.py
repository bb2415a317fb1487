"""Estimates of time per step and memory per device, one module per kind of work (pure functions).

``train`` (a policy's or a critic's step; a LoRA policy's gradients, AdamW state, gradient sync and
step over its adapters; a mixture of experts' FLOPs from the active experts, memory and sync from
all of them, its experts split over the data-parallel ranks, ``expert_parallel``, paying the tokens'
all-to-alls), ``generate`` (each generator priced by its engine's ``ENGINE_CAPS`` row, no engine
name read; a decode step reads the routed experts its batch touches,
``ModelSpec.expert_read_fraction``), ``sync`` (a weight edge's transfer over the torchrun backend's
layouts, LoRA's float32 adapters to every replica with no cast), ``direct`` (the direct route into
vLLM), ``rates`` (the rates a sync into vLLM is priced at, each naming its source), ``cpu_ranks``
(tp and pp ranks on a CPU), ``quantize`` (the trainer's cast to the generator's dtype), ``cpu`` (the
CPU kinds), ``common``.
"""

from flowrl.planners.estimate.common import Context, MemoryBreakdown, NodeEstimate
from flowrl.planners.estimate.generate import estimate_generate, generator_dtype
from flowrl.planners.estimate.cpu import estimate_in_policy, estimate_scorer, estimate_source
from flowrl.planners.estimate.sync import SyncEstimate, estimate_sync
from flowrl.planners.estimate.train import estimate_train, train_options

__all__ = [
    "Context",
    "MemoryBreakdown",
    "NodeEstimate",
    "SyncEstimate",
    "estimate_train",
    "train_options",
    "estimate_generate",
    "generator_dtype",
    "estimate_sync",
    "estimate_source",
    "estimate_scorer",
    "estimate_in_policy",
]
