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
- ``reference``: a copy of the initial policy; writes ``ref_logprobs`` for a KL penalty. Frozen,
  or (``ReferenceConfig.sync_steps``) mixed with the policy every N trainer steps, whose weights then
  reach it over a weight edge.
- ``reward_model``: rewards from a Hugging Face model in a local directory reading each sample's
  prompt and completion text: a sequence classifier (one label: its logit is the reward) or, with a
  ``judge`` (``flowrl.graph.judges``), a causal LM prompted with a template whose verdict is read.
  Runs on devices of its own like a reference (it holds a model). Reads the rollout's prompt and
  completion ids and lengths; writes one reward field (``rewards`` unless renamed).
- ``critic``: a trained value model (``flowrl.graph.critic``): reads the rollout and the reward
  fields of its loss, writes ``values`` and ``value_version``, and trains on each batch with its own
  optimizer on devices of its own.
- ``teacher``: a frozen model of its own (``flowrl.graph.teacher``): reads the rollout, writes
  ``teacher_logprobs`` for on-policy distillation (``objective="opd"``).
- ``loss``: the RL objective (AIPO, GRPO/PPO-clip, PPO with a critic's GAE advantages). Reads the
  rollout and the reward fields named in its config (``"ppo"``: a critic's ``values`` too); runs
  inside the policy's training step, on the policy's devices. Writes ``objective``.
- ``policy``: the trainer. Holds pi's trainable weights and optimizer; every optimizer step bumps
  the policy version. Reads ``objective``; its weights leave over weight edges.

Which kinds own trainable weights (may start a weight edge) and which hold weights (may end one)
is stated by ``TRAINABLE_KINDS`` and ``WEIGHT_HOLDING_KINDS``, read from the kinds table's
``publishes_weights`` and ``holds_weights``; which run inside their policy's step (a loss) by
``IN_POLICY_KINDS`` (``runs_on="policy"``). Code asking what a node does reads these sets or the
table, not kind names.

Each node struct states its own fields and summary (``signature()``, ``describe()``), and the
``Node`` union that graph files decode into is built from the kinds table
(``flowrl.graph.kinds.KINDS``), so a new kind is its module (a ``NodeBase`` subclass with a
``tag``) plus one entry in that table; nothing here changes.

Typed access: ``Node``, the union graph files decode into, is ``NodeBase`` to a type checker, and
``GraphStructure.nodes_of(struct)`` hands a kind's nodes out typed, so no ``type: ignore`` reads a
kind's fields. A ``reward_model`` node receives no weights (``holds_weights=False``: not in
``WEIGHT_HOLDING_KINDS``). ``Node.keeps_state()`` says what a checkpoint saves (the policies, a
syncing reference's mixed weights, a critic); ``Node.version_needed`` is a policy version a step
needs besides the version clock's gate (a syncing reference's ``U * seq``: its weight edge, which
``validate._check_reference_sync`` requires exactly when ``sync_steps`` is set, names its own
versions; a critic's step ``s - 1``). Every ``describe()`` lists the options set off their defaults.
"""

from __future__ import annotations

import functools
import operator
from typing import TYPE_CHECKING, Literal, TypeAlias

from flowrl.graph.kinds import KINDS
from flowrl.graph.refs import resolve

import msgspec

from flowrl.errors import ConfigError
from flowrl.graph.engines import DEFAULT_ENGINE, ENGINE_CAPS, Engine, VLLMConfig, check_engine_options
from flowrl.graph.configs import AnyModelConfig, HFModelConfig, LossConfig, ModelConfig, OptimizerConfig, ReferenceConfig, SamplingConfig, SourceConfig
from flowrl.graph.envs import ENV_FIELDS, EnvConfig
from flowrl.graph.judges import JudgeConfig
from flowrl.graph.fields import FIELDS, REWARD_TYPE, ROLLOUT_FIELDS, SOURCE_FIELDS, FieldType
from flowrl.graph.objectives import OBJECTIVES, READ_FIELDS

__all__ = [
    "NodeKind",
    "NODE_KINDS",
    "TRAINABLE_KINDS",
    "WEIGHT_HOLDING_KINDS",
    "IN_POLICY_KINDS",
    "DEVICE_KINDS",
    "SourceNode",
    "GeneratorNode",
    "ScorerNode",
    "ReferenceNode",
    "RewardModelNode",
    "LossNode",
    "PolicyNode",
    "Node",
    "NodeBase",
    "Signature",
    "signature",
    "describe",
]

NodeKind = str
#: Every kind, in the order of the kinds table (``flowrl.graph.kinds.KINDS``).
NODE_KINDS: tuple[str, ...] = tuple(KINDS)
TRAINABLE_KINDS: frozenset[str] = frozenset(k for k, spec in KINDS.items() if spec.publishes_weights)
#: Kinds that run a model on devices of their own (a placement gives each some); the others run on
#: the host CPU beside them (sources, rule scorers) or inside their policy's step (losses).
DEVICE_KINDS: frozenset[str] = frozenset(k for k, spec in KINDS.items() if spec.runs_on == "devices")
#: A reward model holds a frozen model of another architecture (a classifier or a judge): no weights flow into it.
WEIGHT_HOLDING_KINDS: frozenset[str] = frozenset(k for k, spec in KINDS.items() if spec.holds_weights)
#: Kinds that run inside the training step of the policy they feed, on its mesh (losses).
IN_POLICY_KINDS: frozenset[str] = frozenset(k for k, spec in KINDS.items() if spec.runs_on == "policy")


class Signature(msgspec.Struct, frozen=True):
    """The typed fields a node reads and writes."""

    inputs: dict[str, FieldType]
    outputs: dict[str, FieldType]


def _fields(names: tuple[str, ...]) -> dict[str, FieldType]:
    return {n: FIELDS[n] for n in names}


class NodeBase(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="kind"):
    """Fields every node has; a kind subclasses it with ``tag="<kind>"``.

    ``name`` is unique in its graph and names the node in every error. A kind overrides
    ``signature()`` (the fields it reads and writes) and ``describe()`` (its one-line summary).
    """

    name: str

    @property
    def kind(self) -> str:
        return str(type(self).__struct_config__.tag)  # every kind's tag is its name (a str)

    def signature(self) -> Signature:
        """The fields this node reads and writes."""
        raise NotImplementedError(f"node kind {self.kind!r} does not state its signature()")

    def describe(self) -> str:
        """A short, stable summary of its config (``print(graph)``, the exporters)."""
        return ""

    def keeps_state(self) -> bool:
        """Whether its program has state a checkpoint must keep (``save``/``load``): a kind that
        trains (``publishes_weights``), or a node whose config makes it change (a syncing reference)."""
        return KINDS[self.kind].publishes_weights

    def version_needed(self, seq: int, updates: int) -> int:
        """The policy version that must be published before this node's step ``seq`` runs, besides
        the version clock's gate of a kind that ``waits_for_weights``; -1: none. ``updates``: the
        graph's updates per batch (versions per trainer step)."""
        return -1


_NodeBase = NodeBase  # the name earlier modules used


class SourceNode(NodeBase, tag="source", frozen=True):
    """Prompts from a task. See the module docstring for the fields it writes."""

    source: SourceConfig = msgspec.field(default_factory=SourceConfig)

    def signature(self) -> Signature:
        return Signature({}, _fields(SOURCE_FIELDS))

    def describe(self) -> str:
        s = self.source
        if s.data:
            return f"data={s.data.rsplit('/', 1)[-1]}, batch={s.batch_size}"
        return f"task={s.task}, batch={s.batch_size}"


def _check_routing_replay(node: GeneratorNode) -> None:
    """Refuse ``routing_replay=True`` where the generator cannot record routing, before any work (what
    needs a model's files or the machine is checked when a run starts: ``flowrl.runtime.preflight``)."""
    owner = f"generator {node.name!r}: routing_replay=True"
    if isinstance(node.model, ModelConfig):
        raise ConfigError(
            f"{owner} records a mixture of experts' routing, but its model is the built-in ModelConfig ({node.model.short()}), "
            "a dense transformer without routers; drop routing_replay, or sample from a MoE Hugging Face model (qwen3_moe, qwen2_moe)"
        )
    if node.env is not None:
        raise ConfigError(f"{owner} records single-turn rollouts; with env={node.env.env!r} the episodes' tokens are not recorded: drop routing_replay or env")
    if node.sampling.batching != "lockstep":
        raise ConfigError(
            f"{owner} records routing in lock-step batches; batching={node.sampling.batching!r} refills rows mid-batch "
            "and does not record it: set batching='lockstep' or drop routing_replay"
        )


class GeneratorNode(NodeBase, tag="generator", frozen=True):
    """Samples completions with the behaviour policy mu.

    Attributes:
        model: the model it samples from.
        sampling: how it samples.
        engine: what runs the sampling: ``"builtin"`` (flowrl's own decode loop over the model,
            ``flowrl.operators.generation``) or ``"vllm"`` (a vLLM engine in the generator's process,
            ``flowrl.operators.engines.vllm_engine``; Hugging Face models only, lock-step or
            continuous batching, float precisions). Either writes the same rollout fields.
        env: multi-turn episodes against an environment, or an agent program's over the chat
            endpoint (``flowrl.graph.envs``; either engine); None: one completion per sample. With
            one it also writes ``ENV_FIELDS`` (``env_rewards`` a loss can weigh).
        vllm: vLLM's memory and batch settings (``VLLMConfig``: ``gpu_memory_utilization``,
            ``max_model_len``, ``max_num_seqs``); None: flowrl's defaults. Refused on the built-in engine.
        routing_replay: record each token's experts per MoE layer (prompt tokens too) into the rollout
            field ``routed_experts``; the policy, reference and critic it feeds then route by them
            (``flowrl.models.routing``), so a token goes through the same experts in the trainer as in
            the engine. A generator option because the generator is where routing is recorded and
            the field it writes reaches every node that reads the rollout; a mixture-of-experts model,
            lock-step batching and no ``env`` only (refused otherwise, before any work).
    """

    model: AnyModelConfig = msgspec.field(default_factory=ModelConfig)
    sampling: SamplingConfig = msgspec.field(default_factory=SamplingConfig)
    engine: Engine = DEFAULT_ENGINE
    env: EnvConfig | None = None
    vllm: VLLMConfig | None = None
    routing_replay: bool = False

    def __post_init__(self) -> None:
        check_engine_options(self.name, self.engine, self.model, self.sampling, self.vllm)
        if self.routing_replay:
            _check_routing_replay(self)
        if self.env is not None and (not ENGINE_CAPS[self.engine].continuous_episodes or self.env.agent) and self.sampling.batching != "lockstep":
            what = "an agent program (agent=True)" if self.env.agent else f"env= with engine={self.engine!r}"
            raise ConfigError(
                f"generator {self.name!r}: {what} runs its episodes in lock step (requests sampled as they come, "
                f"weights between batches), not batching={self.sampling.batching!r}: drop batching="
            )

    def signature(self) -> Signature:
        outputs = _fields(ROLLOUT_FIELDS)
        if self.env is not None:
            outputs.update(_fields(ENV_FIELDS))
        if self.routing_replay:
            outputs["routed_experts"] = FIELDS["routed_experts"]
        return Signature(_fields(SOURCE_FIELDS), outputs)

    def describe(self) -> str:
        s = self.sampling
        engine = f", engine={self.engine}" if self.engine != "builtin" else ""
        text = f"model={self.model.short()}, n={s.n_samples}, max_new={s.max_new_tokens}, T={s.temperature:g}{engine}"
        text += "".join(f", {k}={v:g}" for k, v in (self.vllm.given() if self.vllm is not None else {}).items())
        text += ", routing_replay" if self.routing_replay else ""
        return text + (f", env={self.env.env}, max_turns={self.env.max_turns}" if self.env is not None else "")


class ScorerNode(NodeBase, tag="scorer", frozen=True):
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

    def signature(self) -> Signature:
        names: tuple[str, ...] = ("sample_prompt_ids", "sample_prompt_lens", "completion_ids", "completion_lens")
        if self.inputs == "text":
            names += ("group_ids", "prompt_index")
        return Signature(_fields(names), {self.output: REWARD_TYPE})

    def describe(self) -> str:
        return f"fn={self.fn}" + (", batched" if self.batched else "") + (", text" if self.inputs == "text" else "")


class ReferenceNode(NodeBase, tag="reference", frozen=True):
    """A copy of the initial policy, for a KL penalty: frozen, or synced with the policy.

    Attributes:
        model: the policy's model description (a LoRA policy's reference is its base model).
        reference: how it follows the policy (``ReferenceConfig``: every ``sync_steps`` trainer
            steps, ``sync_alpha * policy + (1 - sync_alpha) * reference``); by default frozen.
    """

    model: AnyModelConfig = msgspec.field(default_factory=ModelConfig)
    reference: ReferenceConfig = msgspec.field(default_factory=ReferenceConfig)

    def signature(self) -> Signature:
        return Signature(
            _fields(("sample_prompt_ids", "sample_prompt_lens", "completion_ids", "completion_mask", "completion_lens",
                     "sampling_temperature", "sampling_top_k", "sampling_top_p")  # it scores as mu sampled (operators.reference)
                    + (() if isinstance(self.model, ModelConfig) else ("routed_experts",))),  # a MoE reference replays the routing
            _fields(("ref_logprobs",)),
        )

    def describe(self) -> str:
        return ", ".join([f"model={self.model.short()}", *_changed(self.reference)])

    def keeps_state(self) -> bool:
        return self.reference.sync_steps > 0  # its mixed weights

    def version_needed(self, seq: int, updates: int) -> int:
        """At a sync step, the policy after ``seq`` trainer steps (``ReferenceConfig``)."""
        return updates * seq if self.reference.syncs_at(seq) else -1


class RewardModelNode(NodeBase, tag="reward_model", frozen=True):
    """Rewards from a Hugging Face model reading each sample's prompt and completion text.

    The text is decoded as a text scorer's is (``flowrl.operators.text_inputs``) and encoded again
    with the reward model's own tokenizer (with its chat template when it has one); see
    ``flowrl.operators.reward_models``.

    Attributes:
        model: the reward model's local directory (``HFModelConfig``: ``path``, ``tokenizer``,
            ``init``). Without ``judge`` it holds a sequence classifier with ``num_labels == 1``
            (``AutoModelForSequenceClassification``), whose logit is the reward; with ``judge``, a
            causal LM (``AutoModelForCausalLM``).
        judge: the generative judge's template and verdict (``flowrl.graph.judges.JudgeConfig``);
            None: a sequence classifier.
        output: name of the reward field it writes.
        batch_size: texts per forward pass (0: the whole batch in one).
    """

    model: HFModelConfig
    judge: JudgeConfig | None = None
    output: str = "rewards"
    batch_size: int = 0

    def __post_init__(self) -> None:
        if self.batch_size < 0:
            raise ConfigError(f"reward_model {self.name!r}: batch_size={self.batch_size} must be >= 0 (0: the whole batch at once)")
        if not self.output:
            raise ConfigError(f"reward_model {self.name!r}: output must name the reward field it writes (e.g. 'rm_rewards')")

    def signature(self) -> Signature:
        names = ("sample_prompt_ids", "sample_prompt_lens", "completion_ids", "completion_lens")
        return Signature(_fields(names), {self.output: REWARD_TYPE})

    def describe(self) -> str:
        judge = f", {self.judge.describe()}" if self.judge is not None else ""
        return f"model={self.model.short()}{judge}" + (f", batch={self.batch_size}" if self.batch_size else "")


class LossNode(NodeBase, tag="loss", frozen=True):
    """The RL objective; runs inside its policy's training step."""

    loss: LossConfig = msgspec.field(default_factory=LossConfig)

    def signature(self) -> Signature:
        inputs = _fields(ROLLOUT_FIELDS + ("routed_experts",))
        inputs.update({name: REWARD_TYPE for name in self.loss.reward_weights})
        if self.loss.kl_coef > 0:
            inputs["ref_logprobs"] = FIELDS["ref_logprobs"]
        row = self.loss.row or OBJECTIVES.get(self.loss.objective)
        reads = row.reads if row is not None else ()
        if "values" in reads:  # a critic's (flowrl.graph.critic)
            inputs.update(_fields(("values", "value_version")))
        inputs.update(_fields(tuple(READ_FIELDS[r] for r in reads if r == "teacher" and READ_FIELDS[r] in FIELDS)))
        return Signature(inputs, _fields(("objective",)))

    def describe(self) -> str:
        """The objective, its main knob (AIPO's rho, a clip's eps) and baseline, then every other
        option not at its default (``reward_weights`` where a weight is not 1: the fields show on the edges)."""
        c = self.loss
        extra = {"aipo": f", rho={c.rho:g}", "opd": f", rho={c.rho:g}", "pg": ""}.get(c.objective, f", eps={c.clip_eps:g}")
        shown = ("objective", "baseline", "rho" if c.objective in ("aipo", "opd") else "clip_eps")
        if c.objective == "ppo":  # GAE's, not a group baseline
            return ", ".join([f"ppo, eps={c.clip_eps:g}, gamma={c.gamma:g}, lam={c.lam:g}", *_changed(c, skip=shown + ("gamma", "lam", "reward_weights"))])
        rest = _changed(c, skip=shown + (() if any(w != 1 for w in c.reward_weights.values()) else ("reward_weights",)))
        return ", ".join([f"{c.objective}{extra}, baseline={c.baseline}", *rest])


class PolicyNode(NodeBase, tag="policy", frozen=True):
    """The trainer: pi's weights, its optimizer and the version clock."""

    model: AnyModelConfig = msgspec.field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = msgspec.field(default_factory=OptimizerConfig)

    def signature(self) -> Signature:
        return Signature(_fields(("objective",)), {})

    def describe(self) -> str:
        """Model and learning rate, then every optimizer option not at its default (``num_iterations=2``)."""
        return ", ".join([f"model={self.model.short()}, lr={self.optimizer.lr:g}", *_changed(self.optimizer, skip=("lr",))])


def _value(v: object) -> str:
    """One option's value as ``describe()`` prints it: numbers by ``:g``, tuples and dicts compactly."""
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, tuple):
        return "(" + ", ".join(_value(x) for x in v) + ")"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_value(x)}" for k, x in sorted(v.items())) + "}"  # sorted: stable across JSON round trips
    if hasattr(v, "describe"):  # a correction, tis(level=token, cap=2.0); a user's objective row, its function
        return v.describe()
    return str(v)


def _changed(config: msgspec.Struct, *, skip: tuple[str, ...] = ()) -> list[str]:
    """``name=value`` for each field of ``config`` not at its default, in field order."""
    default = type(config)()
    return [
        f"{name}={_value(getattr(config, name))}"
        for name in config.__struct_fields__
        if name not in skip and getattr(config, name) != getattr(default, name)
    ]


def _node_structs() -> tuple[type[NodeBase], ...]:
    """Each kind's node struct, from the table (a kind in another module is imported here; it may
    import ``NodeBase`` from this module, which is defined by then)."""
    structs = []
    for kind, spec in KINDS.items():
        struct = resolve(spec.node)
        if not (isinstance(struct, type) and issubclass(struct, NodeBase) and struct.__struct_config__.tag == kind):
            raise TypeError(f"kinds table: {spec.node} is not a NodeBase subclass tagged {kind!r}")
        structs.append(struct)
    return tuple(structs)


def _tagged_union() -> object:
    """The tagged union of every kind's struct (``A | B | ...``), a user's kind included."""
    return functools.reduce(operator.or_, _node_structs())


# Any node. A type checker reads it as ``NodeBase``: every kind's struct subclasses it (a user's kind
# too, which no union written here could name; nor could it name ``CriticNode``, whose module imports
# this one), and code reads a kind's own fields after ``isinstance``. At run time it is the tagged
# union of the kinds table's structs, which msgspec reads from ``GraphSpec.nodes`` to decode a graph
# file's nodes by their ``kind``.
if TYPE_CHECKING:
    Node: TypeAlias = NodeBase
else:
    Node = _tagged_union()


def signature(node: Node) -> Signature:
    """The fields ``node`` reads and writes, by kind and config (``node.signature()``).

    Example:
        >>> sorted(signature(ScorerNode(name="r", fn="m:f")).outputs)
        ['rewards']
    """
    return node.signature()


def describe(node: Node) -> str:
    """A short, stable summary of a node's config, used by ``print(graph)`` and the exporters."""
    return node.describe()
