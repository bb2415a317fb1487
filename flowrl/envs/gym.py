"""An adapter for gymnasium-style text environments: bring an existing environment to flowrl.

gymnasium's protocol is ``reset(seed=...) -> (observation, info)`` and ``step(action) -> (observation,
reward, terminated, truncated, info)``; a text environment's observations and actions are strings
(``gymnasium.spaces.Text``). ``GymTextEnv`` wraps one in flowrl's protocol (``flowrl.envs.environment``):

- ``reset(row)`` calls ``reset(seed=...)`` with a seed from the row (``seed_of``: the prompt's stream
  position and the sample, so every sample plays its own reproducible episode; a resumed run replays
  it) and returns its observation;
- ``step(action)`` returns ``(None if terminated or truncated else observation, reward, info)``.

It is duck-typed: gymnasium itself is not imported (nor needed); anything with those two methods
works. Subclass it and override ``make()`` to build the wrapped environment (flowrl calls the class
with no arguments, one instance per sample), e.g. ``gymnasium.make("MyText-v0")``.

Example:
    >>> class Count:
    ...     def reset(self, seed=None, options=None): self.n = seed % 3; return f"n={self.n}", {}
    ...     def step(self, action): return "again", float(action == str(self.n)), True, False, {}
    >>> class CountEnv(GymTextEnv):
    ...     def make(self): return Count()
    >>> env = CountEnv()
    >>> env.reset({"prompt_index": 4, "sample": 0})
    'n=1'
    >>> env.step("1")
    (None, 1.0, {})
"""

from __future__ import annotations

from typing import Any

__all__ = ["GymTextEnv"]


class GymTextEnv:
    """flowrl's environment protocol over a gymnasium-style text environment (see the module docstring).

    Args:
        env: the wrapped environment; None calls ``make()``.
    """

    def __init__(self, env: Any = None) -> None:
        self.env = env if env is not None else self.make()
        for method in ("reset", "step"):
            if not callable(getattr(self.env, method, None)):
                raise TypeError(f"{type(self).__name__}: the wrapped {type(self.env).__name__} has no {method}; it must follow gymnasium's API")

    def make(self) -> Any:
        """Build the wrapped environment; override it."""
        raise NotImplementedError(f"{type(self).__name__}: override make() to build the gymnasium-style environment")

    def seed_of(self, row: dict[str, Any]) -> int:
        """The episode's seed: from the prompt's stream position and the sample number."""
        return int(row.get("prompt_index", 0)) * 1000 + int(row.get("sample", 0))

    def reset(self, row: dict[str, Any]) -> Any:
        out = self.env.reset(seed=self.seed_of(row))
        observation = out[0] if isinstance(out, tuple) and len(out) == 2 else out
        return observation

    def step(self, action: str) -> tuple[Any, float, dict[str, Any]]:
        out = self.env.step(action)
        if not isinstance(out, tuple) or len(out) != 5:
            return out  # not gymnasium's 5-tuple: flowrl's checks fail the sample, naming it
        observation, reward, terminated, truncated, info = out
        return (None if terminated or truncated else observation), reward, info
