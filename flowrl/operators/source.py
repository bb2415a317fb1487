"""The source node's operator: batches of left-padded prompts from a task's endless, seeded stream.

State: ``position``, the index of the next prompt to emit. Prompt ``i`` is a pure function of the
task's seed and ``i``, so saving ``state()`` and restoring it with ``load_state`` resumes the stream
exactly: no prompt lost, none repeated.

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

import torch

from flowrl.errors import ConfigError
from flowrl.graph.nodes import SourceNode
from flowrl.operators.batch import Batch
from flowrl.operators.tasks import Task, make_task
from flowrl.operators.tokenizer import DEFAULT_TOKENIZER

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
    """Emits ``batch_size`` prompts per call from ``make_task(node.source.task, node.source.seed)``.

    Attributes:
        task: the task.
        position: index of the next prompt to emit.
    """

    def __init__(self, node: SourceNode) -> None:
        self.name = node.name
        self.config = node.source
        self.task: Task = make_task(node.source.task, node.source.seed)
        self.pad_id: int = int(getattr(self.task, "pad_id", DEFAULT_TOKENIZER.pad_id))
        self.position = 0

    def next_batch(self) -> Batch:
        """The next ``batch_size`` prompts: ``prompt_ids``, ``prompt_lens``, ``prompt_index``.

        Raises:
            ConfigError: when the task yields an empty prompt.
        """
        start, n = self.position, self.config.batch_size
        prompts = [self.task.prompt(i) for i in range(start, start + n)]
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
