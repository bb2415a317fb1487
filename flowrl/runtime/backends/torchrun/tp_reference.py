"""A reference whose mesh has a ``tp`` axis > 1, under torchrun: its rank program ``TensorParallelReference``.

``rank_programs.reference_ranks`` builds it on every rank of the reference's mesh. Every rank builds
the whole frozen model, the lead's weights are broadcast, then ``tp_train.shard_tp_model_`` splits
its linear layers over ``tp`` with DTensor (the family's split table, as a tensor-parallel policy).
Per step the lead broadcasts the rollout; every rank computes the log-probs (the logits come out
replicated: every rank the same), and the lead returns them.

Refused by name before any work (``tp_train.check_tp_reference``): an axis other than ``tp`` > 1, a
syncing reference (``sync_steps`` > 0: it mixes the policy's whole weights, and saves them), a ``tp``
the model cannot be split into.
"""

from __future__ import annotations

from typing import Any


from flowrl.graph.ir import Graph
from flowrl.graph.nodes import ReferenceNode
from flowrl.runtime.backends.torchrun.rank_policy import _context, _mesh_axes, lead_forward_step, split_whole_model
from flowrl.runtime.programs.nodes import Batch, Info, ReferenceProgram, SharedTransports

__all__ = ["TensorParallelReference"]


class TensorParallelReference(ReferenceProgram):
    """One rank of a tensor-parallel reference (see the module docstring)."""

    _reported = False  # the lead reported its layout (its first step)

    def __init__(
        self, node: ReferenceNode, graph: Graph, transports: SharedTransports, *, device: str, timeout_s: float, group: Any, ranks: tuple[int, ...], mesh: Any
    ) -> None:
        from flowrl.runtime.parallel.tp_train import check_tp_reference, shard_tp_model_

        ctx = _context()
        check_tp_reference(node, {"dp": 1, "tp": 1, "pp": 1, **_mesh_axes(mesh)})
        super().__init__(node, graph, transports, device=device, timeout_s=timeout_s)
        self.group, self.ranks, self.lead = group, ranks, ranks[0]
        self.device = ctx.device
        self.is_lead = ctx.rank == self.lead
        split_whole_model(self.reference.model, mesh, lambda model, tp_mesh: shard_tp_model_(model, tp_mesh, node.model), lead=self.lead, group=group)

    def step(self, seq: int, inputs: Batch, min_version: int) -> tuple[Batch, Info]:
        return lead_forward_step(self, super().step, seq, inputs, min_version, f"one frozen reference over {len(self.ranks)} tensor-parallel ranks")
