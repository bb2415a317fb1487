"""Continuous batching on vLLM: samples streamed into vLLM's engine, weights updated in flight between its steps.

``VLLMSlotBatcher`` is the vLLM engine's counterpart of ``flowrl.operators.slots.SlotBatcher``, with
its interface (``add``, ``step(admit)``, ``busy``, ``waiting``, ``steps``, ``busy_steps``), so that
``flowrl.runtime.programs.continuous.ContinuousRollouts`` drives either one with the same admission,
deadlines, delivery and rollout format (per-token ``versions`` and ``logprobs`` on each ``Sample``).

Why vLLM's step API (``LLMEngine.add_request`` / ``step`` / ``abort_request``) and not its async
engine: flowrl's generator program is synchronous (one thread drives the engine, between which it
takes weights, admits samples and delivers groups), and ``LLMEngine`` gives exactly that without an
event loop in the generator's process. vLLM's engine core runs in its own process and keeps
decoding the requests it holds while this process does something else (the controller's other
work, a trainer step on the same machine): ``step()`` collects one engine step's new tokens
(``RequestOutputKind.DELTA``).

State:

- ``rows``: request id -> the ``Sample`` vLLM decodes under it. At most ``slots`` of them, or
  ``2 * slots`` when vLLM itself decodes at most ``slots`` sequences at once (``max_num_seqs``, set
  from ``SamplingConfig.slots``): vLLM's engine core runs ahead of this process, so a place freed in
  one engine step would stay empty until this process sees the finish and submits the next sample;
  with ``slots`` more requests waiting inside vLLM, its scheduler refills the place in the same step.
  (Admitting a sample early is safe for the staleness bound: its deadline is set from the version
  at admission, and a later first token only has a newer version.)
- ``waiting``: samples not admitted yet, FIFO (``admit`` may refuse the head).
- ``resume``: admitted samples whose request was stopped by a weight update, re-submitted first.
- ``done``: samples that finished in the outputs drained by an update, returned by the next ``step``.

In-flight weight update (``interrupt``, which ``VLLMGenerator`` calls before it loads new weights):
the outputs vLLM already produced are taken (drawn by the old weights: they keep its version), every
running request is aborted, and its sample goes to ``resume``; then the weights load (nothing runs in
vLLM, so its prefix cache is reset) and ``step`` re-submits each such sample with its prompt followed
by its kept tokens as the new prompt and ``max_new_tokens`` less those tokens as its budget. The KV of
the kept tokens is recomputed by the new weights (vLLM's own ``pause_generation(mode="keep")``
would keep it, but its engine core runs ahead of this process, so the tokens on either side of the
load could not be told apart; abort gives a sharp edge). mu of the kept tokens stays as recorded (the
distribution each was drawn from); tokens drawn after the update record the new version and its mu.
Outputs of an aborted request that arrive later are dropped by vLLM's output processor: no token is
recorded twice or lost from a sample's record.

Each submission draws its own 62-bit seed from ``rng`` (a re-submission gets a fresh one), so a run's
draws follow its seed up to vLLM's batch-dependent rounding.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from flowrl.errors import ConfigError
from flowrl.operators.slots import Sample

if TYPE_CHECKING:
    from flowrl.operators.engines.vllm_engine import VLLMGenerator

__all__ = ["VLLMSlotBatcher"]


class VLLMSlotBatcher:
    """Samples streamed into a ``VLLMGenerator``'s engine, at most ``slots`` at once (see the module docstring).

    Args:
        generator: the vLLM generator (its engine, sampling, stop tokens, ``version``); the batcher
            registers itself as the generator's ``stream``, so a weight update interrupts it.
        slots: sequences decoded at once (requests held in vLLM: ``capacity``, see ``rows`` above).
        rng: the stream each submission's seed is drawn from.

    Attributes:
        steps, busy_steps: vLLM engine steps whose outputs were taken, and the requests that drew a
            token in them (utilisation = busy_steps / (steps * slots)).
        interrupts, resubmitted: weight updates that stopped running requests, and the samples they re-submitted.
    """

    def __init__(self, generator: VLLMGenerator, *, slots: int, rng: torch.Generator) -> None:
        if slots < 1:
            raise ValueError(f"slots={slots} must be >= 1")
        self.gen = generator
        self.slots = slots
        self.rng = rng
        self.engine = generator.llm.llm_engine
        self.capacity = 2 * slots if generator.max_num_seqs <= slots else slots  # requests held in vLLM (``rows``)
        self.rows: dict[str, Sample] = {}
        self.waiting: deque[Sample] = deque()
        self.resume: deque[Sample] = deque()
        self.done: list[Sample] = []
        self._ids = itertools.count()
        self.steps = self.busy_steps = self.interrupts = self.resubmitted = 0
        generator.stream = self

    @property
    def busy(self) -> int:
        """Admitted samples not returned yet: running in vLLM, waiting to be re-submitted, or finished in a drain."""
        return len(self.rows) + len(self.resume) + len(self.done)

    def add(self, sample: Sample, *, front: bool = False) -> None:
        """Queue ``sample`` for the next free slot (``front``: ahead of every waiting sample).

        Raises:
            ConfigError: a prompt whose ids fall outside the vocabulary, or that leaves no room for
                ``max_new_tokens`` in the model's context.
        """
        owner, C = f"generator {self.gen.name!r}", self.gen.sampling.max_new_tokens
        if sample.prompt and (min(sample.prompt) < 0 or max(sample.prompt) >= self.gen.vocab_size):
            raise ConfigError(f"{owner}: prompt token ids must be in [0, {self.gen.vocab_size}), got {sample.prompt}")
        if len(sample.prompt) + C > self.gen.max_seq_len:
            raise ConfigError(
                f"{owner}: prompt ({len(sample.prompt)}) + max_new_tokens ({C}) = {len(sample.prompt) + C} > "
                f"max_seq_len={self.gen.max_seq_len}; set a smaller max_new_tokens= on the generator (a pretrained Hugging Face "
                "model's default is 256: flowrl.graph.defaults) or max_prompt_len= on the source"
            )
        if front:
            self.waiting.appendleft(sample)
        else:
            self.waiting.append(sample)

    def _submit(self, sample: Sample) -> None:
        from vllm.inputs import tokens_input
        from vllm.sampling_params import RequestOutputKind

        seed = int(torch.randint(0, 2**62, (1,), generator=self.rng))
        budget = self.gen.sampling.max_new_tokens - len(sample.tokens)
        params = self.gen.sampling_params(seed, n=1, max_tokens=budget, output_kind=RequestOutputKind.DELTA)
        request = f"flowrl-{next(self._ids)}"
        adapter = self.gen.lora_request()
        self.engine.add_request(request, tokens_input([*sample.prompt, *sample.tokens]), params, lora_request=adapter)
        self.rows[request] = sample

    def _take(self, outputs: list[Any]) -> list[Sample]:
        """Record one engine step's new tokens (drawn by the weights of ``gen.version``); the samples that finished."""
        version, sampling, finished = self.gen.version, self.gen.sampling, []
        drew = 0
        for out in outputs:
            sample = self.rows.get(out.request_id)
            if sample is None:  # aborted (a stop string): vLLM's late output for it
                continue
            completion = out.outputs[0]
            new = list(completion.token_ids)
            drew += bool(new)
            done = out.finished
            for token, step in zip(new, completion.logprobs or ()):
                sample.tokens.append(token)
                sample.logprobs.append(step[token].logprob)
                sample.versions.append(version)
                if sampling.stop_strings and any(s in self.gen.decode(sample.tokens) for s in sampling.stop_strings):
                    done = True
                    break
            if done or len(sample.tokens) >= sampling.max_new_tokens:
                del self.rows[out.request_id]
                if not out.finished:  # cut at a stop string here: vLLM stops on stop token ids only
                    self.engine.abort_request([out.request_id])
                finished.append(sample)
        self.steps += 1
        self.busy_steps += drew
        return finished

    def step(self, admit: Callable[[Sample], bool] | None = None) -> list[Sample]:
        """Re-submit interrupted samples, admit waiting ones into free slots, take one engine step's tokens.

        Args:
            admit: called with the head of the queue before it takes a slot; False keeps it (and
                everything behind it) waiting.

        Returns:
            The samples that finished (in this step, or in outputs drained by a weight update since the last one).
        """
        finished, self.done = self.done, []
        while self.resume:
            self._submit(self.resume.popleft())
            self.resubmitted += 1
        while len(self.rows) < self.capacity and self.waiting and (admit is None or admit(self.waiting[0])):
            self._submit(self.waiting.popleft())
        if self.rows:
            finished += self._take(self.engine.step())
        return finished

    def interrupt(self) -> None:
        """Stop every running request before a weight update (see the module docstring): the tokens
        vLLM already produced are kept, the rest of each sample is re-submitted by the next ``step``."""
        if not self.rows:
            return
        queue = getattr(self.engine.engine_core, "outputs_queue", None)  # vLLM's multiprocess client: steps already done
        while self.rows and queue is not None and not queue.empty():
            self.done += self._take(self.engine.step())
        if self.rows:
            self.engine.abort_request(list(self.rows))
            self.resume.extend(self.rows.values())
            self.rows = {}
            self.interrupts += 1

    def close(self) -> None:
        """Abort what still runs in vLLM (its engine stays up: the generator closes it)."""
        if self.rows:
            self.engine.abort_request(list(self.rows))
            self.rows = {}
        if self.gen.stream is self:
            self.gen.stream = None
