"""The engine/trainer mismatch in real runs: in every metrics row, 0 for the built-in engine at k = 0 with
top-k/top-p on (lock step and continuous batching), and measured only on tokens of the trainer's weights."""

from __future__ import annotations

import pytest

from flowrl.graph.builder import GraphBuilder
from flowrl.graph.ir import Graph
from flowrl.operators.mismatch import MISMATCH_KEYS
from flowrl.runtime.config import RunConfig
from flowrl.runtime.observe.metrics import read_metrics
from flowrl.runtime.run import run_graph
from tests.operators.helpers import TINY
from tests.tolerances import graph_logprob_atol, ratio_atol


def _graph(*, k: int, batching: str, **sampling: object) -> Graph:
    b = GraphBuilder("mismatch", model=TINY)
    prompts = b.source("prompts", task="copy", batch_size=4)
    gen = b.generator("gen", prompts, n_samples=4, max_new_tokens=6, batching=batching, **sampling)
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    policy = b.policy("policy", b.loss("aipo", gen, reward), lr=1e-2)
    b.weights(policy, gen, max_staleness=k)
    return b.build()


@pytest.mark.parametrize("batching", ["lockstep", "continuous"])
@pytest.mark.parametrize("sampling", [dict(top_p=0.95), dict(top_k=5, temperature=0.8)], ids=["top-p", "top-k"])
def test_at_k0_every_row_shows_zero_mismatch_and_ratio_one(tmp_path, batching, sampling):
    path = tmp_path / "m.jsonl"
    graph = _graph(k=0, batching=batching, **sampling)
    run_graph(graph, RunConfig(steps=3, max_staleness=0, progress=False, metrics=str(path)))
    atol = graph_logprob_atol(graph, steps=3)  # float32 rounding of mu and pi (tests/tolerances.py)
    rows = read_metrics(path)
    assert len(rows) == 3
    for row in rows:
        assert all(key in row for key in MISMATCH_KEYS), sorted(row)
        # every token was drawn by the trainer's weights and lies in pi's kept set
        assert row["mismatch/tokens"] == row["aipo/tokens"] > 0 and row["mismatch/outside_kept_frac"] == 0.0
        assert abs(row["mismatch/kl"]) < atol and row["mismatch/abs_logp_max"] < atol
        assert row["aipo/ratio_mean"] == pytest.approx(1.0, abs=ratio_atol(atol))


def test_lock_step_at_k1_measures_only_batches_of_the_current_weights():
    """Lock step draws a batch with one version: at staleness 0 all its tokens are measured, at staleness 1 none
    (0 over 0 tokens; the row still has every key)."""
    graph = _graph(k=1, batching="lockstep", top_p=0.95)
    result = run_graph(graph, RunConfig(steps=6, max_staleness=1, progress=False))
    atol = graph_logprob_atol(graph, steps=6)
    stalenesses = [row["staleness"] for row in result.rows]
    assert stalenesses[0] == 0 and 1 in stalenesses, stalenesses  # seen: [0, 1, 1, 1, 1, 1]
    for row in result.rows:
        assert all(key in row for key in MISMATCH_KEYS)
        if row["staleness"] == 0:
            assert row["mismatch/tokens"] == row["aipo/tokens"] > 0 and row["mismatch/abs_logp_max"] < atol
        else:
            assert (row["mismatch/tokens"], row["mismatch/kl"], row["mismatch/abs_logp_max"]) == (0.0, 0.0, 0.0)
