"""Samples of what the model writes, decoded during a run (``flowrl run --log-samples N``).

Every ``N`` trainer steps the controller decodes a few samples of the batch the policy just
consumed (one per prompt group, the first ``count`` groups) with the tokenizer of the policy's model
and puts them in the step's metrics row as ``samples_text``: a list of ``{"prompt", "completion",
"reward"}`` (the combined reward the loss saw). The progress bar prints them; the metrics file keeps
them, so a run's samples can be read back next to its curves; TensorBoard shows them as a table
(``samples_markdown``, a text summary) and W&B as a ``wandb.Table``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from flowrl.graph.ir import Graph
from flowrl.graph.nodes import PolicyNode
from flowrl.operators.scoring import unpad

__all__ = ["SampleLogger", "samples_markdown", "SAMPLE_COLUMNS"]

#: The columns of a logged sample, in the order tables show them.
SAMPLE_COLUMNS = ("prompt", "completion", "reward")


class SampleLogger:
    """Decodes ``count`` samples of a training batch every ``every`` steps (see the module docstring).

    Args:
        graph: the graph (the policy's model gives the tokenizer).
        policy: the policy node's name.
        every: steps between logged samples; count: samples per log.
        reward_weights: reward field -> weight of the combined reward.
    """

    def __init__(self, graph: Graph, policy: str, *, every: int, count: int = 2, reward_weights: Mapping[str, float]) -> None:
        self.graph, self.policy, self.every, self.count = graph, policy, every, count
        self.reward_weights = dict(reward_weights)
        self._decode: Callable[[list[int]], str] | None = None

    def __call__(self, step: int, batch: Mapping[str, torch.Tensor]) -> list[dict[str, Any]] | None:
        """The decoded samples of trainer step ``step`` (1-based, the row's ``step``), or None when it is
        not a logging step (every ``every`` trainer steps, whatever the updates per batch)."""
        if self.every <= 0 or step % self.every or "completion_ids" not in batch:
            return None
        if self._decode is None:  # the tokenizer is loaded on first use (HF: from the model directory)
            from flowrl.models.registry import model_tokens

            self._decode = model_tokens(self.graph.node_of(self.policy, PolicyNode).model).decode
        prompts, completions = unpad(batch)
        groups = batch["group_ids"].tolist() if "group_ids" in batch else list(range(len(prompts)))
        rewards = sum(w * batch[k].float() for k, w in self.reward_weights.items() if k in batch)
        picked, seen = [], set()
        for i, g in enumerate(groups):
            if g in seen:
                continue
            seen.add(g)
            reward = float(rewards[i]) if isinstance(rewards, torch.Tensor) else 0.0
            picked.append({"prompt": self._decode(prompts[i]), "completion": self._decode(completions[i]), "reward": round(reward, 4)})
            if len(picked) >= self.count:
                break
        return picked


def samples_markdown(samples: list[dict[str, Any]]) -> str:
    """A markdown table of logged samples (``samples_text``), one row each, as TensorBoard's text
    plugin renders it: ``|`` escaped, line breaks as ``<br>``.

    Example:
        >>> print(samples_markdown([{"prompt": "1+1=", "completion": "2|", "reward": 1.0}]))
        | prompt | completion | reward |
        |---|---|---|
        | 1+1= | 2\\| | 1.0 |
    """

    def cell(value: Any) -> str:
        return str(value).replace("\\", "\\\\").replace("|", "\\|").replace("\r\n", "<br>").replace("\n", "<br>")

    lines = ["| " + " | ".join(SAMPLE_COLUMNS) + " |", "|" + "---|" * len(SAMPLE_COLUMNS)]
    lines += ["| " + " | ".join(cell(s.get(c, "")) for c in SAMPLE_COLUMNS) + " |" for s in samples]
    return "\n".join(lines)
