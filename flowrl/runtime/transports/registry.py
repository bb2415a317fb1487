"""The registry of weight transports: names to factories and what each transport is (its traits).

A transport class declares its :class:`TransportTraits` (``flowrl.transport_traits``) as a class
attribute ``traits``: whether it crosses processes and hosts, which options it is opened with,
whether it is a torch.distributed collective and how the planner costs it; a built-in's is its row
of ``BUILTINS``. The backends and the planner read those traits (``transport_traits`` here,
``traits_of`` in the planner) instead of matching names, so a new transport is one class plus one
``register_transport`` call.

The registry is consulted where a run starts (``check_transports``), not when a graph is validated
(validation checks only a name's form, ``TRANSPORT_NAME_RE``): a graph naming a transport that only the
running process registers loads anywhere. A user transport reaches the workers of another process
by reference (``transport_reference``: its factory's ``module:qualname``), so it must be defined at
module level in an importable module.

This module imports nothing heavy; a built-in transport's module is imported only when one is created.

Example:
    >>> "inprocess" in transport_names()
    True
    >>> transport_traits("file").needs_directory
    True
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from flowrl.errors import TransportError
from flowrl.graph.validate import TRANSPORT_NAME_RE  # the graph owns a name's form
from flowrl.transport_traits import TransportTraits, declare_traits, traits_of

__all__ = [
    "TransportTraits",
    "TRANSPORT_NAME_RE",
    "register_transport",
    "transport_names",
    "transport_traits",
    "transport_reference",
    "import_transport",
    "check_transports",
    "create_transport",
    "BUILTIN_TRANSPORTS",
]

#: Built-in transports: name -> (module, class) in this package, imported on first use; their traits
#: are ``flowrl.transport_traits.BUILTINS`` (pure data, which the planner reads without this package).
BUILTIN_TRANSPORTS: dict[str, tuple[str, str]] = {
    "inprocess": ("flowrl.runtime.transports.inprocess", "InProcessTransport"),
    "shm": ("flowrl.runtime.transports.shm", "SharedMemoryTransport"),
    "file": ("flowrl.runtime.transports.file", "FileTransport"),
    "collective": ("flowrl.runtime.transports.collective", "CollectiveTransport"),
    "cuda_ipc": ("flowrl.runtime.transports.cuda_ipc", "CudaIpcTransport"),
}

_USER_TRANSPORTS: dict[str, Callable[..., Any]] = {}


def register_transport(name: str, factory: Callable[..., Any], *, replace: bool = False, traits: TransportTraits | None = None) -> None:
    """Make ``factory(**options)`` available as transport ``name`` in graphs.

    Args:
        name: the name weight edges use (``TRANSPORT_NAME_RE``).
        factory: called with the transport's options; a class or a module-level function (the
            process and torchrun backends import it by ``module:qualname`` in their workers).
        replace: replace a transport registered under ``name``.
        traits: what the transport is; by default ``factory.traits`` if it has one, else
            ``TransportTraits()`` (crosses processes, costed as a collective).

    Raises:
        TransportError: if ``name`` is taken and ``replace`` is False, or is not a valid name.
    """
    if not TRANSPORT_NAME_RE.match(name):
        raise TransportError(f"transport name {name!r} is not valid: use letters, digits, '_', '-' and '.', starting with a letter")
    if not replace and (name in BUILTIN_TRANSPORTS or name in _USER_TRANSPORTS):
        raise TransportError(f"transport {name!r} is already registered; pass replace=True to override it")
    declared = traits if traits is not None else getattr(factory, "traits", None)
    _USER_TRANSPORTS[name] = factory
    declare_traits(name, declared if isinstance(declared, TransportTraits) else TransportTraits())


def transport_names() -> list[str]:
    """Every name a weight edge may use: the built-ins and the registered ones, sorted."""
    return sorted({*BUILTIN_TRANSPORTS, *_USER_TRANSPORTS})


def _builtin_class(name: str) -> Any:
    module_name, attr = BUILTIN_TRANSPORTS[name]
    return getattr(importlib.import_module(module_name), attr)


def _unknown(name: str) -> TransportError:
    return TransportError(
        f"unknown transport {name!r}; known transports: {transport_names()} "
        "(register yours with flowrl.runtime.transports.register_transport before the run starts)"
    )


def transport_traits(name: str) -> TransportTraits:
    """The traits transport ``name`` declares (``flowrl.transport_traits``: a built-in's row, or a user's
    declared at registration).

    Raises:
        TransportError: for a name nobody registered.
    """
    traits = traits_of(name) if name in _USER_TRANSPORTS or name in BUILTIN_TRANSPORTS else None
    if traits is None:
        raise _unknown(name)
    return traits


def transport_reference(name: str) -> str:
    """How another process finds transport ``name``: ``""`` for a built-in, else its factory's ``module:qualname``.

    Raises:
        TransportError: for an unknown name, or a user factory that another process cannot import
            (a lambda, a nested function, or one defined in ``__main__``).
    """
    if name in BUILTIN_TRANSPORTS and name not in _USER_TRANSPORTS:
        return ""
    if name not in _USER_TRANSPORTS:
        raise _unknown(name)
    factory = _USER_TRANSPORTS[name]
    module, qualname = getattr(factory, "__module__", None), getattr(factory, "__qualname__", "")
    if not module or module == "__main__" or "<" in qualname:
        raise TransportError(
            f"transport {name!r} is registered with {factory!r}, which another process cannot import; "
            "define its factory at module level in an importable module (not __main__, a lambda or a nested function)"
        )
    return f"{module}:{qualname}"


def import_transport(name: str, reference: str) -> None:
    """Register transport ``name`` from its factory's ``reference`` unless this process knows it already
    (a worker process of a backend: the controller's process registered it)."""
    if name in _USER_TRANSPORTS or (name in BUILTIN_TRANSPORTS and not reference):
        return
    from flowrl.graph.refs import resolve

    register_transport(name, resolve(reference), replace=True)


def check_transports(names: Any) -> None:
    """At run start: every transport name a graph uses is registered.

    Raises:
        TransportError: naming the first unknown transport and the known ones.
    """
    for name in names:
        if name not in _USER_TRANSPORTS and name not in BUILTIN_TRANSPORTS:
            raise _unknown(name)


def create_transport(name: str, /, **options: Any) -> Any:
    """A new transport of kind ``name``; ``options`` go to its factory.

    ``name`` is positional-only, so a transport may take a ``name`` option of its own (the shared-memory
    transport's segment name: ``create_transport("shm", name="flowrl-run1-policy-gen", create=False)``).
    """
    if name in _USER_TRANSPORTS:
        return _USER_TRANSPORTS[name](**options)
    if name not in BUILTIN_TRANSPORTS:
        raise _unknown(name)
    return _builtin_class(name)(**options)
