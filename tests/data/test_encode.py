"""Encoding prompts with a real tokenizer: text, chat messages through the template, the length limit."""

from __future__ import annotations

import warnings

import pytest

from flowrl.data.encode import encode_prompts
from flowrl.data.stream import PromptStream
from flowrl.errors import ConfigError
from flowrl.models.tokenizer import load_tokenizer

from .helpers import word_tokenizer, write_jsonl

CHAT = [{"role": "system", "content": "the answer"}, {"role": "user", "content": "what is two plus two ?"}]


@pytest.fixture
def tok(tmp_path):
    return load_tokenizer(str(word_tokenizer(tmp_path / "tok", bos=True)))


def test_text_prompts_use_the_tokenizer_with_its_special_tokens(tok):
    enc = encode_prompts(["what is 1 plus 2 ?"], tok, origin="f")
    assert enc.ids == [tok("what is 1 plus 2 ?")["input_ids"]]
    assert tok.convert_ids_to_tokens(enc.ids[0]) == ["<s>", "what", "is", "1", "plus", "2", "?"]


def test_chat_prompts_go_through_the_template_with_the_generation_prompt(tok):
    enc = encode_prompts([CHAT, "what is 1 ?"], tok, chat_template=True, origin="f")
    assert tok.convert_ids_to_tokens(enc.ids[0]) == "system the answer user what is two plus two ? assistant".split()
    assert tok.convert_ids_to_tokens(enc.ids[1]) == "user what is 1 ? assistant".split()  # text wrapped as one user message


def test_messages_without_chat_template_are_an_error_naming_the_row(tok):
    with pytest.raises(ConfigError, match=r"'f', row 1: a prompt given as chat messages needs chat_template=True"):
        encode_prompts(["what", CHAT], tok, origin="f")


@pytest.mark.parametrize(
    ("overlong", "want", "rows", "dropped", "truncated"),
    [
        ("drop", ["<s> what", "<s> one two"], [0, 2], 1, 0),
        ("truncate", ["<s> what", "one two three", "<s> one two"], [0, 1, 2], 0, 1),  # the end is kept
    ],
    ids=["drop", "truncate"],
)
def test_overlong_prompts_are_dropped_or_truncated_and_counted(tok, overlong, want, rows, dropped, truncated):
    enc = encode_prompts(["what", "one two three", "one two"], tok, max_len=3, overlong=overlong, origin="f")
    assert [" ".join(tok.convert_ids_to_tokens(i)) for i in enc.ids] == want
    assert enc.rows == rows
    assert (enc.dropped, enc.truncated, enc.longest) == (dropped, truncated, 4)


def test_every_prompt_too_long_is_an_error_at_start(tok):
    with pytest.raises(ConfigError, match=r"all 2 prompts are longer than max_prompt_len=1 tokens \(the longest has 3\); raise"):
        encode_prompts(["one two", "what"], tok, max_len=1, origin="f")


def test_an_empty_prompt_is_an_error(tmp_path):
    tok = load_tokenizer(str(word_tokenizer(tmp_path / "tok", bos=False)))
    with pytest.raises(ConfigError, match=r"row 1: the prompt '' encodes to no tokens"):
        encode_prompts(["what", ""], tok, origin="f")


def test_the_stream_warns_once_with_the_counts(tok, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "what"}, {"prompt": "one two three four"}, {"prompt": "one two three"}])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stream = PromptStream.open(path=str(path), tokenizer=tok, max_prompt_len=3, owner="source 'p'")
        for p in range(10):
            stream.prompt_ids(p)
    assert [str(w.message) for w in caught] == [
        f"source 'p': 2 of 3 prompts in {str(path)!r} are longer than max_prompt_len=3 tokens (the longest has 5) and are dropped"
    ]
    assert len(stream) == 1 and {stream.row_of(p) for p in range(10)} == {0}
