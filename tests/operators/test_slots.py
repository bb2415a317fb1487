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
from tests.tolerances import logprob_atol

MODEL = ModelConfig(vocab_size=16, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, max_seq_len=40)


def _run(gen: Generator, prompts: list[list[int]], slots: int, seed: int, *, splices: bool = True, prefill_rows: int | None = None) -> list[Sample]:
    batcher = SlotBatcher(gen, slots=slots, rng=torch.Generator().manual_seed(_mix(seed, 0, 0)), width=48, prefill_rows=prefill_rows)
    batcher.splices = splices  # False: refills ride in the decode forward, as for a cache that takes no splice
    for i, p in enumerate(prompts):
        for j in range(gen.sampling.n_samples):
            batcher.add(Sample(key=(i, j), prompt=p))
    done: list[Sample] = []
    while batcher.busy or batcher.waiting:
        done += batcher.step()
    return sorted(done, key=lambda s: s.key)


def _recomputed_mu(gen: Generator, samples: list[Sample]) -> list[torch.Tensor]:
    """Each sample's completion log-probs by one full forward pass of ``gen``'s model over prompt and completion, alone."""
    from flowrl.operators.logprobs import completion_logprobs

    out = []
    for s in samples:
        ids, lens = pad_left([s.prompt], 0)
        out.append(completion_logprobs(gen.model, ids, lens, torch.tensor([s.tokens]), torch.ones(1, len(s.tokens), dtype=torch.bool))[0])
    return out


def _atol(gen: Generator, samples: list[Sample]) -> float:
    """float32 rounding of two evaluations of ``gen``'s model on the samples' sequences (``tests/tolerances.py``)."""
    return logprob_atol(gen.model, [torch.tensor(s.prompt + s.tokens) for s in samples])


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
    atol = _atol(gen, done)
    for s, mu in zip(done, _recomputed_mu(gen, done)):  # the recorded log-probs are the model's for the tokens drawn (temperature 1, no truncation)
        assert torch.allclose(mu, torch.tensor(s.logprobs), rtol=0, atol=atol)


@pytest.mark.parametrize("prefill_rows", [1, 2, None], ids=["one-prompt", "two-prompts", "slots"])
def test_spliced_refills_draw_what_refills_in_the_decode_forward_draw(prefill_rows):
    """Prefilling only the refilled prompts (staged, shared by a prompt's samples) and splicing their keys and
    values into the free rows gives the tokens and mu of the path that carries them in the decode forward."""
    gen = Generator(GeneratorNode(name="g", model=MODEL, sampling=SamplingConfig(n_samples=3, max_new_tokens=16)), seed=4)
    prompts = [LongTailTask(0).prompt(i) for i in range(8)]  # lengths 5 and 6: left padding within a staged batch
    spliced = _run(gen, prompts, slots=4, seed=4, prefill_rows=prefill_rows)
    merged = _run(gen, prompts, slots=4, seed=4, splices=False)
    assert [s.tokens for s in spliced] == [s.tokens for s in merged]
    atol = _atol(gen, spliced)
    for a, b in zip(spliced, merged):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=atol)
    for s, mu in zip(spliced, _recomputed_mu(gen, spliced)):
        assert torch.allclose(mu, torch.tensor(s.logprobs), rtol=0, atol=atol)


def test_refills_prefill_only_new_prompts_and_rarely_compact():
    gen = Generator(GeneratorNode(name="g", model=MODEL, sampling=SamplingConfig(n_samples=4, max_new_tokens=8)), seed=0)
    batcher = SlotBatcher(gen, slots=8, rng=torch.Generator().manual_seed(0), width=80)
    for i in range(16):
        for j in range(4):
            batcher.add(Sample(key=(i, j), prompt=LongTailTask(0).prompt(i)))
    while batcher.busy or batcher.waiting:
        batcher.step()
    assert batcher.prefills <= 3  # 16 prompts, 8 staged per prefill (all 4 samples of a prompt share it) + restaging
    assert batcher.compactions == 1 + batcher.steps // (80 - 8)  # the first fill, then one per cache width of steps


def test_a_prompt_staged_before_a_weight_change_is_prefilled_again_by_the_new_weights():
    """Sample 2's prompt is prefilled ahead (staged with sample 1's) under version 0; weights change before
    it takes a slot: its first token's mu and every later one are the new weights'."""
    sampling = SamplingConfig(n_samples=1, max_new_tokens=6, stop_tokens=(10**6,))
    gen = Generator(GeneratorNode(name="g", model=MODEL, sampling=sampling), seed=2)
    batcher = SlotBatcher(gen, slots=1, rng=torch.Generator().manual_seed(0), prefill_rows=2)
    for i in range(3):
        batcher.add(Sample(key=(i, 0), prompt=LongTailTask(0).prompt(i)))
    done: list[Sample] = []
    while batcher.busy or batcher.waiting:
        done += batcher.step()
        if batcher.steps == 8:  # sample 1 took the slot at step 7 and staged sample 2's prompt
            assert tuple(batcher.waiting[0].prompt) in batcher.staged
            noise = torch.Generator().manual_seed(1)
            gen.load_weights({k: v + 0.5 * torch.randn(v.shape, generator=noise) for k, v in gen.weight_targets().items()}, 1)
    last = sorted(done, key=lambda s: s.key)[2]
    assert last.versions == [1] * 6
    assert torch.allclose(_recomputed_mu(gen, [last])[0], torch.tensor(last.logprobs), rtol=0, atol=_atol(gen, [last]))


def test_each_token_records_the_version_and_mu_of_the_weights_that_drew_it():
    """Weights change after decode step 5: tokens drawn before carry version 0 and the old model's
    log-probs (those of a run without the change), tokens drawn after carry version 1 and new log-probs."""
    sampling = SamplingConfig(n_samples=1, max_new_tokens=12, stop_tokens=(10**6,))  # no stop: every sample runs 12 steps
    prompts = [LongTailTask(0).prompt(i) for i in range(3)]

    def run(swap_after: int | None) -> list[Sample]:
        gen = Generator(GeneratorNode(name="g", model=MODEL, sampling=sampling), seed=2)
        batcher = SlotBatcher(gen, slots=2, rng=torch.Generator().manual_seed(0))
        for i, p in enumerate(prompts):
            batcher.add(Sample(key=(i, 0), prompt=p))
        done: list[Sample] = []
        while batcher.busy or batcher.waiting:
            done += batcher.step()
            if batcher.steps == swap_after:
                noise = torch.Generator().manual_seed(1)
                gen.load_weights({k: v + 0.5 * torch.randn(v.shape, generator=noise) for k, v in gen.weight_targets().items()}, 1)
        return sorted(done, key=lambda s: s.key)

    plain, swapped = run(None), run(5)
    assert [s.versions for s in swapped] == [[0] * 5 + [1] * 7, [0] * 5 + [1] * 7, [1] * 12]  # sample 2 starts at step 13
    assert [s.versions for s in plain] == [[0] * 12] * 3
    for p, s in zip(plain[:2], swapped[:2]):
        assert s.tokens[:5] == p.tokens[:5] and s.logprobs[:5] == p.logprobs[:5]  # drawn by version 0 in both runs
        assert s.logprobs[5] != p.logprobs[5]  # the first token of version 1: its mu is the new weights'


def test_a_cache_that_takes_no_splice_is_compacted_once_then_refilled_in_the_decode_forward(monkeypatch):
    gen = Generator(GeneratorNode(name="g", model=MODEL, sampling=SamplingConfig(n_samples=2, max_new_tokens=16)), seed=1)
    monkeypatch.setattr(gen.model, "splice_cache", lambda *args: False)  # as an HF cache with sliding-window layers answers
    prompts = [LongTailTask(0).prompt(i) for i in range(6)]
    done = _run(gen, prompts, slots=3, seed=1)
    assert [s.key for s in done] == [(i, j) for i in range(6) for j in range(2)]
    atol = _atol(gen, done)
    for s, mu in zip(done, _recomputed_mu(gen, done)):
        assert torch.allclose(mu, torch.tensor(s.logprobs), rtol=0, atol=atol)
