"""The backend protocol and registry: a backend decides where a run's node programs live.

A :class:`Backend` runs a whole graph: ``run(graph, placement, config, on_step=..., gate=...)`` returns the run's
``RunResult`` (``placement`` None: the backend's default, ``flowrl.placement.default``). ``run_graph`` (``flowrl.runtime.run``) checks what every backend needs checked, then
dispatches through this registry by ``RunConfig.backend``. The built-ins:

- ``local`` (``backends.local``): every program in this process, on the controller's threads;
- ``process`` (``backends.process.backend``): one OS process per executor on this machine;
- ``torchrun`` (``backends.torchrun.backend``): this process is one rank of a torch.distributed job.

``local`` and ``process`` share their driver (``backends.drive.run_with_controller``: one controller in this
process over node programs); ``torchrun`` drives its own ranks. What each backend is (it crosses
processes, it is a job of ranks, it shards with FSDP2, it offloads) is pure data,
``flowrl.backend_traits.BACKENDS``, which the CLI, preflight and the planner read; a backend class's
``crosses_processes`` is its row's, and decides the transport each edge opens (``flowrl.runtime.weights.edges``).

To add a backend: one module with a class that has ``name``, ``crosses_processes`` and ``run``, and
one ``register_backend`` call (or one entry in ``BUILTIN_BACKENDS``). This module imports nothing heavy.

Example:
    >>> backend_names()
    ['local', 'process', 'torchrun']
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from flowrl.errors import ConfigError

if TYPE_CHECKING:
    from flowrl.graph.ir import Graph
    from flowrl.placement.layout import Placement
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.control.controller import RunResult
    from flowrl.runtime.staleness import StalenessGate

__all__ = ["Backend", "BUILTIN_BACKENDS", "register_backend", "backend_names", "create_backend", "takes_gate", "OnStep"]

OnStep = Callable[[dict[str, Any]], None]

#: Built-in backends: name -> (module, class) in this package, imported on first use; their traits
#: are ``flowrl.backend_traits.BACKENDS``.
BUILTIN_BACKENDS: dict[str, tuple[str, str]] = {
    "local": ("flowrl.runtime.backends.local", "LocalBackend"),
    "process": ("flowrl.runtime.backends.process.backend", "ProcessBackend"),
    "torchrun": ("flowrl.runtime.backends.torchrun.backend", "TorchrunBackend"),
}

_USER_BACKENDS: dict[str, Callable[[], Backend]] = {}


@runtime_checkable
class Backend(Protocol):
    """Where a run's programs live and how the run is driven there.

    Attributes:
        name: the registry name (``RunConfig.backend``).
        crosses_processes: the two ends of a weight edge may be in different processes, so a
            transport that cannot cross processes is replaced (``weight_edges.transport_specs``).
    """

    name: str
    crosses_processes: bool

    def run(
        self, graph: Graph, placement: Placement | None, config: RunConfig, *, on_step: OnStep | None = None, gate: StalenessGate | None = None
    ) -> RunResult:
        """Execute ``graph`` on ``placement`` (None: the backend's default) for ``config.steps`` trainer
        steps; ``NodeExecutionError`` on failure. ``gate``: the run's staleness gate, built once by
        ``run_graph``: everything in the run that needs k reads it (a backend that declares no ``gate``
        parameter is called without one)."""
        ...


def register_backend(name: str, factory: Callable[[], Backend], *, replace: bool = False) -> None:
    """Make ``factory()`` the backend ``RunConfig(backend=name)`` runs on.

    Raises:
        ConfigError: if ``name`` is taken and ``replace`` is False.
    """
    if not replace and (name in BUILTIN_BACKENDS or name in _USER_BACKENDS):
        raise ConfigError(f"backend {name!r} is already registered; pass replace=True to override it")
    _USER_BACKENDS[name] = factory


def backend_names() -> list[str]:
    """Every backend a run may name: the built-ins and the registered ones, sorted."""
    return sorted({*BUILTIN_BACKENDS, *_USER_BACKENDS})


def create_backend(name: str) -> Backend:
    """A new backend of kind ``name``.

    Raises:
        ConfigError: for a name nobody registered, listing the known ones.
    """
    if name in _USER_BACKENDS:
        return _USER_BACKENDS[name]()
    if name not in BUILTIN_BACKENDS:
        raise ConfigError(f"unknown backend {name!r}; choose one of {backend_names()} (or register yours with register_backend)")
    module_name, attr = BUILTIN_BACKENDS[name]
    return getattr(importlib.import_module(module_name), attr)()


def takes_gate(backend: Backend) -> bool:
    """Whether ``backend.run`` takes the run's staleness gate (``gate=``, or ``**kwargs``): the built-ins
    do; a backend written before the gate was handed down is called without it, and reads no k.

    Example:
        >>> takes_gate(create_backend("local"))
        True
    """
    parameters = inspect.signature(backend.run).parameters.values()
    return any(p.name == "gate" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
