"""What the planner needs of one device node, per kind: its model shape and the options its cost reads.

Each device kind has its function in the planner's kind table (``flowrl.planners.kind_table.PLAN_ROLES``);
``planners.search.resolve_roles`` calls it as ``role(node, graph, ctx, model) -> NodeRole`` for every node of the kind. Which side of
the search costs the node comes from the table, not from here: ``side="generator"`` is priced as
generation (``estimate/generate.py``), ``side="trainer"`` as training when the kind publishes
weights (``publishes_weights``, a policy) or trains (``trains``, a critic) and as a forward-only
pass otherwise (a reference, a reward model). A new device kind writes its own function in its own module, or names one of these.

``model`` is the shape ``flowrl plan --model`` gives every node; a function returns it instead of
its node's own shape, without reading the node's model directory (which need not exist then), but
with the node's LoRA adapters (``model_shape``): ``--model`` changes the base model's shape, not
what the node trains and sends.

Example:
    >>> from flowrl.examples import build_example
    >>> from flowrl.planners.cluster import parse_cluster
    >>> from flowrl.planners.estimate.common import Context
    >>> from flowrl.planners.tuning import make_tuning
    >>> from flowrl.planners.workload import default_workload
    >>> g = build_example("llamarl_ref")
    >>> ctx = Context(cluster=parse_cluster("cpu:2"), workload=default_workload(g), tuning=make_tuning())
    >>> reference_role(g.node("ref"), g, ctx, None).model.name, policy_role(g.node("policy"), g, ctx, None).iterations
    ('2L64d', (1, 1))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from flowrl.graph.engines import DEFAULT_ENGINE
from flowrl.graph.objectives import recomputes_logprobs
from flowrl.modelspec import ModelSpec, lora_adapter_params, model_from_config, reward_model_spec
from flowrl.planners.estimate.generate import generator_dtype

if TYPE_CHECKING:
    from flowrl.graph.ir import Graph
    from flowrl.planners.estimate.common import Context

__all__ = ["NodeRole", "model_shape", "generator_role", "policy_role", "critic_role", "reference_role", "reward_model_role"]


@dataclass(frozen=True)
class NodeRole:
    """The planner's facts about one device node (``search.Roles`` gathers them per graph).

    Attributes:
        model: its model's shape.
        dtype: a generator-side node's weight dtype (``""``: a trainer-side node, which uses the
            trainer's ``param_bytes``).
        engine: a generator-side node's engine (``"builtin"`` or ``"vllm"``).
        memory_fraction: a generator's own share of each GPU its engine claims at start (``VLLMConfig.
            gpu_memory_utilization``); 0: the engine's (``EngineCaps.cuda_memory_fraction``).
        recompute: a training node's step runs the extra no-gradient log-prob forward (log pi_prox:
            ``flowrl.graph.objectives.recomputes_logprobs``, the trainer's rule).
        iterations: a training node's (passes over a batch, optimizer steps a batch).
        micro_batch: a training node's optimizer micro-batch (0: the estimate chooses).
        last_logits: a forward-only node that computes each sequence's last-position logits only.
        extra_tokens: a forward-only node's tokens per sequence beyond the prompt and the completion.
    """

    model: ModelSpec
    dtype: str = ""
    engine: str = DEFAULT_ENGINE
    memory_fraction: float = 0.0
    recompute: bool = False
    iterations: tuple[int, int] = (1, 1)
    micro_batch: int = 0
    last_logits: bool = False
    extra_tokens: int = 0


def model_shape(config: Any, model: ModelSpec | None) -> ModelSpec:
    """A node's model shape: ``config``'s own (``model_from_config``), or with ``model`` (``flowrl plan
    --model``) that shape carrying ``config``'s LoRA adapters, counted on it (``lora_adapter_params``).

    Example:
        >>> from flowrl.graph.configs import HFModelConfig
        >>> from flowrl.modelspec import model_preset
        >>> lora = HFModelConfig(path="unread", lora=dict(r=8, alpha=16, target_modules=["q_proj", "v_proj"]))
        >>> model_shape(lora, model_preset("qwen2.5-7b")).adapter_params * 4 / 2**20  # float32 MiB
        9.625
        >>> model_shape(HFModelConfig(path="unread"), model_preset("qwen2.5-7b")).adapter_params
        0
    """
    if model is None:
        return model_from_config(config)
    lora = getattr(config, "lora", None)
    if lora is None:
        return model
    return msgspec.structs.replace(model, adapter_params=lora_adapter_params(model, lora.r, lora.target_modules))


def generator_role(node: Any, graph: Graph, ctx: Context, model: ModelSpec | None) -> NodeRole:
    """A generator: its model, weight dtype (``--gen-precision`` over its sampling precision) and engine."""
    share = node.vllm.gpu_memory_utilization if node.vllm is not None else None
    return NodeRole(
        model=model_shape(node.model, model), dtype=generator_dtype(node.sampling.precision, ctx), engine=node.engine,
        memory_fraction=share or 0.0,
    )


def policy_role(node: Any, graph: Graph, ctx: Context, model: ModelSpec | None) -> NodeRole:
    """A policy: its model, micro-batch, passes and updates a batch, and whether its step recomputes
    log-probs: the trainer's own rule (``flowrl.graph.objectives.recomputes_logprobs``) unless
    ``Tuning.recompute_logprobs`` says otherwise (a what-if, or a baseline system's choice)."""
    loss = graph.loss_of(node.name)
    objective = getattr(loss, "loss", None) or "aipo"  # its LossConfig: the row it carries or names
    opt = node.optimizer
    recompute = recomputes_logprobs(objective, updates_per_batch=opt.updates_per_batch)
    if ctx.tuning.recompute_logprobs is not None:
        recompute = ctx.tuning.recompute_logprobs
    return NodeRole(
        model=model_shape(node.model, model),
        recompute=recompute,
        iterations=(opt.num_iterations, opt.updates_per_batch),
        micro_batch=opt.micro_batch_size,
    )


def critic_role(node: Any, graph: Graph, ctx: Context, model: ModelSpec | None) -> NodeRole:
    """A critic, priced like a policy (``KindSpec.trains``): its model, micro-batch and passes a batch,
    and the extra forward of the values it writes before it trains (``recompute``)."""
    opt = node.optimizer
    return NodeRole(
        model=model_shape(node.model, model),
        recompute=True,
        iterations=(opt.num_iterations, opt.updates_per_batch),
        micro_batch=opt.micro_batch_size,
    )


def reference_role(node: Any, graph: Graph, ctx: Context, model: ModelSpec | None) -> NodeRole:
    """A frozen model's forward pass over each sequence: just its model."""
    return NodeRole(model=model_shape(node.model, model))


def reward_model_role(node: Any, graph: Graph, ctx: Context, model: ModelSpec | None) -> NodeRole:
    """A reward model, a forward pass like a reference's, with the shape of ``reward_model_spec``: a
    classifier's score head; a ``logprob`` judge's logits at the last position only; a ``regex``
    judge's forward also over its ``max_new_tokens`` answer."""
    judge = node.judge
    return NodeRole(
        model=model or reward_model_spec(node.model, judge=judge is not None),
        last_logits=judge is not None and judge.verdict == "logprob",
        extra_tokens=judge.max_new_tokens if judge is not None and judge.verdict != "logprob" else 0,
    )

