"""The teacher node kind (``flowrl.graph.teacher``) and the ``"opd"`` loss in a graph: what the builder
wires, what graph files keep, and every bad input refused when the graph is built."""

from __future__ import annotations

import msgspec
import pytest

from flowrl.errors import ConfigError, GraphError
from flowrl.examples.llamarl import DEFAULT_MODEL
from flowrl.graph.builder import GraphBuilder
from flowrl.graph.configs import HFModelConfig
from flowrl.graph.structure import GraphStructure
from flowrl.graph.serialize import from_json, to_json
from flowrl.graph.validate import problems

BIGGER = msgspec.structs.replace(DEFAULT_MODEL, n_layers=3, seed=7)


def distill_graph(*, teacher_model=BIGGER, reward_weight: float = 0.0, read: bool = True) -> GraphBuilder:
    b = GraphBuilder("distill", model=DEFAULT_MODEL)
    gen = b.generator("gen", b.source("prompts", task="copy", batch_size=4), n_samples=4, max_new_tokens=5)
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    teacher = b.teacher("teacher", gen, model=teacher_model)
    inputs = (gen, reward, teacher) if read else (gen, reward)
    loss = b.loss("opd", *inputs, objective="opd" if read else "aipo", reward_weights={"rewards": reward_weight})
    b.weights(b.policy("policy", loss), gen)
    return b


def test_the_teacher_feeds_the_loss_its_logprobs_and_survives_a_graph_file():
    g = distill_graph().build()
    assert "teacher = teacher(model=3L64d) <- gen[completion_ids,completion_lens,completion_mask,sample_prompt_ids,sample_prompt_lens,sampling_temperature]" in str(g)
    assert "teacher[teacher_logprobs]" in str(g) and "opd = loss(opd, rho=4, baseline=group_mean, reward_weights={rewards: 0})" in str(g)
    assert from_json(to_json(g)) == g


def test_an_opd_loss_without_a_teacher_is_refused_by_the_builder():
    b = GraphBuilder("d", model=DEFAULT_MODEL)
    gen = b.generator("gen", b.source("prompts", task="copy"))
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    with pytest.raises(ConfigError, match=r"loss 'opd': objective='opd' distills from a teacher's per-token log-probs, and no teacher is listed; declare one, teacher = b.teacher\('teacher', 'gen', model=...\)"):
        b.loss("opd", gen, reward, objective="opd")


def test_an_opd_loss_without_a_teacher_in_a_graph_file_is_refused():
    """A graph file is not built by the builder: the validator names the missing teacher."""
    g = distill_graph().build()
    spec = msgspec.structs.replace(
        g.spec, nodes=tuple(n for n in g.nodes if n.kind != "teacher"), edges=tuple(e for e in g.edges if "teacher" not in (e.src, e.dst))
    )
    found = problems(GraphStructure(spec))
    assert any("loss 'opd' has objective='opd', on-policy distillation from a teacher's per-token log-probs, but no teacher node feeds it" in p for p in found), found


def test_a_teacher_listed_for_another_objective_is_refused():
    b = GraphBuilder("d", model=DEFAULT_MODEL)
    gen = b.generator("gen", b.source("prompts", task="copy"))
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    teacher = b.teacher("teacher", gen, model=BIGGER)
    with pytest.raises(ConfigError, match=r"loss 'aipo': objective='aipo' does not read a teacher, but teacher 'teacher' is listed; set objective='opd'"):
        b.loss("aipo", gen, reward, teacher, objective="aipo")


def test_a_teacher_nothing_reads_is_refused():
    with pytest.raises(GraphError, match=r"node 'teacher' \(teacher\) writes \['teacher_logprobs'\] but no node reads them; list it in a loss with objective='opd'"):
        distill_graph(read=False).build()


def test_a_teacher_of_another_vocabulary_is_refused_naming_why():
    with pytest.raises(GraphError) as info:
        distill_graph(teacher_model=msgspec.structs.replace(BIGGER, vocab_size=32)).build()
    text = str(info.value)
    assert "teacher 'teacher' (3L64d) cannot score the rollout of generator 'gen' (2L64d): its vocab_size=32 differs from the student model's vocab_size=16" in text
    assert "cross-tokenizer distillation is not supported" in text


def test_a_hugging_face_teacher_of_a_built_in_student_is_refused():
    with pytest.raises(GraphError, match=r"it is a Hugging Face model \(its tokenizer's ids\) and the student is a built-in model \(the task's token ids\)"):
        distill_graph(teacher_model=HFModelConfig(path="/nowhere/teacher")).build()
