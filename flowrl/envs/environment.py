"""The environment protocol, its checks, and time-limited calls that never crash a run.

An environment is any object with two methods, sync or ``async``:

- ``reset(row: dict) -> observation``: start an episode for one sample. ``row`` holds the prompt
  (``prompt``: its text, ``prompt_ids``: its tokens), ``prompt_index`` (its stream position), ``sample``
  (which of the prompt's ``n_samples``) and, for a prompt file, the row's other fields. The observation
  is appended after the prompt before the first model turn; ``None`` or ``""`` appends nothing.
- ``step(action: str) -> (observation | None, reward, info)``: the model's turn as text (decoded from
  its sampled tokens, the stop token included); ``None`` ends the episode, a string (or a message
  ``{"role": ..., "content": ...}``, whose content is sent as the generator's ``EnvConfig.role``) is
  the next observation; ``reward`` is a finite real number (an
  episode's rewards are summed); ``info`` is a dict (or None).

One instance per sample (the class or factory is called with no arguments). Each call runs in a
daemon thread under ``step_timeout_s``, all of an episode's calls under ``episode_timeout_s``; an
exception, a call past its limit, or a return of the wrong form fails the sample (reward 0, no
loss: ``flowrl.operators.multiturn``) with an ``EnvResult`` saying why, never the run. A hung call's
thread is abandoned (Python cannot kill it): it is a daemon, so it does not keep the process alive.

Example:
    >>> class Echo:
    ...     def reset(self, row): return "go"
    ...     def step(self, action): return None, float(action == "a"), {}
    >>> env = Echo()
    >>> call(env.reset, {"prompt": "x"}, timeout_s=1.0).value
    'go'
    >>> parse_step(call(env.step, "a", timeout_s=1.0).value)
    (None, 1.0, {})
    >>> call(env.step, "a", "extra", timeout_s=1.0).error
    'TypeError: Echo.step() takes 2 positional arguments but 3 were given'
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from flowrl.errors import ConfigError, FlowrlError

__all__ = ["Env", "EnvError", "EnvResult", "Observation", "Pending", "call", "start", "check_env", "make_env", "parse_step", "parse_observation"]

#: What ``reset`` and ``step`` may return as an observation: text, one chat message, or None.
Observation = str | dict[str, str] | None


class EnvError(FlowrlError):
    """An environment returned something outside the protocol (caught per sample: it fails the sample)."""


@runtime_checkable
class Env(Protocol):
    """The environment protocol (see the module docstring); sync or async methods."""

    def reset(self, row: dict[str, Any]) -> Any: ...

    def step(self, action: str) -> Any: ...


@dataclass
class EnvResult:
    """The outcome of one time-limited call.

    Attributes:
        value: what the call returned (None after an error).
        error: ``""`` if it returned; else why not (``"TypeError: ..."``, ``"timed out after 2 s"``).
        seconds: how long it took (the limit, for a call that timed out).
        timed_out: the error is the call's time limit (not an exception it raised).
    """

    value: Any = None
    error: str = ""
    seconds: float = 0.0
    timed_out: bool = False


def _run(fn: Callable[..., Any], args: tuple[Any, ...], timeout_s: float, box: dict[str, Any]) -> None:
    try:
        value = fn(*args)
        if inspect.isawaitable(value):  # an async method: its own loop, in this thread, under the limit
            async def limited() -> Any:
                return await asyncio.wait_for(value, timeout_s)

            value = asyncio.run(limited())
        box["value"] = value
    except BaseException as exc:  # noqa: BLE001 - whatever an environment raises fails its sample only
        box["error"] = f"{type(exc).__name__}: {exc}" if not isinstance(exc, TimeoutError) else f"timed out after {timeout_s:g} s"
        box["timed_out"] = isinstance(exc, TimeoutError)


class Pending:
    """A call running in its daemon thread (``start``): ``ready()`` says whether its result is in
    (returned, raised, or past its limit); calling it waits and gives the ``EnvResult``."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], timeout_s: float) -> None:
        self._box: dict[str, Any] = {}
        self._t0 = time.perf_counter()
        self._timeout_s = timeout_s
        self._thread = threading.Thread(target=_run, args=(fn, args, timeout_s, self._box), daemon=True, name="flowrl-env")
        self._thread.start()

    def ready(self) -> bool:
        """True once waiting would not block: the call ended or ran past its limit."""
        return not self._thread.is_alive() or time.perf_counter() >= self._t0 + self._timeout_s

    def __call__(self, deadline: float = math.inf) -> EnvResult:
        """The result, waiting at most until ``deadline`` (a ``time.perf_counter()`` value) or the call's limit."""
        limit = min(self._t0 + self._timeout_s, deadline)
        self._thread.join(max(0.0, limit - time.perf_counter()))
        seconds = time.perf_counter() - self._t0
        if self._thread.is_alive():
            return EnvResult(error=f"timed out after {min(self._timeout_s, limit - self._t0):.3g} s", seconds=seconds, timed_out=True)
        if "error" in self._box:
            return EnvResult(error=self._box["error"], seconds=seconds, timed_out=self._box["timed_out"])
        return EnvResult(value=self._box.get("value"), seconds=seconds)


def start(fn: Callable[..., Any], *args: Any, timeout_s: float) -> Pending:
    """Start ``fn(*args)`` in a daemon thread; the ``Pending`` call gives its ``EnvResult`` when called
    (an error if it has not returned by the deadline passed, a ``time.perf_counter()`` value, or ``timeout_s``)."""
    return Pending(fn, args, timeout_s)


def call(fn: Callable[..., Any], *args: Any, timeout_s: float) -> EnvResult:
    """``fn(*args)`` (awaited if it returns an awaitable) with a time limit, as an ``EnvResult``."""
    return start(fn, *args, timeout_s=timeout_s)()


def parse_observation(value: Any, *, where: str) -> Observation:
    """``value`` if it is an observation (text, a ``{"role", "content"}`` message, None).

    Raises:
        EnvError: naming ``where`` and the value.
    """
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str) and isinstance(value.get("role", ""), str):
        return value
    raise EnvError(f"{where} returned the observation {value!r:.200} of type {type(value).__name__}; "
                   "an observation is a str, a message {'role': ..., 'content': str}, or None")


def parse_step(value: Any) -> tuple[Observation, float, dict[str, Any]]:
    """``(observation, reward, info)`` from what ``step`` returned.

    Raises:
        EnvError: for anything but a 3-tuple of an observation, a finite real and a dict (or None).
    """
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        raise EnvError(f"step returned {value!r:.200}; it must return (observation or None, reward, info)")
    observation, reward, info = value
    observation = parse_observation(observation, where="step")
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
        raise EnvError(f"step returned the reward {reward!r:.200}; a reward is a finite real number")
    if info is not None and not isinstance(info, dict):
        raise EnvError(f"step returned the info {info!r:.200}; info is a dict or None")
    return observation, float(reward), dict(info or {})


def check_env(factory: Any, *, owner: str) -> None:
    """Refuse, before any work, an environment class or factory whose class lacks ``reset`` or ``step``.

    A class is checked as it is; a factory function is called once and its result checked (so keep it cheap).

    Raises:
        ConfigError: naming the environment and the missing methods.
    """
    target = factory
    if not isinstance(factory, type):
        if not callable(factory):
            raise ConfigError(f"{owner}: the environment {factory!r} is not a class or a factory () -> env")
        try:
            target = factory()
        except Exception as exc:
            raise ConfigError(f"{owner}: the environment factory {factory!r} raised {type(exc).__name__}: {exc}") from exc
    missing = [m for m in ("reset", "step") if not callable(getattr(target, m, None))]
    if missing:
        name = getattr(target, "__name__", type(target).__name__)
        raise ConfigError(
            f"{owner}: the environment {name!r} has no {' or '.join(missing)} method; an environment needs "
            "reset(row) -> observation and step(action_text) -> (observation or None, reward, info) "
            "(flowrl.envs.environment; a gymnasium-style one goes through flowrl.envs.gym.GymTextEnv)"
        )


def make_env(factory: Callable[[], Any]) -> Any:
    """One environment instance: ``factory()`` (a class or a function of no arguments)."""
    return factory()
