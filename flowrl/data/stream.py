"""The endless prompt stream of a data source: position -> (epoch, row) -> prompt ids and row fields.

A ``PromptStream`` serves the prompts of a file that survived the length limit
(``flowrl.data.encode``), in the epoch order of ``flowrl.data.order``. Everything it serves at a
position is a pure function of the file, the source's settings and the position, so the runtime's
checkpointed stream position is all an exact resume needs, and any process (the source, a scorer)
that opens the same stream maps a position to the same row.

A metrics row's ``prompt_index`` lists stream positions; ``row_of(position)`` names the file row
(0-based, in file order) that a position served.

Example:
    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "p.jsonl"
    >>> _ = path.write_text("".join(f'{{"prompt": "q{i}", "answer": "{i}"}}\\n' for i in range(3)))
    >>> class Chars:
    ...     def __call__(self, text):
    ...         return {"input_ids": [ord(c) for c in text]}
    >>> stream = PromptStream.open(path=str(path), tokenizer=Chars(), seed=0)
    >>> [stream.row_of(p) for p in range(6)], stream.epoch_of(4)
    ([1, 0, 2, 1, 2, 0], 1)
    >>> stream.prompt_ids(0), stream.fields(0)
    ([113, 49], {'answer': '1'})
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

from flowrl.data.dataset import PromptDataset
from flowrl.data.encode import EncodedPrompts, encode_prompts
from flowrl.data.order import EpochOrder

__all__ = ["PromptStream"]


class PromptStream:
    """Prompts of ``dataset`` by stream position (see the module docstring).

    Args:
        dataset: the rows.
        encoded: their token ids after the length limit.
        seed: seed of the per-epoch shuffle.
        shuffle: shuffle each epoch (else file order, epoch after epoch).
        tokenizer: the tokenizer that encoded them (its ``pad_token_id`` pads batches).
    """

    def __init__(
        self, dataset: PromptDataset, encoded: EncodedPrompts, *, seed: int, shuffle: bool = True, tokenizer: Any = None
    ) -> None:
        self.dataset, self.encoded, self.tokenizer = dataset, encoded, tokenizer
        self.order = EpochOrder(len(encoded.rows), seed, shuffle=shuffle)

    @classmethod
    def open(
        cls,
        *,
        path: str,
        tokenizer: Any,
        prompt_field: str = "prompt",
        chat_template: bool = False,
        max_prompt_len: int = 0,
        overlong: Literal["drop", "truncate"] = "drop",
        seed: int = 0,
        shuffle: bool = True,
        owner: str = "source",
        warn: bool = True,
    ) -> PromptStream:
        """Read, check and encode the prompt file ``path``.

        Args:
            path: the prompt file (``flowrl.data.files``).
            tokenizer: the tokenizer that encodes the prompts.
            prompt_field, chat_template, max_prompt_len, overlong, seed, shuffle: as in ``SourceConfig``.
            owner: who opens it (``"source 'prompts'"``), for the warning.
            warn: warn once when prompts are dropped or truncated.

        Raises:
            ConfigError: for a bad file, rows or prompts (see ``flowrl.data``), before anything is served.
        """
        dataset = PromptDataset.from_file(path, prompt_field=prompt_field)
        prompts = [dataset.prompt(i) for i in range(len(dataset))]
        encoded = encode_prompts(prompts, tokenizer, chat_template=chat_template, max_len=max_prompt_len, overlong=overlong, origin=path)
        if warn and (encoded.dropped or encoded.truncated):
            what = "dropped" if encoded.dropped else "truncated to their last tokens"
            count = encoded.dropped or encoded.truncated
            warnings.warn(
                f"{owner}: {count} of {len(dataset)} prompts in {path!r} are longer than max_prompt_len={max_prompt_len} "
                f"tokens (the longest has {encoded.longest}) and are {what}",
                stacklevel=2,
            )
        return cls(dataset, encoded, seed=seed, shuffle=shuffle, tokenizer=tokenizer)

    @property
    def pad_id(self) -> int:
        """The id that pads prompts: the tokenizer's pad token (0 if it has none)."""
        return int(getattr(self.tokenizer, "pad_token_id", None) or 0)

    def __len__(self) -> int:
        """Prompts per epoch (the rows kept)."""
        return len(self.encoded.rows)

    def epoch_of(self, position: int) -> int:
        """The epoch (0-based) that stream ``position`` falls in."""
        return self.order.epoch(position)

    def row_of(self, position: int) -> int:
        """The file row (0-based, file order) served at stream ``position``."""
        return self.encoded.rows[self.order.index(position)]

    def prompt_ids(self, position: int) -> list[int]:
        """The token ids of the prompt served at ``position``."""
        return self.encoded.ids[self.order.index(position)]

    def fields(self, position: int) -> dict[str, Any]:
        """The row fields (all but the prompt) of the prompt served at ``position``."""
        return self.dataset.fields(self.row_of(position))
