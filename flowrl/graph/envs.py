"""How a generator runs multi-turn episodes against an environment: ``EnvConfig``, plain data.

A generator with an ``env`` alternates model turns and environment turns (``flowrl.operators.multiturn``):
the environment is a user class (or factory) referenced like a scorer's function
(``package.module:qualname`` or ``path/to/file.py:qualname``, ``flowrl.graph.refs``) and resolved only
when the graph runs; one instance per sample (``flowrl.envs.environment`` states the protocol).

Example:
    >>> EnvConfig(env="flowrl.envs.games:GuessNumberEnv", max_turns=2).max_turns
    2
    >>> EnvConfig(env="flowrl.envs.games:GuessNumberEnv", max_turns=0)
    Traceback (most recent call last):
    ...
    flowrl.errors.ConfigError: EnvConfig: max_turns=0 must be >= 1 (model turns per episode)
"""

from __future__ import annotations

import math

import msgspec

from flowrl.errors import ConfigError
from flowrl.graph.refs import check_reference

__all__ = ["EnvConfig", "ENV_FIELDS"]

#: Rollout fields a generator with an environment writes besides the usual ones (``flowrl.graph.fields``).
ENV_FIELDS: tuple[str, ...] = ("env_rewards", "env_failed", "env_turns")


class EnvConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A generator's environment and its limits.

    Attributes:
        env: reference of the environment class or factory ``() -> env`` (``module:qualname`` or
            ``file.py:qualname``); called once per sample.
        max_turns: model turns per episode at most (>= 1); an episode still running after its last
            model turn ends there (truncated, its rewards so far kept).
        step_timeout_s: longest one ``reset`` or ``step`` call may take; a longer one fails its sample.
        episode_timeout_s: longest an episode's environment calls may take together.
        max_env_tokens: longest observation, in tokens; a longer one fails its sample.
        role: the chat role an observation's text is sent as, for a chat-template model (``"tool"``
            for tool results, ``"user"`` for a game's replies); the built-in model appends the text as is.
        agent: ``env`` names an agent program ``(session, row) -> reward`` instead of an environment:
            it chats with the generator through an OpenAI-compatible endpoint (``flowrl.serve.agents``);
            ``max_turns`` bounds its requests, ``episode_timeout_s`` its run; ``role`` does not apply.
    """

    env: str
    max_turns: int = 2
    step_timeout_s: float = 10.0
    episode_timeout_s: float = 60.0
    max_env_tokens: int = 64
    role: str = "user"
    agent: bool = False

    def __post_init__(self) -> None:
        o = "EnvConfig"
        message = check_reference(self.env)
        if message:
            raise ConfigError(f"{o}: env: {message}")
        if self.max_turns < 1:
            raise ConfigError(f"{o}: max_turns={self.max_turns} must be >= 1 (model turns per episode)")
        for name in ("step_timeout_s", "episode_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{o}: {name}={value} must be a finite number > 0 (seconds)")
        if self.max_env_tokens < 1:
            raise ConfigError(f"{o}: max_env_tokens={self.max_env_tokens} must be >= 1")
        if not self.role:
            raise ConfigError(f"{o}: role must not be empty (e.g. 'user' or 'tool')")
