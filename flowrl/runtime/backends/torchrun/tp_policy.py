"""A policy whose mesh has a ``tp`` axis > 1, under torchrun: its rank program ``TensorParallelPolicy``.

``rank_programs.policy_ranks`` builds it on every rank of the policy's mesh (axes ``tp``, or ``dp``
and ``tp``; ranks in mesh order, tp innermost). What each rank holds and how a step runs:

- every rank builds the whole model, the lead's weights are broadcast to all (equal starts), then
  ``flowrl.runtime.parallel.tp_train.shard_tp_trainer_`` shards its linear layers over ``tp`` with
  DTensor (the family's split table) and, with ``sharding="fsdp"`` and ``dp`` > 1, FSDP2 over ``dp``;
- a step (``_RankPolicy.step``): the lead broadcasts the batch; each optimizer step's mini-batch splits
  into ``dp`` parts of whole prompt groups (``_shares``: the ranks of one tp group take the same part);
  each rank's loss is scaled by ``dp * N_r / N`` (``fsdp.token_scale``, 1 with ``dp`` = 1) so that
  FSDP2's average over ``dp`` is the mini-batch's gradient; the trainer clips by the global norm
  (``tp_train.clip_grad_norm_``, every shard counted once) and steps AdamW on its shards. Metrics are
  reduced over the ranks of one tp index (``_reduce``: one rank per dp part, weighted by its samples;
  the ranks of a tp group hold the same figures);
- weights: on a collective edge every rank publishes its own shards, laid out as
  ``tp_train.trainer_layouts`` says (``flowrl.runtime.weights.torchrun_edges`` gives the transport the same
  layouts), so each byte leaves one rank once; on a ``shm`` / ``file`` edge every rank gathers
  (``full_tensor``) and the lead publishes the whole tensors;
- checkpoints: ``save`` runs on every rank (``saves_on_every_rank``) and writes a sharded state
  (``flowrl.runtime.checkpointing.sharded_state``: torch.distributed.checkpoint, keys the full model's
  names, each rank its own shards); ``load`` reads one written by any layout (tp, dp or FSDP2 sizes:
  DCP reshards by overlap) or a one-file state (each rank keeps its pieces).

Refused by name before any work (``tp_train.check_tp_policy``): a ``tp`` not dividing the heads, the
kv heads or a split width; ``dp`` > 1 without ``sharding="fsdp"``; LoRA dropout; a ``pp`` axis. A LoRA
policy trains its adapters split with their targets (``tp_train.tp_plan``), publishes and checkpoints them. A weight edge
on the direct route into vLLM is served as an FSDP2 policy's: ``direct_route.DirectPolicy`` with every
rank gathering each bucket (``full_tensor`` of the split weights), the lead sending.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from flowrl.errors import ConfigError
from flowrl.graph.ir import Graph
from flowrl.graph.nodes import LossNode, PolicyNode
from flowrl.runtime.backends.torchrun.rank_policy import _context, _mesh_axes, _RankPolicy, publish_shards
from flowrl.runtime.programs.nodes import SharedTransports

__all__ = ["TensorParallelPolicy"]


class TensorParallelPolicy(_RankPolicy):
    """One rank of a tensor-parallel policy (see the module docstring)."""

    saves_on_every_rank = True
    holds_shards = True  # on the direct route into vLLM every rank gathers each bucket (``direct_route.DirectPolicy``)

    def __init__(self, node: PolicyNode, graph: Graph, transports: SharedTransports, *, group: Any, ranks: tuple[int, ...], mesh: Any) -> None:
        from flowrl.runtime.parallel.tp_train import check_tp_policy, shard_tp_trainer_

        ctx = _context()
        sizes = {"dp": 1, "tp": 1, "pp": 1, **_mesh_axes(mesh)}
        check_tp_policy(node, sizes)
        self.dp, self.tp = sizes["dp"], sizes["tp"]
        self.fsdp = node.optimizer.sharding == "fsdp" and self.dp > 1
        loss = graph.loss_of(node.name)
        if not isinstance(loss, LossNode):
            raise ConfigError(f"policy {node.name!r} has no loss node")
        super().__init__(node, loss, graph, transports, device=str(ctx.device))
        self.group, self.ranks, self.lead = group, ranks, ranks[0]
        self.index = ranks.index(ctx.rank)
        self.device = ctx.device
        with torch.no_grad():
            for p in self.trainer.model.parameters():  # equal whole models on every rank before sharding
                torch.distributed.broadcast(p.data, src=self.lead, group=group)
        self.mesh = mesh
        shard_tp_trainer_(self.trainer, mesh, group=group, fsdp=self.fsdp)
        self.collective_bytes = 0

    def _layout(self) -> dict[str, Any]:
        from flowrl.runtime.observe.layout import record

        groups = [self.ranks[i * self.tp : (i + 1) * self.tp] for i in range(self.dp)]  # mesh order, tp innermost
        each = f"{self.tp} tensor-parallel ranks holding their DTensor shards"
        runs = f"{self.dp} data-parallel parts as FSDP2 shards, each {each}" if self.fsdp else f"one policy over {each}"
        return record(self.ranks, {"dp": self.dp, "tp": self.tp}, groups, runs)

    def _shares(self) -> tuple[int, int]:
        return self.dp, self.index // self.tp  # mesh order, tp innermost: a tp group's ranks share one dp part

    def _share(self, mine: float, total: float) -> None:
        from flowrl.runtime.parallel.fsdp import token_scale

        self.trainer.loss_scale = token_scale(self.dp, mine, total) if self.fsdp else 1.0

    def _check(self, sizes: list[int]) -> None:
        if self.fsdp:
            from flowrl.runtime.parallel.fsdp import check_shards

            check_shards(self.name, sizes, self.trainer.node.optimizer.micro_batch_size)

    def _reduce(self, metrics: dict[str, float], samples: float) -> dict[str, float]:
        """Over the dp parts only: the ranks sharing this rank's tp index (a tp group's ranks hold the same figures)."""
        from flowrl.runtime.parallel.distributed import reduce_metrics

        return metrics if self.dp == 1 else reduce_metrics(metrics, samples, group=self.mesh["dp"].get_group(), device=self.device)

    def _grad_norm(self, metrics: dict[str, float]) -> float:
        return float(metrics["policy/grad_norm"])  # the global norm already (tp_train.clip_grad_norm_), averaged over the steps

    def publish(self) -> float:
        return publish_shards(self)

    def save(self, path: str) -> None:
        from flowrl.runtime.checkpointing.sharded_state import save_sharded

        save_sharded(self.trainer, path, group=self.group)  # each rank writes its own shards, nothing is gathered

    def snapshot(self, path: str) -> Any:
        """``save``'s shards staged to CPU memory now; the write returned, to run behind training."""
        from flowrl.runtime.checkpointing.sharded_state import snapshot_sharded

        return snapshot_sharded(self.trainer, path, group=self.group, buffers=self.__dict__.setdefault("_checkpoint_buffers", {}))

    def load(self, path: str) -> None:
        from flowrl.runtime.checkpointing.sharded_state import SHARDED_SUFFIX, is_sharded, load_sharded
        from flowrl.runtime.parallel.fsdp import load_full_state

        if is_sharded(path) or (path.endswith(SHARDED_SUFFIX) and not os.path.isfile(path)):  # any layout's shards
            load_sharded(self.trainer, path, group=self.group)
        else:  # a one-file state (one process's, a replicated policy's): each rank keeps its pieces
            load_full_state(self.trainer, torch.load(path, weights_only=True, map_location="cpu", mmap=True))
        self._published = -1
