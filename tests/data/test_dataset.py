"""The prompt field: text or messages, every other field kept, and clear errors for rows that break it."""

from __future__ import annotations

import pytest

from flowrl.data.dataset import PromptDataset, is_messages
from flowrl.errors import ConfigError

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]


def test_text_and_messages_prompts_and_the_other_fields():
    ds = PromptDataset([{"q": "2+2=", "answer": "4", "id": 7}, {"q": CHAT, "answer": "4", "level": 1}], prompt_field="q", origin="f")
    assert ds.prompt(0) == "2+2=" and ds.prompt(1) == CHAT
    assert ds.fields(0) == {"answer": "4", "id": 7} and ds.fields(1) == {"answer": "4", "level": 1}
    assert ds.field_names == ["answer", "id", "level"]
    assert ds.rows_lacking("id") == [1]


@pytest.mark.parametrize(
    ("value", "ok"),
    [(CHAT, True), ([], False), ([{"role": "user"}], False), ([{"role": "user", "content": 3}], False), ("text", False), ([CHAT], False)],
    ids=["chat", "empty", "no-content", "int-content", "text", "nested"],
)
def test_is_messages(value, ok):
    assert is_messages(value) is ok


BAD = [
    ([{"question": "a", "answer": "1"}], "prompt", r"no row has the prompt field 'prompt'; the fields present are \['answer', 'question'\]"),
    ([{"prompt": "a"}, {"text": "b"}], "prompt", r"row 1 has no field 'prompt' \(its fields: \['text'\]\)"),
    ([{"prompt": "a"}, {"prompt": 3}], "prompt", r"row 1's 'prompt' is int 3, which is neither text nor chat messages"),
    ([{"prompt": None}], "prompt", r"row 0's 'prompt' is NoneType None"),
    ([{"prompt": [{"role": "user"}]}], "prompt", r"row 0's 'prompt' is list"),
    ([], "prompt", "holds no rows"),
]


@pytest.mark.parametrize(("rows", "field", "match"), BAD, ids=["field-absent", "row-lacks", "int", "none", "bad-messages", "no-rows"])
def test_bad_rows_are_clear_errors(rows, field, match):
    with pytest.raises(ConfigError, match=match) as info:
        PromptDataset(rows, prompt_field=field, origin="data/train.jsonl")
    assert "data/train.jsonl" in str(info.value)
