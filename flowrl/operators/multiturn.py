"""Multi-turn rollouts: model turns and environment turns, token in / token out (lock step here; continuous batching reuses the episode's steps).

A generator with an ``env`` (``flowrl.graph.envs.EnvConfig``) runs, for each batch of P prompts, one
episode per sample (S = P * n): one environment instance per sample (``flowrl.envs.environment``), then

    reset(row) -> observation            appended after the prompt (mask 0)
    repeat up to max_turns:
        a model turn: up to ``max_new_tokens`` tokens sampled from mu over prompt + everything so far
        step(turn text) -> (observation or None, reward, info)
        None: the episode ends; otherwise the observation's tokens are appended (mask 0)

The sample's completion is the concatenation of its turns. What each part of it is:

- ``completion_ids``: the model's tokens exactly as sampled (never decoded and re-encoded) and each
  observation's tokens, encoded once when it arrives (``flowrl.operators.env_tokens``);
- ``completion_mask`` (the loss mask): True on the model's tokens only: an environment's tokens are
  never trained (the trainer's log pi is 0 there, so no gradient) but pi conditions on them;
- ``completion_lens``: the sample's whole extent (model and environment tokens): the trainer and the
  reference attend to every token before it (``completion_logprobs(..., completion_lens=)``);
- ``behaviour_logprobs``: mu's log-prob of each model token (0 on environment tokens);
- ``token_versions``: the version that drew each model token (in lock step the generator's, which never
  changes within a batch); environment tokens and padding get the sample's oldest;
- ``env_rewards``: the sum of the episode's rewards; ``env_turns``: its model turns;
  ``env_failed``: True when the environment raised, ran past ``step_timeout_s`` /
  ``episode_timeout_s``, or returned something outside the protocol, or an observation could not be
  encoded or was longer than ``max_env_tokens``. A failed sample gets reward 0 and an all-False
  mask (no loss), its error is logged (logger ``flowrl.envs``) and counted (``env/failed``, and by
  cause in ``env/failed/<cause>``, one of ``FAIL_CAUSES``): the run goes on.

An episode also ends when its next model turn would not fit ``max_seq_len`` (not a failure).
Environment calls of one turn run concurrently (a thread per sample, ``flowrl.envs.environment.start``).
Each model turn re-reads the sample's whole prefix (one prefill per turn; the KV cache is not kept
across environment turns).

``generate`` also returns the batch's metrics (``env/turns_mean``, ``env/seconds`` (wall-clock time
spent waiting on environments), ``env/seconds_per_sample``, ``env/failed`` (and ``env/failed/<cause>``
for every cause of ``FAIL_CAUSES``), ``env/model_tokens``,
``env/env_tokens`` (tokens per sample by role), ``env/reward_mean``), which the generator program
reports and the metrics rows carry.

With ``batching="continuous"``, ``flowrl.runtime.programs.continuous.ContinuousRollouts`` drives the same
episode steps one sample at a time: a finished model turn frees its slot and the sample is parked
while its environment answers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import torch

from flowrl.envs.environment import EnvError, EnvResult, Pending, check_env, make_env, parse_observation, parse_step, start
from flowrl.graph.configs import SamplingConfig
from flowrl.graph.nodes import GeneratorNode
from flowrl.graph.refs import resolve
from flowrl.operators.batch import Batch
from flowrl.operators.env_tokens import ObservationEncoder, observation_encoder
from flowrl.operators.generation import Generator, rollout_batch
from flowrl.operators.source import pad_left

__all__ = ["FAIL_CAUSES", "EpisodeSteps", "MultiTurnGenerator", "Episode", "TurnSampler", "row_fields"]

log = logging.getLogger("flowrl.envs")

#: Why a sample failed, each counted in the metrics as ``env/failed/<cause>``: the environment or agent
#: program raised; a call or program ran past its limit; it returned something outside the protocol
#: (an observation or step of the wrong form, a reward that is no finite real); an observation could not
#: be encoded or was longer than ``max_env_tokens``; an agent program returned without asking the endpoint.
FAIL_CAUSES: tuple[str, ...] = ("raised", "timeout", "protocol", "observation", "no_request")


class _ObservationError(EnvError):
    """An observation that cannot be encoded or is too long (cause ``observation``)."""


@dataclass
class Episode:
    """One sample's episode: its environment and the completion built so far (four parallel lists;
    ``versions`` is -1 on environment tokens)."""

    env: Any = None
    prompt: list[int] = field(default_factory=list)
    index: int = 0  # the prompt's stream position
    sample: int = 0  # which of the prompt's n samples
    tokens: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    env_s: float = 0.0
    done: bool = False
    error: str = ""
    cause: str = ""  # one of FAIL_CAUSES when ``error`` is set

    def fail(self, error: str, cause: str) -> None:
        if cause not in FAIL_CAUSES:
            raise ValueError(f"episode failure cause {cause!r} is not one of {FAIL_CAUSES}")
        self.error, self.cause, self.done = error, cause, True


class TurnSampler(Protocol):
    """What the episode steps read of a generator engine (``Generator`` and ``VLLMGenerator`` have it)."""

    @property
    def name(self) -> str: ...
    @property
    def sampling(self) -> SamplingConfig: ...
    @property
    def stop_tokens(self) -> tuple[int, ...]: ...
    @property
    def pad_id(self) -> int: ...
    @property
    def version(self) -> int: ...
    @property
    def max_seq_len(self) -> int: ...
    def _decode(self, ids: list[int], /) -> str: ...


G = TypeVar("G", bound=TurnSampler)


class EpisodeSteps(Generic[G]):
    """The steps of ``node.env``'s episodes with ``generator``'s engine (see the module docstring).

    The methods that lock step (``MultiTurnGenerator.generate``, ``VLLMMultiTurn.generate``) and
    continuous batching (``flowrl.runtime.programs.continuous``) share: ``episode`` and ``start_reset`` /
    ``finish_reset`` open one, ``wants_turn`` says whether it takes another model turn, ``add_turn``
    records one and ``start_step`` / ``finish_step`` hand it to the environment; ``batch`` and
    ``metrics`` report.

    Args:
        generator: the node's engine (its version, sampling and tokens).
        node: the generator node, with ``env`` set.
        encoder: how observations become tokens (default: ``observation_encoder`` of the node's model).
        rows: stream position -> the prompt file row's other fields, added to ``reset``'s row (``row_fields``).

    Raises:
        ConfigError: for an environment without ``reset``/``step``, or a chat template that cannot be
            applied incrementally (both before any work).
    """

    def __init__(
        self,
        generator: G,
        node: GeneratorNode,
        *,
        encoder: ObservationEncoder | None = None,
        rows: Callable[[int], dict[str, Any]] | None = None,
    ) -> None:
        if node.env is None:
            raise ValueError(f"generator {node.name!r} has no env")
        self.gen, self.config = generator, node.env
        owner = f"generator {node.name!r}"
        self.factory = resolve(self.config.env)
        check_env(self.factory, owner=owner)
        self.encoder = encoder if encoder is not None else observation_encoder(node.model, role=self.config.role, owner=owner)
        self.rows = rows

    def episode(self, prompt: list[int], index: int, sample: int, extra: dict[str, Any] | None = None) -> tuple[Episode, dict[str, Any]]:
        """A new episode for sample ``sample`` of the prompt at stream position ``index``, and ``reset``'s row."""
        row = {"prompt": self.gen._decode(prompt), "prompt_ids": prompt, "prompt_index": index, "sample": sample}
        row.update(extra if extra is not None else self.rows(index) if self.rows is not None else {})
        return Episode(prompt=prompt, index=index, sample=sample), row

    def _budget(self, ep: Episode) -> float:
        return max(min(self.config.step_timeout_s, self.config.episode_timeout_s - ep.env_s), 1e-3)

    def start_reset(self, ep: Episode, row: dict[str, Any]) -> Pending:
        """Make the episode's environment and call ``reset(row)``, in a thread under the episode's limits."""
        return start(lambda r: _reset(self.factory, r), row, timeout_s=self._budget(ep))  # a constructor may hang too

    def finish_reset(self, ep: Episode, result: EnvResult) -> None:
        """Take ``reset``'s result: the environment and its first observation's tokens, or the failure."""
        ep.env_s += result.seconds
        if result.error:
            return ep.fail(f"reset: {result.error}", _call_cause(result))
        ep.env, first_obs = result.value
        try:
            self._observe(ep, first_obs, where="reset", model_stopped=True)
        except EnvError as exc:
            ep.fail(str(exc), _error_cause(exc))

    def wants_turn(self, ep: Episode) -> bool:
        """Whether the episode takes another model turn; it ends (truncated, not failed) when one would not fit ``max_seq_len``."""
        if not ep.done and len(ep.prompt) + len(ep.tokens) + self.gen.sampling.max_new_tokens > self.gen.max_seq_len:
            ep.done = True
        return not ep.done

    def add_turn(self, ep: Episode, ids: list[int], logprobs: list[float], versions: list[int]) -> str:
        """Record a model turn as sampled (mask 1); returns its text, the action for ``step``."""
        ep.tokens += ids
        ep.mask += [True] * len(ids)
        ep.logprobs += logprobs
        ep.versions += versions
        ep.turns += 1
        return self.gen._decode(ids)

    def start_step(self, ep: Episode, action: str) -> Pending:
        """Call the episode's ``step(action)`` in a thread under its limits."""
        return start(ep.env.step, action, timeout_s=self._budget(ep))

    def finish_step(self, ep: Episode, result: EnvResult, turn: list[int]) -> None:
        """Take ``step``'s result after the model turn ``turn``: its reward, then the end of the episode
        (None, or the last turn) or the observation's tokens; or the failure."""
        ep.env_s += result.seconds
        if result.error:
            return ep.fail(f"step: {result.error}", _call_cause(result))
        try:
            obs, reward, _info = parse_step(result.value)
            ep.reward += reward
            if obs is None or ep.turns >= self.config.max_turns:
                ep.done = True
            else:
                stopped = bool(turn) and turn[-1] in self.gen.stop_tokens
                self._observe(ep, obs, where="step", model_stopped=stopped)
        except EnvError as exc:
            ep.fail(str(exc), _error_cause(exc))

    def _observe(self, ep: Episode, value: Any, *, where: str, model_stopped: bool) -> None:
        """Append an observation's tokens (mask 0), or fail the episode."""
        obs = parse_observation(value, where=where)
        text = obs if isinstance(obs, str) or obs is None else obs["content"]
        if not text:
            return
        try:
            ids = self.encoder.encode(text, model_stopped=model_stopped)
        except Exception as exc:
            raise _ObservationError(f"{where}'s observation {text!r:.100} cannot be encoded: {type(exc).__name__}: {exc}") from exc
        if len(ids) > self.config.max_env_tokens:
            raise _ObservationError(f"{where}'s observation is {len(ids)} tokens, more than max_env_tokens={self.config.max_env_tokens}")
        ep.tokens += ids
        ep.mask += [False] * len(ids)
        ep.logprobs += [0.0] * len(ids)
        ep.versions += [-1] * len(ids)

    def batch(self, episodes: list[Episode], sample_ids: torch.Tensor, sample_lens: torch.Tensor, index: torch.Tensor) -> Batch:
        """The rollout of finished ``episodes`` (``n`` per prompt of ``index``, in group order), with
        ``ENV_FIELDS``; each failed episode's error is logged here."""
        gen, n = self.gen, self.gen.sampling.n_samples
        S = len(episodes)
        C = max([len(ep.tokens) for ep in episodes] + [1])
        tokens = torch.full((S, C), gen.pad_id, dtype=torch.int64)
        mask = torch.zeros(S, C, dtype=torch.bool)
        logprobs = torch.zeros(S, C, dtype=torch.float32)
        versions = torch.full((S, C), gen.version, dtype=torch.int64)
        extent = torch.zeros(S, dtype=torch.int64)
        for i, ep in enumerate(episodes):
            if ep.error:
                log.warning("generator %r: sample %d (prompt %d) failed: %s", gen.name, i, ep.index, ep.error)
            k = len(ep.tokens)
            extent[i] = k
            model = [v for v in ep.versions if v >= 0]
            versions[i] = min(model) if model else gen.version  # environment tokens and padding: the sample's oldest
            if k:
                tokens[i, :k] = torch.tensor(ep.tokens, dtype=torch.int64)
                logprobs[i, :k] = torch.tensor(ep.logprobs, dtype=torch.float32)
                versions[i, :k] = torch.tensor([v if v >= 0 else int(versions[i, 0]) for v in ep.versions], dtype=torch.int64)
                if not ep.error:  # a failed sample is kept (its group stays whole) but never trained on
                    mask[i, :k] = torch.tensor(ep.mask, dtype=torch.bool)
        out = rollout_batch(sample_ids, sample_lens, tokens, mask, logprobs, versions, index,
                            n=n, temperature=gen.sampling.temperature, version=gen.version,
                            top_k=gen.sampling.top_k, top_p=gen.sampling.top_p)  # the trainer truncates pi as the turns sampled
        out["completion_lens"] = extent  # the whole sample, model and environment tokens (the mask marks the model's)
        out["env_rewards"] = torch.tensor([0.0 if ep.error else ep.reward for ep in episodes], dtype=torch.float32)
        out["env_failed"] = torch.tensor([bool(ep.error) for ep in episodes], dtype=torch.bool)
        out["env_turns"] = torch.tensor([ep.turns for ep in episodes], dtype=torch.int64)
        return out

    @staticmethod
    def metrics(episodes: list[Episode], env_wall: float) -> dict[str, float]:
        """The ``env/*`` numbers of ``episodes`` (``env_wall``: seconds the generator waited on environments)."""
        S = max(len(episodes), 1)
        model = sum(sum(ep.mask) for ep in episodes)
        return {
            "env/turns_mean": sum(ep.turns for ep in episodes) / S,
            "env/seconds": env_wall,
            "env/seconds_per_sample": sum(ep.env_s for ep in episodes) / S,
            "env/failed": float(sum(bool(ep.error) for ep in episodes)),
            **{f"env/failed/{c}": float(sum(bool(ep.error) and ep.cause == c for ep in episodes)) for c in FAIL_CAUSES},
            "env/model_tokens": model / S,
            "env/env_tokens": sum(len(ep.mask) for ep in episodes) / S - model / S,
            "env/reward_mean": sum(0.0 if ep.error else ep.reward for ep in episodes) / S,
        }



class MultiTurnGenerator(EpisodeSteps[Generator]):
    """Runs episodes for ``node.env`` with a ``Generator``'s model, in lock step (see the module docstring);
    built as ``EpisodeSteps`` is (its arguments and errors), ``generator`` a ``Generator``."""

    def generate(self, prompts: Mapping[str, torch.Tensor], rows: list[dict[str, Any]] | None = None) -> tuple[Batch, dict[str, float]]:
        """Episodes for every sample of ``prompts``, in lock step: the rollout with ``ENV_FIELDS``, and its metrics.

        Args:
            prompts: ``prompt_ids``, ``prompt_lens`` (and ``prompt_index``), as ``Generator.generate`` takes.
            rows: per prompt, extra fields for ``reset``'s row (a prompt file's row).
        """
        gen = self.gen
        ids, lens, index, rng = gen._batch_start(prompts)
        P, n, width = ids.shape[0], gen.sampling.n_samples, ids.shape[1]
        opened = [self.episode(ids[p, width - int(lens[p]) :].tolist(), int(index[p]), j, rows[p] if rows else None)
                  for p in range(P) for j in range(n)]  # fmt: skip
        episodes = [ep for ep, _ in opened]
        t0 = time.perf_counter()
        for (ep, _), wait in zip(opened, [self.start_reset(ep, row) for ep, row in opened]):
            self.finish_reset(ep, wait())
        env_wall = time.perf_counter() - t0
        for _ in range(self.config.max_turns):
            active = [ep for ep in episodes if self.wants_turn(ep)]
            if not active:
                break
            sampled = self._model_turn(active, rng)
            waits = [self.start_step(ep, self.add_turn(ep, t, lp, [gen.version] * len(t))) for ep, (t, lp) in zip(active, sampled)]
            t0 = time.perf_counter()
            for ep, wait, (turn, _) in zip(active, waits, sampled):
                self.finish_step(ep, wait(), turn)
            env_wall += time.perf_counter() - t0
        return self.batch(episodes, ids.repeat_interleave(n, 0), lens.repeat_interleave(n, 0), index), self.metrics(episodes, env_wall)

    def _model_turn(self, active: list[Episode], rng: torch.Generator) -> list[tuple[list[int], list[float]]]:
        """One model turn for each active episode: its sampled tokens and their log-probs under mu."""
        gen = self.gen
        batch, plens = pad_left([ep.prompt + ep.tokens for ep in active], gen.pad_id)
        with torch.no_grad():
            tokens, logprobs, mask = (t.cpu() for t in gen._sample(batch.to(gen.device), plens.to(gen.device), rng))
        counts = mask.sum(1).tolist()
        return [(tokens[i, :k].tolist(), logprobs[i, :k].tolist()) for i, k in enumerate(counts)]


def _call_cause(result: EnvResult) -> str:
    return "timeout" if result.timed_out else "raised"


def _error_cause(exc: EnvError) -> str:
    return "observation" if isinstance(exc, _ObservationError) else "protocol"


def row_fields(graph: Any, generator: str) -> Callable[[int], dict[str, Any]] | None:
    """Stream position -> the prompt file row's fields (all but the prompt), for the source upstream of
    ``generator``; None for a task source (no file)."""
    from flowrl.data.wiring import open_source_stream, source_of

    source = source_of(graph, generator)
    if source is None or not source.source.data:
        return None
    stream = open_source_stream(graph, source.name, warn=False)
    return stream.fields


def _reset(factory: Any, row: dict[str, Any]) -> tuple[Any, Any]:
    """A new environment and its first observation (run in the call's thread, under its limit)."""
    env = make_env(factory)
    return env, env.reset(row) if not _is_async(env.reset) else _await(env.reset(row))


def _is_async(fn: Any) -> bool:
    import inspect

    return inspect.iscoroutinefunction(fn)


def _await(coro: Any) -> Any:
    import asyncio

    return asyncio.run(coro)
