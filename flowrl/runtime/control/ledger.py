"""The prompt ledger: which prompts the trainer consumed, so that each is delivered exactly once.

State (touched by the policy executor's thread, ``consume``, and by continuous generators' executor
threads, ``read_ahead``; the two share nothing but ``skip``, which only a restore writes):

- ``watermark``: the first prompt index the trainer has not consumed: the data position a
  checkpoint stores (``resume.save_run_checkpoint``).
- ``ahead``: consumed indices above the watermark (continuous batching delivers groups out of
  order; in lock step indices arrive in order and it stays empty): a checkpoint's ``delivered_ahead``.
- ``skip``: after a resume, the prompts the checkpointed run had consumed above its watermark; a
  continuous generator's prompt feed drops them (``read_ahead``), so none is delivered twice.
- ``pulled``: per continuous generator, the prompts it was handed so far.
- ``feeds``: continuous generator -> (its source, P prompts a step, k): it starts groups up to ``k``
  steps ahead, so it is handed prompts ``k`` batches ahead of its step (``want``) and its source
  runs ``k + 1`` steps more, and more after a resume skipped some (``steps_of``).
- ``consumed``: each step's consumed indices, in step order (``RunResult.consumed``).

Example:
    >>> ledger = PromptLedger()
    >>> ledger.consume([0, 2]); ledger.watermark, ledger.delivered_ahead()
    (1, (2,))
    >>> ledger.consume([1]); ledger.watermark, ledger.delivered_ahead()
    (3, ())
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

import torch

from flowrl.runtime.staleness import StalenessViolation

if TYPE_CHECKING:
    from flowrl.graph.ir import Graph
    from flowrl.runtime.staleness import StalenessGate

__all__ = ["PromptLedger", "continuous_feeds"]


def continuous_feeds(graph: Graph, gate: StalenessGate) -> dict[str, tuple[str, int, int]]:
    """Each continuous-batching generator of ``graph`` -> (its source, the source's batch size P, its k)."""
    from flowrl.graph.nodes import GeneratorNode, SourceNode

    feeds = {}
    for gen in graph.nodes_of(GeneratorNode):
        if gen.sampling.batching == "continuous":
            (source,) = (e.src for e in graph.edges if e.dst == gen.name)
            feeds[gen.name] = (source, graph.node_of(source, SourceNode).source.batch_size, gate.bound(gen.name).k)
    return feeds


class PromptLedger:
    """Exactly-once prompt bookkeeping of one run (see the module docstring).

    Args:
        watermark: the first prompt not consumed (a restored checkpoint's data position).
        ahead: the prompts consumed above it (a restored checkpoint's ``delivered_ahead``); a resumed
            run skips them.
        feeds: the continuous generators' feeds (``continuous_feeds``).
    """

    def __init__(self, watermark: int = 0, ahead: Iterable[int] = (), *, feeds: Mapping[str, tuple[str, int, int]] | None = None) -> None:
        self.feeds = dict(feeds or {})
        self.pulled: dict[str, int] = {}
        self.consumed: list[list[int]] = []
        self.restore(watermark, ahead)

    def restore(self, watermark: int, ahead: Iterable[int]) -> None:
        """Continue from a checkpoint's data position and the prompts it had consumed above it (skipped from now on)."""
        self.watermark = watermark
        self.ahead: set[int] = set(ahead)
        self.skip: frozenset[int] = frozenset(self.ahead)

    def consume(self, indices: list[int]) -> None:
        """Record one step's consumed ``indices``: advance the watermark past them, keep those above it.

        Raises:
            StalenessViolation: a prompt consumed twice (a flowrl bug).
        """
        for i in indices:
            if i in self.ahead or i < self.watermark:
                raise StalenessViolation(f"prompt {i} was consumed twice; this is a flowrl bug")
            self.ahead.add(i)
        while self.watermark in self.ahead:
            self.ahead.remove(self.watermark)
            self.watermark += 1
        self.consumed.append(list(indices))

    def delivered_ahead(self) -> tuple[int, ...]:
        """The consumed prompts above the watermark, sorted (what a checkpoint stores)."""
        return tuple(sorted(self.ahead))

    def extra_steps(self, group_count: int) -> int:
        """Source steps a continuous generator's feed needs beyond a fresh run's: those the skipped prompts took."""
        return -(-len(self.skip) // group_count)

    def steps_of(self, node: str, steps: int) -> int:
        """The steps ``node``'s executor runs in a run of ``steps``: more for the source of a continuous generator."""
        return steps + sum(k + 1 + self.extra_steps(P) for source, P, k in self.feeds.values() if source == node)

    def want(self, generator: str, steps_in: int) -> int:
        """The prompts continuous ``generator`` should have been handed by its ``steps_in``-th step of this
        run (from 0): ``(steps_in + 1 + k) * P``, so that it may start groups up to ``k`` steps ahead."""
        _source, P, k = self.feeds[generator]
        return (steps_in + 1 + k) * P

    def read_ahead(self, generator: str, want: int, receive: Callable[[], Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The prompts to hand ``generator`` so that it holds ``want`` in all, reading source batches with
        ``receive`` and dropping the skipped ones; concatenated, left-padded (empty when it holds enough).
        """
        from flowrl.operators.source import pad_left

        prompts: list[list[int]] = []
        index: list[int] = []
        while self.pulled.get(generator, 0) + len(index) < want:
            fields = receive()
            lens = fields["prompt_lens"].tolist()
            for row, i in enumerate(fields["prompt_index"].tolist()):
                if i in self.skip:
                    continue
                ids = fields["prompt_ids"][row]
                prompts.append(ids[ids.shape[0] - lens[row] :].tolist())
                index.append(i)
        self.pulled[generator] = self.pulled.get(generator, 0) + len(index)
        if not index:
            return {}
        ids, lens_t = pad_left(prompts, 0)  # the generator reads each prompt by its length
        return {"prompt_ids": ids, "prompt_lens": lens_t, "prompt_index": torch.tensor(index, dtype=torch.int64)}
