"""A continuous-batching generator's rollouts: groups decoded across steps, delivered as they finish, within the staleness bound.

``ContinuousRollouts`` wraps the engine's continuous batcher for the generator program (the built-in
``SlotBatcher``, or vLLM's ``flowrl.operators.engines.vllm_stream.VLLMSlotBatcher``: the same interface). The controller hands it
prompts ahead of need (``k`` batches of lookahead, ``Controller._read_ahead``); each ``next_batch(seq)``
returns ``P`` finished groups (a prompt's ``n`` samples), whichever finished first, so a long
completion no longer holds its batch back: it keeps its slot and is delivered at a later step.

Staleness on the oldest token. A group's *deadline* is the step of its first token's version (the
version ``v`` itself with one update per batch, ``v // U`` with ``U``) plus ``k``: the last trainer
step that may consume it (versions only grow, so the first token is the oldest,
whether or not weights change in flight). Two rules keep every deadline met:

- admission: a group takes its first slot at step ``seq`` only if, counting it, at most
  ``P * (d - seq + 1)`` undelivered groups have a deadline ``<= d`` (its own deadline ``d``);
- delivery: step ``seq`` delivers the ``P`` finished groups of earliest deadline, and only once no
  deadline ``D`` would be left with more than ``P * (D - seq)`` groups for the steps after it
  (otherwise it decodes on).

Deliveries by earliest deadline keep the admission invariant, so every group is delivered by its
deadline: ``trainer_version - oldest_token_version <= k`` for every consumed sample, checked again by
the controller. ``rollout_version`` is the batch's oldest token's version; ``token_versions``
``[S, C]`` holds each token's (padding repeats the sample's first).

Weights: without ``in_flight`` the program takes new weights only between steps, and sequences
carried across a step meet the newer weights then; either way each token records the version that
drew it, so carried sequences have per-token versions in both cases. The KV cache of a carried
sequence keeps the keys and values its earlier tokens got under older weights (as PipelineRL does);
mu's log-probs are those of the distribution each token was actually drawn from.

Environments (``episodes``, a ``flowrl.operators.multiturn.EpisodeSteps``): a slot decodes one
model turn of a sample. When the turn ends the slot frees and the sample is *parked* while its
environment's ``step`` runs in its thread (``reset`` likewise before the first turn), and the slots
go on decoding other samples. A parked sample whose call returned comes back as a new slot sample
whose prompt is the conversation so far as sampled (its tokens never re-tokenised), ahead of the
queue once its group has a deadline (a group already admitted is never held behind a refused one);
an episode that ended (or failed) joins its group. The group's deadline is still set when its first
model turn takes a slot, so the staleness rule above holds on every sample's oldest token. When no
slot is busy and nothing waiting can be admitted, the generator waits for the first parked call
(``env/seconds`` counts that wait).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import time
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from flowrl.errors import FlowrlError
from flowrl.operators.generation import Generator, _mix, rollout_batch
from flowrl.operators.slots import Sample, SlotBatcher
from flowrl.operators.source import pad_left
from flowrl.runtime.staleness import EdgeBound

if TYPE_CHECKING:
    from flowrl.envs.environment import Pending
    from flowrl.operators.multiturn import Episode, EpisodeSteps

__all__ = ["ContinuousRollouts"]


@dataclass
class _Group:
    index: int  # the prompt's stream position
    prompt: list[int]
    samples: list[Any] = field(default_factory=list)  # finished: Samples, or Episodes with an environment
    deadline: int | None = None  # set when its first sample takes a slot
    finished_at: int = -1  # order of completion


class ContinuousRollouts:
    """Continuous batching for a generator program (see the module docstring).

    Args:
        generator: the generator (model, sampling, weight version).
        group_count: P, the groups (prompts) each step delivers.
        k: the weight edge's max staleness, in trainer steps.
        updates: U, policy versions per trainer step (``Graph.updates_per_batch``): weights of version
            ``v`` are those of step ``v // U`` (only versions ``U * seq`` are published).
        poll: called between decode steps to take newer weights in flight (None: between steps only).
        episodes: the generator's environment episodes (multi-turn samples), or None for one completion per sample.
        batcher: the engine's continuous batcher class, ``cls(generator, *, slots, rng)``
            (``flowrl.operators.engines.EngineSpec.batcher``; the built-in ``SlotBatcher`` by default).
    """

    def __init__(
        self, generator: Generator, *, group_count: int, k: int, updates: int = 1, poll: Callable[[], None] | None = None,
        episodes: EpisodeSteps[Any] | None = None, batcher: Callable[..., Any] = SlotBatcher,
    ) -> None:  # fmt: skip
        self.gen = generator
        self.P = group_count
        self.n = generator.sampling.n_samples
        self.bound = EdgeBound(k=k, updates=updates)  # the staleness gate's deadlines
        self.poll = poll
        self.slots = generator.sampling.slots or group_count * self.n
        self._make_batcher = batcher
        self.batcher: SlotBatcher | None = None
        self.groups: dict[int, _Group] = {}  # pulled, not delivered
        self._finished = 0
        self.mt = episodes
        self._episodes: dict[tuple[int, int], Episode] = {}  # (group, sample) -> its episode, until delivered
        self.parked: list[tuple[Episode, Pending, list[int] | None]] = []  # (episode, its env call, the turn it answers; None: reset)
        self._env_wall = 0.0

    def add_prompts(self, prompts: Mapping[str, Tensor]) -> None:
        """Queue the prompts of a (possibly empty) prompt batch, ``n`` samples each."""
        if "prompt_ids" not in prompts or not len(prompts["prompt_ids"]):
            return
        ids, lens, index = prompts["prompt_ids"], prompts["prompt_lens"], prompts["prompt_index"]
        if self.batcher is None:  # seeded as lock step seeds its first batch
            rng = torch.Generator(device=self.gen.device).manual_seed(_mix(self.gen.seed, int(index[0]), 0))
            self.batcher = self._make_batcher(self.gen, slots=self.slots, rng=rng)
        for row in range(ids.shape[0]):
            i, length = int(index[row]), int(lens[row])
            if i in self.groups:
                raise FlowrlError(f"generator {self.gen.name!r} got prompt {i} twice; this is a flowrl bug")
            group = _Group(index=i, prompt=ids[row, ids.shape[1] - length :].tolist())
            self.groups[i] = group
            for j in range(self.n):
                if self.mt is None:
                    self.batcher.add(Sample(key=(i, j), prompt=group.prompt))
                    continue
                ep, env_row = self.mt.episode(group.prompt, i, j)
                self._episodes[(i, j)] = ep
                self.parked.append((ep, self.mt.start_reset(ep, env_row), None))

    def _done(self, key: tuple[int, int], sample: Any) -> None:
        """Sample ``key`` is finished (a ``Sample``, or an ``Episode`` that ended): its group completes with its n-th."""
        group = self.groups[key[0]]
        group.samples.append(sample)
        if len(group.samples) == self.n:
            group.finished_at = self._finished
            self._finished += 1

    def _turn_ended(self, sample: Sample) -> None:
        """A model turn is done: record it in its episode and park the episode on ``step``."""
        assert self.mt is not None
        ep = self._episodes[sample.key]
        action = self.mt.add_turn(ep, sample.tokens, sample.logprobs, sample.versions)
        self.parked.append((ep, self.mt.start_step(ep, action), sample.tokens))

    def _unpark(self, *, block: bool) -> None:
        """Take the parked calls that returned (with ``block``, first wait for one): each episode then
        queues its next model turn or, ended, joins its group."""
        assert self.mt is not None and self.batcher is not None
        if block and not any(p.ready() for _, p, _ in self.parked):
            t0 = time.perf_counter()
            while not any(p.ready() for _, p, _ in self.parked):
                time.sleep(0.0005)
            self._env_wall += time.perf_counter() - t0
        still = []
        for ep, pending, turn in self.parked:
            if not pending.ready():
                still.append((ep, pending, turn))
                continue
            if turn is None:
                self.mt.finish_reset(ep, pending())
            else:
                self.mt.finish_step(ep, pending(), turn)
            key = (ep.index, ep.sample)
            if self.mt.wants_turn(ep):
                sample = Sample(key=key, prompt=ep.prompt + ep.tokens)  # the conversation as sampled
                self.batcher.add(sample, front=self.groups[ep.index].deadline is not None)
            else:
                self._done(key, ep)
        self.parked = still

    def _admit(self, seq: int) -> Callable[[Sample], bool]:
        def admit(sample: Sample) -> bool:
            group = self.groups[sample.key[0]]
            if group.deadline is not None:
                return True
            d = self.bound.deadline(self.gen.version)  # the last step that may consume it
            earlier = sum(1 for g in self.groups.values() if g.deadline is not None and g.deadline <= d)
            if earlier + 1 > self.P * (d - seq + 1):
                return False
            group.deadline = d
            return True

        return admit

    def _pick(self, seq: int) -> list[_Group] | None:
        """The P groups to deliver at ``seq``, or None while no choice keeps every deadline."""
        done = sorted((g for g in self.groups.values() if g.finished_at >= 0), key=lambda g: (g.deadline, g.finished_at))
        if len(done) < self.P:
            return None
        chosen = done[: self.P]
        deadlines = sorted(g.deadline for g in self.groups.values() if g.deadline is not None)
        taken = sorted(g.deadline for g in chosen if g.deadline is not None)  # every finished group has one
        for D in sorted(set(deadlines)):
            left = sum(1 for d in deadlines if d <= D) - sum(1 for d in taken if d <= D)
            if left > self.P * (D - seq):
                return None
        return chosen

    def next_batch(self, seq: int) -> tuple[dict[str, Tensor], dict[str, float]]:
        """Decode until ``P`` groups can be delivered at step ``seq``; the rollout and numbers about it."""
        if self.batcher is None:
            raise FlowrlError(f"generator {self.gen.name!r}: step {seq} has no prompts; this is a flowrl bug")
        b = self.batcher
        steps0, busy0, swaps = b.steps, b.busy_steps, 0
        admit = self._admit(seq)
        while (chosen := self._pick(seq)) is None:
            if self.poll is not None:
                before = self.gen.version
                self.poll()
                swaps += self.gen.version != before
            if not b.busy and not b.waiting:
                if self.parked:
                    self._unpark(block=True)
                    continue
                raise FlowrlError(f"generator {self.gen.name!r}: step {seq} ran out of prompts; this is a flowrl bug")
            drawn = b.steps
            finished = b.step(admit)
            if b.steps == drawn and not finished:  # no slot busy and the head of the queue refused: nothing changes until an environment answers
                if self.parked:
                    self._unpark(block=True)
                    continue
                raise FlowrlError(
                    f"generator {self.gen.name!r}: step {seq} cannot deliver ({len(self.groups)} groups pending, "
                    f"{len(b.waiting)} samples waiting, none admitted, no slot busy); this is a flowrl bug"
                )
            for sample in finished:
                if self.mt is None:
                    self._done(sample.key, sample)
                else:
                    self._turn_ended(sample)
            if self.parked:
                self._unpark(block=False)  # environments that answered meanwhile: their next turns queue now
        for g in chosen:
            del self.groups[g.index]
        steps = b.steps - steps0
        info = {
            "slots/utilisation": (b.busy_steps - busy0) / (steps * self.slots) if steps else 0.0,
            "slots/decode_steps": float(steps),
            "slots/carried_groups": float(sum(g.deadline is not None for g in self.groups.values())),
            "slots/weight_swaps": float(swaps),  # weights taken in flight during this step
        }
        if self.mt is not None:
            return self._episode_rollout(chosen, info)
        return self._rollout(chosen), info

    def close(self, grace_s: float = 1.0) -> None:
        """Wait up to ``grace_s`` seconds in all for the environment calls still parked, then drop them
        (their episodes were not delivered: a resumed run pulls their prompts again)."""
        deadline = time.perf_counter() + grace_s
        for _, pending, _ in self.parked:
            pending(deadline)
        self.parked = []

    def _episode_rollout(self, chosen: list[_Group], info: dict[str, float]) -> tuple[dict[str, Tensor], dict[str, float]]:
        """The rollout of the chosen groups' episodes (``EpisodeSteps.batch``) and the ``env/*`` numbers."""
        assert self.mt is not None
        episodes = [ep for g in chosen for ep in sorted(g.samples, key=lambda ep: ep.sample)]
        for ep in episodes:
            del self._episodes[(ep.index, ep.sample)]
        sample_ids, sample_lens = pad_left([ep.prompt for ep in episodes], self.gen.pad_id)
        index = torch.tensor([g.index for g in chosen], dtype=torch.int64)
        info.update(self.mt.metrics(episodes, self._env_wall))
        self._env_wall = 0.0
        return self.mt.batch(episodes, sample_ids, sample_lens, index), info

    def _rollout(self, chosen: list[_Group]) -> dict[str, Tensor]:
        C, n, pad = self.gen.sampling.max_new_tokens, self.n, self.gen.pad_id
        samples = [s for g in chosen for s in sorted(g.samples, key=lambda s: s.key[1])]
        S = len(samples)
        sample_ids, sample_lens = pad_left([s.prompt for s in samples], pad)
        tokens = torch.full((S, C), pad, dtype=torch.int64)
        logprobs = torch.zeros(S, C, dtype=torch.float32)
        mask = torch.zeros(S, C, dtype=torch.bool)
        versions = torch.zeros(S, C, dtype=torch.int64)
        for r, s in enumerate(samples):
            L = len(s.tokens)
            tokens[r, :L] = torch.tensor(s.tokens)
            logprobs[r, :L] = torch.tensor(s.logprobs)
            mask[r, :L] = True
            versions[r] = s.versions[0]
            versions[r, :L] = torch.tensor(s.versions)
        index = torch.tensor([g.index for g in chosen], dtype=torch.int64)
        sampling = self.gen.sampling
        return rollout_batch(
            sample_ids, sample_lens, tokens, mask, logprobs, versions, index,
            n=n, temperature=sampling.temperature, version=self.gen.version, top_k=sampling.top_k, top_p=sampling.top_p,
        )  # fmt: skip
