"""The objective rows: the table the trainer, the validator and the planner read, a user's row carried
by a graph file, and the refusals of a malformed row, a correction on an objective that corrects, an
unknown option."""

from __future__ import annotations

import pytest

from flowrl.errors import ConfigError, GraphError
from flowrl.graph.builder import GraphBuilder
from flowrl.graph.configs import LossConfig, ModelConfig
from flowrl.graph.corrections import CorrectionConfig
from flowrl.graph.objectives import (
    ANCHORED_AT_OLD,
    READS_TEACHER,
    BUILTIN_OBJECTIVES,
    NEEDS_PROXIMAL,
    OBJECTIVES,
    ObjectiveRow,
    recomputes_logprobs,
    register_objective,
    row_of,
)
from flowrl.graph.serialize import from_json, references, to_json

MODEL = ModelConfig(vocab_size=16, dim=16, n_layers=1, n_heads=2, n_kv_heads=2, max_seq_len=32)


@pytest.fixture
def user_row():
    row = register_objective("scaled_pg", "tests.graph.test_objectives:scaled_pg", reads=("mu", "proximal"), options={"scale": 0.5})
    yield row
    OBJECTIVES.pop("scaled_pg", None)


def scaled_pg(config, logprobs, old, advantages, mask, *, options, proximal, normalizer=None, lengths=None):
    from flowrl.operators.losses import pg_loss

    loss, metrics = pg_loss(logprobs, old, advantages, mask, rho=config.rho, normalizer=normalizer, lengths=lengths, agg=config.loss_agg)
    return options["scale"] * loss, {**metrics, "scaled_pg/scale": options["scale"]}


def _graph(**loss):
    b = GraphBuilder("g", model=MODEL)
    gen = b.generator("gen", b.source("prompts", task="copy", batch_size=2), n_samples=2, max_new_tokens=4)
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    policy = b.policy("policy", b.loss("loss", gen, reward, **loss))
    b.weights(policy, gen, max_staleness=1)
    return b.build()


def test_the_old_sets_are_views_of_the_rows():
    assert NEEDS_PROXIMAL == {"decoupled_ppo"}
    assert ANCHORED_AT_OLD == {"grpo", "ppo_clip", "ppo", "gspo", "cispo", "sapo"}
    assert {n for n, r in BUILTIN_OBJECTIVES.items() if r.corrects} == {"aipo", "tis", "mis", "decoupled_ppo", "dppo", "opd"}
    assert READS_TEACHER == {"opd"}
    assert not any(r.fn for r in BUILTIN_OBJECTIVES.values())  # found by name in flowrl.operators.losses.LOSSES


def test_a_users_row_travels_in_the_graph_file_and_the_planner_reads_it(user_row):
    graph = _graph(objective="scaled_pg", options={"scale": 0.25})
    assert graph.node("loss").loss.row == user_row
    assert references(graph) == ["flowrl.operators.tasks:copy_reward", "tests.graph.test_objectives:scaled_pg"]
    OBJECTIVES.pop("scaled_pg")  # a process that never registered it: the file's row is enough
    loaded = from_json(to_json(graph))
    config = loaded.node("loss").loss
    assert row_of(config) == user_row and config.objective_options() == {"scale": 0.25}
    assert recomputes_logprobs(config, updates_per_batch=1)  # it reads the proximal policy: priced like decoupled_ppo
    assert not recomputes_logprobs("scaled_pg", updates_per_batch=1)  # by name alone this process does not know it


def test_the_builder_takes_a_row_itself():
    row = ObjectiveRow(name="mine", fn="tests.graph.test_objectives:scaled_pg", options={"scale": 1.0})
    graph = _graph(objective=row)
    assert graph.node("loss").loss.objective == "mine" and graph.node("loss").loss.row == row


def test_a_correction_shows_in_describe_and_survives_json():
    graph = _graph(objective="grpo", correction={"kind": "tis", "level": "sequence", "cap": 3.0})
    assert "correction=tis(level=sequence, cap=3.0)" in graph.node("loss").describe()
    assert from_json(to_json(graph)).node("loss").loss.correction == CorrectionConfig(kind="tis", level="sequence", cap=3.0)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: register_objective("grpo", "m:f"), ConfigError, r"objective 'grpo' is built in"),
        (lambda: register_objective("x", lambda *a: a), ConfigError, r"objective 'x': cannot reference"),
        (lambda: register_objective("x", "m:f", reads=("proximal",)), ConfigError, r"must hold 'mu'"),
        (lambda: register_objective("x", "m:f", reads=("mu", "judge")), ConfigError, r"unknown: \['judge'\]"),
        (lambda: register_objective("x", "m:f", advantages="gae"), ConfigError, r"GAE advantages read a critic's 'values'"),
        (lambda: _graph(objective="aipo", correction="icepop"), ConfigError, r"already corrects the mismatch \(AIPO's one-sided truncation"),
        (lambda: _graph(objective="grpo", correction="popice"), ConfigError, r"loss 'loss': correction='popice'"),
        (lambda: _graph(objective="grpo", correction={"kind": "seq_mask", "low": 1.2, "high": 1.1}), ConfigError, r"low=1.2 > high=1.1"),
        (lambda: _graph(objective="grpo", options={"tau_pos": 1.0}), ConfigError, r"not options of objective 'grpo' \(its options: none\)"),
        (lambda: LossConfig(objective="grpo", row=ObjectiveRow(name="grpo", fn="m:f")), ConfigError, r"is built in: it carries no row"),
        (lambda: _graph(objective=ObjectiveRow(name="mine")), ConfigError, r"objective 'mine''s row names no function"),
        (lambda: _graph(objective="no_such"), GraphError, None),  # known at run start (flowrl.runtime.names)
    ],
    ids=["builtin-name", "lambda", "no-mu", "unknown-read", "gae-without-values", "corrects", "unknown-correction", "low-above-high",
         "foreign-option", "row-for-builtin", "row-without-fn", "unknown-name-builds"],
)
def test_bad_rows_corrections_and_options_are_refused_by_name(call, error, match):
    if match is None:  # an unknown name builds (its form is checked); the run refuses it
        assert call().node("loss").loss.objective == "no_such"
        return
    with pytest.raises(error, match=match):
        call()
