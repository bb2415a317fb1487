"""The planner prices the forward passes the trainer runs, for every objective (issue 34, item 2).

Each case plans a tiny graph with ``plan_graph`` and reads the passes its policy estimate priced
(``num_iterations`` passes with gradients, plus one log-prob recompute when the estimate notes
one), then runs the trainer's step on a real rollout and counts the rows its forward passes
saw: the passes over the batch it actually ran. Both sides must follow
``flowrl.graph.objectives.recomputes_logprobs``; neither is compared with that function here.
"""

from __future__ import annotations

import pytest
import torch

import flowrl.operators.trainer as trainer_module
from flowrl.graph.builder import GraphBuilder
from flowrl.graph.nodes import LossNode, PolicyNode
from flowrl.operators.losses import LOSSES
from flowrl.operators.trainer import Trainer
from flowrl.planners.plan import plan_graph

from ..operators.helpers import TINY, rollout_with_rewards

BATCH = 4  # prompts; with 3 samples each, 12 rows a batch
#: (objective, num_iterations, num_mini_batches): every objective with one optimizer step a batch;
#: two steps (mini-batches) for an objective with and two without a recompute of their own; two
#: passes over the batch for one with and one without
CASES = [(o, 1, 1) for o in sorted(LOSSES)] + [(o, 1, 2) for o in ("aipo", "grpo", "decoupled_ppo")] + [("aipo", 2, 1), ("decoupled_ppo", 2, 1)]


def _graph(objective: str, num_iterations: int, num_mini_batches: int):
    b = GraphBuilder("passes", model=TINY)
    prompts = b.source("prompts", task="copy", batch_size=BATCH)
    gen = b.generator("gen", prompts, n_samples=3, max_new_tokens=5)
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    critic = [b.critic("critic", gen, reward, lr=1e-3)] if objective == "ppo" else []  # ppo's advantages: a critic's GAE
    teacher = [b.teacher("teacher", gen, model=TINY)] if objective == "opd" else []  # opd's teacher (its passes are its node's)
    loss = b.loss("loss", gen, reward, *critic, *teacher, objective=objective)
    pol = b.policy("policy", loss, num_iterations=num_iterations, num_mini_batches=num_mini_batches)
    b.weights(pol, gen, max_staleness=1)
    return b.build()


def _priced_passes(graph) -> int:
    """Passes over the batch the plan's policy estimate priced: one per iteration, + 1 recompute."""
    plan = plan_graph(graph, "cpu:2")
    notes = plan.placements["policy"].notes
    opt = graph.node("policy").optimizer
    return opt.num_iterations + int("log-prob recompute" in notes)


@pytest.fixture(scope="module")
def rollout() -> dict[str, torch.Tensor]:
    """One real rollout of the tiny generator (the trainer's input; no objective reads it differently)."""
    return rollout_with_rewards(0, batch_size=BATCH)


def _run_passes(graph, batch, monkeypatch) -> tuple[int, int]:
    """(passes with gradients, passes without) over the batch in one trainer step on a real rollout."""
    rows = {"grad": 0, "no_grad": 0}

    def counting(fn):
        def wrapped(model, prompt_ids, *args, **kwargs):
            rows["grad" if torch.is_grad_enabled() else "no_grad"] += int(prompt_ids.shape[0])
            return fn(model, prompt_ids, *args, **kwargs)

        return wrapped

    for name in ("completion_logprobs", "completion_logprobs_and_entropy"):
        monkeypatch.setattr(trainer_module, name, counting(getattr(trainer_module, name)))
    policy: PolicyNode = graph.node("policy")  # type: ignore[assignment]
    loss: LossNode = graph.node("loss")  # type: ignore[assignment]
    n = int(batch["completion_ids"].shape[0])
    if loss.loss.objective == "ppo":  # the critic's fields (the critic's own passes are its node's, priced as its role)
        batch = {**batch, "values": torch.zeros(batch["completion_ids"].shape), "value_version": torch.tensor(0)}
    if loss.loss.objective == "opd":  # the teacher's field
        batch = {**batch, "teacher_logprobs": batch["behaviour_logprobs"] - 0.5}
    Trainer(policy, loss).train_step(dict(batch))
    assert rows["grad"] % n == 0 and rows["no_grad"] % n == 0, f"partial passes: {rows} rows over a batch of {n}"
    return rows["grad"] // n, rows["no_grad"] // n


@pytest.mark.parametrize(("objective", "iterations", "mini_batches"), CASES, ids=[f"{o}-iters{i}-minib{m}" for o, i, m in CASES])
def test_the_plan_prices_the_passes_the_trainer_runs(objective, iterations, mini_batches, rollout, monkeypatch):
    graph = _graph(objective, iterations, mini_batches)
    with_grad, without = _run_passes(graph, rollout, monkeypatch)
    assert with_grad == iterations  # the trainer's own contract: one gradient pass per iteration
    priced = _priced_passes(graph)
    assert priced == with_grad + without, f"{objective}: the plan prices {priced} passes, the trainer ran {with_grad} + {without} without gradients"
