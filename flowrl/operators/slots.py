"""Continuous batching: a fixed number of sequence slots, each taking the next waiting sample as soon as it frees.

``SlotBatcher`` decodes up to ``slots`` sequences at once with one KV cache whose columns form one
time axis shared by every slot. State:

- ``rows[i]``: the ``Sample`` slot ``i`` decodes, or None when free.
- ``waiting``: samples not started yet, FIFO (a sample is admitted only in turn).
- ``valid`` ``[slots, L]``: True where column ``j`` of the cache holds a real token of row ``i``'s
  current sample; ``L`` is the cache's length.
- ``pending`` ``[slots, V]``: each busy row's logits for its next token (a ``feeding`` row's come
  with the next step's forward pass).
- ``feeding`` ``[slots]``: rows whose last drawn token is not in the cache yet (``feed`` holds it).
- ``staged``: prompt (token ids) -> its row of a small staging cache that holds it prefilled
  (keys/values, real-token mask, next-token logits) by the weights of ``_part_version``.

One ``step``: free slots take waiting samples (``admit`` may refuse the head of the queue). Then
the cache is brought up to date, in one of three ways:

- decode and splice (the rule): one forward pass appends one column holding the continuing rows'
  last tokens (the other rows' entries masked invalid); then each new row is filled from its
  staged prompt: ``CausalLM.splice_cache`` copies the prompt's keys/values into the new row's
  last columns (its previous occupant's, masked invalid for it from then on) and its logits into
  ``pending``. A prompt that is not staged is prefilled first, in one forward pass with the next
  distinct waiting prompts (``prefill_rows`` in all, none wider than the cache): a refill costs a
  copy, not a forward pass over every row, and a prompt's ``n`` samples share one prefill (as
  serving engines share a prompt's KV blocks across parallel samples). Positions come from
  ``valid`` (real tokens before each), so a spliced prompt keeps the positions it was prefilled
  with. Staged prompts prefilled by older weights are dropped (prefilled again when needed), so
  every token's logits come from the weights of the version it records.
- compaction: when one more column would outgrow ``width`` (or a new prompt is wider than the
  cache), every busy row is re-prefilled from its tokens (prompt and completion so far) into a
  fresh cache. The cache then grows by one column per step, so this is rare.
- merged (a model whose cache takes no splice, e.g. Hugging Face sliding-window layers: the first
  refusal compacts once and switches to this for good): one forward pass appends, as new columns,
  the new rows' prompts and the continuing rows' last tokens.

All three work for the built-in and the Hugging Face models alike. Then every busy row draws one
token exactly as the lock-step sampler does (``sampling_logprobs``, Gumbel-max with one
``[slots, V]`` uniform draw per step from ``rng``) and records it, its log-prob and the weight
version that drew it; the rows that continue are fed it at the next step. A row stops at a stop
token, a stop string, or ``max_new_tokens``; ``step`` returns the samples that finished. The
three ways compute the same logits up to float rounding (batch shapes differ), so they draw the same
tokens but where rounding flips a draw.

With ``slots`` equal to the rows of one batch and nothing waiting, the forward passes, random
draws and tokens are those of ``Generator.generate`` (lock step): only refills differ.

Example:
    >>> from flowrl.graph.nodes import GeneratorNode
    >>> from flowrl.graph.configs import ModelConfig, SamplingConfig
    >>> from flowrl.operators.generation import Generator
    >>> gen = Generator(GeneratorNode(name="g", model=ModelConfig(vocab_size=16, dim=32, n_layers=1, n_heads=2, n_kv_heads=1),
    ...                               sampling=SamplingConfig(n_samples=1, max_new_tokens=3)))
    >>> slots = SlotBatcher(gen, slots=2, rng=torch.Generator().manual_seed(0))
    >>> for i in range(3):
    ...     slots.add(Sample(key=(i, 0), prompt=[1, 4 + i, 14]))
    >>> done = []
    >>> while slots.busy or slots.waiting:
    ...     done += slots.step()
    >>> sorted(s.key for s in done), all(1 <= len(s.tokens) <= 3 for s in done)
    ([(0, 0), (1, 0), (2, 0)], True)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from flowrl.operators.generation import Generator

__all__ = ["Sample", "SlotBatcher"]


@dataclass
class Sample:
    """One completion being drawn.

    Attributes:
        key: (group, sample number): who asked for it.
        prompt: its prompt's real token ids.
        tokens, logprobs, versions: per completion token: the id, log mu of it, the weight version that drew it.
    """

    key: tuple[int, int]
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


class SlotBatcher:
    """Continuous batching over ``slots`` rows (see the module docstring).

    Args:
        generator: the model, sampling settings, stop tokens and pad id to use (its ``version`` is
            read at every step).
        slots: rows decoded at once.
        rng: the random stream of the draws.
        width: cache columns before a compaction (default: twice the model's ``max_seq_len``).
        prefill_rows: distinct prompts prefilled together when a refill finds its prompt not staged
            (default: ``slots``).

    Attributes:
        steps, busy_steps: decode steps run and slot-steps that drew a token (utilisation = busy_steps / (steps * slots)).
        compactions: how often the cache was rebuilt.
        prefills: forward passes that staged prompts.
        splices: whether refills are spliced (False once the model refused a splice: merged refills).

    Raises:
        ValueError: for ``slots`` or ``prefill_rows`` below 1.
    """

    def __init__(
        self, generator: Generator, *, slots: int, rng: torch.Generator, width: int | None = None, prefill_rows: int | None = None
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots={slots} must be >= 1")
        if prefill_rows is not None and prefill_rows < 1:
            raise ValueError(f"prefill_rows={prefill_rows} must be >= 1")
        self.gen = generator
        self.slots = slots
        self.rng = rng
        self.width = width or 2 * generator.model.max_seq_len
        self.rows: list[Sample | None] = [None] * slots
        self.waiting: deque[Sample] = deque()
        device = generator.device
        self.valid = torch.zeros(slots, 0, dtype=torch.bool, device=device)
        self.pending = torch.zeros(slots, generator.model.vocab_size, dtype=torch.float32, device=device)
        self.feeding = torch.zeros(slots, dtype=torch.bool, device=device)
        self.feed = torch.full((slots,), generator.pad_id, dtype=torch.int64, device=device)
        self.cache: Any = None
        self.splices = True
        self.prefill_rows = prefill_rows or slots
        self.staged: dict[tuple[int, ...], int] = {}
        self._part: Any = None
        self._part_valid = self._part_logits = torch.zeros(0, 0)
        self._part_version = 0
        self.prefills = 0
        self.steps = self.busy_steps = self.compactions = 0

    @property
    def busy(self) -> int:
        """Slots decoding a sample now."""
        return sum(r is not None for r in self.rows)

    def add(self, sample: Sample, *, front: bool = False) -> None:
        """Queue ``sample`` for the next free slot (``front``: ahead of every waiting sample)."""
        if front:
            self.waiting.appendleft(sample)
        else:
            self.waiting.append(sample)

    def _prompt(self, i: int) -> list[int]:
        """The prompt of the sample in slot ``i`` (one ``_fill`` just placed there)."""
        row = self.rows[i]
        assert row is not None, f"slot {i} holds no sample"
        return row.prompt

    def _fill(self, admit: Callable[[Sample], bool] | None) -> list[int]:
        new = []
        for i, row in enumerate(self.rows):
            if row is not None:
                continue
            if not self.waiting or (admit is not None and not admit(self.waiting[0])):
                break
            self.rows[i] = self.waiting.popleft()
            new.append(i)
        return new

    def _forward(self, tokens: Tensor, valid: Tensor, cache: Any) -> Tensor:
        return self.gen.model(tokens, valid=valid, cache=cache, keep=1)[:, -1].float()

    def _prefill_all(self) -> None:
        """A fresh cache holding every busy row's tokens so far (compaction, and the first fill)."""
        from flowrl.operators.source import pad_left

        seqs = [[*r.prompt, *r.tokens] if r is not None else [] for r in self.rows]
        ids, lens = pad_left(seqs, self.gen.pad_id)
        ids, lens = ids.to(self.gen.device), lens.to(self.gen.device)
        width = ids.shape[1]
        self.valid = torch.arange(width, device=self.gen.device)[None, :] >= (width - lens)[:, None]
        self.cache = self.gen.model.new_cache(self.slots, self.width)
        self.pending = self._forward(ids, self.valid, self.cache)
        self.feeding[:] = False  # every row's tokens are in the fresh cache
        self.compactions += 1

    def _decode(self) -> None:
        """Append one column: the feeding rows' last tokens (the other rows' entry is masked invalid)."""
        self.valid = torch.cat([self.valid, self.feeding[:, None]], dim=1)
        logits = self._forward(self.feed[:, None], self.valid, self.cache)
        self.pending = torch.where(self.feeding[:, None], logits, self.pending)
        self.feeding[:] = False

    def _stage(self, needed: list[tuple[int, ...]], longest: int) -> None:
        """Prefill ``needed`` and the next distinct waiting prompts (up to ``prefill_rows`` in all, none
        longer than ``longest``) in one forward pass, into a fresh staging cache."""
        from flowrl.operators.logprobs import prompt_valid
        from flowrl.operators.source import pad_left

        prompts = dict.fromkeys(needed)
        for sample in self.waiting:
            if len(prompts) >= self.prefill_rows:
                break
            if len(sample.prompt) <= longest:
                prompts.setdefault(tuple(sample.prompt))
        device, model = self.gen.device, self.gen.model
        ids, lens = pad_left([list(p) for p in prompts], self.gen.pad_id)
        ids, lens = ids.to(device), lens.to(device)
        self._part = model.new_cache(len(prompts), ids.shape[1])
        self._part_valid = prompt_valid(ids, lens)  # [prompts, Tp]
        self._part_logits = self._forward(ids, self._part_valid, self._part)
        self._part_version = self.gen.version
        self.staged = {p: j for j, p in enumerate(prompts)}
        self.prefills += 1

    def _splice(self, new: list[int]) -> bool:
        """Fill the new rows from staged prompts, staging the ones that are not (see the module docstring).

        Returns:
            False when the model cannot splice this cache (then rows are filled another way from now on).
        """
        filled = self.valid.shape[1]
        if self._part is not None and (self._part_version != self.gen.version or self._part_valid.shape[1] > filled):
            self.staged = {}  # prefilled by older weights, or wider than this (compacted) cache
        prompts = {i: tuple(self._prompt(i)) for i in new}
        ready = [i for i in new if prompts[i] in self.staged]
        if ready and not self._place(ready, prompts):
            return False
        unstaged = [i for i in new if prompts[i] not in self.staged]
        if unstaged:
            self._stage([prompts[i] for i in unstaged], filled)
            return self._place(unstaged, prompts)
        return True

    def _place(self, new: list[int], prompts: dict[int, tuple[int, ...]]) -> bool:
        """Splice the staged prompts of rows ``new`` into their rows' last columns; False if the model refuses."""
        device, filled = self.gen.device, self.valid.shape[1]
        rows = torch.tensor(new, device=device)
        source = torch.tensor([self.staged[prompts[i]] for i in new], device=device)
        start = filled - self._part_valid.shape[1]
        splice = getattr(self.gen.model, "splice_cache", None)  # an adapter without it takes the merged refill
        if splice is None or not splice(self.cache, self._part, source, rows, start):
            self.splices = False
            return False
        self.valid[rows] = False  # the previous occupants' columns
        self.valid[rows, start:] = self._part_valid[source]
        self.pending[rows] = self._part_logits[source]
        return True

    def _advance(self, new: list[int]) -> None:
        """Append the new rows' prompts and the feeding rows' last tokens as columns, in one forward pass
        (for a model that cannot splice its cache)."""
        from flowrl.operators.source import pad_left

        device = self.gen.device
        ids, lens = pad_left([self._prompt(i) if i in new else [] for i in range(self.slots)], self.gen.pad_id)
        width = max(ids.shape[1], 1)
        ids = torch.cat([torch.full((self.slots, width - ids.shape[1]), self.gen.pad_id, dtype=torch.int64), ids], dim=1).to(device)
        fresh = torch.arange(width, device=device)[None, :] >= (width - lens.to(device))[:, None]  # [slots, width]
        ids[:, -1] = torch.where(self.feeding, self.feed, ids[:, -1])
        fresh[:, -1] |= self.feeding
        updated = self.feeding.clone()
        if new:
            rows = torch.tensor(new, device=device)
            self.valid[rows] = False  # the previous occupants' columns
            updated[rows] = True
        self.valid = torch.cat([self.valid, fresh], dim=1)
        logits = self._forward(ids, self.valid, self.cache)
        self.pending = torch.where(updated[:, None], logits, self.pending)
        self.feeding[:] = False

    def _columns(self, new: list[int]) -> None:
        """Bring the cache up to date: the new rows' prompts and the feeding rows' last tokens in it, their logits in ``pending``."""
        feeding = bool(self.feeding.any())
        longest = max((len(self._prompt(i)) for i in new), default=0)
        filled = self.valid.shape[1] if self.cache is not None else 0
        if self.splices:
            if self.cache is None or filled + feeding > self.width or longest > filled + feeding:
                self._prefill_all()
                return
            if feeding:
                self._decode()
            if new and not self._splice(new):
                self._prefill_all()  # this model's cache takes no splice: the rows it just decoded are re-prefilled once
            return
        columns = max(longest, int(feeding))
        if self.cache is None or filled + columns > self.width:
            self._prefill_all()
        elif columns:
            self._advance(new)

    def step(self, admit: Callable[[Sample], bool] | None = None) -> list[Sample]:
        """Fill free slots, draw one token in every busy row, feed the rows that continue.

        Args:
            admit: called with the head of the queue before it takes a slot; False keeps it (and
                everything behind it) waiting.

        Returns:
            The samples that finished in this step (their slots are free again).
        """
        from flowrl.operators.generation import sampling_logprobs

        gen, sampling = self.gen, self.gen.sampling
        new = self._fill(admit)
        busy = [i for i, r in enumerate(self.rows) if r is not None]
        if not busy:
            return []
        self._columns(new)
        logp = sampling_logprobs(self.pending, sampling)  # [slots, V]
        uniform = torch.rand(logp.shape, generator=self.rng, device=logp.device).clamp_(min=1e-20)
        token = torch.argmax(logp - torch.log(-torch.log(uniform)), dim=-1)  # Gumbel-max, as in lock step
        chosen = logp.gather(-1, token[:, None]).squeeze(-1)
        stops = torch.isin(token, gen._stop).tolist()
        token_list, chosen_list = token.tolist(), chosen.tolist()
        self.steps += 1
        self.busy_steps += len(busy)
        finished = []
        for i in busy:
            row = self.rows[i]
            assert row is not None
            row.tokens.append(token_list[i])
            row.logprobs.append(chosen_list[i])
            row.versions.append(gen.version)
            done = stops[i] or len(row.tokens) >= sampling.max_new_tokens
            if not done and sampling.stop_strings:
                text = gen._decode(row.tokens)
                done = any(stop in text for stop in sampling.stop_strings)
            if done:
                finished.append(row)
                self.rows[i] = None
            else:
                self.feeding[i] = True  # fed at the next step, with any refills
        self.feed = token
        return finished
