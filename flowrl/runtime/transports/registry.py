"""The registry of weight transports: names to factories, built-ins listed explicitly.

Graph validation asks this registry which transport names exist, so this module imports nothing
heavy; a transport's own module is imported only when one is created.

Example:
    >>> "inprocess" in transport_names()
    True
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from flowrl.errors import TransportError

__all__ = ["register_transport", "transport_names", "create_transport", "BUILTIN_TRANSPORTS"]

#: Built-in transports: name -> "module:factory". Imported on first use.
BUILTIN_TRANSPORTS: dict[str, str] = {
    "inprocess": "flowrl.runtime.transports.inprocess:InProcessTransport",
    "shm": "flowrl.runtime.transports.shm:SharedMemoryTransport",
    "file": "flowrl.runtime.transports.file:FileTransport",
    "collective": "flowrl.runtime.transports.collective:CollectiveTransport",
}

_USER_TRANSPORTS: dict[str, Callable[..., Any]] = {}


def register_transport(name: str, factory: Callable[..., Any], *, replace: bool = False) -> None:
    """Make ``factory(**options)`` available as transport ``name`` in graphs.

    Raises:
        TransportError: if ``name`` is taken and ``replace`` is False.
    """
    if not replace and (name in BUILTIN_TRANSPORTS or name in _USER_TRANSPORTS):
        raise TransportError(f"transport {name!r} is already registered; pass replace=True to override it")
    _USER_TRANSPORTS[name] = factory


def transport_names() -> list[str]:
    """Every name a weight edge may use: the built-ins and the registered ones, sorted."""
    return sorted({*BUILTIN_TRANSPORTS, *_USER_TRANSPORTS})


def create_transport(name: str, /, **options: Any) -> Any:
    """A new transport of kind ``name``; ``options`` go to its factory.

    ``name`` is positional-only, so a transport may take a ``name`` option of its own (the shared-memory
    transport's segment name: ``create_transport("shm", name="flowrl-run1-policy-gen", create=False)``).
    """
    if name in _USER_TRANSPORTS:
        return _USER_TRANSPORTS[name](**options)
    if name not in BUILTIN_TRANSPORTS:
        raise TransportError(f"unknown transport {name!r}; known transports: {transport_names()}")
    module_name, attr = BUILTIN_TRANSPORTS[name].split(":")
    return getattr(importlib.import_module(module_name), attr)(**options)
