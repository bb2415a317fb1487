"""How an executor's program step is drawn in the run's trace (``--trace``): its spans and counters.

A step is one span named by its node kind (``SPAN_NAMES``: the planner's predicted timeline uses the
same names), split where the step's ``info`` says part of it was something else: a generator's
weight fetch at its start, a policy's weight publish at its end, colocated offloading's state moves
at either end (``offload.trace_spans``), and a continuous generator's slot occupancy as a counter.
"""

from __future__ import annotations

from typing import Any

from flowrl.graph.kinds import KINDS
from flowrl.runtime.programs.offload import trace_spans
from flowrl.trace import Tracer

__all__ = ["SPAN_NAMES", "trace_step"]

#: The span each node kind's program step is recorded as in the trace (``flowrl.graph.kinds``).
SPAN_NAMES = {kind: spec.span for kind, spec in KINDS.items() if spec.runs_on != "policy"}


def trace_step(tracer: Tracer, node: str, kind: str, seq: int, t0: float, t1: float, info: dict[str, Any]) -> None:
    """Record ``node``'s (of ``kind``) step ``seq``, run from ``t0`` to ``t1`` and reporting ``info``, in ``tracer``."""
    name = SPAN_NAMES.get(kind, kind)
    t0, t1, moves = trace_spans(t0, t1, info)  # colocated offloading: the state's moves, at the step's ends
    for move, start, end in moves:
        tracer.add(node, move, start, end, step=seq)
    if KINDS[kind].waits_for_weights and info.get("fetch_s", 0) > 0:
        fetch_end = t0 + info["fetch_s"]
        tracer.add(node, "weight fetch", t0, fetch_end, step=seq, version=info.get("version"))
        tracer.add(node, name, fetch_end, t1, step=seq, version=info.get("version"))
        if "slots/utilisation" in info:
            tracer.counter(node, "slot occupancy", fetch_end, info["slots/utilisation"])
    elif KINDS[kind].publishes_weights and "publish_s" in info:
        pub_start = t1 - info["publish_s"]
        tracer.add(node, name, t0, pub_start, step=seq, version=info.get("version"))
        tracer.add(node, "weight publish", pub_start, t1, step=seq, version=info.get("version"))
    else:
        tracer.add(node, name, t0, t1, step=seq)
