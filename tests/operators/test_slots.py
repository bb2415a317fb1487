"""Continuous batching's slot engine: identical to lock step when nothing refills; every sample finishes once when slots refill."""

from __future__ import annotations

import pytest
import torch

from flowrl.graph.configs import ModelConfig, SamplingConfig
from flowrl.graph.nodes import GeneratorNode
from flowrl.operators.generation import Generator, _mix
from flowrl.operators.slots import Sample, SlotBatcher
from flowrl.operators.source import pad_left
from flowrl.operators.tasks import LongTailTask

MODEL = ModelConfig(vocab_size=16, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, max_seq_len=40)


def _run(gen: Generator, prompts: list[list[int]], slots: int, seed: int) -> list[Sample]:
    batcher = SlotBatcher(gen, slots=slots, rng=torch.Generator().manual_seed(_mix(seed, 0, 0)), width=48)
    for i, p in enumerate(prompts):
        for j in range(gen.sampling.n_samples):
            batcher.add(Sample(key=(i, j), prompt=p))
    done: list[Sample] = []
    while batcher.busy or batcher.waiting:
        done += batcher.step()
    return sorted(done, key=lambda s: s.key)


def test_without_refills_it_draws_exactly_what_lock_step_draws():
    gen = Generator(GeneratorNode(name="g", model=MODEL, sampling=SamplingConfig(n_samples=2, max_new_tokens=16)), seed=3)
    prompts = [LongTailTask(0).prompt(i) for i in range(4)]
    ids, lens = pad_left(prompts, 0)
    out = gen.generate({"prompt_ids": ids, "prompt_lens": lens, "prompt_index": torch.arange(4)})
    for r, s in enumerate(_run(gen, prompts, slots=8, seed=3)):
        n = int(out["completion_lens"][r])
        assert out["completion_ids"][r, :n].tolist() == s.tokens
        assert torch.equal(out["behaviour_logprobs"][r, :n], torch.tensor(s.logprobs))


@pytest.mark.parametrize("slots", [1, 3, 8], ids=["one", "three", "eight"])
def test_refilled_slots_finish_every_sample_once_with_mu_of_its_tokens(slots):
    gen = Generator(GeneratorNode(name="g", model=MODEL, sampling=SamplingConfig(n_samples=2, max_new_tokens=16)), seed=1)
    prompts = [LongTailTask(0).prompt(i) for i in range(6)]
    done = _run(gen, prompts, slots=slots, seed=1)  # width 48 forces compactions
    assert [s.key for s in done] == [(i, j) for i in range(6) for j in range(2)]
    for s in done[:4]:  # the recorded log-probs are the model's for the tokens drawn (temperature 1, no truncation)
        from flowrl.operators.logprobs import completion_logprobs

        ids, lens = pad_left([s.prompt], 0)
        lp = completion_logprobs(gen.model, ids, lens, torch.tensor([s.tokens]), torch.ones(1, len(s.tokens), dtype=torch.bool))
        assert torch.allclose(lp[0], torch.tensor(s.logprobs), atol=1e-4)
