"""A device kind written the way docs/extending.md says to add one: this module plus one entry in each table.

Like ``kind_module.py`` (a CPU kind), it imports only ``flowrl.graph`` at the top and the runtime,
operators and planner where they are used. ``likelihood`` runs on devices of its own on the trainer's
side (``side="trainer"``): a frozen model of the policy's architecture that rewards each completion
with its mean log-probability under that model. Its planner role (``likelihood_role``) gives the
search its model's shape; being trainer-side and publishing no weights, it is costed as a forward
pass over every sequence (a kind with other costs says so in its ``NodeRole``: see
``flowrl.planners.roles.reward_model_role``).
``tests/graph/test_kinds.py`` adds ``ENTRY`` to the kinds table (its program and role to theirs) in a fresh interpreter and plans,
reports and runs a graph that uses it.
"""

from __future__ import annotations

from flowrl.graph.configs import ModelConfig
from flowrl.graph.fields import FIELDS, REWARD_TYPE
from flowrl.graph.kinds import KINDS, KindSpec
from flowrl.graph.nodes import NodeBase, Signature

__all__ = ["LikelihoodNode", "build_likelihood", "likelihood_role", "ENTRY"]

_READS = ("sample_prompt_ids", "sample_prompt_lens", "completion_ids", "completion_mask")


class LikelihoodNode(NodeBase, tag="likelihood"):
    """Writes ``output``: each completion's mean log-probability under a frozen ``model``."""

    model: ModelConfig = ModelConfig()
    output: str = "reward_likelihood"

    def signature(self) -> Signature:
        return Signature({f: FIELDS[f] for f in _READS}, {self.output: REWARD_TYPE})

    def describe(self) -> str:
        return f"model={self.model.short()}"


def build_likelihood(node, graph, env, transports):
    """Its program: the frozen model's log-probs of each completion, averaged over its tokens."""
    from flowrl.operators.reference import Reference
    from flowrl.runtime.programs.nodes import ProgramBase

    class LikelihoodProgram(ProgramBase):
        def __init__(self) -> None:
            self.model = Reference(node, device=env.device_of(node.name))

        def step(self, seq, inputs, min_version):
            lp = self.model.logprobs(inputs)["ref_logprobs"]  # [B, T]
            mask = inputs["completion_mask"].to(lp.dtype)
            value = (lp * mask).sum(-1) / mask.sum(-1).clamp(min=1)
            return {node.output: value}, {"likelihood/mean": float(value.mean())}

    return LikelihoodProgram()


def likelihood_role(node, graph, ctx, model):
    """The planner's facts: its model's shape (a forward pass at every position, like a reference's)."""
    from flowrl.modelspec import model_from_config
    from flowrl.planners.roles import NodeRole

    return NodeRole(model=model or model_from_config(node.model))



ENTRY = KindSpec(node="tests.graph.device_kind_module:LikelihoodNode", runs_on="devices", side="trainer", span="likelihood", style=KINDS["reference"].style)
