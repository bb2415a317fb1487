"""Small configs and batches the operator tests share."""

from __future__ import annotations

import math
from typing import Any

import torch

from flowrl.graph.configs import LossConfig, ModelConfig, OptimizerConfig, SamplingConfig, SourceConfig
from flowrl.graph.nodes import GeneratorNode, LossNode, PolicyNode, ScorerNode, SourceNode

__all__ = ["TINY", "Favour", "tiny_generator_node", "tiny_policy_node", "loss_node", "prompts_of", "rollout_with_rewards", "reference_sampling_logprobs"]

#: A model of a few thousand parameters with grouped-query attention (4 query heads, 2 kv heads).
TINY = ModelConfig(vocab_size=16, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)


def tiny_generator_node(model: ModelConfig = TINY, **sampling: object) -> GeneratorNode:
    sampling.setdefault("n_samples", 3)
    sampling.setdefault("max_new_tokens", 5)
    return GeneratorNode(name="gen", model=model, sampling=SamplingConfig(**sampling))  # type: ignore[arg-type]


def tiny_policy_node(model: ModelConfig = TINY, **optimizer: object) -> PolicyNode:
    return PolicyNode(name="policy", model=model, optimizer=OptimizerConfig(**optimizer))  # type: ignore[arg-type]


def loss_node(**loss: object) -> LossNode:
    return LossNode(name="loss", loss=LossConfig(**loss))  # type: ignore[arg-type]


def source_node(task: str = "copy", batch_size: int = 4, seed: int = 0) -> SourceNode:
    return SourceNode(name="prompts", source=SourceConfig(task=task, batch_size=batch_size, seed=seed))


def scorer_node(fn: str = "flowrl.operators.tasks:copy_reward", **kw: object) -> ScorerNode:
    return ScorerNode(name="reward", fn=fn, **kw)  # type: ignore[arg-type]


def prompts_of(rows: list[list[int]], start: int = 0) -> dict[str, torch.Tensor]:
    """A source batch of ``rows``, left-padded with 0."""
    from flowrl.operators.source import pad_left

    ids, lens = pad_left(rows, 0)
    return {"prompt_ids": ids, "prompt_lens": lens, "prompt_index": torch.arange(start, start + len(rows))}


def rollout_with_rewards(seed: int = 0, *, task: str = "copy", batch_size: int = 4, **sampling: object) -> dict[str, torch.Tensor]:
    """A rollout of the tiny generator on ``task`` with its ``rewards``."""
    from flowrl.operators.generation import Generator
    from flowrl.operators.scoring import Scorer
    from flowrl.operators.source import PromptSource

    source = PromptSource(source_node(task, batch_size))
    rollout = Generator(tiny_generator_node(**sampling), seed=seed).generate(source.next_batch())
    fn = f"flowrl.operators.tasks:{task}_reward"
    return {**rollout, **Scorer(scorer_node(fn)).score(rollout)}


def reference_sampling_logprobs(logits: list[float], temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> list[float]:
    """The sampling distribution's log-probs, written independently of ``flowrl.operators.generation``.

    Plain Python in float64, one token at a time: divide by the temperature; keep the ``top_k`` largest
    (0: all); of those, in descending order, keep a token while the probability mass of the ones before
    it is below ``top_p``; ``log softmax`` over what is kept, ``-inf`` elsewhere.
    """
    z = [x / temperature for x in logits]
    order = sorted(range(len(z)), key=lambda i: -z[i])[: top_k or len(z)]
    norm = math.fsum(math.exp(z[i]) for i in order)
    kept, before = [], 0.0
    for i in order:
        if before >= top_p:
            break
        kept.append(i)
        before += math.exp(z[i]) / norm
    log_norm = math.log(math.fsum(math.exp(z[i]) for i in kept))
    return [z[i] - log_norm if i in kept else -math.inf for i in range(len(z))]


class Favour:
    """``model`` with ``bump`` added to the logits of ``ids`` (everything else delegated to it)."""

    def __init__(self, model: Any, ids: list[int], bump: float) -> None:
        self.model, self.ids, self.bump = model, ids, bump

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        logits = self.model(*args, **kwargs).clone()
        logits[..., self.ids] += self.bump
        return logits

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)
