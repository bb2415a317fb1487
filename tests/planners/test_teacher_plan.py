"""The planner prices a teacher's forward passes (``flowrl.planners.kind_table.PLAN_ROLES["teacher"]``):
a frozen model's forward over every sequence of the batch, with the teacher's own model."""

from __future__ import annotations

import re

import msgspec
import pytest

from flowrl.examples.llamarl import DEFAULT_MODEL
from flowrl.graph.builder import GraphBuilder
from flowrl.planners.plan import plan_graph
from flowrl.planners.report import format_plan


def _graph(teacher_layers: int):
    """gen -> reward, a reference (a KL penalty) and a teacher with ``teacher_layers`` layers -> opd -> policy."""
    b = GraphBuilder("distill", model=DEFAULT_MODEL)
    gen = b.generator("gen", b.source("prompts", task="copy", batch_size=4), n_samples=4, max_new_tokens=5)
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    ref = b.reference("ref", gen)
    teacher = b.teacher("teacher", gen, model=msgspec.structs.replace(DEFAULT_MODEL, n_layers=teacher_layers))
    b.weights(b.policy("policy", b.loss("opd", gen, reward, ref, teacher, objective="opd", kl_coef=0.01)), gen)
    return b.build()


def test_the_plan_shows_the_teachers_forward_passes_by_its_own_model():
    plans = {n: plan_graph(_graph(n), "cpu:2", strategy="disaggregated") for n in (2, 3, 8)}
    times = {n: p.placements["teacher"].time_s for n, p in plans.items()}
    # the student's model: priced exactly as the reference's forward passes over the same batch
    assert times[2] > 0 and times[2] == pytest.approx(plans[2].placements["ref"].time_s, rel=1e-12)
    # its own depth: each layer adds the same forward flops (the embedding and LM head once)
    assert times[8] - times[2] == pytest.approx(6 * (times[3] - times[2]), rel=1e-9) and times[3] > times[2]
    assert plans[8].placements["teacher"].memory_bytes > plans[2].placements["teacher"].memory_bytes
    report = format_plan(plans[8])  # what flowrl plan prints
    assert re.search(r"^teacher +teacher +\d", report, re.M), report
