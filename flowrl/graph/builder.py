"""A builder API for RL pipelines: one call per node, data edges wired by field name.

Example (the canonical LlamaRL pipeline):
    >>> from flowrl.graph.builder import GraphBuilder
    >>> b = GraphBuilder("llamarl")
    >>> prompts = b.source("prompts", task="copy", batch_size=8)
    >>> gen = b.generator("gen", prompts, n_samples=4, max_new_tokens=6)
    >>> reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    >>> aipo = b.loss("aipo", gen, reward, objective="aipo", rho=4.0)
    >>> policy = b.policy("policy", aipo, lr=1e-3)
    >>> _ = b.weights(policy, gen, transport="inprocess", max_staleness=1)
    >>> graph = b.build()

Each node call names the nodes it reads from; every input field of the new node is wired from the
one listed node that produces it. Node configs can be passed whole (``sampling=SamplingConfig(...)``)
or as keyword arguments of that config (``n_samples=4``).

A value the caller does not give (no keyword argument, no whole config) takes the default of the
node's model kind (``flowrl.graph.defaults``): a pretrained Hugging Face model starts from TRL's
``lr`` 1e-6, ``max_new_tokens`` 256 and synchronous weights (``max_staleness`` 0), the built-in
model from the configs' own defaults; ``print(graph)`` names each value set so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import msgspec

from flowrl.errors import ConfigError, GraphError
from flowrl.graph.engines import Engine, VLLMConfig
from flowrl.graph.envs import EnvConfig
from flowrl.graph.defaults import KIND_DEFAULTS, DefaultUsed, model_kind
from flowrl.graph.configs import AnyModelConfig, HFModelConfig, LoraConfig, LossConfig, ModelConfig, OptimizerConfig, ReferenceConfig, SamplingConfig, SourceConfig
from flowrl.graph.judges import JudgeConfig
from flowrl.graph.ir import DataEdge, Graph, GraphSpec, WeightEdge
from flowrl.graph.nodes import (
    GeneratorNode,
    LossNode,
    Node,
    PolicyNode,
    ReferenceNode,
    RewardModelNode,
    ScorerNode,
    SourceNode,
    signature,
)
from flowrl.graph.corrections import correction_of
from flowrl.graph.critic import CriticNode, reads_values
from flowrl.graph.objectives import BUILTIN_OBJECTIVES, OBJECTIVES, ObjectiveRow
from flowrl.graph.objectives import READS_TEACHER
from flowrl.graph.teacher import TeacherNode
from flowrl.graph.advice import warn_about
from flowrl.graph.option_names import leftover_message, reference_options
from flowrl.graph.refs import reference_of
from flowrl.graph.scorer_forms import form_mismatch

__all__ = ["GraphBuilder"]

NodeRef = Node | str


def _config(cls: type[msgspec.Struct], given: Any, kwargs: dict[str, Any], owner: str) -> Any:
    """``given`` (a config) updated by the keyword arguments that name its fields; others are errors."""
    names = set(cls.__struct_fields__)
    mine = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
    base = given if given is not None else cls()
    try:
        return msgspec.structs.replace(base, **mine) if mine else base
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{owner}: {exc}") from exc


class GraphBuilder:
    """Declares nodes and edges, then ``build()`` validates them into a ``Graph``.

    Args:
        name: the graph's name (used in files, pictures and errors).
        model: the model config shared by policy, generator and reference unless one is given.
    """

    def __init__(self, name: str, *, model: AnyModelConfig | None = None) -> None:
        self.name = name
        self.model = model or ModelConfig()
        self._nodes: list[Node] = []
        self._edges: list[DataEdge] = []
        self._weight_edges: list[WeightEdge] = []
        self._defaults: list[DefaultUsed] = []

    def _kind_default(self, node: str, option: str, model: AnyModelConfig, config_default: float | int) -> float | int:
        """``model``'s kind's default for ``option`` (``flowrl.graph.defaults``), noted for
        ``print(graph)`` where it differs from ``config_default``, the config's own."""
        kind = model_kind(model)
        value = getattr(KIND_DEFAULTS[kind], option)
        if value != config_default:
            self._defaults.append(DefaultUsed(node=node, option=option, value=value, kind=kind))
        return value

    # -- generic ------------------------------------------------------------------------------------
    def add(self, node: Node, inputs: tuple[NodeRef, ...] = ()) -> Node:
        """Add ``node`` and wire each of its input fields from the one node in ``inputs`` producing it."""
        upstream = [self._lookup(ref, reader=node.name) for ref in inputs]
        wanted = signature(node).inputs
        wired: dict[str, dict] = {u.name: {} for u in upstream}
        for fname, ftype in wanted.items():
            makers = [u for u in upstream if fname in signature(u).outputs]
            if len(makers) > 1:
                raise GraphError(
                    f"node {node.name!r}: input field {fname!r} is produced by several of its inputs "
                    f"({', '.join(m.name for m in makers)}); list only one of them, or rename a scorer's output"
                )
            if makers:
                wired[makers[0].name][fname] = ftype
        for u in upstream:
            if not wired[u.name]:
                raise GraphError(
                    f"node {node.name!r} ({node.kind}) lists {u.name!r} ({u.kind}) as an input but reads none of "
                    f"its fields {sorted(signature(u).outputs)}; it reads {sorted(wanted)}"
                )
        self._nodes.append(node)
        self._edges.extend(DataEdge(src=u.name, dst=node.name, fields=wired[u.name]) for u in upstream)
        return node

    def _lookup(self, ref: NodeRef, *, reader: str) -> Node:
        name = ref if isinstance(ref, str) else ref.name
        for n in self._nodes:
            if n.name == name:
                return n
        raise GraphError(f"node {reader!r} reads from {name!r}, which is not declared yet; declare {name!r} first")

    def _no_leftovers(self, kind: str, name: str, kwargs: dict[str, Any]) -> None:
        """Refuse keyword arguments no config field took, saying what each most likely meant
        (TRL's names among them: ``flowrl.graph.option_names``); a reference's sync option in a
        graph without a reference also says how to add one."""
        if not kwargs:
            return
        message = leftover_message(kind, name, list(kwargs))
        syncs = reference_options(kwargs)
        if syncs and not any(isinstance(n, ReferenceNode) for n in self._nodes):
            message += (
                f". {syncs} sync a reference node with the policy, and this graph has none yet: declare one with the "
                "sync, ref = b.reference('ref', gen, sync_steps=N, sync_alpha=0.6), read it in the loss (kl_coef > 0, "
                "b.loss(..., ref)) and send it the policy's weights: b.weights(policy, ref)"
            )
        raise ConfigError(message)

    # -- one method per node kind ------------------------------------------------------------------
    def source(self, name: str, *, config: SourceConfig | None = None, **kwargs: Any) -> Node:
        """Prompts from a task (``task=``) or a prompt file (``data=``, ``prompt_field=``, ...);
        keyword arguments are ``SourceConfig`` fields.

        ``task`` is a built-in task name, or a task factory ``(seed) -> Task``: a module-level
        function or class, stored by reference like a scorer's function. A file's ``tokenizer``
        defaults to that of the Hugging Face model of the generator the source feeds (filled in by
        ``build``).
        """
        if config is None and kwargs.get("data") and "task" not in kwargs:
            kwargs["task"] = ""  # the default config's built-in task gives way to the file
        task = kwargs.get("task", config.task if config is not None else None)
        if task is not None and not isinstance(task, str):
            if not callable(task):
                raise ConfigError(
                    f"source {name!r}: task={task!r} is a {type(task).__name__}; give a built-in task name "
                    "or a module-level factory (seed) -> Task"
                )
            kwargs["task"] = reference_of(task)
        cfg = _config(SourceConfig, config, kwargs, f"source {name!r}")
        self._no_leftovers("source", name, kwargs)
        return self.add(SourceNode(name=name, source=cfg))

    def generator(
        self,
        name: str,
        prompts: NodeRef,
        *,
        model: ModelConfig | None = None,
        sampling: SamplingConfig | None = None,
        engine: Engine = "builtin",
        env: EnvConfig | str | type | Callable[..., Any] | None = None,
        routing_replay: bool = False,
        **kwargs: Any,
    ) -> Node:
        """Samples completions from ``prompts``; keyword arguments are ``SamplingConfig`` fields.

        ``routing_replay`` records a mixture of experts' routing for the trainer to replay
        (``GeneratorNode.routing_replay``).

        ``env`` makes it multi-turn (``flowrl.operators.multiturn``): an environment class or factory
        (stored by reference, like a scorer's function), its reference string, or an ``EnvConfig``;
        the keyword arguments that are ``EnvConfig`` fields (``max_turns``, ``step_timeout_s``, ...)
        go to it. ``engine`` picks what samples: ``"builtin"`` (flowrl's decode loop) or ``"vllm"`` (a
        vLLM engine, for a Hugging Face model; see ``flowrl.graph.engines``); the keyword arguments that
        are ``VLLMConfig`` fields (``gpu_memory_utilization``, ``max_model_len``, ``max_num_seqs``) are
        vLLM's settings, refused with another engine.
        """
        env_config = None
        if env is not None:
            if not isinstance(env, EnvConfig):
                env = EnvConfig(env=reference_of(env))
            env_config = _config(EnvConfig, env, kwargs, f"generator {name!r}")
        elif any(k in EnvConfig.__struct_fields__ and k != "env" for k in kwargs):
            raise ConfigError(f"generator {name!r}: {sorted(k for k in kwargs if k in EnvConfig.__struct_fields__)} "
                              "apply to a generator with an environment only; pass env=")
        if sampling is None and "max_new_tokens" not in kwargs:
            kwargs["max_new_tokens"] = self._kind_default(name, "max_new_tokens", model or self.model, SamplingConfig().max_new_tokens)
        cfg = _config(SamplingConfig, sampling, kwargs, f"generator {name!r}")
        vllm = _config(VLLMConfig, None, kwargs, f"generator {name!r}") if any(k in VLLMConfig.__struct_fields__ for k in kwargs) else None
        self._no_leftovers("generator", name, kwargs)
        node = GeneratorNode(name=name, model=model or self.model, sampling=cfg, engine=engine, env=env_config, vllm=vllm, routing_replay=routing_replay)
        return self.add(node, (prompts,))

    def scorer(
        self,
        name: str,
        rollouts: NodeRef,
        *,
        fn: Callable[..., Any] | str,
        batched: bool = False,
        output: str = "rewards",
        inputs: Literal["ids", "text"] = "ids",
    ) -> Node:
        """Rewards from ``fn(prompt_ids, completion_ids) -> float`` or, with ``inputs="text"``, from
        ``fn(prompt, completion, **row_fields) -> float``; ``fn`` is a module-level function or its name.
        TRL's reward functions, ``fn(completions, **kwargs) -> list[float]``, take ``inputs="text",
        batched=True`` (``flowrl.graph.scorer_forms``).

        Raises:
            ConfigError: when ``fn`` (a function, not a name) has a signature its flags contradict
                (text parameters with ``inputs="ids"``, TRL's form without ``batched=True``), naming the flags to set.
        """
        ref = reference_of(fn)
        if not isinstance(fn, str):
            mismatch = form_mismatch(fn, inputs=inputs, batched=batched)
            if mismatch:
                raise ConfigError(f"scorer {name!r}: {ref} {mismatch}")
        node = ScorerNode(name=name, fn=ref, batched=batched, output=output, inputs=inputs)
        return self.add(node, (rollouts,))

    def reference(
        self, name: str, rollouts: NodeRef, *, model: ModelConfig | None = None, config: ReferenceConfig | None = None, **kwargs: Any
    ) -> Node:
        """A copy of the initial policy, writing ``ref_logprobs``; keyword arguments are ``ReferenceConfig``
        fields: frozen by default, or synced with the policy (TRL's ``sync_ref_model``) every
        ``sync_steps`` trainer steps, ``sync_alpha * policy + (1 - sync_alpha) * reference``, when the
        policy's weights reach it over a weight edge (``b.weights(policy, ref)``; ``build`` refuses a
        syncing reference without one, and one into a frozen reference).

        Example:
            >>> b = GraphBuilder("kl")
            >>> gen = b.generator("gen", b.source("prompts", task="copy"))
            >>> b.reference("ref", gen, sync_steps=64, sync_alpha=0.6).describe()
            'model=2L64d, sync_steps=64'
        """
        cfg = _config(ReferenceConfig, config, kwargs, f"reference {name!r}")
        self._no_leftovers("reference", name, kwargs)
        source = self._lookup(rollouts, reader=name)
        return self.add(ReferenceNode(name=name, model=model or self.model, reference=cfg), (rollouts,))

    def reward_model(
        self,
        name: str,
        rollouts: NodeRef,
        *,
        model: str | HFModelConfig,
        judge: JudgeConfig | str | None = None,
        output: str = "rewards",
        batch_size: int = 0,
    ) -> Node:
        """Rewards from a Hugging Face model in a local directory (``flowrl.graph.nodes.RewardModelNode``).

        Args:
            model: the directory (or its ``HFModelConfig``): a sequence classifier with one label,
                or, with ``judge``, a causal LM.
            judge: a ``JudgeConfig``, or its template alone (``{prompt}``, ``{completion}``; the
                verdict is then ``p(Yes) / (p(Yes) + p(No))``).
            output: the reward field it writes.
            batch_size: texts per forward pass (0: the whole batch).

        Example:
            >>> b = GraphBuilder("rm")
            >>> gen = b.generator("gen", b.source("prompts", task="copy"))
            >>> b.reward_model("rm", gen, model="/models/my-rm", output="rm_rewards").describe()
            'model=hf:my-rm'
        """
        cfg = model if isinstance(model, HFModelConfig) else HFModelConfig(path=model)
        if isinstance(judge, str):
            judge = JudgeConfig(template=judge)
        node = RewardModelNode(name=name, model=cfg, judge=judge, output=output, batch_size=batch_size)
        return self.add(node, (rollouts,))

    def critic(
        self,
        name: str,
        rollouts: NodeRef,
        *rewards: NodeRef,
        model: ModelConfig | HFModelConfig | None = None,
        optimizer: OptimizerConfig | None = None,
        lora: LoraConfig | dict[str, Any] | None = None,
        value_clip: float | None = 0.2,
        **kwargs: Any,
    ) -> Node:
        """A trained value model (``flowrl.graph.critic``) reading ``rollouts`` and the reward nodes
        ``rewards``; keyword arguments are ``OptimizerConfig`` fields (its own optimizer).

        Without ``rewards`` it reads every scorer and reward model declared so far that reads
        ``rollouts`` (and a multi-turn generator's ``env_rewards``): list the same ones in the loss,
        which must have ``objective="ppo"``. ``model`` defaults to the builder's; ``lora`` adapts a
        Hugging Face model as ``policy``'s does (the value head trains in full).

        Example:
            >>> b = GraphBuilder("ppo")
            >>> gen = b.generator("gen", b.source("prompts", task="copy"))
            >>> reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
            >>> critic = b.critic("critic", gen, lr=1e-3)
            >>> b.loss("ppo", gen, reward, critic, objective="ppo", gamma=1.0, lam=0.95).describe()
            'ppo, eps=0.2, gamma=1, lam=0.95'
        """
        if optimizer is None and "lr" not in kwargs:
            kwargs["lr"] = self._kind_default(name, "lr", model or self.model, OptimizerConfig().lr)
        cfg = _config(OptimizerConfig, optimizer, kwargs, f"critic {name!r}")
        self._no_leftovers("critic", name, kwargs)
        source = self._lookup(rollouts, reader=name)
        readers = [self._lookup(r, reader=name) for r in rewards] or [
            n for n in self._nodes
            if isinstance(n, (ScorerNode, RewardModelNode)) and any(e.src == source.name and e.dst == n.name for e in self._edges)
        ]
        fields = [n.output for n in readers if isinstance(n, (ScorerNode, RewardModelNode))]
        fields += ["env_rewards"] if isinstance(source, GeneratorNode) and source.env is not None else []
        if not fields:
            raise ConfigError(
                f"critic {name!r}: no reward to learn the value of: declare the scorer first (b.scorer(..., {source.name!r}, ...)) "
                f"or list it: b.critic({name!r}, {source.name!r}, reward)"
            )
        model = model or self.model
        if lora is not None:
            if not isinstance(model, HFModelConfig):
                raise ConfigError(f"critic {name!r}: lora= adapts a Hugging Face model; this critic's model is the built-in family ({model.short()})")
            model = msgspec.structs.replace(model, lora=lora)
        node = CriticNode(name=name, model=model, optimizer=cfg, value_clip=value_clip, rewards=tuple(fields))
        return self.add(node, (rollouts, *readers))

    def loss(self, name: str, *inputs: NodeRef, config: LossConfig | None = None, **kwargs: Any) -> Node:
        """The RL objective over the rollouts and rewards of ``inputs``; keyword arguments are ``LossConfig`` fields.

        With several scorers, ``reward_weights`` defaults to weight 1.0 for each scorer's output.
        ``objective="ppo"`` reads a critic's values (``critic()``), listed among ``inputs``.
        ``objective`` is a name (a built-in's, or one ``register_objective`` added: its row is copied
        into the config, so the graph file carries it) or an ``ObjectiveRow``; ``correction`` is a
        rollout correction's name (``"tis"``, ``"icepop"``, ``"seq_mask"``), a dict with ``kind`` and
        its thresholds, or a ``CorrectionConfig`` (``flowrl.graph.corrections``).

        Example:
            >>> b = GraphBuilder("g")
            >>> gen = b.generator("gen", b.source("prompts", task="copy"))
            >>> reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
            >>> b.loss("grpo", gen, reward, objective="grpo", correction={"kind": "icepop", "high": 3.0}).describe()
            'grpo, eps=0.2, baseline=group_mean, correction=icepop(low=0.5, high=3.0)'

        Raises:
            ConfigError: ``objective="ppo"`` without a critic among ``inputs``, or a critic with another
                objective; a correction on an objective that corrects already, or a bad threshold.
        """
        if config is None and "reward_weights" not in kwargs:
            read = [self._lookup(r, reader=name) for r in inputs]
            outputs = [n.output for n in read if isinstance(n, (ScorerNode, RewardModelNode))]
            # a generator with an environment brings its own rewards (flowrl.graph.envs)
            outputs += ["env_rewards" for n in read if isinstance(n, GeneratorNode) and n.env is not None]
            if outputs:
                kwargs["reward_weights"] = {o: 1.0 for o in outputs}
        owner = f"loss {name!r}"
        if isinstance(kwargs.get("objective"), ObjectiveRow):
            kwargs["row"] = kwargs["objective"]
            kwargs["objective"] = kwargs["row"].name
        elif kwargs.get("objective") in OBJECTIVES and kwargs["objective"] not in BUILTIN_OBJECTIVES:
            kwargs["row"] = OBJECTIVES[kwargs["objective"]]  # a user's row travels with the graph
        if "correction" in kwargs:
            kwargs["correction"] = correction_of(kwargs["correction"], owner=owner)
        try:
            cfg = _config(LossConfig, config, kwargs, owner)
        except ConfigError as exc:  # LossConfig's own checks: name the node
            raise ConfigError(str(exc) if str(exc).startswith(owner) else f"{owner}: {exc}") from None
        self._no_leftovers("loss", name, kwargs)
        self._check_reward_weights(name, cfg, inputs)
        self._check_critic(name, cfg, inputs)
        self._check_teacher(name, cfg, inputs)
        return self.add(LossNode(name=name, loss=cfg), inputs)

    def teacher(self, name: str, rollouts: NodeRef, *, model: ModelConfig | HFModelConfig | str) -> Node:
        """A frozen teacher model (``flowrl.graph.teacher``) scoring ``rollouts`` token by token for
        ``objective="opd"``; ``model`` is its own (a directory: a pretrained Hugging Face model), with
        the student's vocabulary."""
        cfg = HFModelConfig(path=model) if isinstance(model, str) else model
        return self.add(TeacherNode(name=name, model=cfg), (rollouts,))

    def _check_teacher(self, name: str, cfg: LossConfig, inputs: tuple[NodeRef, ...]) -> None:
        """Refuse ``"opd"`` without a teacher among ``inputs``, and a teacher listed for another objective."""
        teachers = [n.name for n in (self._lookup(r, reader=name) for r in inputs) if isinstance(n, TeacherNode)]
        if cfg.objective in READS_TEACHER and not teachers:
            gens = [n.name for n in self._nodes if isinstance(n, GeneratorNode)]
            raise ConfigError(
                f"loss {name!r}: objective={cfg.objective!r} distills from a teacher's per-token log-probs, and no teacher is listed; "
                f"declare one, teacher = b.teacher('teacher', {gens[0] if gens else 'gen'!r}, model=...), and list it: b.loss({name!r}, ..., teacher)"
            )
        if teachers and cfg.objective not in READS_TEACHER:
            raise ConfigError(
                f"loss {name!r}: objective={cfg.objective!r} does not read a teacher, but teacher {teachers[0]!r} is listed; "
                f"set objective='opd' (on-policy distillation), or drop the teacher"
            )

    def _check_critic(self, name: str, cfg: LossConfig, inputs: tuple[NodeRef, ...]) -> None:
        """Refuse ``"ppo"`` without a critic among ``inputs``, and a critic listed for another objective."""
        critics = [n.name for n in (self._lookup(r, reader=name) for r in inputs) if isinstance(n, CriticNode)]
        if reads_values(cfg) and not critics:
            gens = [n.name for n in self._nodes if isinstance(n, GeneratorNode)]
            raise ConfigError(
                f"loss {name!r}: objective={cfg.objective!r} takes its advantages from a critic's values, and none is listed; "
                f"declare one, critic = b.critic('critic', {gens[0] if gens else 'gen'!r}, lr=...), and list it: b.loss({name!r}, ..., critic) "
                "(or use objective='grpo', whose group baseline needs no critic)"
            )
        if critics and not reads_values(cfg):
            raise ConfigError(
                f"loss {name!r}: objective={cfg.objective!r} does not use a learned value, but critic {critics[0]!r} is listed; "
                "set objective='ppo' (GAE advantages from the critic), or drop the critic"
            )

    def _check_reward_weights(self, name: str, cfg: LossConfig, inputs: tuple[NodeRef, ...]) -> None:
        """Refuse a ``reward_weights`` key that none of the listed scorers writes, naming those they write."""
        listed = [self._lookup(r, reader=name) for r in inputs]
        scorers = [n for n in listed if isinstance(n, (ScorerNode, RewardModelNode))]
        produced = {f for n in listed for f in signature(n).outputs}
        missing = [k for k in cfg.reward_weights if k not in produced]
        if scorers and missing:
            present = sorted(s.output for s in scorers)
            raise GraphError(
                f"loss {name!r}: reward_weights names {', '.join(map(repr, missing))}, which none of its inputs produces; "
                f"the reward fields present are {present} (scorers {', '.join(s.name for s in scorers)}): "
                f"rename the key, or set output={missing[0]!r} on the scorer that computes it"
            )

    def policy(
        self,
        name: str,
        loss: NodeRef,
        *,
        model: AnyModelConfig | None = None,
        optimizer: OptimizerConfig | None = None,
        lora: LoraConfig | dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Node:
        """The trainer, stepping on ``loss``; keyword arguments are ``OptimizerConfig`` fields.

        ``lora`` (a ``LoraConfig`` or a dict of its fields, e.g. ``dict(r=8, alpha=16,
        target_modules=["q_proj", "v_proj"])``) trains low-rank adapters on the Hugging Face model
        instead of the model: it becomes the policy model's ``lora``, and a generator this policy's
        weights reach (``weights()``) samples from the same base model with those adapters.

        Raises:
            ConfigError: for ``lora`` on the built-in model (LoRA adapts Hugging Face models, through peft).
        """
        if optimizer is None and "lr" not in kwargs:
            kwargs["lr"] = self._kind_default(name, "lr", model or self.model, OptimizerConfig().lr)
        cfg = _config(OptimizerConfig, optimizer, kwargs, f"policy {name!r}")
        self._no_leftovers("policy", name, kwargs)
        model = model or self.model
        if lora is not None:
            if not isinstance(model, HFModelConfig):
                raise ConfigError(
                    f"policy {name!r}: lora= adapts a Hugging Face model (peft wraps transformers models), and this policy's "
                    f"model is the built-in family ({model.short()}); use model=HFModelConfig(path=DIR), or drop lora="
                )
            model = msgspec.structs.replace(model, lora=lora)  # HFModelConfig checks and converts a dict
        return self.add(PolicyNode(name=name, model=model, optimizer=cfg), (loss,))

    def weights(
        self, src: NodeRef, dst: NodeRef, *, transport: str = "inprocess", max_staleness: int | None = None, in_flight: bool = False
    ) -> WeightEdge:
        """A weight edge: ``src``'s trainable weights reach ``dst`` over ``transport``, at most
        ``max_staleness`` trainer steps (batches) behind when its rollouts are consumed; ``in_flight``
        lets a continuous generator take them between decode steps. ``max_staleness`` defaults, into
        a generator, to that of ``src``'s model kind (``flowrl.graph.defaults``: 0 for a pretrained
        Hugging Face model, 1 otherwise), and to 1 into another node."""
        src_name, dst_name = (ref if isinstance(ref, str) else ref.name for ref in (src, dst))
        if max_staleness is None:
            max_staleness = WeightEdge(src=src_name, dst=dst_name).max_staleness  # the edge's own default
            declared = {n.name: n for n in self._nodes}
            model = getattr(declared.get(src_name), "model", None)
            if isinstance(declared.get(dst_name), GeneratorNode) and model is not None:
                max_staleness = int(self._kind_default(f"{src_name}~>{dst_name}", "max_staleness", model, max_staleness))
        edge = WeightEdge(src=src_name, dst=dst_name, transport=transport, max_staleness=max_staleness, in_flight=in_flight)
        self._adopt_lora(edge)
        self._weight_edges.append(edge)
        return edge

    def _adopt_lora(self, edge: WeightEdge) -> None:
        """A generator fed by a LoRA policy (``policy(..., lora=)``) whose model is the policy's base
        model takes the policy's description, adapters included: it applies what the edge carries."""
        names = [n.name for n in self._nodes]
        if edge.src not in names or edge.dst not in names:
            return  # reported by build()
        src, i = self._nodes[names.index(edge.src)], names.index(edge.dst)
        src_model, dst_model = getattr(src, "model", None), getattr(self._nodes[i], "model", None)
        if (isinstance(src_model, HFModelConfig) and src_model.lora is not None and isinstance(dst_model, HFModelConfig)
                and dst_model.lora is None and msgspec.structs.replace(src_model, lora=None) == dst_model):
            self._nodes[i] = msgspec.structs.replace(self._nodes[i], model=src_model)

    def _with_tokenizers(self) -> tuple[Node, ...]:
        """The nodes, each data source without a ``tokenizer`` given that of the HF model it feeds."""
        nodes = []
        for node in self._nodes:
            if isinstance(node, SourceNode) and node.source.data and not node.source.tokenizer:
                fed = {e.dst for e in self._edges if e.src == node.name}
                models = [n.model for n in self._nodes if isinstance(n, GeneratorNode) and n.name in fed]
                paths = [m.tokenizer_path for m in models if isinstance(m, HFModelConfig)]
                if paths:
                    node = msgspec.structs.replace(node, source=msgspec.structs.replace(node.source, tokenizer=paths[0]))
            nodes.append(node)
        return tuple(nodes)

    def build(self) -> Graph:
        """Validate and return the graph; raises ``GraphError`` naming every broken rule, and warns
        (``GraphWarning``) about settings that are legal but most likely a mistake (``flowrl.graph.advice``)."""
        spec = GraphSpec(
            name=self.name,
            nodes=self._with_tokenizers(),
            edges=tuple(self._edges),
            weight_edges=tuple(self._weight_edges),
        )
        graph = Graph(spec, defaults=tuple(self._defaults))
        warn_about(graph)
        return graph
