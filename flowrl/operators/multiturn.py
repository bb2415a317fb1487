"""Multi-turn rollouts: model turns and environment turns, token in / token out, in lock step.

A generator with an ``env`` (``flowrl.graph.envs.EnvConfig``) runs, for each batch of P prompts, one
episode per sample (S = P * n): one environment instance per sample (``flowrl.envs.base``), then

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
- ``token_versions``: the generator's version (lock step never changes weights within a batch);
- ``env_rewards``: the sum of the episode's rewards; ``env_turns``: its model turns;
  ``env_failed``: True when the environment raised, ran past ``step_timeout_s`` /
  ``episode_timeout_s``, or returned something outside the protocol, or an observation could not be
  encoded or was longer than ``max_env_tokens``. A failed sample gets reward 0 and an all-False
  mask (no loss), its error is logged (logger ``flowrl.envs``) and counted (``env/failed``): the run goes on.

An episode also ends when its next model turn would not fit ``max_seq_len`` (not a failure).
Environment calls of one turn run concurrently (a thread per sample, ``flowrl.envs.base.start``).
Each model turn re-reads the sample's whole prefix (one prefill per turn; the KV cache is not kept
across environment turns).

``generate`` also returns the batch's metrics (``env/turns_mean``, ``env/seconds`` (wall-clock time
spent waiting on environments), ``env/seconds_per_sample``, ``env/failed``, ``env/model_tokens``,
``env/env_tokens`` (tokens per sample by role), ``env/reward_mean``), which the generator program
reports and the metrics rows carry.

Continuous batching is refused for an environment (``GeneratorNode``): a waiting sample is not parked yet.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from flowrl.envs.base import EnvError, check_env, make_env, parse_observation, parse_step, start
from flowrl.graph.nodes import GeneratorNode
from flowrl.graph.refs import resolve
from flowrl.operators.batch import Batch
from flowrl.operators.env_tokens import ObservationEncoder, observation_encoder
from flowrl.operators.generation import Generator, _mix, rollout_batch

__all__ = ["MultiTurnGenerator", "Episode", "row_fields"]

log = logging.getLogger("flowrl.envs")


@dataclass
class Episode:
    """One sample's episode: its environment and the completion built so far (three parallel lists)."""

    env: Any = None
    prompt: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    env_s: float = 0.0
    done: bool = False
    error: str = ""

    def fail(self, error: str) -> None:
        self.error, self.done = error, True


class MultiTurnGenerator:
    """Runs episodes for ``node.env`` with ``generator``'s model (see the module docstring).

    Args:
        generator: the node's ``Generator`` (its model, weights, version, sampling and tokens).
        node: the generator node, with ``env`` set.
        encoder: how observations become tokens (default: ``observation_encoder`` of the node's model).
        rows: stream position -> the prompt file row's other fields, added to ``reset``'s row (``row_fields``).

    Raises:
        ConfigError: for an environment without ``reset``/``step``, or a chat template that cannot be
            applied incrementally (both before any work).
    """

    def __init__(
        self,
        generator: Generator,
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

    def _observe(self, ep: Episode, value: Any, *, where: str, model_stopped: bool) -> None:
        """Append an observation's tokens (mask 0), or fail the episode."""
        obs = parse_observation(value, where=where)
        text = obs if isinstance(obs, str) or obs is None else obs["content"]
        if not text:
            return
        try:
            ids = self.encoder.encode(text, model_stopped=model_stopped)
        except Exception as exc:
            raise EnvError(f"{where}'s observation {text!r:.100} cannot be encoded: {type(exc).__name__}: {exc}") from exc
        if len(ids) > self.config.max_env_tokens:
            raise EnvError(f"{where}'s observation is {len(ids)} tokens, more than max_env_tokens={self.config.max_env_tokens}")
        ep.tokens += ids
        ep.mask += [False] * len(ids)
        ep.logprobs += [0.0] * len(ids)

    def _env_calls(self, episodes: list[Episode], method: str, args: list[tuple[Any, ...]]) -> list[Any]:
        """Call ``method`` on each episode's env at once, each under its limits; returns the values (None
        where the episode failed, which ``fail`` records)."""
        cfg = self.config
        waits = []
        for ep, a in zip(episodes, args):
            budget = min(cfg.step_timeout_s, cfg.episode_timeout_s - ep.env_s)
            if method == "reset":  # the instance is made in the call's thread too: a constructor may hang
                waits.append(start(lambda row: _reset(self.factory, row), *a, timeout_s=max(budget, 1e-3)))
            else:
                waits.append(start(getattr(ep.env, "step"), *a, timeout_s=max(budget, 1e-3)))
        values = []
        for ep, wait in zip(episodes, waits):
            result = wait(math.inf)
            ep.env_s += result.seconds
            if result.error:
                ep.fail(f"{method}: {result.error}")
                values.append(None)
            else:
                values.append(result.value)
        return values

    def generate(self, prompts: Mapping[str, torch.Tensor], rows: list[dict[str, Any]] | None = None) -> tuple[Batch, dict[str, float]]:
        """Episodes for every sample of ``prompts``: the rollout with ``ENV_FIELDS``, and its metrics.

        Args:
            prompts: ``prompt_ids``, ``prompt_lens`` (and ``prompt_index``), as ``Generator.generate`` takes.
            rows: per prompt, extra fields for ``reset``'s row (a prompt file's row).
        """
        gen = self.gen
        ids, lens = gen._check(prompts)
        P, n = ids.shape[0], gen.sampling.n_samples
        index = prompts.get("prompt_index")
        if index is None:
            index = torch.arange(P, dtype=torch.int64)
        first = int(index[0]) if len(index) else 0
        rng = torch.Generator(device=gen.device).manual_seed(_mix(gen.seed, first, gen._calls if "prompt_index" not in prompts else 0))
        gen._calls += 1
        width = ids.shape[1]
        episodes: list[Episode] = []
        reset_args = []
        for p in range(P):
            prompt = ids[p, width - int(lens[p]) :].tolist()
            for j in range(n):
                episodes.append(Episode(prompt=prompt))
                row = {"prompt": gen._decode(prompt), "prompt_ids": prompt, "prompt_index": int(index[p]), "sample": j}
                row.update(rows[p] if rows else self.rows(int(index[p])) if self.rows is not None else {})
                reset_args.append((row,))
        t0 = time.perf_counter()
        env_wall = 0.0
        for ep, value in zip(episodes, self._env_calls(episodes, "reset", reset_args)):
            if ep.done:
                continue
            ep.env, first_obs = value
            try:
                self._observe(ep, first_obs, where="reset", model_stopped=True)
            except EnvError as exc:
                ep.fail(str(exc))
        env_wall += time.perf_counter() - t0
        max_new, limit = gen.sampling.max_new_tokens, gen.model.max_seq_len
        for turn in range(self.config.max_turns):
            for ep in episodes:
                if not ep.done and len(ep.prompt) + len(ep.tokens) + max_new > limit:
                    ep.done = True  # no room for another model turn: the episode ends here (truncated)
            active = [ep for ep in episodes if not ep.done]
            if not active:
                break
            sampled = self._model_turn(active, rng)
            actions = []
            for ep, (turn_ids, turn_lps) in zip(active, sampled):
                ep.tokens += turn_ids
                ep.mask += [True] * len(turn_ids)
                ep.logprobs += turn_lps
                ep.turns += 1
                actions.append((gen._decode(turn_ids),))
            t0 = time.perf_counter()
            values = self._env_calls(active, "step", actions)
            env_wall += time.perf_counter() - t0
            last = turn == self.config.max_turns - 1
            for ep, value, (turn_ids, _) in zip(active, values, sampled):
                if ep.done:
                    continue
                try:
                    obs, reward, _info = parse_step(value)
                    ep.reward += reward
                    if obs is None or last:
                        ep.done = True
                    else:
                        stopped = bool(turn_ids) and turn_ids[-1] in gen.stop_tokens
                        self._observe(ep, obs, where="step", model_stopped=stopped)
                except EnvError as exc:
                    ep.fail(str(exc))
        for i, ep in enumerate(episodes):
            if ep.error:
                log.warning("generator %r: sample %d (prompt %d) failed: %s", gen.name, i, int(index[i // n]), ep.error)
        return self._batch(episodes, ids, lens, index), self._metrics(episodes, env_wall)

    def _model_turn(self, active: list[Episode], rng: torch.Generator) -> list[tuple[list[int], list[float]]]:
        """One model turn for each active episode: its sampled tokens and their log-probs under mu."""
        gen = self.gen
        prefixes = [ep.prompt + ep.tokens for ep in active]
        T = max(len(p) for p in prefixes)
        batch = torch.full((len(active), T), gen.pad_id, dtype=torch.int64)
        for i, p in enumerate(prefixes):
            batch[i, T - len(p) :] = torch.tensor(p, dtype=torch.int64)
        plens = torch.tensor([len(p) for p in prefixes], dtype=torch.int64)
        with torch.no_grad():
            tokens, logprobs, mask = (t.cpu() for t in gen._sample(batch.to(gen.device), plens.to(gen.device), rng))
        out = []
        for i in range(len(active)):
            k = int(mask[i].sum())
            out.append((tokens[i, :k].tolist(), logprobs[i, :k].tolist()))
        return out

    def _batch(self, episodes: list[Episode], ids: torch.Tensor, lens: torch.Tensor, index: torch.Tensor) -> Batch:
        gen, n = self.gen, self.gen.sampling.n_samples
        S = len(episodes)
        C = max([len(ep.tokens) for ep in episodes] + [1])
        tokens = torch.full((S, C), gen.pad_id, dtype=torch.int64)
        mask = torch.zeros(S, C, dtype=torch.bool)
        logprobs = torch.zeros(S, C, dtype=torch.float32)
        extent = torch.zeros(S, dtype=torch.int64)
        for i, ep in enumerate(episodes):
            k = len(ep.tokens)
            extent[i] = k
            if k:
                tokens[i, :k] = torch.tensor(ep.tokens, dtype=torch.int64)
                logprobs[i, :k] = torch.tensor(ep.logprobs, dtype=torch.float32)
                if not ep.error:  # a failed sample is kept (its group stays whole) but never trained on
                    mask[i, :k] = torch.tensor(ep.mask, dtype=torch.bool)
        versions = torch.full((S, C), gen.version, dtype=torch.int64)
        out = rollout_batch(ids.repeat_interleave(n, 0), lens.repeat_interleave(n, 0), tokens, mask, logprobs, versions, index,
                            n=n, temperature=gen.sampling.temperature, version=gen.version,
                            top_k=gen.sampling.top_k, top_p=gen.sampling.top_p)  # the trainer truncates pi as the turns sampled
        out["completion_lens"] = extent  # the whole sample, model and environment tokens (the mask marks the model's)
        out["env_rewards"] = torch.tensor([0.0 if ep.error else ep.reward for ep in episodes], dtype=torch.float32)
        out["env_failed"] = torch.tensor([bool(ep.error) for ep in episodes], dtype=torch.bool)
        out["env_turns"] = torch.tensor([ep.turns for ep in episodes], dtype=torch.int64)
        return out

    @staticmethod
    def _metrics(episodes: list[Episode], env_wall: float) -> dict[str, float]:
        S = max(len(episodes), 1)
        model = sum(sum(ep.mask) for ep in episodes)
        return {
            "env/turns_mean": sum(ep.turns for ep in episodes) / S,
            "env/seconds": env_wall,
            "env/seconds_per_sample": sum(ep.env_s for ep in episodes) / S,
            "env/failed": float(sum(bool(ep.error) for ep in episodes)),
            "env/model_tokens": model / S,
            "env/env_tokens": sum(len(ep.mask) for ep in episodes) / S - model / S,
            "env/reward_mean": sum(0.0 if ep.error else ep.reward for ep in episodes) / S,
        }


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
