"""Training health in every metrics row, read from real runs with two updates per batch.

A toy task that rewards one token (``sevens``) makes the built-in policy collapse onto it within a few
steps: its entropy, reported by the trainer from its own forward pass, falls from near log 16 (the
vocabulary) towards 0 while the reward saturates and the groups stop differing. The ``rollout/*``
figures of each row are recomputed here by hand from the batch the policy consumed; ``policy/lr`` is
the schedule's and ``policy/grad_norm`` the norm before clipping. Every key any program of the run
reports reaches the row or is in ``metrics.UNNAMESPACED``, under the local and process backends (the
torchrun policy's reduction over ranks: ``test_iterations_ranks.py`` and ``test_reduce_metrics.py``).
"""

from __future__ import annotations

import math
import statistics

import pytest

from flowrl.graph.builder import GraphBuilder
from flowrl.graph.configs import ModelConfig
from flowrl.graph.ir import Graph
from flowrl.operators.trainer import learning_rate
from flowrl.runtime.control import controller as controller_module
from flowrl.runtime.config import RunConfig
from flowrl.runtime.observe.metrics import HEALTH_KEYS, UNNAMESPACED
from flowrl.runtime.run import run_graph

MODEL = ModelConfig(vocab_size=16, dim=32, n_layers=1, n_heads=2, n_kv_heads=2, max_seq_len=32)
MAX_NEW_TOKENS = 6
GRAD_CLIP = 0.01  # below the first steps' gradient norms (~0.05): a reported norm above it was taken before clipping
SEVEN = 7


def sevens(prompt_ids: list[int], completion_ids: list[int]) -> float:
    """The share of the completion's tokens that are token 7: the policy collapses onto it."""
    return sum(t == SEVEN for t in completion_ids) / max(len(completion_ids), 1)


def collapse_graph(*, batching: str = "lockstep", k: int = 0) -> Graph:
    b = GraphBuilder("collapse", model=MODEL)
    prompts = b.source("prompts", task="copy", batch_size=4)
    gen = b.generator("gen", prompts, n_samples=4, max_new_tokens=MAX_NEW_TOKENS, batching=batching)
    reward = b.scorer("reward", gen, fn="tests.runtime.test_health_metrics:sevens")
    loss = b.loss("loss", gen, reward, objective="grpo")
    policy = b.policy("policy", loss, lr=3e-2, num_iterations=2, warmup_steps=2, grad_clip=GRAD_CLIP)
    b.weights(policy, gen, max_staleness=k)
    return b.build()


def _spied_run(monkeypatch, graph: Graph, config: RunConfig):
    """Run ``graph``; also return every program step's ``(kind, info)`` and each row with its batch."""
    infos: list[tuple[str, dict]] = []
    rows: list[tuple[dict, dict]] = []
    from flowrl.runtime.observe import row_sink

    trace_step, step_row = controller_module.Controller._trace_step, row_sink.step_row

    def spy_trace(self, ex, seq, t0, t1, info):
        infos.append((ex.kind, dict(info)))
        return trace_step(self, ex, seq, t0, t1, info)

    def spy_row(**kw):
        row = step_row(**kw)
        rows.append((kw["batch"], row))
        return row

    monkeypatch.setattr(controller_module.Controller, "_trace_step", spy_trace)
    monkeypatch.setattr(row_sink, "step_row", spy_row)  # the row sink builds each step's row
    return run_graph(graph, config), infos, rows


def _check_every_key_reaches_the_row(infos: list[tuple[str, dict]], rows: list[dict]) -> None:
    in_rows = {k for row in rows for k in row}
    lost = sorted({f"{kind}:{key}" for kind, info in infos for key in info if key not in in_rows and key not in UNNAMESPACED})
    assert not lost, f"keys reported by programs that no row holds and UNNAMESPACED does not list: {lost}"


def test_entropy_falls_as_the_policy_collapses_and_the_rows_match_their_batches(monkeypatch):
    graph = collapse_graph()
    assert graph.updates_per_batch() == 2
    steps = 8
    result, infos, seen = _spied_run(monkeypatch, graph, RunConfig(steps=steps, progress=False))
    rows = result.rows
    assert [r["step"] for r in rows] == list(range(1, steps + 1)) and [r for _, r in seen] == rows
    for row in rows:
        missing = [k for k in HEALTH_KEYS if k not in row]
        assert not missing, (row["step"], missing)

    entropy = [r["policy/entropy"] for r in rows]
    # an entropy over 16 tokens lies in [0, log 16]; float32 log-softmax sums give a few ulps more at most
    assert all(0.0 <= h <= math.log(16) * (1 + 1e-5) for h in entropy), entropy
    assert entropy[0] > 0.75 * math.log(16), entropy  # the random policy is near uniform
    assert entropy[-1] < 0.25 * entropy[0], entropy  # ... and collapses
    assert rows[-1]["reward_mean"] > 0.9, [r["reward_mean"] for r in rows]  # onto token 7

    config = graph.node("policy").optimizer
    for batch, row in seen:
        step = row["step"]
        # the schedule's rate, averaged over the step's two optimizer steps (warm-up: 1.5e-2, 3e-2; then 3e-2)
        assert row["policy/lr"] == pytest.approx(sum(learning_rate(config, 2 * (step - 1) + i) for i in (0, 1)) / 2, rel=1e-15)
        assert math.isfinite(row["policy/grad_norm"]) and row["policy/grad_norm"] >= 0.0
        # the rollout figures by hand, in Python floats from the batch's float32 rewards and int lengths;
        # the row's are float64 over the same values in another order: 1e-12 is thousands of float64 ulps
        lengths = batch["completion_lens"].tolist()
        assert row["rollout/length_mean"] == pytest.approx(sum(lengths) / len(lengths), abs=1e-12)
        assert (row["rollout/length_min"], row["rollout/length_max"]) == (min(lengths), max(lengths))
        assert row["rollout/cut_frac"] == pytest.approx(sum(n == MAX_NEW_TOKENS for n in lengths) / len(lengths), abs=1e-12)
        groups: dict[int, list[float]] = {}
        for g, r in zip(batch["group_ids"].tolist(), batch["rewards"].tolist()):
            groups.setdefault(g, []).append(r)
        assert row["rollout/reward_std"] == pytest.approx(statistics.fmean(statistics.pstdev(v) for v in groups.values()), abs=1e-12)
        assert row["rollout/zero_std_frac"] == pytest.approx(sum(len(set(v)) == 1 for v in groups.values()) / len(groups), abs=1e-12)
    assert rows[0]["policy/grad_norm"] > GRAD_CLIP  # before clipping (after, it would be <= GRAD_CLIP)
    assert rows[-1]["rollout/zero_std_frac"] >= 0.5 and rows[-1]["rollout/reward_std"] < rows[2]["rollout/reward_std"]  # the signal dies
    _check_every_key_reaches_the_row(infos, rows)


@pytest.mark.parametrize(
    ("backend", "batching", "k"),
    [("process", "lockstep", 1), ("local", "continuous", 1)],
    ids=["process", "local-continuous"],
)
def test_every_key_any_program_reports_reaches_the_row_or_is_dropped_on_purpose(monkeypatch, backend, batching, k):
    graph = collapse_graph(batching=batching, k=k)
    result, infos, _ = _spied_run(monkeypatch, graph, RunConfig(steps=2, backend=backend, progress=False))
    assert {kind for kind, _ in infos} >= {"source", "generator", "scorer", "policy"}
    for row in result.rows:
        missing = [key for key in HEALTH_KEYS if key not in row]
        assert not missing, (row["step"], missing)
    _check_every_key_reaches_the_row(infos, result.rows)
