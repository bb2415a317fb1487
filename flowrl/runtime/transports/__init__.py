"""Weight transports: the protocol, the registry, and the built-in in-process, shared-memory and file transports.

The registry functions are imported eagerly (graph validation needs ``transport_names`` and must
not pay for torch); the protocol and the transport classes are imported on first access
(PEP 562 ``__getattr__``), so ``import flowrl.runtime.transports`` stays light.

Example:
    >>> from flowrl.runtime.transports import create_transport
    >>> t = create_transport("inprocess")
    >>> t.latest_version()
    -1
    >>> t.close()
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from flowrl.runtime.transports.registry import BUILTIN_TRANSPORTS, create_transport, register_transport, transport_names

if TYPE_CHECKING:
    from flowrl.runtime.transports.weight_transport import State, WeightTransport
    from flowrl.runtime.transports.file import FileTransport
    from flowrl.runtime.transports.inprocess import InProcessTransport
    from flowrl.runtime.transports.shm import SharedMemoryTransport
    from flowrl.runtime.transports.cuda_ipc import CudaIpcTransport
    from flowrl.runtime.transports.collective import CollectiveTransport

__all__ = [
    "WeightTransport",
    "State",
    "register_transport",
    "transport_names",
    "create_transport",
    "BUILTIN_TRANSPORTS",
    "InProcessTransport",
    "SharedMemoryTransport",
    "FileTransport",
    "CudaIpcTransport",
    "CollectiveTransport",
]

_LAZY = {
    "WeightTransport": "flowrl.runtime.transports.weight_transport",
    "State": "flowrl.runtime.transports.weight_transport",
    "InProcessTransport": "flowrl.runtime.transports.inprocess",
    "SharedMemoryTransport": "flowrl.runtime.transports.shm",
    "FileTransport": "flowrl.runtime.transports.file",
    "CudaIpcTransport": "flowrl.runtime.transports.cuda_ipc",
    "CollectiveTransport": "flowrl.runtime.transports.collective",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
