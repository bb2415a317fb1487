"""A reference scores the rollout as mu sampled it: at the generator's temperature (and top-k / top-p).

The graph's reference is the policy's initial model and the generator samples at temperature 0.7,
k = 0: the first batch is drawn, scored and trained by the same weights, so ``loss/kl_ref`` is 0
within the k3 estimate of float32 rounding (``tests.tolerances.k3_atol``). A reference that scored at
temperature 1 (its inputs lacked ``sampling_temperature`` until 2026-12-06) gave 0.034.
"""

from __future__ import annotations

import pytest

from flowrl.examples.llamarl import DEFAULT_MODEL
from flowrl.graph.builder import GraphBuilder
from tests.tolerances import graph_logprob_atol, k3_atol


@pytest.mark.parametrize("backend", ["local", pytest.param("process", marks=pytest.mark.slow)])  # process: 6 s of workers (--runslow)
def test_a_frozen_twin_reference_at_temperature_07_gives_kl_0(backend):
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.run import run_graph

    b = GraphBuilder("twin_ref", model=DEFAULT_MODEL)
    gen = b.generator("gen", b.source("prompts", task="copy", batch_size=4), n_samples=4, max_new_tokens=5, temperature=0.7, top_k=8)
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    ref = b.reference("ref", gen)
    loss = b.loss("aipo", gen, reward, ref, objective="aipo", kl_coef=0.1)
    b.weights(b.policy("policy", loss), gen, max_staleness=0)
    graph = b.build()
    assert "sampling_temperature" in graph.node("ref").signature().inputs
    (row,) = [r for r in run_graph(graph, RunConfig(steps=1, progress=False, device="cpu", backend=backend)).rows if "loss/kl_ref" in r]
    assert abs(row["loss/kl_ref"]) <= k3_atol(graph_logprob_atol(graph, steps=0)), row["loss/kl_ref"]
