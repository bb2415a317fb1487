"""A two-rank gloo job for ``test_routing_replay_run``: a rollout's routed_experts through ``broadcast_batch`` and ``send_batch``
(imports torch only, so that a spawned rank starts fast)."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["ranks_job"]


def ranks_job(rank: int, init: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from flowrl.runtime.parallel.distributed import broadcast_batch, recv_batch, send_batch

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        g = torch.Generator().manual_seed(0)
        batch = {  # routed_experts of an 8-expert and of a 300-expert model, with the fields beside them
            "routed_experts": torch.randint(0, 9, (3, 7, 2, 2), generator=g, dtype=torch.uint8),
            "wide": torch.randint(0, 301, (3, 7, 2, 2), generator=g).to(torch.int16),
            "completion_mask": torch.rand(3, 4, generator=g) > 0.5,
            "rollout_version": torch.tensor(4),
        }
        got = broadcast_batch(batch if rank == 0 else None, src=0, group=None)
        if rank == 0:
            send_batch(batch, dst=1)
        else:
            sent = recv_batch(src=0)
            same = all(got[k].dtype == v.dtype and torch.equal(got[k], v) and torch.equal(sent[k], v) for k, v in batch.items())
            Path(out).write_text(json.dumps({"same": same}))
    finally:
        dist.destroy_process_group()
