"""The source node's operator: batches of left-padded prompts from a task's or a file's endless stream.

State: ``position``, the index of the next prompt to emit. Prompt ``i`` is a pure function of the
task's seed and ``i`` (or, for a prompt file, of the file, the source's settings and ``i``: see
``flowrl.data.stream``), so saving ``state()`` and restoring it with ``load_state`` resumes the stream
exactly: no prompt lost, none repeated. ``prompt_index`` holds stream positions; for a prompt file,
``stream.row_of(position)`` names the file row.

Example:
    >>> from flowrl.graph.nodes import SourceNode
    >>> from flowrl.graph.configs import SourceConfig
    >>> src = PromptSource(SourceNode(name="p", source=SourceConfig(task="copy", batch_size=2)))
    >>> batch = src.next_batch()
    >>> batch["prompt_index"].tolist(), src.position
    ([0, 1], 2)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from flowrl.errors import ConfigError
from flowrl.graph.nodes import SourceNode

if TYPE_CHECKING:
    from flowrl.data.stream import PromptStream
from flowrl.operators.batch import Batch
from flowrl.operators.tasks import Task, make_task
from flowrl.models.families.builtin.tokenizer import DEFAULT_TOKENIZER

__all__ = ["PromptSource", "pad_left"]


def pad_left(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [N, max_len] int64 left-padded with pad_id, lens [N] int64)``."""
    lens = torch.tensor([len(p) for p in prompts], dtype=torch.int64)
    width = int(lens.max()) if len(prompts) else 0
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.int64)
    for row, prompt in enumerate(prompts):
        if len(prompt):
            ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.int64)
    return ids, lens


class PromptSource:
    """Emits ``batch_size`` prompts per call from the source's task or prompt file.

    Args:
        node: the source node.
        stream: for a prompt file (``node.source.data``), its opened stream
            (``flowrl.data.wiring.open_source_stream``, which knows the graph's tokenizer and length
            limit); None opens it from the node's own settings.

    Attributes:
        task: the task (None for a prompt file).
        stream: the prompt file's stream (None for a task).
        position: index of the next prompt to emit.
    """

    def __init__(self, node: SourceNode, *, stream: PromptStream | None = None) -> None:
        self.name = node.name
        self.config = node.source
        self.task: Task | None = None
        self.stream: PromptStream | None = None
        if node.source.data:
            if stream is None:
                from flowrl.data.wiring import open_source_stream
                from flowrl.graph.ir import Graph, GraphSpec

                stream = open_source_stream(Graph(GraphSpec(name=node.name, nodes=(node,)), validate=False), node.name)
            self.stream = stream
            self.pad_id = int(stream.pad_id)
        else:
            self.task = make_task(node.source.task, node.source.seed)
            self.pad_id = int(getattr(self.task, "pad_id", DEFAULT_TOKENIZER.pad_id))
        self.position = 0

    def prompt(self, position: int) -> list[int]:
        """The token ids of the prompt at stream ``position``."""
        if self.stream is not None:
            return self.stream.prompt_ids(position)
        assert self.task is not None  # one of the two is set in __init__
        return self.task.prompt(position)

    def next_batch(self) -> Batch:
        """The next ``batch_size`` prompts: ``prompt_ids``, ``prompt_lens``, ``prompt_index`` (stream positions).

        Raises:
            ConfigError: when the task yields an empty prompt.
        """
        start, n = self.position, self.config.batch_size
        prompts = [self.prompt(i) for i in range(start, start + n)]
        for i, p in enumerate(prompts):
            if not len(p):
                raise ConfigError(f"source {self.name!r}: task {self.config.task!r} gave an empty prompt at index {start + i}")
        ids, lens = pad_left(prompts, self.pad_id)
        self.position = start + n
        return {"prompt_ids": ids, "prompt_lens": lens, "prompt_index": torch.arange(start, start + n, dtype=torch.int64)}

    def state(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state(self, state: Mapping[str, int]) -> None:
        position = int(state["position"])
        if position < 0:
            raise ConfigError(f"source {self.name!r}: position={position} must be >= 0")
        self.position = position
