"""The planner prices several updates per batch: K passes of forward and backward, one log pi_old
pass, and an optimizer step (with its gradient sync) per update."""

from __future__ import annotations

import pytest

from flowrl.planners.plan import plan_graph
from tests.runtime.test_iterations_run import graph


def _train(iterations: int, mini_batches: int):
    g = graph(k=1, iterations=iterations, mini_batches=mini_batches, objective="aipo")
    plan = plan_graph(g, "4xA100", strategy="gen:d1@0 | policy:d2@1-2", zero_stage=0)
    return plan.placements["policy"]


def test_passes_and_optimizer_steps_scale_the_training_estimate():
    """aipo with one update adds no log-prob pass (3 passes per micro-batch: forward, backward x2);
    K=2 x M=2 makes it 2 x 3 + 1 (the pi_old pass) and 4 optimizer steps and gradient syncs."""
    one, more = _train(1, 1), _train(2, 2)
    assert one.breakdown["dp_comm"] > 0 and one.breakdown["optimizer"] > 0
    assert more.breakdown["compute"] == pytest.approx(one.breakdown["compute"] * 7 / 3, rel=1e-9)
    assert more.breakdown["optimizer"] == pytest.approx(4 * one.breakdown["optimizer"], rel=1e-9)
    assert more.breakdown["dp_comm"] == pytest.approx(4 * one.breakdown["dp_comm"], rel=1e-9)
    assert any("2 passes, 4 optimizer steps" in n for n in more.notes)
