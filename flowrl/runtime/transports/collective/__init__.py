"""The collective weight transport: trainer shards to generator shards, rank to rank, over torch.distributed.

Two modules: :mod:`~flowrl.runtime.transports.collective.messages` lays a transfer plan out as one
message per (trainer rank, generator rank) pair (which block travels where, cut into which pieces);
:mod:`~flowrl.runtime.transports.collective.transport` moves those messages (versions, staging,
direct sends and receives, timeouts).

The plan comes from ``flowrl.placement.resharding`` (pure: layouts, ``plan_state``, and the copy
rule ``staging_copies`` / ``transfer_volume``), and the planner's ``estimate.sync`` prices a sync
with the same ``transfer_volume`` over the layouts the torchrun backend uses (``sync_params``:
replicas, or ``fsdp(ranks)`` shards for a policy with ``sharding="fsdp"``, which the planner costs
as ZeRO stage 3), so the bytes and copies it predicts are the ones this transport moves. A trainer
rank sends its contiguous shard slices in place and packs the rest through one reused send buffer of
``bucket_bytes`` (:mod:`~flowrl.runtime.transports.collective.send_buffer`; 64 MiB by default), so
its staging memory is one bucket, not a copy of its shards; a rank that is also a generator
(colocated) stages its whole message, since it sends from its fetch. Its NCCL tests need 2 GPUs
(NCCL refuses two ranks on one GPU) and skip visibly without them.
"""

from flowrl.runtime.transports.collective.messages import DTYPES, HEADER_BYTES, ParamSpec
from flowrl.runtime.transports.collective.transport import CollectiveTransport

__all__ = ["CollectiveTransport", "ParamSpec", "HEADER_BYTES", "DTYPES"]
