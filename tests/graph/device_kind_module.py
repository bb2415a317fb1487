"""A device kind written the way ARCHITECTURE.md says to add one: this module plus one table entry.

Like ``kind_module.py`` (a CPU kind), it imports only ``flowrl.graph`` at the top and the runtime,
operators and planner where they are used. ``critic`` runs on devices of its own on the trainer's
side (``side="trainer"``): a frozen model of the policy's architecture that rewards each completion
with its mean log-probability under that model. Its planner role (``critic_role``) says the
planner costs it as a forward pass reading only the last position's logits, as a value head would.
``tests/graph/test_kinds.py`` adds ``ENTRY`` to the kinds table in a fresh interpreter and plans,
reports and runs a graph that uses it.
"""

from __future__ import annotations

from flowrl.graph.configs import ModelConfig
from flowrl.graph.fields import FIELDS, REWARD_TYPE
from flowrl.graph.kinds import KINDS, KindSpec
from flowrl.graph.nodes import NodeBase, Signature

__all__ = ["CriticNode", "build_critic", "critic_role", "ENTRY"]

_READS = ("sample_prompt_ids", "sample_prompt_lens", "completion_ids", "completion_mask")


class CriticNode(NodeBase, tag="critic"):
    """Writes ``output``: each completion's mean log-probability under a frozen ``model``."""

    model: ModelConfig = ModelConfig()
    output: str = "reward_critic"

    def signature(self) -> Signature:
        return Signature({f: FIELDS[f] for f in _READS}, {self.output: REWARD_TYPE})

    def describe(self) -> str:
        return f"model={self.model.short()}"


def build_critic(node, graph, env, transports):
    """Its program: the frozen model's log-probs of each completion, averaged over its tokens."""
    from flowrl.operators.reference import Reference
    from flowrl.runtime.programs import ProgramBase

    class CriticProgram(ProgramBase):
        def __init__(self) -> None:
            self.model = Reference(node, device=env.device_of(node.name))

        def step(self, seq, inputs, min_version):
            lp = self.model.logprobs(inputs)["ref_logprobs"]  # [B, T]
            mask = inputs["completion_mask"].to(lp.dtype)
            value = (lp * mask).sum(-1) / mask.sum(-1).clamp(min=1)
            return {node.output: value}, {"critic/value_mean": float(value.mean())}

    return CriticProgram()


def critic_role(node, graph, ctx, model):
    """The planner's facts: its model's shape, logits at the last position only."""
    from flowrl.modelspec import model_from_config
    from flowrl.planners.roles import NodeRole

    return NodeRole(model=model or model_from_config(node.model), last_logits=True)


ENTRY = KindSpec(
    node="tests.graph.device_kind_module:CriticNode",
    program="tests.graph.device_kind_module:build_critic",
    estimator="flowrl.planners.estimate.train:estimate_train",
    runs_on="devices",
    side="trainer",
    plan_role="tests.graph.device_kind_module:critic_role",
    span="critic",
    style=KINDS["reference"].style,
)
