"""A dataset of prompts: the rows of a prompt file, the field that holds each prompt, and the rest.

A row's prompt (in ``prompt_field``) is either text (a ``str``) or chat messages (a list of
``{"role": str, "content": str}`` objects). Every other field of the row is kept untouched for the
scorers (``fields(i)``), e.g. the reference ``answer`` of a math problem.

Example:
    >>> ds = PromptDataset([{"q": "2+2=", "answer": "4"}], prompt_field="q", origin="inline")
    >>> ds.prompt(0), ds.fields(0), ds.field_names
    ('2+2=', {'answer': '4'}, ['answer'])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flowrl.errors import ConfigError
from flowrl.data.files import read_rows

__all__ = ["PromptDataset", "Prompt", "is_messages"]

#: A prompt: text, or chat messages.
Prompt = str | list[dict[str, str]]


def is_messages(value: Any) -> bool:
    """True for a non-empty list of ``{"role": str, "content": str}`` objects."""
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)
    )


class PromptDataset:
    """The rows of a prompt file, checked: each has ``prompt_field`` holding text or messages.

    Args:
        rows: the records (``flowrl.data.files.read_rows``).
        prompt_field: the field holding the prompt.
        origin: where the rows came from (the file), for error messages.

    Raises:
        ConfigError: when no row has ``prompt_field`` (listing the fields present), when a row lacks
            it, or when a row's prompt is neither text nor messages.
    """

    def __init__(self, rows: Sequence[dict[str, Any]], *, prompt_field: str, origin: str) -> None:
        if not rows:
            raise ConfigError(f"prompt file {origin!r} holds no rows; give it at least one record with a prompt")
        self.rows, self.prompt_field, self.origin = list(rows), prompt_field, origin
        names: dict[str, None] = {}
        for row in self.rows:
            names.update(dict.fromkeys(row))
        if prompt_field not in names:
            raise ConfigError(
                f"prompt file {origin!r}: no row has the prompt field {prompt_field!r}; the fields present are "
                f"{sorted(names)}: set the source's prompt_field to the one holding the prompts"
            )
        for i, row in enumerate(self.rows):
            if prompt_field not in row:
                raise ConfigError(
                    f"prompt file {origin!r}: row {i} has no field {prompt_field!r} (its fields: {sorted(row)}); "
                    "give every row a prompt or remove that row"
                )
            value = row[prompt_field]
            if not isinstance(value, str) and not is_messages(value):
                raise ConfigError(
                    f"prompt file {origin!r}: row {i}'s {prompt_field!r} is {_show(value)}, which is neither text nor "
                    'chat messages; write a string or a list of {"role": ..., "content": ...} objects'
                )
        #: Fields besides the prompt, in order of first appearance.
        self.field_names: list[str] = [n for n in names if n != prompt_field]

    @classmethod
    def from_file(cls, path: str, *, prompt_field: str = "prompt") -> PromptDataset:
        """The dataset of the prompt file ``path`` (see ``flowrl.data.files.read_rows``)."""
        return cls(read_rows(path), prompt_field=prompt_field, origin=path)

    def __len__(self) -> int:
        return len(self.rows)

    def prompt(self, index: int) -> Prompt:
        """The prompt of row ``index``: text or messages."""
        return self.rows[index][self.prompt_field]

    def fields(self, index: int) -> dict[str, Any]:
        """Row ``index``'s fields other than the prompt."""
        return {k: v for k, v in self.rows[index].items() if k != self.prompt_field}

    def rows_lacking(self, name: str) -> list[int]:
        """Indices of the rows without field ``name``."""
        return [i for i, row in enumerate(self.rows) if name not in row]


def _show(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"
