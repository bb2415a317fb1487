"""A node kind written the way docs/extending.md says to add one: this module plus one entry in each table.

Like the built-in kinds, it imports only ``flowrl.graph`` at the top and the runtime and planner
where they are used: the kinds table is read while ``flowrl.graph.nodes`` is still loading.

``length_bonus`` is a CPU kind: it reads each completion's length and writes a reward field that
favours short completions. ``tests/graph/test_kinds.py`` adds ``ENTRY`` to the kinds table (its program and estimator to theirs) in a
fresh interpreter and runs a graph that uses it through every part of flowrl.
"""

from __future__ import annotations

import torch

from flowrl.graph.fields import FIELDS, REWARD_TYPE
from flowrl.graph.kinds import KINDS, KindSpec
from flowrl.graph.nodes import NodeBase, Signature

__all__ = ["LengthBonusNode", "build_length_bonus", "estimate_length_bonus", "ENTRY"]


class LengthBonusNode(NodeBase, tag="length_bonus"):
    """Writes ``output``: ``1 - completion_len / max_len`` per sample."""

    max_len: int = 5
    output: str = "reward_short"

    def signature(self) -> Signature:
        return Signature({"completion_lens": FIELDS["completion_lens"]}, {self.output: REWARD_TYPE})

    def describe(self) -> str:
        return f"max_len={self.max_len}"


def build_length_bonus(node, graph, env, transports):
    """Its program: the bonus for one batch per step."""
    from flowrl.runtime.programs.nodes import ProgramBase

    class LengthBonusProgram(ProgramBase):
        def step(self, seq, inputs, min_version):
            lens = inputs["completion_lens"].to(torch.float32)
            return {node.output: 1.0 - lens / node.max_len}, {"bonus_mean": float((1.0 - lens / node.max_len).mean())}

    return LengthBonusProgram()


def estimate_length_bonus(kind, ctx):
    """A microsecond per sample on the CPU."""
    from flowrl.planners.estimate.common import MemoryBreakdown, NodeEstimate

    time = ctx.workload.sequences * 1e-6
    return NodeEstimate(time_s=time, memory=MemoryBreakdown(), breakdown={"cpu": time})



ENTRY = KindSpec(node="tests.graph.kind_module:LengthBonusNode", runs_on="cpu", span="length_bonus", style=KINDS["scorer"].style)
