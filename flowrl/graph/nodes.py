"""The closed set of node kinds, as plain-data structs, and the typed fields each one reads and writes.

Node kinds (the ``kind`` tag in JSON):

- ``source``: yields batches of prompts from a task's or a prompt file's endless, seeded stream.
  Writes ``prompt_ids``, ``prompt_lens``, ``prompt_index``.
- ``generator``: samples ``n_samples`` completions per prompt with the behaviour policy mu. Holds
  inference weights (received over a weight edge). Writes the rollout: completion ids and mask,
  per-token log-probs under mu (``behaviour_logprobs``), lengths, group ids and ``rollout_version``.
- ``scorer``: turns completions into rewards with a rule, a user function referenced as
  ``module:qualname``, on token ids or (``inputs="text"``) on decoded text and the prompt row's
  fields; a text scorer also reads ``prompt_index`` and ``group_ids`` to find each sample's row.
  Writes one reward field (``rewards`` unless renamed).
- ``reference``: a frozen copy of the initial policy; writes ``ref_logprobs`` for a KL penalty.
- ``loss``: the RL objective (AIPO, GRPO/PPO-clip). Reads the rollout and the reward fields named in
  its config; runs inside the policy's training step, on the policy's devices. Writes ``objective``.
- ``policy``: the trainer. Holds pi's trainable weights and optimizer; every optimizer step bumps
  the policy version. Reads ``objective``; its weights leave over weight edges.

``critic`` and ``reward_model`` are reserved for later; they are not accepted yet.

Which kinds own trainable weights (may start a weight edge) and which hold weights (may end one)
is stated by ``TRAINABLE_KINDS`` and ``WEIGHT_HOLDING_KINDS``.
"""

from __future__ import annotations

from typing import Literal, Union

import msgspec

from flowrl.errors import ConfigError
from flowrl.graph.configs import AnyModelConfig, LossConfig, ModelConfig, OptimizerConfig, SamplingConfig, SourceConfig
from flowrl.graph.fields import FIELDS, REWARD_TYPE, ROLLOUT_FIELDS, SOURCE_FIELDS, FieldType

__all__ = [
    "NodeKind",
    "NODE_KINDS",
    "TRAINABLE_KINDS",
    "WEIGHT_HOLDING_KINDS",
    "DEVICE_KINDS",
    "SourceNode",
    "GeneratorNode",
    "ScorerNode",
    "ReferenceNode",
    "LossNode",
    "PolicyNode",
    "Node",
    "Signature",
    "signature",
    "describe",
]

NodeKind = Literal["source", "generator", "scorer", "reference", "loss", "policy"]
NODE_KINDS: tuple[str, ...] = ("source", "generator", "scorer", "reference", "loss", "policy")
TRAINABLE_KINDS: frozenset[str] = frozenset({"policy"})
WEIGHT_HOLDING_KINDS: frozenset[str] = frozenset({"generator", "reference", "policy"})
#: Kinds that run a model on devices of their own (a placement gives each some); the others run on
#: the host CPU beside them (sources, rule scorers) or inside their policy's step (losses).
DEVICE_KINDS: frozenset[str] = WEIGHT_HOLDING_KINDS


class _NodeBase(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="kind"):
    """Fields every node has. ``name`` is unique in its graph and names the node in every error."""

    name: str

    @property
    def kind(self) -> str:
        return type(self).__struct_config__.tag  # type: ignore[return-value]


class SourceNode(_NodeBase, tag="source"):
    """Prompts from a task. See the module docstring for the fields it writes."""

    source: SourceConfig = msgspec.field(default_factory=SourceConfig)


class GeneratorNode(_NodeBase, tag="generator"):
    """Samples completions with the behaviour policy mu."""

    model: AnyModelConfig = msgspec.field(default_factory=ModelConfig)
    sampling: SamplingConfig = msgspec.field(default_factory=SamplingConfig)


class ScorerNode(_NodeBase, tag="scorer"):
    """Rewards from a rule.

    Attributes:
        fn: ``module:qualname`` of ``fn(prompt_ids, completion_ids) -> float`` (or, with ``batched``,
            of a function taking lists and returning a list of floats). Resolved only when the graph
            runs, never when it is loaded.
        batched: ``fn`` scores a whole batch at once.
        output: name of the reward field it writes.
        inputs: ``"ids"`` (token ids, as above) or ``"text"``: ``fn(prompt: str, completion: str,
            **fields) -> float`` with the decoded prompt and completion and the prompt row's fields
            (batched: ``fn(prompts, completions, **fields_as_lists) -> list[float]``); see
            ``flowrl.operators.scoring``.
    """

    fn: str
    batched: bool = False
    output: str = "rewards"
    inputs: Literal["ids", "text"] = "ids"

    def __post_init__(self) -> None:
        if self.inputs not in ("ids", "text"):
            raise ConfigError(f"scorer {self.name!r}: inputs={self.inputs!r} must be 'ids' (token ids) or 'text' (decoded text)")


class ReferenceNode(_NodeBase, tag="reference"):
    """A frozen copy of the initial policy, for a KL penalty."""

    model: AnyModelConfig = msgspec.field(default_factory=ModelConfig)


class LossNode(_NodeBase, tag="loss"):
    """The RL objective; runs inside its policy's training step."""

    loss: LossConfig = msgspec.field(default_factory=LossConfig)


class PolicyNode(_NodeBase, tag="policy"):
    """The trainer: pi's weights, its optimizer and the version clock."""

    model: AnyModelConfig = msgspec.field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = msgspec.field(default_factory=OptimizerConfig)


Node = Union[SourceNode, GeneratorNode, ScorerNode, ReferenceNode, LossNode, PolicyNode]


class Signature(msgspec.Struct, frozen=True):
    """The typed fields a node reads and writes."""

    inputs: dict[str, FieldType]
    outputs: dict[str, FieldType]


def _fields(names: tuple[str, ...]) -> dict[str, FieldType]:
    return {n: FIELDS[n] for n in names}


def signature(node: Node) -> Signature:
    """The fields ``node`` reads and writes, by kind and config.

    Example:
        >>> sorted(signature(ScorerNode(name="r", fn="m:f")).outputs)
        ['rewards']
    """
    if isinstance(node, SourceNode):
        return Signature({}, _fields(SOURCE_FIELDS))
    if isinstance(node, GeneratorNode):
        return Signature(_fields(SOURCE_FIELDS), _fields(ROLLOUT_FIELDS))
    if isinstance(node, ScorerNode):
        names = ("sample_prompt_ids", "sample_prompt_lens", "completion_ids", "completion_lens")
        if node.inputs == "text":
            names += ("group_ids", "prompt_index")
        return Signature(_fields(names), {node.output: REWARD_TYPE})
    if isinstance(node, ReferenceNode):
        return Signature(
            _fields(("sample_prompt_ids", "sample_prompt_lens", "completion_ids", "completion_mask")),
            _fields(("ref_logprobs",)),
        )
    if isinstance(node, LossNode):
        inputs = _fields(ROLLOUT_FIELDS)
        inputs.update({name: REWARD_TYPE for name in node.loss.reward_weights})
        if node.loss.kl_coef > 0:
            inputs["ref_logprobs"] = FIELDS["ref_logprobs"]
        return Signature(inputs, _fields(("objective",)))
    if isinstance(node, PolicyNode):
        return Signature(_fields(("objective",)), {})
    raise TypeError(f"not a flowrl node: {node!r}")  # unreachable for the closed Node union


def describe(node: Node) -> str:
    """A short, stable summary of a node's config, used by ``print(graph)`` and the exporters."""
    if isinstance(node, SourceNode):
        s = node.source
        if s.data:
            return f"data={s.data.rsplit('/', 1)[-1]}, batch={s.batch_size}"
        return f"task={s.task}, batch={s.batch_size}"
    if isinstance(node, GeneratorNode):
        s = node.sampling
        return f"model={node.model.short()}, n={s.n_samples}, max_new={s.max_new_tokens}, T={s.temperature:g}"
    if isinstance(node, ScorerNode):
        return f"fn={node.fn}" + (", batched" if node.batched else "") + (", text" if node.inputs == "text" else "")
    if isinstance(node, ReferenceNode):
        return f"model={node.model.short()}"
    if isinstance(node, LossNode):
        c = node.loss
        extra = {"aipo": f", rho={c.rho:g}", "pg": ""}.get(c.objective, f", eps={c.clip_eps:g}")
        return f"{c.objective}{extra}, baseline={c.baseline}"
    if isinstance(node, PolicyNode):
        return f"model={node.model.short()}, lr={node.optimizer.lr:g}"
    raise TypeError(f"not a flowrl node: {node!r}")
