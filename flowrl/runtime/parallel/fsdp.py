"""A policy sharded with FSDP2 (``OptimizerConfig.sharding="fsdp"``): sharding, state, the checks.

What ``shard_trainer_`` does to a ``flowrl.operators.trainer.Trainer`` on each of the policy's dp
ranks (all of them call it, in the same order):

- ``torch.distributed.fsdp.fully_shard`` on every transformer block (``blocks``: the built-in
  ``Transformer.layers``, a Hugging Face model's ``model.layers``), then on the root (embeddings,
  final norm, head; a tied head shares the embedding's shard), over the policy's 1-D dp mesh, with
  a ``MixedPrecisionPolicy(param_dtype, reduce_dtype)`` from the policy's optimizer config. Each
  parameter becomes a DTensor ``Shard(0)``: this rank holds rows ``torch.chunk(p, dp)[i]``, which is
  ``flowrl.placement.resharding.fsdp(ranks)``, the trainer layout the collective transport moves
  (``local_weights``) and the planner prices (ZeRO stage 3).
- AdamW is rebuilt over the sharded parameters, so its moments are sharded too.
- ``trainer.loss_scale`` is set per step (``token_scale``): FSDP2 averages gradients over the dp
  ranks, and each rank's loss is its token sum over its own token count ``N_r``; scaling it by
  ``dp * N_r / N`` makes the average the whole batch's gradient (token sum over ``N``).
- Gradient clipping is the trainer's own ``clip_grad_norm_``, which on DTensor gradients computes
  the global norm (one all-reduce).

Checkpoints are sharded (``flowrl.runtime.checkpointing.sharded_state``, torch.distributed.checkpoint): each rank
writes its own rows, nothing is gathered, and they load on any dp size, sharded (each rank reads
the chunks overlapping its rows) or replicated (consolidated in one process), and export as any
other. ``full_state`` gathers the one-file format (``Trainer.state()``) to the policy's lead rank
only (each rank sends its rows to it; the others never hold a whole tensor): the reference the
tests compare a sharded state with. ``load_full_state`` loads a one-file state (a replicated
policy's, or an FSDP one's from before sharded checkpoints): every rank reads it memory-mapped
(``mmap=True``) and copies only its rows.

Limits: the policy's mesh is 1-D (``dp``) here; a ``tp`` axis too is ``flowrl.runtime.parallel.tp_train``'s
(FSDP2 over ``dp`` of a tensor-parallel policy). Every dp rank must get at least one prompt group
per batch and the same number of micro-batches (``check_shards``).

Initialisation (``ShardedPolicy``): the model is built with its parameters on the meta device and
only this rank's rows are materialised, read from the weight files or drawn one parameter at a time
(``flowrl.runtime.parallel.fsdp_init``), bit for bit the shards of the whole model, with no broadcast; a LoRA
policy's adapters too (drawn as one process draws them, each rank keeping its rows).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from flowrl.backend_traits import backend_traits
from flowrl.errors import ConfigError, FlowrlError
from flowrl.graph.ir import Graph
from flowrl.graph.nodes import PolicyNode

__all__ = [
    "fsdp_policies",
    "check_backend",
    "check_ranks",
    "check_shards",
    "blocks",
    "shard_trainer_",
    "token_scale",
    "local_weights",
    "full_weights",
    "full_state",
    "load_full_state",
    "local_numel",
]


# -- the checks (before any work) -----------------------------------------------------------------
def fsdp_policies(graph: Graph, *, skip: Iterable[str] = ()) -> list[PolicyNode]:
    """The graph's policies with ``sharding="fsdp"`` (not those in ``skip``: user programs)."""
    skip = set(skip)
    return [n for n in graph.nodes_of(PolicyNode) if n.optimizer.sharding == "fsdp" and n.name not in skip]


def check_backend(graph: Graph, backend: str, *, skip: Iterable[str] = ()) -> None:
    """Refuse an FSDP policy on a backend other than torchrun.

    Raises:
        ConfigError: naming the policy and the two fixes.
    """
    if backend_traits(backend).shards:
        return
    for node in fsdp_policies(graph, skip=skip):
        raise ConfigError(
            f"policy {node.name!r} has sharding='fsdp', which shards it over torch.distributed ranks, but the "
            f"{backend!r} backend runs it in one process; launch under torchrun with --backend torchrun and "
            "give the policy its ranks (e.g. torchrun --nproc-per-node 3 -m flowrl run GRAPH --backend torchrun "
            "--plan place.json with {\"gen\": [0], \"policy\": [1, 2]}), or set sharding='replicate'"
        )


def check_ranks(graph: Graph, ranks: Mapping[str, tuple[int, ...]], axes: Mapping[str, Any], *, skip: Iterable[str] = ()) -> None:
    """Refuse an FSDP policy placed on no rank, or on a mesh with an axis other than dp and tp (a
    tensor-parallel policy: ``flowrl.runtime.backends.torchrun.tp_policy``). One rank is
    allowed: the policy runs whole there and checkpoints one file, which sharded ranks read their rows of,
    so that a sharded run resumes on fewer ranks and back with the same graph.

    Args:
        ranks: node -> its ranks (the plan's placement).
        axes: node -> (axis names, shape) of its mesh.

    Raises:
        ConfigError: naming the policy, its ranks and the fix.
    """
    for node in fsdp_policies(graph, skip=skip):
        rs = tuple(ranks.get(node.name, ()))
        if not rs:
            raise ConfigError(
                f"policy {node.name!r} has sharding='fsdp' but the plan gives it no rank; "
                "place the policy on one or more ranks (e.g. {\"policy\": [1, 2]})"
            )
        names, shape = axes.get(node.name, (("dp",), (len(rs),)))
        extra = {a: s for a, s in zip(names, shape) if a not in ("dp", "tp") and s > 1}  # tp: FSDP2 over dp of a tp policy (tp_train)
        if extra:
            raise ConfigError(
                f"policy {node.name!r} has sharding='fsdp' over its dp axis, but its mesh also has {extra}; "
                f"give the policy a mesh of dp={len(rs)} only"
            )


def check_shards(name: str, sizes: list[int], micro_batch_size: int) -> None:
    """Every dp rank must run the same passes (FSDP's all-gathers and reduce-scatters are collectives).

    Args:
        name: the policy.
        sizes: samples in each rank's shard of the batch.
        micro_batch_size: the optimizer's (0: the whole shard in one pass).

    Raises:
        ConfigError: a rank without samples, or ranks with different numbers of micro-batches.
    """
    if min(sizes) == 0:
        raise ConfigError(
            f"policy {name!r} (sharding='fsdp' over {len(sizes)} ranks): a batch split into whole prompt groups gave "
            f"shards of {sizes} samples; every rank needs at least one group: make the source's batch_size >= {len(sizes)}"
        )
    if micro_batch_size:
        passes = [-(-s // micro_batch_size) for s in sizes]
        if len(set(passes)) > 1:
            raise ConfigError(
                f"policy {name!r} (sharding='fsdp'): shards of {sizes} samples make {passes} micro-batches of "
                f"{micro_batch_size}; every rank must run as many: make batch_size a multiple of {len(sizes)}, "
                "or micro_batch_size=0"
            )


# -- sharding -----------------------------------------------------------------------------------------
def blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a ``flowrl.models`` model (built-in ``layers``; Hugging Face ``model.layers``).

    Raises:
        ConfigError: for a model without either.
    """
    for owner in (model, getattr(model, "model", None)):
        layers = getattr(owner, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers):
            return list(layers)
    raise ConfigError(f"{type(model).__name__} has no 'layers' or 'model.layers' list of blocks for FSDP to shard")


def shard_trainer_(trainer: Any, mesh: Any, *, source: Any = None, ignored: set[nn.Parameter] | None = None) -> None:
    """Shard ``trainer``'s model with FSDP2 over ``mesh`` (1-D) and rebuild its AdamW over the shards
    (see the module docstring). Every rank of ``mesh`` calls it; their models must start equal, or,
    with ``source`` (a ``flowrl.runtime.parallel.fsdp_init.RowSource``), be ``meta_build``'s model with its
    parameters on the meta device: each rank's shards are then allocated on ``trainer.device`` and
    filled with its rows from ``source`` (``fsdp_init.materialise_``). ``ignored``: parameters FSDP2
    leaves alone (an expert-parallel policy's experts, already DTensors over ``mesh``: ``expert_parallel``)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from flowrl.operators.generation import DTYPES
    from flowrl.operators.trainer import learning_rate
    from flowrl.runtime.parallel.fsdp_init import materialise_

    opt = trainer.node.optimizer
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[opt.param_dtype], reduce_dtype=DTYPES[opt.reduce_dtype])
    for block in blocks(trainer.model):
        fully_shard(block, mesh=mesh, mp_policy=policy, ignored_params=ignored)
    fully_shard(trainer.model, mesh=mesh, mp_policy=policy, ignored_params=ignored)
    if source is not None:
        materialise_(trainer.model, source, trainer.device)
    trainer.optimizer = torch.optim.AdamW(
        [p for p in trainer.model.parameters() if p.requires_grad], lr=learning_rate(opt, trainer.version), betas=opt.betas, weight_decay=opt.weight_decay
    )
    trainer._weights = local_weights(trainer.model)  # what Trainer.weights() gives: this rank's shards


def token_scale(dp: int, mine: float, total: float) -> float:
    """The factor on one rank's loss so that FSDP's gradient average is the whole batch's gradient:
    ``dp * N_r / N`` (token counts; both at least 1, as the trainer's normalizer).

    Example:
        >>> token_scale(2, 30, 40)
        1.5
    """
    return dp * max(mine, 1.0) / max(total, 1.0)


def _named(model: nn.Module) -> dict[str, Tensor]:
    """What the policy publishes, by name: every weight (``weight_dict``), or a LoRA policy's adapters
    (``adapter_weights``; its frozen base is sharded too, but never travels)."""
    from flowrl.models.causal_lm import weight_dict
    from flowrl.models.lora import adapter_weights

    adapters = adapter_weights(model)
    return adapters if adapters else weight_dict(model)


def local_weights(model: nn.Module) -> dict[str, Tensor]:
    """This rank's shard of every weight (``weight_dict`` names), views of the sharded parameters:
    ``fsdp(ranks)``'s local slices, what the collective transport publishes (no gather)."""
    return {n: t.to_local() if hasattr(t, "to_local") else t for n, t in _named(model).items()}


def full_weights(model: nn.Module) -> dict[str, Tensor]:
    """Every weight gathered (one all-gather per tensor; every rank calls it): for a transport that
    needs the whole state from one writer (``shm``, ``file``)."""
    return {n: t.full_tensor() if hasattr(t, "full_tensor") else t for n, t in _named(model).items()}


def _to_lead(t: Any) -> Tensor | None:
    """A ``Shard(0)`` DTensor gathered on the first rank of its mesh (a CPU tensor there, None on the
    others): each rank sends its rows, padded to ``torch.chunk``'s largest chunk, to the first one,
    which alone holds the whole tensor (an all-gather would put it on every rank)."""
    import torch.distributed as dist

    from torch.distributed.tensor import Shard

    mesh = t.device_mesh
    if tuple(t.placements) != (Shard(0),):
        raise FlowrlError(f"an FSDP2 parameter placed {t.placements}, not Shard(0) over a 1-D mesh; this is a flowrl bug")
    group, n = mesh.get_group(), mesh.size()
    local = t.to_local().detach()
    rows = torch.chunk(torch.empty(t.shape[0], device="meta"), n)
    sizes = [len(c) for c in rows] + [0] * (n - len(rows))  # torch.chunk may give fewer chunks than ranks
    biggest = max(sizes)
    padded = torch.zeros((biggest, *t.shape[1:]), dtype=local.dtype, device=local.device)
    padded[: local.shape[0]] = local
    lead = dist.get_global_rank(group, 0)
    if mesh.get_local_rank() == 0:
        pieces = [torch.empty_like(padded) for _ in range(n)]
        dist.gather(padded, gather_list=pieces, dst=lead, group=group)
        return torch.cat([p[:size] for p, size in zip(pieces, sizes)]).to("cpu", copy=True)
    dist.gather(padded, dst=lead, group=group)
    return None


def _gathered(value: Any, lead: bool) -> Any:
    """``value`` with every DTensor gathered to the mesh's first rank (collective: the same order on
    every rank); the first rank gets CPU copies of everything, the others None for each tensor."""
    if hasattr(value, "full_tensor"):
        return _to_lead(value)
    if isinstance(value, Tensor):
        return value.detach().to("cpu", copy=True) if lead else None
    if isinstance(value, dict):
        return {k: _gathered(v, lead) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_gathered(v, lead) for v in value)
    return value


def full_state(trainer: Any) -> dict[str, Any] | None:
    """``trainer.state()``'s format with every sharded tensor gathered (full, CPU): the same file a
    replicated policy writes. Every rank of the policy's mesh calls it; the mesh's first rank (the
    lead, which writes it) gets the state and alone holds the whole of it, the others get None."""
    import msgspec

    mesh = next(p.device_mesh for p in trainer.model.parameters() if hasattr(p, "device_mesh"))
    lead = mesh.get_local_rank() == 0
    model = _gathered(_named(trainer.model) if trainer.lora else dict(trainer.model.state_dict()), lead)  # LoRA: the adapters
    optimizer = _gathered(trainer.optimizer.state_dict(), lead)
    if not lead:
        return None
    return {"version": trainer.version, "model_config": msgspec.to_builtins(trainer.node.model), "model": model, "optimizer": optimizer}


def _shard_like(full: Any, like: Any) -> Any:
    """``full`` (a whole tensor) as a DTensor placed like ``like``, keeping only this rank's chunk (no communication)."""
    from torch.distributed.tensor import distribute_tensor

    if not hasattr(like, "device_mesh") or not isinstance(full, Tensor):
        return full
    return distribute_tensor(full.detach().to(like.device), like.device_mesh, like.placements, src_data_rank=None)


def load_full_state(trainer: Any, state: Mapping[str, Any]) -> None:
    """Load a one-file policy state (``full_state`` or any ``Trainer.state()``) into a sharded
    trainer: each rank keeps its chunks, then ``Trainer.load_state`` checks and loads them."""
    from flowrl.errors import CheckpointError

    model = state.get("model")
    optimizer = state.get("optimizer")
    if not isinstance(model, Mapping) or not isinstance(optimizer, Mapping):
        trainer.load_state(state)  # raises its own error naming what is missing
        return
    mine = _named(trainer.model) if trainer.lora else dict(trainer.model.state_dict())
    unknown = sorted(set(model) - set(mine))
    if unknown:
        raise CheckpointError(f"policy {trainer.name!r}: the checkpoint's model has tensors this model lacks: {unknown[:5]}")
    sharded_model = {k: _shard_like(v, mine.get(k)) for k, v in model.items()}
    if trainer.lora:  # Trainer.load_state copies a LoRA policy's adapters into its local views
        sharded_model = {k: v.to_local() if hasattr(v, "to_local") else v for k, v in sharded_model.items()}
    params = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    per_param = {}
    for index, entry in dict(optimizer.get("state", {})).items():
        like = params[int(index)] if int(index) < len(params) else None
        # "step" is cloned: AdamW increments it in place, and must not change the caller's state
        per_param[index] = {k: (v.clone() if k == "step" or like is None else _shard_like(v, like)) for k, v in entry.items()}
    sharded_optimizer = {**optimizer, "state": per_param}
    trainer.load_state({**state, "model": sharded_model, "optimizer": sharded_optimizer})


def local_numel(trainer: Any) -> dict[str, int]:
    """Elements this rank holds: ``params`` (its shards) and ``optimizer`` (AdamW's moments, local parts)."""
    def numel(t: Any) -> int:
        return int(t.to_local().numel()) if hasattr(t, "to_local") else int(t.numel())

    params = sum(numel(p) for p in {id(p): p for p in trainer.model.parameters()}.values())
    moments = sum(numel(v) for s in trainer.optimizer.state.values() for k, v in s.items() if k != "step" and isinstance(v, Tensor))
    return {"params": params, "optimizer": moments}
