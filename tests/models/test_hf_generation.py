"""Generation with Hugging Face models: recorded log-probs equal the HF model's own forward pass."""

from __future__ import annotations

import pytest
import torch

from flowrl.operators.generation import Generator
from tests.models.helpers import hf_generator_node, hf_reference_model, left_padded, reference_logprobs
from tests.tolerances import rollout_logprob_atol

pytest.importorskip("transformers")

PROMPTS = [[1, 5, 6, 7, 8, 9], [1, 12], [1, 20, 21, 22]]  # different lengths: left padding


@pytest.mark.parametrize("use_kv_cache", [True, False], ids=["cache", "no-cache"])
@pytest.mark.parametrize("temperature", [1.0, 0.7], ids=["T1", "T0.7"])
def test_behaviour_logprobs_equal_the_hf_forward(hf_dir, use_kv_cache, temperature):
    gen = Generator(hf_generator_node(hf_dir, use_kv_cache=use_kv_cache, temperature=temperature), seed=3)
    out = gen.generate(left_padded(PROMPTS))
    assert bool(out["completion_mask"].any())
    ref = hf_reference_model(hf_dir)
    with torch.no_grad():
        alone = reference_logprobs(ref, out, temperature=temperature)
        padded = reference_logprobs(ref, out, temperature=temperature, padded=True)
    atol = rollout_logprob_atol(ref, out, temperature=temperature)
    torch.testing.assert_close(out["behaviour_logprobs"], alone, rtol=0, atol=atol)
    torch.testing.assert_close(out["behaviour_logprobs"], padded, rtol=0, atol=atol)
    assert torch.equal(out["sampling_temperature"], torch.full((9,), temperature))


def test_a_moe_generators_kv_cached_logprobs_equal_the_hf_forward(hf_moe_dir):
    """Qwen3-MoE and Qwen2-MoE (8 experts, top-2): the KV-cached decode routes each token as the full forward does."""
    test_behaviour_logprobs_equal_the_hf_forward(hf_moe_dir, use_kv_cache=True, temperature=1.0)


def test_cache_and_no_cache_draw_the_same_completions(hf_llama_dir):
    outs = [Generator(hf_generator_node(hf_llama_dir, use_kv_cache=c), seed=1).generate(left_padded(PROMPTS)) for c in (True, False)]
    assert torch.equal(outs[0]["completion_ids"], outs[1]["completion_ids"])


def test_completions_stop_at_eos_and_pad_with_the_tokenizers_pad(hf_llama_dir):
    gen = Generator(hf_generator_node(hf_llama_dir, n_samples=16, max_new_tokens=12), seed=0)
    assert gen.stop_tokens == (2,) and gen.pad_id == 0
    with torch.no_grad():
        gen.model.lm_head.weight[2] *= 40  # a large </s> logit in some contexts: some rows stop early
    out = gen.generate(left_padded([[1, 5, 6]]))
    ids, mask = out["completion_ids"], out["completion_mask"]
    stopped = 0
    for s in range(ids.shape[0]):
        n = int(mask[s].sum())
        row = ids[s, :n].tolist()
        assert 2 not in row[:-1]  # nothing after </s>
        if row[-1] == 2:
            stopped += 1
            assert (ids[s, n:] == 0).all()
    assert stopped >= 1


def test_stop_strings_end_a_completion_at_the_token_that_completes_them(hf_llama_dir):
    gen = Generator(hf_generator_node(hf_llama_dir, n_samples=16, max_new_tokens=12, stop_strings=("a", "b", "c")), seed=0)
    out = gen.generate(left_padded([[1, 5, 6]]))
    tok = __import__("flowrl.models", fromlist=["load_tokenizer"]).load_tokenizer(str(hf_llama_dir))
    hits = 0
    for s in range(out["completion_ids"].shape[0]):
        n = int(out["completion_mask"][s].sum())
        row = out["completion_ids"][s, :n].tolist()
        before = tok.decode(row[:-1])
        assert not any(x in before.split() for x in "abc")  # no stop string before the last token
        if tok.decode(row[-1:]) in ("a", "b", "c"):
            hits += 1
        else:
            assert n == 12 or row[-1] == 2
    assert hits >= 1


def test_a_bf16_generator_samples_from_the_same_initial_weights_rounded(hf_llama_dir):
    gen = Generator(hf_generator_node(hf_llama_dir, precision="bfloat16"), seed=0)
    ref = hf_reference_model(hf_llama_dir)
    w = gen.weight_targets()["model.embed_tokens.weight"]
    assert w.dtype == torch.bfloat16
    assert torch.equal(w, ref.model.embed_tokens.weight.to(torch.bfloat16))
    out = gen.generate(left_padded(PROMPTS))
    assert torch.isfinite(out["behaviour_logprobs"]).all()


@pytest.mark.parametrize("splices", [True, False], ids=["spliced", "in-decode-forward"])
def test_continuous_batching_refills_record_the_hf_forwards_mu(hf_dir, splices):
    """Slots refilled by splicing prefilled prompts into the HF cache (and, for a cache that takes no
    splice, in the decode forward): every token's mu is the HF model's own log-prob."""
    from flowrl.operators.slots import Sample, SlotBatcher
    from flowrl.operators.source import pad_left

    gen = Generator(hf_generator_node(hf_dir, n_samples=2, max_new_tokens=6, stop_tokens=(10**6,)), seed=0)
    batcher = SlotBatcher(gen, slots=2, rng=torch.Generator().manual_seed(0), prefill_rows=2)
    batcher.splices = splices
    for i, prompt in enumerate([*PROMPTS, [1, 30, 31]]):
        for j in range(2):
            batcher.add(Sample(key=(i, j), prompt=prompt))
    done: list[Sample] = []
    while batcher.busy or batcher.waiting:
        done += batcher.step()
    assert len(done) == 8 and batcher.splices == splices
    assert batcher.prefills == (2 if splices else 0)  # prompts 1+2, then 3 (prompt 0's samples fill the first slots)
    ids, lens = pad_left([s.prompt for s in done], 0)
    rollout = {"sample_prompt_ids": ids, "sample_prompt_lens": lens, "completion_ids": torch.tensor([s.tokens for s in done]),
               "completion_mask": torch.ones(8, 6, dtype=torch.bool)}
    ref = hf_reference_model(hf_dir)
    with torch.no_grad():
        alone = reference_logprobs(ref, rollout)
    torch.testing.assert_close(torch.tensor([s.logprobs for s in done]), alone, rtol=0, atol=rollout_logprob_atol(ref, rollout))


@pytest.mark.parametrize("batching", ["lockstep", "continuous"])
def test_stop_tokens_add_to_the_tokenizers_eos_which_still_stops(hf_llama_dir, batching):
    """``stop_tokens=(7,)`` (the word "4") adds a stop; the tokenizer's </s> (2) still ends completions."""
    from flowrl.operators.slots import Sample, SlotBatcher

    gen = Generator(hf_generator_node(hf_llama_dir, n_samples=16, max_new_tokens=12, stop_tokens=(7,)), seed=0)
    with torch.no_grad():
        gen.model.lm_head.weight[2] *= 40  # a large </s> logit in some contexts: some rows stop early
    if batching == "lockstep":
        out = gen.generate(left_padded([[1, 5, 6]]))
        rows = [out["completion_ids"][s, : int(n)].tolist() for s, n in enumerate(out["completion_lens"])]
    else:
        batcher = SlotBatcher(gen, slots=5, rng=torch.Generator().manual_seed(0))
        for j in range(16):
            batcher.add(Sample(key=(0, j), prompt=[1, 5, 6]))
        rows = []
        while batcher.busy or batcher.waiting:
            rows += [s.tokens for s in batcher.step()]
    assert len(rows) == 16
    ended_by_eos = 0
    for row in rows:
        assert not {2, 7} & set(row[:-1])  # nothing is drawn after </s> or "4"
        assert len(row) == 12 or row[-1] in (2, 7)
        ended_by_eos += row[-1] == 2
    assert ended_by_eos >= 1


@pytest.mark.parametrize("batching", ["lockstep", "continuous"])
def test_a_stop_string_of_two_words_ends_the_completion_at_its_second_word(hf_llama_dir, batching):
    """The word-level tokenizer decodes "a", "b" as "a b": that stop string spans two tokens, and a
    completion ends at the "b" that completes it."""
    from flowrl.operators.slots import Sample, SlotBatcher
    from tests.operators.helpers import Favour

    a, b = 3 + 10, 3 + 11  # ids of "a" and "b" (hf_fixtures: <pad>, <s>, </s>, then 0-9, a-z)
    gen = Generator(hf_generator_node(hf_llama_dir, n_samples=12, max_new_tokens=12, stop_strings=("a b",)), seed=0)
    gen.model = Favour(gen.model, [a, b], 4.0)  # "a" and "b" likely: the pair shows up within a few tokens
    if batching == "lockstep":
        out = gen.generate(left_padded([[1, 5, 6]]))
        rows = [out["completion_ids"][s, : int(n)].tolist() for s, n in enumerate(out["completion_lens"])]
    else:
        batcher = SlotBatcher(gen, slots=5, rng=torch.Generator().manual_seed(0))
        for j in range(12):
            batcher.add(Sample(key=(0, j), prompt=[1, 5, 6]))
        rows = []
        while batcher.busy or batcher.waiting:
            rows += [s.tokens for s in batcher.step()]
    hits = 0
    for row in rows:
        assert "a b" not in gen._decode(row[:-1])
        if "a b" in gen._decode(row):
            hits += 1
            assert row[-1] == b  # (ids past the tokenizer's words decode to nothing: "a", 78, "b" reads "a b" too)
        else:
            assert len(row) == 12 or row[-1] == 2
    assert hits >= 3


def test_a_hf_run_passes_the_cache_api_and_warns_nothing(hf_dir, capfd, recwarn):
    """flowrl hands transformers a ``DynamicCache`` object (its Cache API) as ``past_key_values``, never
    the legacy tuples whose use transformers deprecates: a cached decode and a cacheless forward leave
    no warning, and nothing about ``past_key_values`` on stderr (transformers' own logger writes there)."""
    import transformers

    transformers.logging.set_verbosity_warning()
    gen = Generator(hf_generator_node(hf_dir, use_kv_cache=True), seed=0)
    cache = gen.model.new_cache(2, 8)
    assert isinstance(cache, transformers.Cache)
    gen.generate(left_padded(PROMPTS))
    gen.model(torch.tensor([[1, 5, 6]]))
    assert "past_key_values" not in capfd.readouterr().err
    assert not [w for w in recwarn if "past_key_values" in str(w.message) or "cache" in str(w.message).lower()]
