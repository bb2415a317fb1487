"""Validation: every rule, injected as a single defect into random valid graphs, is caught naming the right node."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import NamedTuple

import msgspec
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from flowrl.errors import GraphError
from flowrl.graph.configs import ModelConfig
from flowrl.graph.fields import FIELDS, FieldType
from flowrl.graph.ir import DataEdge, Graph, GraphSpec, WeightEdge
from flowrl.graph.nodes import LossNode, PolicyNode, ScorerNode, signature
from flowrl.graph.validate import problems, validate_graph
from tests.graph.strategies import valid_graphs

replace = msgspec.structs.replace


class Defect(NamedTuple):
    """A broken graph, the message pattern that must report it, and the node names it must name."""

    spec: GraphSpec
    pattern: str
    names: tuple[str, ...]


def _names(spec: GraphSpec, kind: str | None = None) -> list[str]:
    return [n.name for n in spec.nodes if kind is None or n.kind == kind]


def _fresh(spec: GraphSpec, stem: str) -> str:
    taken = set(_names(spec))
    name, i = stem, 0
    while name in taken:
        i += 1
        name = f"{stem}{i}"
    return name


def _node(spec: GraphSpec, name: str):
    return next(n for n in spec.nodes if n.name == name)


def _pick(data: st.DataObject, options: list, what: str):
    assume(options)
    return data.draw(st.sampled_from(options), label=what)


def _pipeline(spec: GraphSpec, data: st.DataObject) -> tuple[str, str, str, str]:
    """A random pipeline's (generator, loss, policy, weight-edge index) names."""
    w_index = data.draw(st.integers(0, len(spec.weight_edges) - 1), label="weight edge")
    w = spec.weight_edges[w_index]
    loss = next(e.src for e in spec.edges if e.dst == w.src)
    return w.dst, loss, w.src, str(w_index)


# -- one function per rule: (valid spec, data) -> Defect ---------------------------------------------
def duplicate_name(spec: GraphSpec, data: st.DataObject) -> Defect:
    victim = _pick(data, list(spec.nodes), "node")
    return Defect(replace(spec, nodes=(*spec.nodes, victim)), r"duplicate node name '[^']+' \(declared 2 times\)", (victim.name,))


def bad_name(spec: GraphSpec, data: st.DataObject) -> Defect:
    old = _pick(data, _names(spec), "node")
    new = data.draw(st.sampled_from([f"{old}-x", f"9{old}", f"{old} x", "", f"{old}{'y' * 64}"]), label="bad name")
    ren = lambda s: new if s == old else s  # noqa: E731
    spec = replace(
        spec,
        nodes=tuple(replace(n, name=ren(n.name)) for n in spec.nodes),
        edges=tuple(replace(e, src=ren(e.src), dst=ren(e.dst)) for e in spec.edges),
        weight_edges=tuple(replace(w, src=ren(w.src), dst=ren(w.dst)) for w in spec.weight_edges),
    )
    return Defect(spec, r"node name '[^']*' is not an identifier", (new,) if new else ())


def edge_to_missing_node(spec: GraphSpec, data: st.DataObject) -> Defect:
    src = _pick(data, _names(spec, "source"), "source")
    ghost = _fresh(spec, "ghost")
    edge = DataEdge(src=src, dst=ghost, fields={"prompt_ids": FIELDS["prompt_ids"]})
    return Defect(replace(spec, edges=(*spec.edges, edge)), r"names node '[^']+', which does not exist", (ghost,))


def self_data_edge(spec: GraphSpec, data: st.DataObject) -> Defect:
    gen = _pick(data, _names(spec, "generator"), "generator")
    edge = DataEdge(src=gen, dst=gen, fields={"prompt_index": FIELDS["prompt_index"]})
    return Defect(replace(spec, edges=(*spec.edges, edge)), r"connects node '[^']+' to itself", (gen,))


def data_cycle(spec: GraphSpec, data: st.DataObject) -> Defect:
    gen, loss, _, _ = _pipeline(spec, data)
    edge = DataEdge(src=loss, dst=gen, fields={"objective": FIELDS["objective"]})
    return Defect(replace(spec, edges=(*spec.edges, edge)), r"data edges form a cycle: ", (gen, loss))


def unproduced_input(spec: GraphSpec, data: st.DataObject) -> Defect:
    gen = _pick(data, _names(spec, "generator"), "generator")
    edges = tuple(e for e in spec.edges if e.dst != gen)
    return Defect(replace(spec, edges=edges), r"input field 'prompt_ids' of node '[^']+' \(generator\) is produced by no node", (gen,))


def unproduced_reward(spec: GraphSpec, data: st.DataObject) -> Defect:
    loss = _pick(data, _names(spec, "loss"), "loss")
    node = _node(spec, loss)
    missing = _fresh(spec, "reward_nobody_writes")
    cfg = replace(node.loss, reward_weights={**node.loss.reward_weights, missing: 1.0})
    nodes = tuple(replace(n, loss=cfg) if n.name == loss else n for n in spec.nodes)
    return Defect(replace(spec, nodes=nodes), rf"input field '{missing}' of node '[^']+' \(loss\) is produced by no node; add a scorer", (loss,))


def kl_without_reference(spec: GraphSpec, data: st.DataObject) -> Defect:
    options = [n for n in spec.nodes if isinstance(n, LossNode) and n.loss.kl_coef == 0]
    node = _pick(data, options, "loss without reference")
    nodes = tuple(replace(n, loss=replace(n.loss, kl_coef=0.5)) if n.name == node.name else n for n in spec.nodes)
    return Defect(replace(spec, nodes=nodes), r"loss '[^']+' has kl_coef=0.5, a KL penalty to a reference policy, but no reference node feeds it; add one: ref = b.reference", (node.name,))


def unused_reference(spec: GraphSpec, data: st.DataObject) -> Defect:
    ref = _pick(data, _names(spec, "reference"), "reference")
    loss = next(e.dst for e in spec.edges if e.src == ref)
    nodes = tuple(replace(n, loss=replace(n.loss, kl_coef=0.0)) if n.name == loss else n for n in spec.nodes)
    edges = tuple(e for e in spec.edges if e.src != ref)
    return Defect(replace(spec, nodes=nodes, edges=edges), r"node '[^']+' \(reference\) writes \['ref_logprobs'\] but no node reads them", (ref,))


def unused_scorer(spec: GraphSpec, data: st.DataObject) -> Defect:
    gen = _pick(data, _names(spec, "generator"), "generator")
    name = _fresh(spec, "forgotten")
    scorer = ScorerNode(name=name, fn="my.mod:score", output=_fresh(spec, "reward_forgotten"))
    edge = DataEdge(src=gen, dst=name, fields=dict(signature(scorer).inputs))
    spec = replace(spec, nodes=(*spec.nodes, scorer), edges=(*spec.edges, edge))
    return Defect(spec, r"node '[^']+' \(scorer\) writes .* but no node reads them; pass it to the loss", (name,))


def _edge_index(spec: GraphSpec, data: st.DataObject, ok: Callable[[DataEdge], bool] = lambda e: True) -> int:
    return _pick(data, [i for i, e in enumerate(spec.edges) if ok(e)], "data edge")


def _with_edge(spec: GraphSpec, i: int, edge: DataEdge) -> GraphSpec:
    return replace(spec, edges=tuple(edge if j == i else e for j, e in enumerate(spec.edges)))


def field_type_mismatch(spec: GraphSpec, data: st.DataObject) -> Defect:
    i = _edge_index(spec, data)
    e = spec.edges[i]
    fname = data.draw(st.sampled_from(sorted(e.fields)), label="field")
    wrong = FieldType(dtype="bool" if e.fields[fname].dtype != "bool" else "int64", dims=("nope",))
    spec = _with_edge(spec, i, replace(e, fields={**e.fields, fname: wrong}))
    return Defect(spec, rf"field type mismatch on '{fname}': edge \S+ -> \S+ carries bool|int64\[nope\] but node '[^']+' reads", (e.dst,))


def field_not_produced(spec: GraphSpec, data: st.DataObject) -> Defect:
    i = _edge_index(spec, data, lambda e: "objective" not in e.fields)
    e = spec.edges[i]
    spec = _with_edge(spec, i, replace(e, fields={**e.fields, "objective": FIELDS["objective"]}))
    return Defect(spec, r"carries field 'objective', which node '[^']+' \(\w+\) does not produce", (e.src,))


def field_not_read(spec: GraphSpec, data: st.DataObject) -> Defect:
    names = {n.name: n for n in spec.nodes}
    i = _edge_index(spec, data, lambda e: isinstance(names[e.dst], ScorerNode))
    e = spec.edges[i]
    spec = _with_edge(spec, i, replace(e, fields={**e.fields, "behaviour_logprobs": FIELDS["behaviour_logprobs"]}))
    return Defect(spec, r"carries field 'behaviour_logprobs', which node '[^']+' \(scorer\) does not read", (e.dst,))


def empty_data_edge(spec: GraphSpec, data: st.DataObject) -> Defect:
    i = _edge_index(spec, data)
    e = spec.edges[i]
    return Defect(_with_edge(spec, i, replace(e, fields={})), r"data edge \S+ -> \S+ carries no fields", (e.src, e.dst))


def duplicate_data_edge(spec: GraphSpec, data: st.DataObject) -> Defect:
    e = spec.edges[_edge_index(spec, data)]
    return Defect(replace(spec, edges=(*spec.edges, e)), r"data edge \S+ -> \S+ is declared 2 times", (e.src, e.dst))


def two_producers(spec: GraphSpec, data: st.DataObject) -> Defect:
    scorer = _node(spec, _pick(data, _names(spec, "scorer"), "scorer"))
    twin = replace(scorer, name=_fresh(spec, "twin"))
    loss = next(e.dst for e in spec.edges if e.src == scorer.name)
    gen_edge = next(e for e in spec.edges if e.dst == scorer.name)
    edges = (*spec.edges, replace(gen_edge, dst=twin.name), DataEdge(src=twin.name, dst=loss, fields={scorer.output: FIELDS.get(scorer.output, signature(scorer).outputs[scorer.output])}))
    spec = replace(spec, nodes=(*spec.nodes, twin), edges=edges)
    return Defect(spec, rf"input field '{scorer.output}' of node '[^']+' comes from 2 nodes", (loss, scorer.name, twin.name))


def loss_without_policy(spec: GraphSpec, data: st.DataObject) -> Defect:
    _, loss, policy, _ = _pipeline(spec, data)
    edges = tuple(e for e in spec.edges if not (e.src == loss and e.dst == policy))
    return Defect(replace(spec, edges=edges), r"loss '[^']+' feeds 0 policies \[\]; a loss runs inside exactly one policy", (loss,))


def loss_two_policies(spec: GraphSpec, data: st.DataObject) -> Defect:
    _, loss, policy, _ = _pipeline(spec, data)
    second = replace(_node(spec, policy), name=_fresh(spec, "second_policy"))
    edge = DataEdge(src=loss, dst=second.name, fields={"objective": FIELDS["objective"]})
    spec = replace(spec, nodes=(*spec.nodes, second), edges=(*spec.edges, edge))
    return Defect(spec, r"loss '[^']+' feeds 2 policies", (loss, policy, second.name))


def policy_two_losses(spec: GraphSpec, data: st.DataObject) -> Defect:
    _, loss, policy, _ = _pipeline(spec, data)
    twin = replace(_node(spec, loss), name=_fresh(spec, "twin_loss"))
    copies = tuple(replace(e, dst=twin.name) for e in spec.edges if e.dst == loss)
    edge = DataEdge(src=twin.name, dst=policy, fields={"objective": FIELDS["objective"]})
    spec = replace(spec, nodes=(*spec.nodes, twin), edges=(*spec.edges, *copies, edge))
    return Defect(spec, r"policy '[^']+' is fed by 2 losses", (policy, loss, twin.name))


def _with_weight_edge(spec: GraphSpec, i: int, **changes: object) -> GraphSpec:
    return replace(spec, weight_edges=tuple(replace(w, **changes) if j == i else w for j, w in enumerate(spec.weight_edges)))


def weights_from_untrainable(spec: GraphSpec, data: st.DataObject) -> Defect:
    *_, i = _pipeline(spec, data)
    src = _pick(data, [n.name for n in spec.nodes if n.kind != "policy"], "non-policy node")
    spec = _with_weight_edge(spec, int(i), src=src)
    return Defect(spec, r"weight edge \S+ ~> \S+ starts at '[^']+', a \w+ without trainable weights", (src,))


def weights_into_weightless(spec: GraphSpec, data: st.DataObject) -> Defect:
    *_, i = _pipeline(spec, data)
    dst = _pick(data, [n.name for n in spec.nodes if n.kind in ("source", "scorer", "loss")], "weightless node")
    spec = _with_weight_edge(spec, int(i), dst=dst)
    return Defect(spec, r"weight edge \S+ ~> \S+ ends at '[^']+', a \w+ that holds no weights", (dst,))


def weights_to_itself(spec: GraphSpec, data: st.DataObject) -> Defect:
    _, _, policy, i = _pipeline(spec, data)
    return Defect(_with_weight_edge(spec, int(i), dst=policy), r"connects '[^']+' to itself", (policy,))


def weights_to_missing_node(spec: GraphSpec, data: st.DataObject) -> Defect:
    *_, i = _pipeline(spec, data)
    ghost = _fresh(spec, "ghost_gen")
    return Defect(_with_weight_edge(spec, int(i), dst=ghost), r"weight edge \S+ ~> \S+ names node '[^']+', which does not exist", (ghost,))


def malformed_transport(spec: GraphSpec, data: st.DataObject) -> Defect:
    gen, _, policy, i = _pipeline(spec, data)
    name = data.draw(st.sampled_from(["", "in process", "2shm", "-x", "shm/fast"]), label="transport")
    return Defect(_with_weight_edge(spec, int(i), transport=name), r"names transport '[^']*', which is not a transport name", (policy, gen))


def negative_staleness(spec: GraphSpec, data: st.DataObject) -> Defect:
    gen, _, policy, i = _pipeline(spec, data)
    k = data.draw(st.integers(max_value=-1), label="k")
    return Defect(_with_weight_edge(spec, int(i), max_staleness=k), rf"has max_staleness={k}; it must be >= 0", (policy, gen))


def generator_without_weights(spec: GraphSpec, data: st.DataObject) -> Defect:
    gen, _, _, i = _pipeline(spec, data)
    weight_edges = tuple(w for j, w in enumerate(spec.weight_edges) if j != int(i))
    return Defect(replace(spec, weight_edges=weight_edges), r"generator '[^']+' receives no weights", (gen,))


def two_weight_edges_in(spec: GraphSpec, data: st.DataObject) -> Defect:
    gen, _, _, i = _pipeline(spec, data)
    return Defect(replace(spec, weight_edges=(*spec.weight_edges, spec.weight_edges[int(i)])), r"node '[^']+' receives weights over 2 weight edges", (gen,))


def weights_between_models(spec: GraphSpec, data: st.DataObject) -> Defect:
    gen, _, policy, _ = _pipeline(spec, data)
    node = _node(spec, policy)
    other = replace(node.model, n_layers=node.model.n_layers + 1, preset=None)
    nodes = tuple(replace(n, model=other) if n.name == policy else n for n in spec.nodes)
    return Defect(replace(spec, nodes=nodes), r"weight edge \S+ ~> \S+: model configs differ", (policy, gen))


def bad_scorer_reference(spec: GraphSpec, data: st.DataObject) -> Defect:
    scorer = _pick(data, _names(spec, "scorer"), "scorer")
    fn = data.draw(st.sampled_from(["not a ref", "module", "mod:", ":fn", "mod:<lambda>", "a-b:c", "m:f()"]), label="fn")
    nodes = tuple(replace(n, fn=fn) if n.name == scorer else n for n in spec.nodes)
    return Defect(replace(spec, nodes=nodes), r"scorer '[^']+': reference '[^']*' is not of the form 'package.module:function'", (scorer,))


def wrong_schema_version(spec: GraphSpec, data: st.DataObject) -> Defect:
    version = data.draw(st.integers().filter(lambda v: v != spec.schema_version), label="schema_version")
    return Defect(replace(spec, schema_version=version), rf"has schema_version {version}, this flowrl reads 1", ())


DEFECTS = [
    duplicate_name,
    bad_name,
    edge_to_missing_node,
    self_data_edge,
    data_cycle,
    unproduced_input,
    unproduced_reward,
    kl_without_reference,
    unused_reference,
    unused_scorer,
    field_type_mismatch,
    field_not_produced,
    field_not_read,
    empty_data_edge,
    duplicate_data_edge,
    two_producers,
    loss_without_policy,
    loss_two_policies,
    policy_two_losses,
    weights_from_untrainable,
    weights_into_weightless,
    weights_to_itself,
    weights_to_missing_node,
    malformed_transport,
    negative_staleness,
    generator_without_weights,
    two_weight_edges_in,
    weights_between_models,
    bad_scorer_reference,
    wrong_schema_version,
]


def _names_node(message: str, name: str) -> bool:
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", message) is not None


def _check_caught(defect: Defect) -> None:
    broken = Graph(defect.spec, validate=False)
    found = [p for p in problems(broken) if re.search(defect.pattern, p)]
    assert found, f"no problem matches {defect.pattern!r}; problems: {problems(broken)}"
    for name in defect.names:
        assert any(_names_node(p, name) for p in found), f"{name!r} not named in {found}"
    with pytest.raises(GraphError) as info:
        Graph(defect.spec)
    assert found[0] in str(info.value)


@pytest.mark.parametrize("inject", DEFECTS, ids=[d.__name__ for d in DEFECTS])
@settings(max_examples=12)
@given(graph=valid_graphs(), data=st.data())
def test_single_defect_is_caught_naming_the_node(inject, graph: Graph, data: st.DataObject) -> None:
    assert problems(graph) == []
    _check_caught(inject(graph.spec, data))


@pytest.mark.slow
@settings(max_examples=300)
@given(graph=valid_graphs(max_pipelines=3), inject=st.sampled_from(DEFECTS), data=st.data())
def test_single_defect_is_caught_many(graph: Graph, inject, data: st.DataObject) -> None:
    _check_caught(inject(graph.spec, data))


@settings(max_examples=25)
@given(valid_graphs())
def test_valid_graphs_have_no_problems(graph: Graph) -> None:
    assert problems(graph) == []
    validate_graph(graph)


# -- exact messages on the default example: what a user reads --------------------------------------
def _llamarl_spec() -> GraphSpec:
    from flowrl.examples import build_example

    return build_example("llamarl").spec


def _raise_message(spec: GraphSpec) -> str:
    with pytest.raises(GraphError) as info:
        Graph(spec)
    return str(info.value)


def test_message_cycle_prints_the_cycle() -> None:
    spec = _llamarl_spec()
    spec = replace(spec, edges=(*spec.edges, DataEdge(src="aipo", dst="gen", fields={"objective": FIELDS["objective"]})))
    message = _raise_message(spec)
    assert "data edges form a cycle: gen -> reward -> aipo -> gen;" in message
    assert "closes through a weight edge (policy ~> generator)" in message


def test_message_lists_every_problem_after_the_first() -> None:
    spec = _llamarl_spec()
    spec = replace(spec, weight_edges=(WeightEdge(src="policy", dst="gen", transport="pig eon", max_staleness=-2),))
    message = _raise_message(spec)
    assert message.startswith("invalid graph 'llamarl': weight edge policy ~> gen names transport 'pig eon', which is not a transport name")
    assert "\n  also: weight edge policy ~> gen has max_staleness=-2; it must be >= 0 (0 is synchronous on-policy training)" in message


def test_unregistered_transport_is_valid_until_the_run_starts() -> None:
    """Validation checks a transport name's form; the registry is consulted where the run starts
    (``flowrl.runtime.run``), so a graph naming a transport that only the running process registers loads anywhere."""
    spec = _llamarl_spec()
    Graph(replace(spec, weight_edges=(WeightEdge(src="policy", dst="gen", transport="pigeon"),)))


def test_message_weights_from_a_generator() -> None:
    spec = _llamarl_spec()
    spec = replace(spec, weight_edges=(WeightEdge(src="gen", dst="gen"),))
    message = _raise_message(spec)
    assert "weight edge gen ~> gen starts at 'gen', a generator without trainable weights; weights flow from a policy node" in message


def test_empty_graph() -> None:
    with pytest.raises(GraphError, match=r"graph 'empty' has no nodes; declare at least a source"):
        Graph(GraphSpec(name="empty", nodes=()))


def test_policy_and_generator_models_may_differ_only_in_nothing() -> None:
    spec = _llamarl_spec()
    nodes = tuple(replace(n, model=ModelConfig(dim=128)) if isinstance(n, PolicyNode) else n for n in spec.nodes)
    assert "model configs differ (2L128d vs 2L64d)" in _raise_message(replace(spec, nodes=nodes))


@pytest.mark.parametrize("batching", ["lockstep", "continuous"])
def test_a_generator_fed_by_a_missing_node_is_a_graph_error(batching):
    """Found by tests/reliability's fuzzing: the continuous-batching rule looked up the feeding node before
    the edge rules had said it does not exist (a KeyError escaped the CLI)."""
    import json

    from flowrl.examples import build_example
    from flowrl.graph.serialize import from_json, to_json

    raw = json.loads(to_json(build_example("llamarl")))
    raw["nodes"] = [n for n in raw["nodes"] if n["name"] != "prompts"]
    for n in raw["nodes"]:
        if n["kind"] == "generator":
            n["sampling"]["batching"] = batching
    with pytest.raises(GraphError, match="names node 'prompts', which does not exist"):
        from_json(json.dumps(raw))
