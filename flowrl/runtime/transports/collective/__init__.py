"""The collective weight transport: trainer shards to generator shards, rank to rank, over torch.distributed.

Two modules: :mod:`~flowrl.runtime.transports.collective.messages` lays a transfer plan out as one
message per (trainer rank, generator rank) pair (which block travels where, cut into which pieces);
:mod:`~flowrl.runtime.transports.collective.transport` moves those messages (versions, staging,
direct sends and receives, timeouts).
"""

from flowrl.runtime.transports.collective.messages import DTYPES, HEADER_BYTES, ParamSpec
from flowrl.runtime.transports.collective.transport import CollectiveTransport

__all__ = ["CollectiveTransport", "ParamSpec", "HEADER_BYTES", "DTYPES"]
