"""Prompts from the user's files: reading rows, the prompt field, encoding, and the endless stream.

- ``files``: ``read_rows(path)`` for JSONL, JSON, Parquet (``flowrl[data]``) and CSV;
- ``dataset``: ``PromptDataset``, the rows with their prompt field checked;
- ``encode``: prompts (text or chat messages) to token ids, with the length limit;
- ``order``: ``EpochOrder``, position -> (epoch, row) with a seeded shuffle per epoch;
- ``stream``: ``PromptStream``, what a data source serves at each stream position;
- ``wiring``: where a graph's data source finds its tokenizer and length limit.

A metrics row's ``prompt_index`` holds stream positions; ``row_of(graph, source, position)`` (or
``PromptStream.row_of``) names the file row a position served.
"""

from __future__ import annotations

from flowrl.data.dataset import PromptDataset, is_messages
from flowrl.data.encode import EncodedPrompts, encode_prompts
from flowrl.data.files import read_rows
from flowrl.data.order import EpochOrder
from flowrl.data.stream import PromptStream

__all__ = ["read_rows", "PromptDataset", "is_messages", "EncodedPrompts", "encode_prompts", "EpochOrder", "PromptStream"]
