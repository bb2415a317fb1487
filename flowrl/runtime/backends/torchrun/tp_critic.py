"""A critic whose mesh has a ``tp`` axis > 1, under torchrun: its rank program ``TensorParallelCritic``.

``rank_programs.critic_ranks`` builds it on every rank of the critic's mesh. Every rank builds the
whole critic (``flowrl.operators.critic.Critic``: the model and its value head), the lead's weights
are broadcast, then the trunk's linear layers are split over ``tp`` with DTensor by the plan of a
tensor-parallel policy (``tp_train.tp_plan`` from the family's split table); the value head, a
``Linear(dim, 1)``, stays whole on every rank (its input, the residual stream, is replicated). AdamW
is rebuilt over the (sharded) parameters and the gradient is clipped by the global norm, every
shard counted once (``tp_train.clip_grad_norm_``). Per step the lead broadcasts the batch; every
rank computes the values and trains on it, and the lead returns the values and the metrics (alike
on every rank).

Checkpoints: one file in the one-process critic's format (``Critic.state()``): ``save`` runs on
every rank (the controller sends it to all: ``torchrun`` builds its ``RemoteProgram`` with ``one_file``), each gathers the whole weights
and AdamW moments (``whole_state``: ``full_tensor``), the lead writes them; ``load`` reads such a file
on every rank, each keeping its shards (``load_whole_state_``: ``distribute_tensor`` into each
parameter's placements). So a critic's
checkpoint resumes on one rank or on any ``tp``.

Refused by name before any work: an axis other than ``tp`` > 1, LoRA, a ``tp``
the model cannot be split into (``tp_train.check_tp_critic``, also on every rank before any work).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
import torch

from flowrl.errors import CheckpointError
from flowrl.graph.critic import CriticNode
from flowrl.graph.ir import Graph
from flowrl.runtime.backends.torchrun.rank_policy import _context, _mesh_axes, lead_forward_step, split_whole_model
from flowrl.runtime.programs.critic import CriticProgram
from flowrl.runtime.programs.nodes import Batch, Info

__all__ = ["TensorParallelCritic", "shard_critic_", "whole_state", "load_whole_state_"]


def shard_critic_(critic: Any, tp_mesh: Any, *, group: Any) -> None:
    """Split ``critic``'s trunk over the 1-D ``tp_mesh`` in place (the value head whole), rebuild its
    AdamW over the sharded parameters and make it clip by the global norm over ``group``. Every rank
    of the mesh calls it with equal whole critics."""
    from torch.distributed.tensor.parallel import parallelize_module

    from flowrl.operators.trainer import learning_rate
    from flowrl.runtime.parallel.tensor_parallel import param_splits
    from flowrl.runtime.parallel.tp_train import _local_heads, clip_grad_norm_, head_local, tp_plan

    head = critic.head  # the value head's module name: a Linear to one number, never split
    splits = {n: s for n, s in param_splits(critic.node.model).items() if n.rpartition(".")[0] != head}
    plan = tp_plan(critic.model, splits)
    partial = set(head_local(critic.model, splits))
    parallelize_module(critic.model, tp_mesh, plan)
    _local_heads(critic.model, tp_mesh.size())
    critic.trainable = {n: p for n, p in critic.model.named_parameters() if p.requires_grad}  # DTensors now where split
    opt = critic.node.optimizer
    critic.optimizer = torch.optim.AdamW(list(critic.trainable.values()), lr=learning_rate(opt, critic.version), betas=opt.betas, weight_decay=opt.weight_decay)
    summed = [p for n, p in critic.model.named_parameters() if n in partial]
    tp_group = tp_mesh.get_group()
    critic.clip_grad_norm = lambda params, max_norm: clip_grad_norm_(params, max_norm, group=group, partial=summed, tp_group=tp_group)


def _full(value: Any) -> Any:
    """A DTensor gathered whole (every rank takes part), a nested state's tensors likewise."""
    if hasattr(value, "full_tensor"):
        return value.full_tensor()
    if isinstance(value, dict):
        return {k: _full(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_full(v) for v in value]
    return value


def _shard_like(full: Any, like: Any) -> Any:
    """``full`` (a whole tensor, alike on every rank) as ``like``'s DTensor placements, or as it is."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(like, DTensor) and isinstance(full, torch.Tensor) and full.shape == like.shape:
        return distribute_tensor(full.to(like.device, like.dtype), like.device_mesh, like.placements)
    return full


class TensorParallelCritic(CriticProgram):
    """One rank of a tensor-parallel critic (see the module docstring)."""

    _reported = False  # the lead reported its layout (its first step)

    def __init__(self, node: CriticNode, graph: Graph, *, device: str, group: Any, ranks: tuple[int, ...], mesh: Any) -> None:
        from flowrl.runtime.parallel.tp_train import check_tp_critic

        ctx = _context()
        check_tp_critic(node, {"dp": 1, "tp": 1, "pp": 1, **_mesh_axes(mesh)})
        super().__init__(node, graph, device=device)
        self.group, self.ranks, self.lead = group, ranks, ranks[0]
        self.device = ctx.device
        self.is_lead = ctx.rank == self.lead
        split_whole_model(self.critic.model, mesh, lambda _, tp_mesh: shard_critic_(self.critic, tp_mesh, group=group), lead=self.lead, group=group)

    def step(self, seq: int, inputs: Batch, min_version: int) -> tuple[Batch, Info]:
        runs = f"one critic over {len(self.ranks)} tensor-parallel ranks holding DTensor shards of its linears (the value head whole)"
        return lead_forward_step(self, super().step, seq, inputs, min_version, runs)

    def save(self, path: str) -> None:
        with self._lock:
            state = whole_state(self.critic)  # every rank takes part in the gathers
        if self.is_lead:
            torch.save(state, path)

    def load(self, path: str) -> None:
        state = torch.load(path, weights_only=True, map_location="cpu")
        with self._lock:
            load_whole_state_(self.critic, state)


def whole_state(critic: Any) -> dict[str, Any]:
    """``Critic.state()`` of a tensor-parallel critic, whole (its DTensors gathered, on the CPU): every
    rank of its mesh calls it, in the same order; one process's critic loads it as its own."""
    return _cpu({
        "version": critic.version,
        "model_config": msgspec.to_builtins(critic.node.model),
        "weights": {n: _full(p.detach()) for n, p in critic.trainable.items()},
        "optimizer": _full(critic.optimizer.state_dict()),
    })  # fmt: skip


def load_whole_state_(critic: Any, state: Mapping[str, Any]) -> None:
    """Load a one-file critic state (``Critic.state()``, ``whole_state``) into a tensor-parallel critic:
    each rank keeps its shards, then ``Critic.load_state`` checks and loads them.

    Raises:
        CheckpointError: a state without weights or optimizer, or as ``Critic.load_state``.
    """
    weights, optimizer = state.get("weights"), state.get("optimizer")
    if not isinstance(weights, Mapping) or not isinstance(optimizer, Mapping):
        raise CheckpointError(f"critic {critic.name!r}: its checkpointed state lacks weights or optimizer (it has {sorted(state)})")
    mine = critic.trainable
    params = [p for g in critic.optimizer.param_groups for p in g["params"]]
    per_param = {}
    for index, entry in dict(optimizer.get("state", {})).items():
        like = params[int(index)] if int(index) < len(params) else None
        # "step" is cloned: AdamW increments it in place, and must not change the caller's state
        per_param[index] = {k: (v.clone() if k == "step" or like is None else _shard_like(v, like)) for k, v in entry.items()}
    critic.load_state({
        **state,
        "weights": {n: (_shard_like(w, mine[n]) if n in mine else w) for n, w in weights.items()},
        "optimizer": {**optimizer, "state": per_param},
    })  # fmt: skip


def _cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu")
    if isinstance(value, dict):
        return {k: _cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_cpu(v) for v in value]
    return value
