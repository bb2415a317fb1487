"""The transformer: seeded init, parameter count, GQA, KV cache and padding give the same numbers."""

from __future__ import annotations

import msgspec
import pytest
import torch

from flowrl.errors import ConfigError
from flowrl.graph.configs import ModelConfig
from flowrl.models.families.builtin.model import Transformer, attention_mask, count_parameters, positions_from_valid

from tests.operators.helpers import TINY
from tests.tolerances import logit_atol


def expected_parameters(c: ModelConfig) -> int:
    kv = c.n_kv_heads * c.head_dim
    attention = c.dim * c.dim * 2 + c.dim * kv * 2  # wq, wo, wk, wv
    ffn = 3 * c.dim * c.hidden_dim
    per_layer = attention + ffn + 2 * c.dim  # two RMSNorms
    embeddings = c.vocab_size * c.dim * (1 if c.tie_embeddings else 2)
    return embeddings + c.n_layers * per_layer + c.dim


@pytest.mark.parametrize(
    "config",
    [TINY, ModelConfig(vocab_size=16, dim=48, n_layers=3, n_heads=6, n_kv_heads=6, tie_embeddings=False, ffn_dim=100)],
    ids=["gqa-tied", "mha-untied"],
)
def test_parameter_count_matches_the_formula(config):
    assert count_parameters(Transformer(config)) == expected_parameters(config)


def test_same_seed_same_weights_whatever_the_global_rng():
    torch.manual_seed(1)
    a = Transformer(TINY).state_dict()
    torch.manual_seed(2)
    torch.rand(100)
    b = Transformer(TINY).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = Transformer(msgspec.structs.replace(TINY, seed=1)).state_dict()
    assert not torch.equal(a["tok_embeddings.weight"], c["tok_embeddings.weight"])


def test_output_shape_and_causality():
    model = Transformer(TINY)
    tokens = torch.tensor([[1, 4, 5, 6, 14], [1, 7, 8, 9, 14]])
    logits = model(tokens)
    assert logits.shape == (2, 5, 16) and logits.dtype == torch.float32
    changed = tokens.clone()
    changed[:, 3:] = 3
    # Changing later tokens never changes earlier logits.
    torch.testing.assert_close(model(changed)[:, :3], logits[:, :3], rtol=0, atol=logit_atol(model, tokens))


@pytest.mark.parametrize("chunks", [[5, 1, 1, 1], [2, 3, 3], [1] * 8], ids=["prefill+decode", "chunked", "token-by-token"])
def test_kv_cache_gives_the_full_forward_logits(chunks):
    model = Transformer(TINY)
    tokens = torch.randint(0, 16, (3, sum(chunks)), generator=torch.Generator().manual_seed(0))
    full = model(tokens)
    cache = model.new_cache(3, sum(chunks))
    got, start = [], 0
    for n in chunks:
        got.append(model(tokens[:, start : start + n], cache=cache))
        start += n
    assert cache.length == sum(chunks)
    torch.testing.assert_close(torch.cat(got, 1), full, rtol=0, atol=logit_atol(model, tokens))


def test_left_padding_gives_the_unpadded_logits():
    model = Transformer(TINY)
    short, long = [1, 4, 5, 14], [1, 9, 8, 7, 6, 5, 14]
    width = len(long)
    tokens = torch.tensor([[0] * (width - len(short)) + short, long])
    valid = tokens != 0
    logits = model(tokens, positions=positions_from_valid(valid), attn_mask=attention_mask(valid, 0, width))
    assert torch.isfinite(logits).all()  # pad rows stay finite
    alone = model(torch.tensor([short]))
    atol = logit_atol(model, [torch.tensor(short), torch.tensor(long)])
    torch.testing.assert_close(logits[0, width - len(short) :], alone[0], rtol=0, atol=atol)
    torch.testing.assert_close(logits[1], model(torch.tensor([long]))[0], rtol=0, atol=atol)


def test_grouped_query_attention_equals_repeated_heads():
    """A GQA model equals the multi-head model whose k/v heads are the GQA heads repeated."""
    gqa = Transformer(TINY)
    mha_config = ModelConfig(vocab_size=16, dim=32, n_layers=2, n_heads=4, n_kv_heads=4, max_seq_len=32)
    mha = Transformer(mha_config)
    state = gqa.state_dict()
    rep = TINY.n_heads // TINY.n_kv_heads
    for key in list(state):
        if key.endswith(("wk.weight", "wv.weight")):
            w = state[key].view(TINY.n_kv_heads, TINY.head_dim, TINY.dim)
            state[key] = w.repeat_interleave(rep, 0).reshape(-1, TINY.dim)
    mha.load_state_dict(state)
    tokens = torch.tensor([[1, 4, 5, 6, 14]])
    torch.testing.assert_close(mha(tokens), gqa(tokens), rtol=0, atol=logit_atol(gqa, tokens))


def test_positions_beyond_max_seq_len_are_refused():
    model = Transformer(ModelConfig(vocab_size=16, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=4))
    with pytest.raises(ConfigError, match="max_seq_len=4"):
        model(torch.ones(1, 5, dtype=torch.long))


def test_presets_are_for_dry_runs_only():
    with pytest.raises(ConfigError, match="preset='llama3-8b'"):
        Transformer(ModelConfig(preset="llama3-8b"))


def test_a_spliced_prompt_continues_as_if_prefilled_in_its_row():
    """Row 1 of a batch gets another sequence's prompt by splicing its keys/values over its last slots:
    the next token's logits equal those of that prompt decoded alone."""
    model = Transformer(TINY).eval()
    prompt, other = torch.tensor([[1, 4, 5]]), torch.tensor([[1, 6, 7, 8, 9], [1, 9, 8, 7, 6]])
    with torch.no_grad():
        cache = model.new_cache(2, 8)
        model(other, valid=torch.ones(2, 5, dtype=torch.bool), cache=cache)
        part = model.new_cache(1, 3)
        model(prompt, valid=torch.ones(1, 3, dtype=torch.bool), cache=part)
        assert model.splice_cache(cache, part, torch.tensor([0]), torch.tensor([1]), 2)
        valid = torch.tensor([[True] * 6, [False, False, True, True, True, True]])
        spliced = model(torch.tensor([[3], [3]]), valid=valid, cache=cache)[1, -1]
        alone = model(torch.tensor([[1, 4, 5, 3]]))[0, -1]
    torch.testing.assert_close(spliced, alone, rtol=0, atol=logit_atol(model, [torch.tensor([1, 4, 5, 3]), torch.tensor([1, 6, 7, 8, 9, 3])]))


@pytest.mark.parametrize(
    "source, rows, start",
    [([0], [1], 3), ([0], [1], -1), ([0, 0], [1], 0)],
    ids=["past-the-filled-slots", "negative-start", "rows-and-source-differ"],
)
def test_a_splice_that_does_not_fit_is_refused(source, rows, start):
    model = Transformer(TINY).eval()
    with torch.no_grad():
        cache, part = model.new_cache(2, 8), model.new_cache(1, 3)
        model(torch.ones(2, 5, dtype=torch.long), cache=cache)
        model(torch.ones(1, 3, dtype=torch.long), cache=part)
    with pytest.raises(ConfigError, match="does not fit a cache with 5 filled slots"):
        model.splice_cache(cache, part, torch.tensor(source), torch.tensor(rows), start)
