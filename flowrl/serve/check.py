"""Checks of an agent program before any work (no engine, no endpoint)."""

from __future__ import annotations

import inspect
from typing import Any

from flowrl.errors import ConfigError

__all__ = ["check_program"]


def check_program(program: Any, *, owner: str) -> None:
    """Refuse an agent program that cannot be called as ``program(session, row)``.

    Raises:
        ConfigError: naming the program and the signature it needs.
    """
    name = getattr(program, "__qualname__", repr(program))
    if not callable(program) or isinstance(program, type):
        raise ConfigError(f"{owner}: the agent program {name} must be a function program(session, row) -> reward, not {type(program).__name__}")
    try:
        inspect.signature(program).bind(None, None)
    except TypeError as exc:
        raise ConfigError(f"{owner}: the agent program {name} cannot be called as program(session, row) -> reward ({exc})") from exc
    except ValueError:  # a builtin without a signature: it is called as it is
        pass
