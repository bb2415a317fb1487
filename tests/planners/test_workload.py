"""The step workload a graph declares (``flowrl.planners.workload``): prompt length from the source when it says it."""

from __future__ import annotations

import pytest

from flowrl.graph.builder import GraphBuilder
from flowrl.graph.configs import ModelConfig
from flowrl.planners.workload import default_workload, workload_from_graph


def _graph(**source):
    b = GraphBuilder("t", model=ModelConfig(max_seq_len=64))
    prompts = b.source("prompts", data="rows.jsonl", tokenizer="tok", batch_size=4, **source)  # no file is read to plan
    gen = b.generator("gen", prompts, n_samples=2, max_new_tokens=8)
    loss = b.loss("aipo", gen, b.scorer("reward", gen, fn="m:f"))
    b.weights(b.policy("policy", loss), gen)
    return b.build()


@pytest.mark.parametrize(("source", "prompt_len"), [({"max_prompt_len": 20}, 20), ({}, 64 - 8)], ids=["max_prompt_len", "model-bound"])
def test_the_prompt_length_is_the_sources_max_prompt_len_else_the_models_room(source, prompt_len):
    """max_prompt_len=20 is what the run encodes prompts to (``data.wiring.default_max_prompt_len``); without it, the
    longest prompt the model leaves room for: max_seq_len 64 - max_new_tokens 8."""
    graph = _graph(**source)
    assert workload_from_graph(graph).prompt_len == prompt_len
    assert default_workload(graph).prompt_len == prompt_len
    assert default_workload(graph, prompt_len=12).prompt_len == 12  # --prompt-len still overrides it


def test_the_planner_and_the_run_agree_on_the_prompt_limit():
    from flowrl.data.wiring import default_max_prompt_len

    for source in ({"max_prompt_len": 20}, {}):
        graph = _graph(**source)
        assert workload_from_graph(graph).prompt_len == default_max_prompt_len(graph, "prompts")
