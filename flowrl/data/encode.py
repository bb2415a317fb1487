"""Prompts to token ids: plain text through the tokenizer, chat messages through its chat template.

Without ``chat_template`` a text prompt is ``tokenizer(text)["input_ids"]`` (special tokens such as
BOS added as the tokenizer does by default); messages then are an error. With ``chat_template`` a
text prompt is wrapped as one user message and messages are rendered with
``tokenizer.apply_chat_template(messages, add_generation_prompt=True)``.

Prompts longer than ``max_len`` tokens are dropped (``overlong="drop"``) or cut to their last
``max_len`` tokens (``"truncate"``: the end is kept, where a chat template puts the generation
prompt). Both are counted in ``EncodedPrompts``; nothing is decided mid-run. Every row dropped, an
empty prompt, or messages without ``chat_template`` are ``ConfigError``s at start.

Example:
    >>> class Chars:  # any object with the tokenizer's __call__ works
    ...     def __call__(self, text):
    ...         return {"input_ids": [ord(c) for c in text]}
    >>> enc = encode_prompts(["hi", "a long one"], Chars(), max_len=4, origin="inline")
    >>> enc.ids, enc.rows, enc.dropped
    ([[104, 105]], [0], 1)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from flowrl.errors import ConfigError
from flowrl.data.dataset import Prompt

__all__ = ["EncodedPrompts", "encode_prompts", "encode_one"]


@dataclass(frozen=True)
class EncodedPrompts:
    """The token ids of the prompts a stream serves.

    Attributes:
        ids: token ids of each kept prompt.
        rows: the dataset row of each kept prompt (``ids[i]`` is row ``rows[i]``).
        dropped: rows left out for being longer than ``max_len`` (``overlong="drop"``).
        truncated: rows cut to ``max_len`` (``overlong="truncate"``).
        longest: length of the longest prompt before any cut.
    """

    ids: list[list[int]]
    rows: list[int]
    dropped: int = 0
    truncated: int = 0
    longest: int = 0


def encode_one(prompt: Prompt, tokenizer: Any, *, chat_template: bool) -> list[int]:
    """The token ids of one prompt (see the module docstring).

    Raises:
        ConfigError: for messages without ``chat_template``.
    """
    if chat_template:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        return [int(i) for i in ids]
    if not isinstance(prompt, str):
        raise ConfigError("a prompt given as chat messages needs chat_template=True on its source (or give the prompt as text)")
    return [int(i) for i in tokenizer(prompt)["input_ids"]]


def encode_prompts(
    prompts: Sequence[Prompt],
    tokenizer: Any,
    *,
    chat_template: bool = False,
    max_len: int = 0,
    overlong: Literal["drop", "truncate"] = "drop",
    origin: str,
) -> EncodedPrompts:
    """Encode every prompt and apply the length limit.

    Args:
        prompts: one prompt per dataset row.
        tokenizer: a ``transformers`` tokenizer (``__call__`` and, for chat, ``apply_chat_template``).
        chat_template: render prompts with the tokenizer's chat template.
        max_len: longest prompt kept whole; 0 means no limit.
        overlong: what happens to a longer prompt: ``"drop"`` it or ``"truncate"`` it.
        origin: the prompt file, for error messages.

    Returns:
        The kept prompts' ids and rows, with the counts.

    Raises:
        ConfigError: for messages without ``chat_template``, an empty prompt, or when every row is dropped.
    """
    ids: list[list[int]] = []
    rows: list[int] = []
    dropped = truncated = longest = 0
    for row, prompt in enumerate(prompts):
        try:
            tokens = encode_one(prompt, tokenizer, chat_template=chat_template)
        except ConfigError as exc:
            raise ConfigError(f"prompt file {origin!r}, row {row}: {exc}") from None
        if not tokens:
            raise ConfigError(f"prompt file {origin!r}, row {row}: the prompt {prompt!r} encodes to no tokens; give it some text")
        longest = max(longest, len(tokens))
        if max_len and len(tokens) > max_len:
            if overlong == "drop":
                dropped += 1
                continue
            tokens, truncated = tokens[-max_len:], truncated + 1
        ids.append(tokens)
        rows.append(row)
    if not ids:
        raise ConfigError(
            f"prompt file {origin!r}: all {len(prompts)} prompts are longer than max_prompt_len={max_len} tokens "
            f"(the longest has {longest}); raise max_prompt_len (or the model's max_seq_len), lower max_new_tokens, "
            "or set overlong='truncate'"
        )
    return EncodedPrompts(ids=ids, rows=rows, dropped=dropped, truncated=truncated, longest=longest)
