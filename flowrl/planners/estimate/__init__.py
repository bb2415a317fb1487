"""Estimates of time per step and memory per device, one module per kind of work (pure functions)."""

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
