"""Routing replay in real runs: a Qwen3-MoE graph whose generator records routing, on the local backend
(threads) and the process backend (the rollout's uint8 routed_experts cross the process wire); at
k = 0 in one precision every row shows routing agreement 1 and no mismatch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowrl.errors import ConfigError
from flowrl.graph.builder import GraphBuilder
from flowrl.graph.configs import HFModelConfig
from flowrl.graph.ir import Graph
from flowrl.runtime.config import RunConfig
from flowrl.runtime.run import run_graph
from tests.hf_fixtures import make_hf_dir
from tests.tolerances import graph_logprob_atol

pytest.importorskip("transformers")


def _graph(directory: Path, prompts: Path) -> Graph:
    b = GraphBuilder("replay", model=HFModelConfig(path=str(directory)))
    source = b.source("prompts", data=str(prompts), prompt_field="prompt", batch_size=2)
    gen = b.generator("gen", source, n_samples=2, max_new_tokens=4, routing_replay=True)
    score = b.scorer("reward", gen, fn="flowrl.examples.hf_copy:reward", inputs="text")
    policy = b.policy("policy", b.loss("aipo", gen, score), lr=1e-3)
    b.weights(policy, gen, max_staleness=0)
    return b.build()


@pytest.mark.parametrize("backend", ["local", pytest.param("process", marks=pytest.mark.slow)])  # process: ~5 s idle, the wire's dtypes are test_wire's
def test_every_row_reports_full_agreement_at_k0(tmp_path: Path, backend: str) -> None:
    directory = make_hf_dir(tmp_path / "moe", "qwen3_moe")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"copy {i} {i + 1} =", "answer": f"{i} {i + 1}"}) + "\n" for i in range(4)))
    graph = _graph(directory, prompts)
    assert "routed_experts" in next(e for e in graph.edges if (e.src, e.dst) == ("gen", "aipo")).fields
    result = run_graph(graph, RunConfig(steps=2, max_staleness=0, progress=False, backend=backend))
    atol = graph_logprob_atol(graph, steps=2)
    assert len(result.rows) == 2
    for row in result.rows:
        assert row["routing/agreement"] == 1.0 and row["routing/tokens"] > 0, row
        assert row["mismatch/abs_logp_max"] < atol


def test_routed_experts_cross_torchrun_ranks_in_their_dtype(tmp_path: Path) -> None:
    """What the torchrun backend moves rollouts with (gloo broadcast and send): uint8 and int16 arrive bit
    for bit (gloo's broadcast has no int16: batches travel as bytes)."""
    import torch.multiprocessing as mp

    out = tmp_path / "rank1.json"
    from tests.runtime.routing_ranks_job import ranks_job

    mp.spawn(ranks_job, args=(f"file://{tmp_path / 'init'}", str(out)), nprocs=2, join=True)
    assert json.loads(out.read_text()) == {"same": True}


def test_a_dense_model_is_refused_before_any_work(tmp_path: Path, hf_llama_dir: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "copy 1 2 =", "answer": "1 2"}) + "\n")
    with pytest.raises(ConfigError, match=r"generator 'gen': routing_replay=True records a mixture of experts' routing, but its model \('llama'\) is dense"):
        run_graph(_graph(hf_llama_dir, prompts), RunConfig(steps=1, progress=False, metrics=str(tmp_path / "m.jsonl")))
    assert not (tmp_path / "m.jsonl").exists()  # nothing ran


def test_a_pipeline_parallel_policy_refuses_to_drop_the_routing() -> None:
    import torch

    from flowrl.runtime.parallel.pipeline_trainer import _fields

    with pytest.raises(ConfigError, match="a pipeline-parallel policy does not replay a generator's routing"):
        _fields({"routed_experts": torch.zeros(1, 2, 1, 2, dtype=torch.uint8)})
