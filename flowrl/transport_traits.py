"""What a weight transport is (``TransportTraits``), by name: pure data the runtime and the planner both read.

A transport's traits say whether it crosses processes and hosts, which options it is opened with,
whether it is a torch.distributed collective and how the planner costs one sync. The built-ins'
are in the table ``BUILTINS`` (each class's ``traits`` attribute is its row; which class is a name's is
the runtime's business: ``runtime/transports/registry.py``, ``BUILTIN_TRANSPORTS``); a user
transport declares its own when it is registered (``flowrl.runtime.transports.register_transport``
calls ``declare_traits``). The runtime's registry (``runtime/transports/registry.py``) and the
planner's sync estimate (``planners/estimate/sync.py``) read them here, so the planner prices a
transport without importing it (or torch).

Example:
    >>> traits_of("file").needs_directory, traits_of("no-such-transport")
    (True, None)
"""

from __future__ import annotations

from typing import Literal

import msgspec

__all__ = ["TransportTraits", "BUILTINS", "declare_traits", "traits_of"]


class TransportTraits(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a transport is; a transport class declares one as its ``traits`` class attribute.

    Attributes:
        crosses_processes: both ends may live in different OS processes of one machine. A backend
            that runs nodes in several processes replaces a transport that cannot with shared memory.
        crosses_hosts: both ends may live on different machines (given what it needs, e.g. a shared directory).
        needs_directory: opened with ``directory=...`` (a folder both ends see; the run's own by default).
        needs_segment: opened with a shared-memory segment ``name=...`` (``create=True`` on the writer's side).
        collective: a torch.distributed transport; the torchrun backend builds one per rank and edge.
        cost: how the planner costs one sync: ``"memory"`` (``memory_copies`` copies through memory on
            one machine, a collective across devices), ``"file"`` (written once, read once per replica)
            or ``"collective"`` (rank-to-rank resharding).
        memory_copies: memory copies per sync when ``cost == "memory"``.
    """

    crosses_processes: bool = True
    crosses_hosts: bool = False
    needs_directory: bool = False
    needs_segment: bool = False
    collective: bool = False
    cost: Literal["memory", "file", "collective"] = "collective"
    memory_copies: int = 1


#: The built-in transports' traits, one line each.
BUILTINS: dict[str, TransportTraits] = {
    "inprocess": TransportTraits(crosses_processes=False, cost="memory", memory_copies=1),
    "shm": TransportTraits(needs_segment=True, cost="memory", memory_copies=2),
    "file": TransportTraits(crosses_hosts=True, needs_directory=True, cost="file"),
    "collective": TransportTraits(crosses_hosts=True, collective=True),
    "cuda_ipc": TransportTraits(needs_segment=True, cost="memory", memory_copies=2),
}

_DECLARED: dict[str, TransportTraits] = {}


def declare_traits(name: str, traits: TransportTraits) -> None:
    """Record the traits of transport ``name`` in this process (the registry does, when it registers one)."""
    _DECLARED[name] = traits


def traits_of(name: str) -> TransportTraits | None:
    """The traits transport ``name`` has in this process: declared at registration, else a built-in's; None for a name nobody declared."""
    if name in _DECLARED:
        return _DECLARED[name]
    return BUILTINS.get(name)
