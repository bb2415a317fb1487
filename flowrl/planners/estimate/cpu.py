"""Nodes that run on the CPU beside the devices (not on a mesh): sources and rule scorers.

    source = prompts_per_step * source_s_per_prompt
    scorer = prompts_per_step * samples_per_prompt * scorer_s_per_sample

They hold no device memory; each runs on its own CPU thread, concurrently with device work.
"""

from __future__ import annotations

from flowrl.planners.estimate.common import Context, MemoryBreakdown, NodeEstimate

__all__ = ["estimate_cpu"]


def estimate_cpu(kind: str, ctx: Context) -> NodeEstimate:
    """Seconds per step of a ``source`` or ``scorer`` node (0 for kinds that run inside another node)."""
    w, t = ctx.workload, ctx.tuning
    if kind == "source":
        time = w.prompts_per_step * t.source_s_per_prompt
    elif kind == "scorer":
        time = w.sequences * t.scorer_s_per_sample
    else:
        time = 0.0
    return NodeEstimate(time_s=time, memory=MemoryBreakdown(), breakdown={"cpu": time} if time else {})
