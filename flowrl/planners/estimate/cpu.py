"""Nodes that run on the CPU beside the devices (not on a mesh): sources and rule scorers; and losses,
which cost nothing of their own. One estimator per kind, each in the planner's kind table
(``flowrl.planners.kind_table.ESTIMATORS``) and called as ``estimator(kind, ctx)``:

    source = prompts_per_step * source_s_per_prompt
    scorer = prompts_per_step * samples_per_prompt * scorer_s_per_sample
    loss   = 0 (it runs inside its policy's step, whose estimate includes it)

They hold no device memory; each runs on its own CPU thread, concurrently with device work.
"""

from __future__ import annotations

from flowrl.planners.estimate.common import Context, MemoryBreakdown, NodeEstimate

__all__ = ["estimate_source", "estimate_scorer", "estimate_in_policy"]


def _cpu(time: float) -> NodeEstimate:
    return NodeEstimate(time_s=time, memory=MemoryBreakdown(), breakdown={"cpu": time} if time else {})


def estimate_source(kind: str, ctx: Context) -> NodeEstimate:
    """Seconds per step of a ``source``: reading and tokenizing one step's prompts."""
    return _cpu(ctx.workload.prompts_per_step * ctx.tuning.source_s_per_prompt)


def estimate_scorer(kind: str, ctx: Context) -> NodeEstimate:
    """Seconds per step of a rule ``scorer``: one call per sample."""
    return _cpu(ctx.workload.sequences * ctx.tuning.scorer_s_per_sample)


def estimate_in_policy(kind: str, ctx: Context) -> NodeEstimate:
    """Nothing of its own: a kind that runs inside its policy's step (a ``loss``) is costed in that step."""
    return _cpu(0.0)
