"""Expert parallelism: each rank of a policy's ``dp`` mesh holds a slice of every MoE block's experts, and tokens travel to them.

A policy with ``ep`` > 1 on its mesh (``flowrl.placement.layout.NodeMesh.ep``) under torchrun, with
``sharding="fsdp"`` (``rank_programs.ShardedPolicy``), is sharded as FSDP2 shards it
(``flowrl.runtime.parallel.fsdp``) except for its routed experts: in each MoE block the stacked expert
tensors (``ModelFamily.stacked``: ``mlp.experts.gate_up_proj`` ``[E, 2f, h]`` and ``down_proj``
``[E, h, f]``) become DTensors ``Shard(0)`` over the same ``dp`` mesh, which FSDP2 leaves alone
(``ignored_params``), and the block's ``experts`` module is replaced by ``ExpertShard``, whose forward
never gathers them: rank ``p`` holds experts ``[p E/ep, (p+1) E/ep)`` and computes them for every
token of the group that chose them. Per block and forward:

1. the ``T * k`` (token, expert) choices of this rank are sorted by expert (stable), so that the rows
   for each rank's experts are contiguous; the per-expert counts go to every rank (``all_to_all_single``
   of ``E`` integers, equal splits);
2. the chosen tokens' hidden states go to the ranks holding their experts (an all-to-all with uneven
   splits through autograd: ``torch.distributed._functional_collectives.all_to_all_single_autograd``,
   which works over gloo and NCCL);
3. each rank runs its experts (SwiGLU: ``act(x W_gate) * (x W_up)``, then ``W_down``) over the rows it
   received, grouped by expert;
4. the outputs go back (the inverse all-to-all) and each is scaled by its token's gate weight and
   summed into the token's row, as transformers' ``Qwen3MoeExperts`` sums them.

The routing is the block's router's (``experts`` receives the top-k indices and weights), so routing
replay (``flowrl.models.routing.RoutingReplay``, which replaces the router's output) decides the
dispatch too. An index equal to ``E`` (transformers' "no expert") adds nothing.

Gradients: each rank's loss is scaled by ``dp * N_r / N`` (``fsdp.token_scale``) so that FSDP2's
average over the dp ranks is the mini-batch's gradient; an expert's gradient already sums every
rank's tokens (the all-to-all's backward), so ``ExpertShard`` divides it by ``dp`` in the backward
pass instead of averaging it. Since ``ep`` equals ``dp`` (each rank one slice, no replicas of an expert
group), an expert tensor's shard is the rows FSDP2 would give the rank (``torch.chunk``: ``ep``
divides ``E``): checkpoints (``checkpointing.sharded_state``), the one-file state, the weights a
collective edge moves (``resharding.fsdp(ranks)``) and ``flowrl export`` are those of an FSDP2 policy
on the same ranks, so a checkpoint written at ``ep`` = 2 resumes at ``ep`` = 1 (FSDP2 alone, or one
process) and back, by torch.distributed.checkpoint's resharding. ``ep`` smaller than ``dp`` (replicas
of an expert group) is refused by name (``check_expert_mesh``): not built.

Example:
    >>> check_expert_mesh("policy", dp=4, ep=2, experts=8)
    Traceback (most recent call last):
    ...
    flowrl.errors.ConfigError: policy 'policy' has ep=2 beside dp=4 on its mesh: expert parallelism runs with ep equal to the policy's dp ranks (each rank holds 1/ep of the experts; replicas of an expert group are not built); give it the mesh {"dp": 4, "ep": 4} if ep=4 divides its 8 experts, or a mesh without ep
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from flowrl.errors import ConfigError

__all__ = ["check_expert_mesh", "expert_modules", "ExpertShard", "shard_experts_", "expert_parameters"]


def check_expert_mesh(node: str, *, dp: int, ep: int, experts: int) -> None:
    """Refuse an ``ep`` this module does not run: not equal to ``dp``, or not dividing the ``experts``.

    Raises:
        ConfigError: naming the node, its dp, ep and experts, and the fix.
    """
    if ep != dp:
        raise ConfigError(
            f"policy {node!r} has ep={ep} beside dp={dp} on its mesh: expert parallelism runs with ep equal to the policy's dp ranks "
            f"(each rank holds 1/ep of the experts; replicas of an expert group are not built); give it the mesh "
            f"{{\"dp\": {dp}, \"ep\": {dp}}} if ep={dp} divides its {experts} experts, or a mesh without ep"
        )
    if experts % ep:
        raise ConfigError(f"policy {node!r} has ep={ep} on its mesh, which does not divide its {experts} experts; pick an ep dividing {experts}, or a mesh without ep")


def expert_modules(model: nn.Module, stacked: tuple[tuple[str, tuple[str, ...]], ...]) -> dict[str, nn.Module]:
    """The modules holding a block's stacked experts, by dotted name, in model order: the owners of the
    parameters ``stacked`` (``ModelFamily.stacked``) matches, group 1 of its pattern; ``{}`` for a dense family.

    Example:
        >>> expert_modules(nn.Linear(2, 2), ())
        {}
    """
    names: dict[str, None] = {}
    for name, _ in model.named_parameters():
        for pattern, _parts in stacked:
            match = re.fullmatch(pattern, name)
            if match:
                names[match.group(1)] = None
    return {n: model.get_submodule(n) for n in names}


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by ``scale`` (an expert shard's ``1/dp``)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.scale, None


def _all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> Tensor:
    """``x``'s rows exchanged among ``group`` (``in_splits`` rows to each rank, ``out_splits`` from each), through
    autograd (its backward the inverse exchange): torch's functional collective, uneven splits over gloo and NCCL."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, group))


def _local(p: Tensor) -> Tensor:
    """This rank's part of ``p`` (a DTensor's local tensor, through autograd), or ``p``."""
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p


class ExpertShard(nn.Module):
    """One MoE block's routed experts, ``1/ep`` of them on this rank, tokens exchanged by all-to-all (module docstring).

    Attributes:
        gate_up_proj: ``[E, 2f, h]`` DTensor ``Shard(0)`` over the ep group (this rank's ``E/ep`` experts locally).
        down_proj: ``[E, h, f]``, the same.
        num_experts: ``E``.
    """

    gate_up_proj: nn.Parameter
    down_proj: nn.Parameter
    act_fn: Callable[[Tensor], Tensor]

    def __init__(self, experts: nn.Module, *, group: Any, ep: int, index: int) -> None:
        super().__init__()
        self.gate_up_proj = experts.gate_up_proj  # type: ignore[assignment]  # nn.Module.__getattr__ is typed Tensor | Module
        self.down_proj = experts.down_proj  # type: ignore[assignment]  # the same
        self.act_fn = experts.act_fn  # type: ignore[assignment]  # the same: transformers' activation module
        self.num_experts = int(getattr(experts, "num_experts"))
        self.group, self.ep, self.index = group, ep, index

    def forward(self, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        experts, ep = self.num_experts, self.ep
        per_rank = experts // ep
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        chosen = order[flat[order] < experts]  # "no expert" (E) adds nothing
        token = chosen // k
        counts = torch.bincount(flat[chosen], minlength=experts)  # rows for each expert, this rank's tokens
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)  # from each rank: its rows for each of my experts
        received = received.view(ep, per_rank)
        send = counts.view(ep, per_rank).sum(1).tolist()
        recv = received.sum(1).tolist()
        rows = _all_to_all(hidden[token], recv, send, self.group)
        # rows arrive by source rank, each source's sorted by expert: group them by local expert (stable)
        local = torch.repeat_interleave(torch.arange(per_rank, device=rows.device).repeat(ep), received.reshape(-1))
        regroup = torch.argsort(local, stable=True)
        scale = 1.0 / ep  # ep == dp: module docstring, gradients
        gate_up = _ScaleGrad.apply(_local(self.gate_up_proj), scale)
        down = _ScaleGrad.apply(_local(self.down_proj), scale)
        grouped = rows[regroup]
        outs = []
        start = 0
        for e, n in enumerate(received.sum(0).tolist()):
            part = grouped[start : start + n]
            start += n
            gate, up = nn.functional.linear(part, gate_up[e].to(part.dtype)).chunk(2, dim=-1)
            outs.append(nn.functional.linear(self.act_fn(gate) * up, down[e].to(part.dtype)))
        done = torch.cat(outs) if outs else rows[:0]
        back = torch.empty_like(done)
        back = back.index_copy(0, regroup, done)  # the arrival order again
        mine = _all_to_all(back, send, recv, self.group)
        weights = top_k_weights.reshape(-1)[chosen]
        out = torch.zeros_like(hidden)
        return out.index_add(0, token, (mine * weights[:, None]).to(out.dtype))


def expert_parameters(model: nn.Module, stacked: tuple[tuple[str, tuple[str, ...]], ...]) -> list[nn.Parameter]:
    """The stacked expert parameters of ``model`` (what ``shard_experts_`` splits)."""
    out = []
    for name, p in model.named_parameters():
        if any(re.fullmatch(pattern, name) for pattern, _ in stacked):
            out.append(p)
    return out


def shard_experts_(model: nn.Module, mesh: Any, stacked: tuple[tuple[str, tuple[str, ...]], ...]) -> set[nn.Parameter]:
    """Split ``model``'s stacked experts over ``mesh`` (1-D, the policy's dp = ep ranks) and swap each
    experts module for an ``ExpertShard``; the new parameters, for ``fully_shard(ignored_params=...)``.

    The model may be on the meta device (``fsdp_init.meta_build``: ``fsdp_init.materialise_`` fills each
    rank's rows afterwards) or whole and equal on every rank (each keeps its rows). Every rank of
    ``mesh`` calls it.

    Raises:
        ConfigError: for a model without stacked experts, or an ``ep`` not dividing them.
    """
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    found = expert_modules(model, stacked)
    if not found:
        raise ConfigError(f"expert parallelism needs a mixture of experts with stacked experts; {type(model).__name__} has none")
    ep, index = mesh.size(), mesh.get_local_rank()
    group = mesh.get_group()
    params: set[nn.Parameter] = set()
    for name, module in found.items():
        experts = int(getattr(module, "num_experts"))
        if experts % ep:
            raise ConfigError(f"{name}: ep={ep} does not divide its {experts} experts; pick an ep dividing {experts}")
        for attr in ("gate_up_proj", "down_proj"):
            p = getattr(module, attr)
            if p.is_meta:
                local = torch.empty((experts // ep, *p.shape[1:]), dtype=p.dtype, device="meta")
                d = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride())
            else:
                d = distribute_tensor(p.detach(), mesh, [Shard(0)], src_data_rank=None)
            new = nn.Parameter(d, requires_grad=p.requires_grad)
            setattr(module, attr, new)
            params.add(new)
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, ExpertShard(module, group=group, ep=ep, index=index))
    return params
