"""The plan's predicted timeline as a Chrome trace with the runtime's tracks and span names.

``flowrl plan ... --trace predicted.json`` writes it; ``flowrl run --trace measured.json`` writes
the measured one. Both have one track per executor node (named by the node) and spans named as
in ``flowrl.graph.kinds`` (``generate``, ``score``, ``train``, ``reference``, ``prompts``) plus
``weight publish`` on the policy's track and ``weight fetch`` on the generator's, so the two open
side by side in Perfetto (https://ui.perfetto.dev). Loss nodes have no track: they run inside
their policy's ``train`` span.

The predicted trace repeats the plan's step (``Plan.timeline``: the steady state when
``max_staleness >= 1``, one synchronous step otherwise) ``steps`` times, ``Plan.step_s`` apart.

Example:
    >>> from flowrl.examples import build_example
    >>> from flowrl.planners.plan import plan_graph
    >>> trace = predicted_trace(plan_graph(build_example("llamarl"), "cpu:2", strategy="disaggregated"), steps=2)
    >>> sorted({e["name"] for e in trace.to_dict()["traceEvents"] if e["ph"] == "X"})
    ['generate', 'prompts', 'score', 'train', 'weight fetch', 'weight publish']
"""

from __future__ import annotations

from flowrl.graph.kinds import KINDS
from flowrl.planners.plan_data import Plan
from flowrl.trace import Tracer

__all__ = ["predicted_trace"]


def predicted_trace(plan: Plan, *, steps: int = 3) -> Tracer:
    """A tracer holding ``steps`` predicted steps of ``plan`` (``tracer.save(path)`` writes it).

    Args:
        plan: a plan with predictions (from ``plan_graph``).
        steps: how many steps to lay out, each ``plan.step_s`` after the previous one.
    """
    tracer = Tracer(origin=0.0)
    period = plan.step_s or max((s.end_s for s in plan.timeline), default=0.0)
    for step in range(steps):
        offset = step * period
        synced: set[tuple[str, float]] = set()
        for span in plan.timeline:
            start, end = offset + span.start_s, offset + span.end_s
            if span.what == "weight sync":
                if (span.node, span.start_s) in synced:
                    continue  # one span per resource it occupies: one publish and one fetch per edge
                synced.add((span.node, span.start_s))
                src, _, dst = span.node.partition("~>")
                tracer.add(src, "weight publish", start, end, step=step, predicted=True)
                tracer.add(dst, "weight fetch", start, end, step=step, predicted=True)
                continue
            kind = plan.placements[span.node].kind if span.node in plan.placements else ""
            if kind in KINDS and KINDS[kind].runs_on != "policy":  # a loss runs inside its policy's train span
                tracer.add(span.node, span.what, start, end, step=step, predicted=True)
    return tracer
