"""Is a plan this graph's: its device nodes, their kinds and model shapes, and the step it priced.

A plan file names its graph and records what it placed and priced: each node's kind and devices,
the model shape of every device node (``Plan.models``), the step's workload (``Plan.workload``) and
its tuning. A graph of the same name can still be another graph (a node added, a model changed,
a plan made with ``--model qwen2.5-7b``). Two questions, two functions:

- ``graph_differences``: what makes the plan another graph's placement: device nodes it places that
  the graph lacks or the reverse, a node of another kind, a generator of another engine or a trainer
  of another sharding (``Plan.engines``, ``Plan.shardings``), a device node planned with another model
  shape (layers, width, heads, vocabulary, context, LoRA adapters). ``flowrl run --plan`` refuses a
  plan with any (``check_plan_graph``), naming them and the re-plan command.
- ``step_differences``: what the graph's run does otherwise than the plan priced: prompts per step,
  samples per prompt, completion length, batching, the generator's weight dtype. The placement still
  runs, but its predicted times are another step's; ``flowrl plan --emit`` refuses to hand over such
  a plan as "the run the plan describes".
- ``planned_for``: one line for a picture of the plan drawn on the graph (``flowrl viz --plan``):
  the model and step the plan's times are for, and the graph's own where they differ.

Model shapes are compared by their figures, not their names: a preset and a Hugging Face directory
of the same shape are the same model. Pure: the graph's shapes come from its config (an HF model
directory's ``config.json``), as the planner reads them.

Example:
    >>> from flowrl.examples import build_example
    >>> from flowrl.modelspec import model_preset
    >>> from flowrl.planners.plan import plan_graph
    >>> graph = build_example("llamarl")
    >>> graph_differences(plan_graph(graph, "cpu:2"), graph)
    []
    >>> big = plan_graph(graph, "64xH100", model=model_preset("qwen2.5-7b"))
    >>> graph_differences(big, graph)[0]
    "node 'gen' was planned as model qwen2.5-7b (n_layers 28, dim 3584, n_heads 28), but runs 2L64d here (n_layers 2, dim 64, n_heads 4)"
    >>> step_differences(big, graph)[:2]
    ['prompts per step: 256 in the plan, 16 here (--prompts-per-step 16)', 'samples per prompt: 8 in the plan, 16 here (--samples 16)']
    >>> planned_for(big, graph)
    "times for model qwen2.5-7b, 256 prompts x 8 samples of 512+2048 tokens (not the graph's own: model 2L64d, 16 prompts x 16 samples of up to 5 new tokens)"
"""

from __future__ import annotations

import msgspec

from flowrl.errors import PlanError
from flowrl.graph.ir import Graph
from flowrl.graph.nodes import DEVICE_KINDS, GeneratorNode
from flowrl.modelspec import ModelSpec
from flowrl.planners.plan_data import Plan
from flowrl.planners.workload import Workload, workload_from_graph

__all__ = ["graph_differences", "step_differences", "check_plan_graph", "graph_models", "graph_workload", "planned_for"]

#: Workload fields a graph decides (the others are the planner's estimates: prompt length, completion
#: lengths, environment time), with the words and the ``flowrl plan`` flag that sets each.
_STEP_FIELDS = (
    ("prompts_per_step", "prompts per step", "--prompts-per-step"),
    ("samples_per_prompt", "samples per prompt", "--samples"),
    ("gen_len", "completion length (max_new_tokens)", "--gen-len"),
    ("batching", "batching", "--batching"),
)


def graph_models(plan: Plan, graph: Graph) -> dict[str, ModelSpec] | None:
    """The model shape the planner gives each device node of ``graph`` (no ``--model``), in the
    plan's context; None when it cannot say (a plan file without its cluster or workload, or a
    model directory that cannot be read here: the run reports that itself)."""
    from flowrl.planners.estimate.common import Context
    from flowrl.planners.search import resolve_roles

    if plan.cluster_spec is None or plan.workload is None:
        return None
    try:
        roles = resolve_roles(graph, Context(cluster=plan.cluster_spec, workload=plan.workload, tuning=plan.tuning))
    except (PlanError, OSError):
        return None
    return dict(roles.models)


def graph_workload(graph: Graph) -> Workload | None:
    """The step ``graph`` runs (its source's batch, its generator's samples and lengths), or None
    when the graph does not say (no source or no generator)."""
    try:
        return workload_from_graph(graph)
    except PlanError:
        return None


def _shape(spec: ModelSpec) -> dict[str, object]:
    return {k: v for k, v in msgspec.structs.asdict(spec).items() if k != "name"}


def _model_difference(name: str, planned: ModelSpec, here: ModelSpec) -> str:
    a, b = _shape(planned), _shape(here)
    fields = [k for k in a if a[k] != b[k]][:3]
    return (
        f"node {name!r} was planned as model {planned.name} ({', '.join(f'{k} {a[k]}' for k in fields)}), "
        f"but runs {here.name} here ({', '.join(f'{k} {b[k]}' for k in fields)})"
    )


def graph_differences(plan: Plan, graph: Graph) -> list[str]:
    """What makes ``plan`` another graph's than ``graph`` (module docstring): one line each; [] when none."""
    out: list[str] = []
    if plan.graph != graph.name:
        out.append(f"the plan was made for graph {plan.graph!r}, not {graph.name!r}")
    kinds = {n.name: n.kind for n in graph.nodes}
    placed = {n: p.kind for n, p in plan.placements.items() if p.devices and p.kind in DEVICE_KINDS}
    here = {n for n, k in kinds.items() if k in DEVICE_KINDS}
    extra = sorted(set(placed) - here)
    missing = sorted(here - set(placed))
    if extra:
        out.append(f"the plan places {extra}, which graph {graph.name!r} {'does' if len(extra) == 1 else 'do'} not have as device nodes")
    out += [f"the plan places no devices for node {name!r} of graph {graph.name!r}" for name in missing]
    for name in sorted(set(placed) & here):
        if placed[name] != kinds[name]:
            out.append(f"node {name!r} is a {placed[name]} in the plan but a {kinds[name]} here")
    if out:
        return out  # the models of another set of nodes say nothing more
    for name, engine in plan.engines.items():
        runs = getattr(graph.node(name), "engine", engine) if name in kinds else engine
        if runs != engine:
            out.append(f"generator {name!r} was planned with the {engine} engine, but runs the {runs} engine here (--engine)")
    for name, sharding in plan.shardings.items():
        holds = getattr(getattr(graph.node(name), "optimizer", None), "sharding", sharding) if name in kinds else sharding
        if holds != sharding:
            out.append(f"{graph.node(name).kind} {name!r} was planned with sharding {sharding!r}, but holds its state as {holds!r} here (--sharding)")
    models = graph_models(plan, graph)
    for name, planned in plan.models.items():
        mine = (models or {}).get(name)
        if mine is not None and _shape(mine) != _shape(planned):
            out.append(_model_difference(name, planned, mine))
    return out


def step_differences(plan: Plan, graph: Graph) -> list[str]:
    """What ``graph``'s run does otherwise than ``plan`` priced (module docstring): one line each,
    naming the ``flowrl plan`` flag and value that plan the graph's; [] when the plan priced the graph's own step."""
    out: list[str] = []
    ours = graph_workload(graph)
    if plan.workload is not None and ours is not None:
        for field, words, flag in _STEP_FIELDS:
            a, b = getattr(plan.workload, field), getattr(ours, field)
            if a != b:
                out.append(f"{words}: {a} in the plan, {b} here ({flag} {b})")
    wanted = plan.tuning.gen_precision
    if wanted:
        for node in graph.nodes_of(GeneratorNode):
            if node.sampling.precision != wanted:
                out.append(f"generator {node.name!r} weights: {wanted} in the plan, {node.sampling.precision} here (--gen-precision {node.sampling.precision})")
    return out


def check_plan_graph(plan: Plan, graph: Graph, *, where: str, replan: str) -> None:
    """Refuse ``plan`` for ``graph`` when ``graph_differences`` finds any.

    Args:
        plan: the plan read from ``where``.
        graph: the graph as it will run (its ``--model``/``--engine``/``--sharding`` applied).
        where: how the plan is named in the message (``"--plan plan.json"``).
        replan: the command that makes a plan for this graph.

    Raises:
        PlanError: naming ``where``, every difference and ``replan``.
    """
    differences = graph_differences(plan, graph)
    if differences:
        raise PlanError(f"{where} was made for another graph than this run's: {'; '.join(differences)}; re-plan for this graph: {replan}")


def _step(w: Workload) -> str:
    return f"{w.prompts_per_step} prompts x {w.samples_per_prompt} samples of {w.prompt_len}+{w.gen_len} tokens"


def planned_for(plan: Plan, graph: Graph) -> str:
    """What the plan's times are for (its models and step) and, where they are not ``graph``'s own,
    the graph's (module docstring): one line for a picture's title."""
    planned = sorted({m.name for m in plan.models.values()})
    mine = graph_models(plan, graph) or {}
    other = sorted({m.name for n, m in mine.items() if n in plan.models and _shape(m) != _shape(plan.models[n])})
    w, ours = plan.workload, graph_workload(graph)
    said = ([f"model {', '.join(planned)}"] if planned else []) + ([_step(w)] if w is not None else [])
    differ = [f"model {', '.join(other)}"] if other else []
    if w is not None and ours is not None and any(getattr(w, f) != getattr(ours, f) for f, _, _ in _STEP_FIELDS):
        batching = f", {ours.batching} batching" if ours.batching != w.batching else ""
        differ.append(f"{ours.prompts_per_step} prompts x {ours.samples_per_prompt} samples of up to {ours.gen_len} new tokens{batching}")
    head = f"times for {', '.join(said)}" if said else "times"
    return f"{head} (not the graph's own: {', '.join(differ)})" if differ else f"{head} (the graph's own)"
