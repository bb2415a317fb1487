"""The task tokenizer: a fixed 16-id vocabulary, exact round trips, clear errors."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flowrl.graph.configs import ModelConfig
from flowrl.models.families.builtin.tokenizer import DEFAULT_TOKENIZER, Tokenizer


def test_vocabulary_fits_the_default_model():
    tok = Tokenizer()
    assert tok.vocab_size == 16 <= ModelConfig(vocab_size=16).vocab_size
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert len(set(tok.tokens)) == tok.vocab_size


@pytest.mark.parametrize(
    ("text", "ids"),
    [("<s>12+3=", [1, 4, 5, 13, 6, 14]), ("90</s>", [12, 3, 2]), ("<pad>-", [0, 15]), ("", [])],
    ids=["prompt", "completion", "pad-minus", "empty"],
)
def test_encode_table(text, ids):
    assert DEFAULT_TOKENIZER.encode(text) == ids
    assert DEFAULT_TOKENIZER.decode(ids) == text


@given(st.lists(st.sampled_from(DEFAULT_TOKENIZER.tokens), max_size=30))
def test_decode_encode_round_trip(tokens):
    text = "".join(tokens)
    ids = DEFAULT_TOKENIZER.encode(text)
    assert DEFAULT_TOKENIZER.decode(ids) == text
    assert ids == [DEFAULT_TOKENIZER.tokens.index(t) for t in tokens]


@pytest.mark.parametrize(("text", "match"), [("12a", "'a' at 2"), ("<x>", "'<' at 0")], ids=["letter", "bad-special"])
def test_unknown_characters_are_named(text, match):
    with pytest.raises(ValueError, match=match):
        DEFAULT_TOKENIZER.encode(text)


def test_out_of_vocabulary_ids_decode_visibly():
    assert DEFAULT_TOKENIZER.decode([4, 99]) == "1<unk:99>"
