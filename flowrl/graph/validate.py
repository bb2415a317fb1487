"""The rules a graph must keep, each checked by a small function that raises ``GraphError``.

Every message names the node(s), the broken rule, the values involved and the fix. ``problems``
lists every broken rule; ``validate_graph`` raises on the first, with the others listed after it.

Among the rules: ``_check_updates`` (mini-batches of whole groups divide the batch; one
updates-per-batch count for every policy; none with continuous batching) and
``_check_reference_sync`` (a reference syncs exactly when a weight edge from its policy reaches it). A
transport's, task's or objective's name is checked for its form only; whether it exists is the run's
question (``flowrl.runtime.names``).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable

from flowrl.errors import GraphError
from flowrl.graph.fields import OPTIONAL_FIELDS, REWARD_TYPE
from flowrl.graph.kinds import KINDS
from flowrl.graph.nodes import IN_POLICY_KINDS, TRAINABLE_KINDS, WEIGHT_HOLDING_KINDS, GeneratorNode, LossNode, Node, PolicyNode, ReferenceNode, ScorerNode, SourceNode, signature
from flowrl.graph.critic import critic_problems, no_critic
from flowrl.graph.teacher import no_teacher, teacher_problems
from flowrl.graph.refs import check_reference
from flowrl.graph.structure import SCHEMA_VERSION, tokenizer_path
from flowrl.graph.structure import GraphStructure as Graph  # the rules read the structure; ir.Graph runs them

__all__ = ["validate_graph", "problems", "NAME_RE", "TRANSPORT_NAME_RE", "REGISTRY_NAME_RE"]

NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
#: The form of a transport name (``flowrl.runtime.transports.register_transport`` checks it too).
TRANSPORT_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]*$")
#: The form of a built-in task's or an objective's name; which names exist is checked at run start
#: (``flowrl.runtime.names``), against the registries (``TASKS``, ``OBJECTIVES``).
REGISTRY_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")


def _check_schema(g: Graph) -> Iterable[str]:
    if g.spec.schema_version != SCHEMA_VERSION:
        yield (
            f"graph {g.name!r} has schema_version {g.spec.schema_version}, this flowrl reads "
            f"{SCHEMA_VERSION}; re-export the graph with this version of flowrl"
        )
    if not g.nodes:
        yield f"graph {g.name!r} has no nodes; declare at least a source, a generator, a scorer, a loss and a policy"


def _check_names(g: Graph) -> Iterable[str]:
    for name, count in Counter(n.name for n in g.nodes).items():
        if count > 1:
            yield f"duplicate node name {name!r} (declared {count} times); give each node its own name"
    for n in g.nodes:
        if not NAME_RE.match(n.name):
            yield (
                f"node name {n.name!r} is not an identifier; use letters, digits and '_' "
                "(at most 64, not starting with a digit) so that it can name files, ranks and pictures"
            )


def _check_edge_ends(g: Graph) -> Iterable[str]:
    for e in g.edges:
        for end in (e.src, e.dst):
            if end not in g:
                yield f"data edge {e.src} -> {e.dst} names node {end!r}, which does not exist; declare it or remove the edge"
        if e.src == e.dst:
            yield f"data edge {e.src} -> {e.dst} connects node {e.src!r} to itself; remove it"
        if not e.fields:
            yield f"data edge {e.src} -> {e.dst} carries no fields; name the fields node {e.dst!r} reads from {e.src!r}, or remove the edge"
    for (src, dst), count in Counter((e.src, e.dst) for e in g.edges).items():
        if count > 1:
            yield f"data edge {src} -> {dst} is declared {count} times; merge their fields into one edge"
    for w in g.weight_edges:
        for end in (w.src, w.dst):
            if end not in g:
                yield f"weight edge {w.src} ~> {w.dst} names node {end!r}, which does not exist; declare it or remove the edge"


def _check_cycle(g: Graph) -> Iterable[str]:
    cycle = g.find_cycle()
    if cycle:
        yield (
            f"data edges form a cycle: {' -> '.join(cycle)}; data must flow one way. The RL loop "
            "closes through a weight edge (policy ~> generator), not a data edge"
        )


def _check_fields(g: Graph) -> Iterable[str]:
    supplied: dict[tuple[str, str], list[str]] = {}
    for e in g.edges:
        if e.src not in g or e.dst not in g:
            continue
        out = signature(g.node(e.src)).outputs
        inp = signature(g.node(e.dst)).inputs
        for fname, ftype in e.fields.items():
            supplied.setdefault((e.dst, fname), []).append(e.src)
            if fname not in out:
                yield (
                    f"data edge {e.src} -> {e.dst} carries field {fname!r}, which node {e.src!r} "
                    f"({g.node(e.src).kind}) does not produce; it produces {sorted(out)}"
                )
            elif out[fname] != ftype:
                yield (
                    f"field {fname!r} on edge {e.src} -> {e.dst} is declared {ftype} but node {e.src!r} "
                    f"produces {out[fname]}; make the types agree"
                )
            if fname not in inp:
                yield (
                    f"data edge {e.src} -> {e.dst} carries field {fname!r}, which node {e.dst!r} "
                    f"({g.node(e.dst).kind}) does not read; it reads {sorted(inp)}"
                )
            elif inp[fname] != ftype:
                yield (
                    f"field type mismatch on {fname!r}: edge {e.src} -> {e.dst} carries {ftype} but node "
                    f"{e.dst!r} reads {inp[fname]}; make producer and consumer agree"
                )
    for node in g.nodes:
        for fname in signature(node).inputs:
            srcs = supplied.get((node.name, fname), [])
            if not srcs and fname not in OPTIONAL_FIELDS:
                if isinstance(node, LossNode) and fname == "ref_logprobs":
                    yield _no_reference(g, node)
                    continue
                if node.kind == "loss" and fname == "teacher_logprobs":
                    yield no_teacher(g, node)
                    continue
                if node.kind == "loss" and fname in ("values", "value_version"):
                    if fname == "values":  # one message for the critic's two fields
                        yield no_critic(g, node)
                    continue
                hint = (
                    f"add a scorer with output={fname!r} feeding it, or drop {fname!r} from the loss's reward_weights; "
                    + _reward_fields_present(g)
                    if node.kind == "loss" and fname in getattr(node, "loss").reward_weights
                    else "connect a node that produces it"
                )
                yield f"input field {fname!r} of node {node.name!r} ({node.kind}) is produced by no node; {hint}"
            elif len(set(srcs)) > 1:
                yield (
                    f"input field {fname!r} of node {node.name!r} comes from {len(set(srcs))} nodes "
                    f"({', '.join(sorted(set(srcs)))}); exactly one must provide it (rename a scorer's output)"
                )


def _no_reference(g: Graph, loss: LossNode) -> str:
    """A loss with a KL penalty and no reference node feeding it: the builder calls that add one."""
    gens = [p.name for p in g.producers(loss.name) if p.kind == "generator"] or [n.name for n in g.nodes_of_kind("generator")]
    gen = gens[0] if gens else "gen"
    return (
        f"loss {loss.name!r} has kl_coef={loss.loss.kl_coef:g}, a KL penalty to a reference policy, but no reference "
        f"node feeds it; add one: ref = b.reference('ref', {gen!r}), and list it: b.loss({loss.name!r}, ..., ref) "
        "(or set kl_coef=0)"
    )


def _writes_rewards(node: Node) -> bool:
    """Whether ``node`` writes per-sample rewards and nothing else (a scorer, a reward model, a kind like them)."""
    outputs = signature(node).outputs
    return bool(outputs) and all(t == REWARD_TYPE for t in outputs.values())


def _reward_fields_present(g: Graph) -> str:
    """The reward fields the graph's scorers write, for a message about one that none writes."""
    scorers = [n for n in g.nodes if _writes_rewards(n)]
    if not scorers:
        return "the graph has no scorer yet (b.scorer(...))"
    fields = sorted({f for s in scorers for f in signature(s).outputs})
    return f"the reward fields present are {fields} (scorers {', '.join(sorted(s.name for s in scorers))})"


def _check_unused(g: Graph) -> Iterable[str]:
    """Every node but a policy must feed some node: an unread scorer is a reward silently ignored."""
    for node in g.nodes:
        outputs = sorted(signature(node).outputs)
        if outputs and not g.out_edges(node.name):
            hint = (
                f"pass it to the loss (builder.loss(..., {node.name!r})) so that its reward counts"
                if _writes_rewards(node)
                else f"list it in a loss with objective='opd' (builder.loss(..., {node.name!r}, objective='opd')) so that the student distills from it"
                if node.kind == "teacher"
                else "connect it to a node that reads them"
            )
            yield f"node {node.name!r} ({node.kind}) writes {outputs} but no node reads them; {hint}, or remove it"


def _check_losses(g: Graph) -> Iterable[str]:
    """A kind that runs inside its policy's step (a loss) feeds exactly one trainer; a trainer (a policy) is fed by exactly one."""
    for loss in (n for n in g.nodes if n.kind in IN_POLICY_KINDS):
        policies = [u.name for u in g.users(loss.name) if u.kind in TRAINABLE_KINDS]
        if len(policies) != 1:
            yield (
                f"loss {loss.name!r} feeds {len(policies)} policies {policies}; a loss runs inside exactly "
                "one policy's training step: connect it to one policy"
            )
    for policy in (n for n in g.nodes if n.kind in TRAINABLE_KINDS):
        losses = [p.name for p in g.producers(policy.name) if p.kind in IN_POLICY_KINDS]
        if len(losses) != 1:
            yield f"policy {policy.name!r} is fed by {len(losses)} losses {losses}; connect exactly one loss node"


def _check_weight_edges(g: Graph) -> Iterable[str]:
    for w in g.weight_edges:
        label = f"weight edge {w.src} ~> {w.dst}"
        if w.src in g and g.node(w.src).kind not in TRAINABLE_KINDS:
            yield (
                f"{label} starts at {w.src!r}, a {g.node(w.src).kind} without trainable weights; "
                f"weights flow from a {'/'.join(sorted(TRAINABLE_KINDS))} node"
            )
        if w.dst in g and g.node(w.dst).kind not in WEIGHT_HOLDING_KINDS:
            yield (
                f"{label} ends at {w.dst!r}, a {g.node(w.dst).kind} that holds no weights; "
                f"weights flow into a {'/'.join(sorted(WEIGHT_HOLDING_KINDS - TRAINABLE_KINDS))} node"
            )
        if w.src == w.dst:
            yield f"{label} connects {w.src!r} to itself; remove it"
        if not TRANSPORT_NAME_RE.match(w.transport):  # which names exist is the run's registry's business
            yield (
                f"{label} names transport {w.transport!r}, which is not a transport name: use letters, digits, "
                "'_', '-' and '.', starting with a letter (a built-in such as 'inprocess', or one you register "
                "with flowrl.runtime.transports.register_transport)"
            )
        if w.max_staleness < 0:
            yield f"{label} has max_staleness={w.max_staleness}; it must be >= 0 (0 is synchronous on-policy training)"
        src, dst = g.node(w.src) if w.src in g else None, g.node(w.dst) if w.dst in g else None
        if w.in_flight and getattr(getattr(dst, "sampling", None), "batching", None) != "continuous":
            yield (
                f"{label} has in_flight=True, but {w.dst!r} is not a generator with batching='continuous' "
                "(a lock-step generator takes weights between batches only); set the generator's batching or drop in_flight"
            )
        src_model, dst_model = getattr(src, "model", None), getattr(dst, "model", None)
        if src_model is not None and dst_model is not None and src_model != dst_model:
            yield f"{label}: model configs differ ({src_model.short()} vs {dst_model.short()}); weights can only move between models of the same config"
    for receiver, count in Counter(w.dst for w in g.weight_edges).items():
        if count > 1:
            yield f"node {receiver!r} receives weights over {count} weight edges; keep one"
    for node in g.nodes:
        if isinstance(node, GeneratorNode) and node.sampling.batching == "continuous":  # a generator's own setting
            feeds = [g.node(e.src) for e in g.edges if e.dst == node.name and e.src in g]  # a missing node is reported by the edge rules
            if len(feeds) != 1 or feeds[0].kind != "source" or any(e.dst != node.name for e in g.edges if e.src == feeds[0].name):
                yield (
                    f"generator {node.name!r} has batching='continuous', which reads prompts ahead from one source that "
                    f"feeds only it; it is fed by {[n.name for n in feeds]}: give it its own source or use batching='lockstep'"
                )
        if KINDS[node.kind].waits_for_weights and not g.weight_edges_into(node.name):  # gated on the version clock (the table)
            yield (
                f"{node.kind} {node.name!r} receives no weights, so it would sample with its initial weights forever; "
                f"add a weight edge from the policy (builder.weights(policy, {node.name!r}))"
            )


def _check_reference_sync(g: Graph) -> Iterable[str]:
    """A reference syncs (``ReferenceConfig.sync_steps``) exactly when the policy's weights reach it
    over a weight edge, and mixes the whole model: a LoRA policy sends its adapters only."""
    for node in g.nodes:
        if not isinstance(node, ReferenceNode):
            continue
        into = g.weight_edges_into(node.name)
        steps = node.reference.sync_steps
        if steps and not into:
            policies = [n.name for n in g.nodes if n.kind in TRAINABLE_KINDS] or ["policy"]
            yield (
                f"reference {node.name!r} has sync_steps={steps} (mix in the policy every {steps} trainer steps) but receives "
                f"no weights; add a weight edge from the policy: b.weights({policies[0]!r}, {node.name!r}), or set sync_steps=0"
            )
        if not steps and into:
            yield (
                f"weight edge {into[0].src} ~> {node.name} feeds reference {node.name!r}, which is frozen (sync_steps=0) and "
                f"would never read it; give it sync_steps=N to mix in the policy every N trainer steps, or remove the edge"
            )
        for edge in into:
            src_model = getattr(g.node(edge.src), "model", None) if edge.src in g else None
            if steps and getattr(src_model, "lora", None) is not None:
                yield (
                    f"reference {node.name!r} syncs with {edge.src!r}, a LoRA policy, which sends its adapters only; the "
                    "reference mixes whole models: drop sync_steps (the reference stays the base model) or train the whole model"
                )


def _check_updates(g: Graph) -> Iterable[str]:
    """Several updates per batch (``OptimizerConfig.num_iterations`` / ``num_mini_batches``): mini-batches
    of whole prompt groups divide the batch; the version clock advances alike for every policy."""
    counts = {p.name: p.optimizer.updates_per_batch for p in g.nodes_of(PolicyNode)}
    if len(set(counts.values())) > 1:
        yield (
            f"policies take different numbers of optimizer steps per batch {counts} (num_iterations * num_mini_batches); "
            "the run's one version clock advances by one count per batch: give every policy the same"
        )
    for policy in g.nodes_of(PolicyNode):
        opt = policy.optimizer
        for w in g.weight_edges:
            if w.src != policy.name or w.dst not in g:
                continue
            gen = g.node(w.dst)
            for e in g.edges:
                src = g.node(e.src) if e.src in g else None
                if e.dst != gen.name or not isinstance(src, SourceNode):
                    continue
                prompts = src.source.batch_size
                if prompts % opt.num_mini_batches:
                    fits = [m for m in range(1, prompts + 1) if prompts % m == 0]
                    yield (
                        f"policy {policy.name!r}: num_mini_batches={opt.num_mini_batches} does not divide the "
                        f"{prompts} prompts of a batch (source {src.name!r} batch_size={prompts}); a mini-batch holds "
                        f"whole prompt groups: use one of {fits}, or change batch_size"
                    )


def _check_scorers(g: Graph) -> Iterable[str]:
    for node in g.nodes:
        if isinstance(node, ScorerNode):
            message = check_reference(node.fn)
            if message:
                yield f"scorer {node.name!r}: {message}"


def _check_sources(g: Graph) -> Iterable[str]:
    """A task is a name or a reference; a prompt file needs a tokenizer: its own, or that of the
    Hugging Face model it feeds (no file is read). Whether a task name is built in is checked at run start."""
    for node in g.nodes_of(SourceNode):
        cfg = node.source
        if cfg.data:
            if not tokenizer_path(g, node.name):
                yield (
                    f"source {node.name!r} reads prompt file {cfg.data!r} but has no tokenizer to encode it; set "
                    "tokenizer='DIR' (a local tokenizer directory) or feed it to a generator with a Hugging Face model"
                )
            continue
        task = cfg.task
        if isinstance(task, str) and (REGISTRY_NAME_RE.match(task) or check_reference(task) is None):
            continue
        yield (
            f"source {node.name!r}: task {task!r} is neither a task name nor a reference; name a built-in task "
            "('flowrl examples' lists the pipelines using them) or a factory (seed) -> Task as "
            "'package.module:function' or 'path/to/file.py:function'"
        )


def _check_objectives(g: Graph) -> Iterable[str]:
    for node in g.nodes_of(LossNode):
        objective = node.loss.objective
        if not REGISTRY_NAME_RE.match(objective):
            yield f"loss {node.name!r}: objective {objective!r} is not an objective name (letters, digits and '_'), e.g. 'aipo'"


RULES: tuple[Callable[[Graph], Iterable[str]], ...] = (
    _check_schema,
    _check_names,
    _check_edge_ends,
    _check_cycle,
    _check_fields,
    _check_unused,
    _check_losses,
    _check_weight_edges,
    _check_reference_sync,
    _check_updates,
    _check_scorers,
    _check_sources,
    _check_objectives,
    critic_problems,
    teacher_problems,
)


def problems(g: Graph) -> list[str]:
    """Every broken rule of ``g``, as messages; empty for a valid graph."""
    found: list[str] = []
    for rule in RULES:
        found.extend(rule(g))
    return found


def validate_graph(g: Graph) -> None:
    """Raise ``GraphError`` if ``g`` breaks any rule; the message lists every broken rule."""
    found = problems(g)
    if found:
        more = "".join(f"\n  also: {p}" for p in found[1:])
        raise GraphError(f"invalid graph {g.name!r}: {found[0]}{more}")
