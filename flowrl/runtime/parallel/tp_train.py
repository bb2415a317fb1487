"""Tensor parallelism of a policy (and of a frozen reference) under torchrun: DTensor plans, checks, the global norm.

What ``shard_tp_trainer_`` does to a ``flowrl.operators.trainer.Trainer`` on each rank of the policy's
mesh (every rank calls it, in the same order), after every rank built the same whole model:

- ``torch.distributed.tensor.parallel.parallelize_module`` over the mesh's ``tp`` axis with the plan
  ``tp_plan`` derives from the model family's split table (``flowrl.models.families``, the one the
  tensor-parallel generator reads through ``tensor_parallel.param_splits``): a column-split weight's
  ``nn.Linear`` becomes ``ColwiseParallel`` (weight and bias rows ``torch.chunk(p, tp)[i]``), a
  row-split one ``RowwiseParallel`` (weight columns; its bias replicated, added once after the
  all-reduce). Inputs and outputs of the plan's modules stay plain tensors, so the residual stream
  is replicated: embeddings, norms and the head are plain parameters every tp rank holds alike, and
  their gradients come out alike (the column-parallel inputs' gradients are all-reduced by DTensor).
  The built-in transformer's attention is told its local head counts (it reshapes by them); a
  Hugging Face attention reshapes by ``head_dim`` and needs nothing.
- With ``sharding="fsdp"`` and a ``dp`` axis > 1, FSDP2 (``fully_shard``) over ``dp`` then shards
  every block and the root, as ``flowrl.runtime.parallel.fsdp`` does on a 1-D mesh: each parameter
  becomes a DTensor over (dp, tp) (a plain one over dp), dim 0 chunked over dp inside its tp shard.
- A LoRA policy (``flowrl.models.lora``: peft's layers around the targets): a column target's base
  layer and its ``lora_B`` are column-parallel, ``lora_A`` whole; a row target's base layer and its
  ``lora_A`` row-parallel, ``lora_B`` whole (``tp_plan``); the adapters publish and checkpoint split
  so (``trainer_layouts``). LoRA dropout is refused (each tp rank would draw its own mask).
- A whole parameter beside the column-parallel projections (``head_local``: Qwen3's per-head q/k
  norms) sees only the rank's heads, so its gradient on each rank is a part: it is summed over tp
  before the clip.
- AdamW is rebuilt over the (sharded) parameters; ``trainer.clip_grad_norm`` becomes
  ``clip_grad_norm_``, the global norm over every shard counted once (one all-reduce over the
  policy's group), because torch's own refuses a mix of DTensors and plain tensors.
- ``trainer._weights`` becomes this rank's shards (``fsdp.local_weights``: what a collective weight
  edge publishes, laid out as ``trainer_layouts`` says).

Tensor parallelism splits attention by whole heads and the MLP by equal slices: ``check_tp_policy``
refuses, before any work, a ``tp`` that does not divide the heads, the kv heads or any split width
(``check_tp_meshes``: every policy and reference of a torchrun job's placement, on every rank).

Example (the plan of a one-layer built-in model):
    >>> from flowrl.graph.configs import ModelConfig
    >>> from flowrl.models.registry import meta_model
    >>> plan = tp_plan(meta_model(ModelConfig(dim=64, n_heads=4, n_kv_heads=2, n_layers=1)))
    >>> {k: type(v).__name__ for k, v in plan.items() if "attention" in k}
    {'layers.0.attention.wq': 'ColwiseParallel', 'layers.0.attention.wk': 'ColwiseParallel', 'layers.0.attention.wv': 'ColwiseParallel', 'layers.0.attention.wo': 'RowwiseParallel'}
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from flowrl.errors import ConfigError
from flowrl.graph.configs import HFModelConfig, ModelConfig
from flowrl.graph.nodes import PolicyNode
from flowrl.placement.resharding import Replicate, Shard, ShardLayout, dp_tp, replicated, tp_column, tp_row

if TYPE_CHECKING:
    from flowrl.models.family import Split

__all__ = ["mesh_sizes", "check_tp_policy", "check_tp_reference", "check_tp_critic", "check_tp_meshes", "tp_plan", "head_local", "shard_tp_model_", "shard_tp_trainer_", "clip_grad_norm_", "grad_squares", "trainer_layouts"]


def mesh_sizes(axes: tuple[Sequence[str], Sequence[int]] | None, ranks: int) -> dict[str, int]:
    """Axis name -> size of a node's mesh (``(names, shape)``; None: ``{"dp": ranks}``), every axis present."""
    names, shape = axes if axes else (("dp",), (ranks,))
    return {"dp": 1, "tp": 1, "pp": 1, **{str(a): int(s) for a, s in zip(names, shape)}}


def check_tp_policy(node: PolicyNode, sizes: Mapping[str, int]) -> None:
    """Refuse, before any work, a tensor-parallel policy this program cannot train as asked.

    Args:
        node: the policy.
        sizes: its mesh's axis sizes (``mesh_sizes``).

    Raises:
        ConfigError: naming the policy, the values and the fix, for a ``pp`` axis > 1, LoRA dropout,
            ``dp`` > 1 without ``sharding="fsdp"``, a model family without a split table, or a
            ``tp`` that does not divide the heads, the kv heads or a split weight's width.
    """
    from flowrl.models.lora import lora_of

    tp, dp, pp = sizes["tp"], sizes["dp"], sizes["pp"]
    where = f"policy {node.name!r} (mesh {dict(sizes)})"
    if pp > 1:
        raise ConfigError(f"{where}: a tensor-parallel policy has no pipeline stages; give it a mesh of dp and tp only (pp=1)")
    lora = lora_of(node.model)
    if lora is not None and lora.dropout > 0:
        raise ConfigError(
            f"{where}: LoRA dropout={lora.dropout} on a tensor-parallel policy would draw a different mask on each tp rank "
            "for the same (replicated) input; set LoraConfig(dropout=0.0), or give the policy a mesh of dp only"
        )
    if dp > 1 and node.optimizer.sharding != "fsdp":
        raise ConfigError(
            f"{where}: dp={dp} x tp={tp} needs sharding='fsdp' (FSDP2 over dp on the 2-D mesh); data-parallel replicas "
            "of a tensor-parallel group are not supported: set sharding='fsdp' on the policy, or give it a mesh of tp only"
        )
    _check_splits(where, node.model, tp)


def check_tp_reference(node: Any, sizes: Mapping[str, int]) -> None:
    """Refuse, before any work, a tensor-parallel reference (``tp_reference``) it cannot run as asked.

    Raises:
        ConfigError: naming the reference, the values and the fix, for an axis other than ``tp`` > 1,
            a syncing reference (``sync_steps`` > 0), or a ``tp`` the model cannot be split into.
    """
    where = f"reference {node.name!r} (mesh {dict(sizes)})"
    other = {a: n for a, n in sizes.items() if a != "tp" and n > 1}
    if other:
        raise ConfigError(f"{where}: a tensor-parallel reference splits its model over tp only; give it a mesh of tp={sizes['tp']} ({other} must be 1)")
    sync = getattr(getattr(node, "reference", None), "sync_steps", 0)
    if sync:
        raise ConfigError(
            f"{where}: a syncing reference (sync_steps={sync}) cannot be tensor-parallel (it mixes the policy's whole weights); "
            "give it one rank, or sync_steps=0"
        )
    _check_splits(where, node.model, sizes["tp"])


def check_tp_critic(node: Any, sizes: Mapping[str, int]) -> None:
    """Refuse, before any work, a tensor-parallel critic this program cannot train as asked.

    Raises:
        ConfigError: naming the critic, the values and the fix, for an axis other than ``tp`` > 1,
            a LoRA critic, or a ``tp`` the model cannot be split into (``tp_train``'s checks).
    """
    from flowrl.models.lora import lora_of

    where = f"critic {node.name!r} (mesh {dict(sizes)})"
    other = {a: n for a, n in sizes.items() if a != "tp" and n > 1}
    if other:
        raise ConfigError(f"{where}: a tensor-parallel critic splits its model over tp only; give it a mesh of tp={sizes['tp']} ({other} must be 1)")
    if lora_of(node.model) is not None:
        raise ConfigError(f"{where}: a LoRA critic is not split over tp; give it one rank, or a model without lora")
    _check_splits(where, node.model, sizes["tp"])


def _check_splits(where: str, model: Any, tp: int) -> None:
    """Refuse a model tp cannot split: its family has no split table, tp does not divide the heads,
    the kv heads or a split weight's width (``where`` names the node and its mesh)."""
    from flowrl.models.registry import weight_shapes
    from flowrl.runtime.parallel.tensor_parallel import check_tp, param_splits

    if not isinstance(model, (ModelConfig, HFModelConfig)):
        raise ConfigError(f"{where}: tensor parallelism splits a ModelConfig or an HFModelConfig, got {type(model).__name__}")
    try:
        check_tp(model, tp)
        splits = param_splits(model)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    shapes = weight_shapes(model)
    bad = {}
    for name, split in splits.items():
        dim = {"column": 0, "row": 1}.get(split)
        if dim is not None and shapes[name][0][dim] % tp:
            bad[name] = shapes[name][0][dim]
    if bad:
        width = "ffn_dim" if isinstance(model, ModelConfig) else "intermediate_size"
        shown = ", ".join(f"{n} splits {w}" for n, w in list(bad.items())[:3])
        raise ConfigError(
            f"{where}: tp={tp} must divide every split width ({shown}); pick a tp dividing them, or a model whose "
            f"{width} (the MLP width) and head sizes are multiples of {tp}"
        )


def check_tp_meshes(graph: Any, axes: Mapping[str, tuple[Sequence[str], Sequence[int]]], *, skip: Iterable[str] = ()) -> None:
    """``check_tp_policy`` / ``check_tp_reference`` / ``check_tp_critic`` for every policy, reference and critic of ``graph`` whose mesh
    (``axes``: node -> (names, shape)) has a ``tp`` axis > 1, but those in ``skip`` (user programs):
    the torchrun backend's check on every rank before any work.

    Raises:
        ConfigError: as ``check_tp_policy``, ``check_tp_reference`` and ``check_tp_critic``.
    """
    skip = set(skip)
    for node in graph.nodes:
        names, shape = axes.get(node.name, ((), ()))
        sizes = mesh_sizes((names, shape), 1)
        if node.name in skip or sizes["tp"] < 2:
            continue
        if node.kind == "policy":
            check_tp_policy(node, sizes)
        elif node.kind == "reference":
            check_tp_reference(node, sizes)
        elif node.kind == "critic":
            check_tp_critic(node, sizes)


def _owners(splits: Mapping[str, str]) -> dict[str, str]:
    """Module name -> split of every ``nn.Linear`` whose weight ``splits`` splits (column or row)."""
    return {n.removesuffix(".weight"): s for n, s in splits.items() if s != "replicated" and n.endswith(".weight")}


def tp_plan(model: nn.Module, splits: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Module name -> ``ColwiseParallel`` / ``RowwiseParallel`` for every ``nn.Linear`` whose weight the
    model family's split table splits (``splits``: ``tensor_parallel.param_splits`` of the model's
    config, the base model's names; default: of ``model``); the rest stays as it is.

    A target that peft wrapped with a LoRA adapter (``base_layer``, ``lora_A``, ``lora_B``): its base
    layer takes the style; a column-parallel one's ``lora_B`` is column-parallel too (``A``, fed the
    replicated input, stays whole, its gradient all-reduced by DTensor), a row-parallel one's
    ``lora_A`` row-parallel (its input is the rank's slice; ``B`` gets the all-reduced sum, whole).

    Raises:
        ConfigError: a family without a split table, or a split weight that is not an ``nn.Linear``'s.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from flowrl.runtime.parallel.tensor_parallel import param_splits

    modules = dict(model.named_modules())
    plan: dict[str, Any] = {}
    for owner, split in _owners(param_splits(model) if splits is None else splits).items():
        style = ColwiseParallel if split == "column" else RowwiseParallel
        module = modules.get(owner)
        base_layer = getattr(module, "base_layer", None)  # peft's LoRA layer wraps the nn.Linear
        lora = base_layer is not None and hasattr(module, "lora_A")
        base = base_layer if lora else module
        if type(base) is not nn.Linear:
            raise ConfigError(f"{owner}.weight splits {split}-parallel but {owner} is a {type(module).__name__}, not an nn.Linear")
        plan[f"{owner}.base_layer" if lora else owner] = style()
        if lora:
            side = "lora_B" if split == "column" else "lora_A"
            for key in getattr(module, side):
                plan[f"{owner}.{side}.{key}"] = style()
    return plan


def head_local(model: nn.Module, splits: Mapping[str, str] | None = None) -> list[str]:
    """Names of the parameters tensor parallelism leaves whole but that see only this rank's heads or
    hidden units: those of a module beside a column-parallel projection (the same parent, neither a
    split projection nor inside one), e.g. Qwen3's per-head ``self_attn.q_norm`` / ``k_norm``. Every tp
    rank holds them whole, but each computes their gradient from its own heads only: the sum over tp
    is the gradient. ``splits`` as ``tp_plan``'s.

    Example:
        >>> from flowrl.graph.configs import ModelConfig
        >>> from flowrl.models.registry import meta_model
        >>> head_local(meta_model(ModelConfig(dim=64, n_heads=4, n_kv_heads=2, n_layers=1)))  # nothing beside the built-in projections
        []
    """
    from flowrl.runtime.parallel.tensor_parallel import param_splits

    owners = _owners(param_splits(model) if splits is None else splits)
    parents = {o.rpartition(".")[0] for o, split in owners.items() if split == "column"}
    out: list[str] = []
    for name, module in model.named_modules():
        parent = name.rpartition(".")[0]
        if not name or parent not in parents or name in owners:
            continue
        out.extend(f"{name}.{k}" for k, p in module.named_parameters() if p is not None)
    return out


def _local_heads(model: nn.Module, tp: int) -> None:
    """The built-in transformer's attention reshapes by its head counts: make them the local ones."""
    from flowrl.models.families.builtin.model import Block, Transformer

    if isinstance(model, Transformer):
        for block in model.layers:
            assert isinstance(block, Block)  # the built-in Transformer's layers
            block.attention.n_heads //= tp
            block.attention.n_kv_heads //= tp


def shard_tp_model_(model: nn.Module, tp_mesh: Any, config: ModelConfig | HFModelConfig) -> set[str]:
    """Split ``model`` (``config``'s, LoRA adapters included) over the 1-D ``tp_mesh`` in place
    (``parallelize_module`` with ``tp_plan``; the built-in attention told its local heads); returns
    ``head_local``'s names. Every rank of the mesh calls it with equal whole models."""
    from torch.distributed.tensor.parallel import parallelize_module

    from flowrl.runtime.parallel.tensor_parallel import param_splits

    splits = param_splits(config)  # the base model's names (a LoRA policy's targets are wrapped)
    plan = tp_plan(model, splits)
    partial = set(head_local(model, splits))
    parallelize_module(model, tp_mesh, plan)
    _local_heads(model, tp_mesh.size())
    return partial


def shard_tp_trainer_(trainer: Any, mesh: Any, *, group: Any, fsdp: bool) -> None:
    """Shard ``trainer``'s model over ``mesh`` (axes ``tp`` and optionally ``dp``; see the module
    docstring). Every rank of ``mesh`` calls it with equal whole models (``group``: every rank of the
    policy, for the gradient norm); ``fsdp``: FSDP2 over ``dp`` too (``dp`` > 1)."""
    from flowrl.operators.trainer import learning_rate
    from flowrl.runtime.parallel.fsdp import local_weights

    names = tuple(mesh.mesh_dim_names or ())
    tp_mesh = mesh["tp"] if len(names) > 1 else mesh
    partial = shard_tp_model_(trainer.model, tp_mesh, trainer.node.model)
    if fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from flowrl.operators.generation import DTYPES
        from flowrl.runtime.parallel.fsdp import blocks

        opt = trainer.node.optimizer
        policy = MixedPrecisionPolicy(param_dtype=DTYPES[opt.param_dtype], reduce_dtype=DTYPES[opt.reduce_dtype])
        for block in blocks(trainer.model):
            fully_shard(block, mesh=mesh["dp"], mp_policy=policy)
        fully_shard(trainer.model, mesh=mesh["dp"], mp_policy=policy)
    opt = trainer.node.optimizer
    trainer.optimizer = torch.optim.AdamW(
        [p for p in trainer.model.parameters() if p.requires_grad], lr=learning_rate(opt, trainer.version), betas=opt.betas, weight_decay=opt.weight_decay
    )
    summed = [p for n, p in trainer.model.named_parameters() if n in partial]
    tp_group = tp_mesh.get_group()
    trainer.clip_grad_norm = lambda params, max_norm: clip_grad_norm_(params, max_norm, group=group, partial=summed, tp_group=tp_group)
    trainer._weights = local_weights(trainer.model)  # what Trainer.weights() gives: this rank's shards


@torch.no_grad()
def clip_grad_norm_(params: Iterable[Tensor], max_norm: float, *, group: Any, partial: Sequence[Tensor] = (), tp_group: Any = None) -> Tensor:
    """Clip the gradients of ``params`` (DTensors over any sub-mesh of ``group``'s ranks, and plain
    tensors every rank holds alike) by their global norm, as ``torch.nn.utils.clip_grad_norm_`` does
    for one process; returns the norm before clipping. First the gradients of ``partial`` (``head_local``:
    each tp rank's is its heads' part) are summed over ``tp_group``. Each rank adds its local squares
    weighted by the share of the ranks holding the same piece (a piece of a DTensor is held by ``world
    / (product of its sharded axes)`` ranks, a plain tensor by all), then one all-reduce over ``group``."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    for p in partial:  # every tp rank holds these whole; each has its heads' part of the gradient
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        dist.all_reduce(local, group=tp_group)
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    world = dist.get_world_size(group)
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    locals_ = []
    for g in grads:
        if isinstance(g, DTensor):
            if any(p.is_partial() for p in g.placements):
                raise ConfigError(f"a gradient placed {g.placements} is a partial sum; this is a flowrl bug")
            pieces = math.prod(g.device_mesh.size(i) for i, p in enumerate(g.placements) if not p.is_replicate())  # Shard, FSDP2's _StridedShard
            local = g.to_local()
        else:
            pieces, local = 1, g
        total += grad_squares(local) * (pieces / world)
        locals_.append(local)
    dist.all_reduce(total, group=group)
    norm = total.sqrt().float()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for local in locals_:
        local.mul_(coef.to(local.device, local.dtype))
    return norm


def grad_squares(grad: Tensor) -> Tensor:
    """``grad``'s sum of squares (float64): its norm in its own precision (float32 at least, as
    ``torch.nn.utils.clip_grad_norm_`` takes it), squared in float64. One vectorised pass: squaring a
    float64 copy of every gradient cost ~14 ms per million elements on this CPU, 0.2-0.4 s a step for a
    4-layer Qwen2.5-0.5B-shaped rank (benches/RESULTS.md)."""
    x = grad if grad.dtype == torch.float64 else grad.float()
    return torch.linalg.vector_norm(x).double().square()


def trainer_layouts(model: ModelConfig | HFModelConfig, ranks: Sequence[int], *, dp: int, tp: int, fsdp: bool) -> dict[str, ShardLayout]:
    """Name -> layout of every weight a tensor-parallel policy's rank publishes on a collective edge
    (``fsdp.local_weights`` of its model), over its ``ranks`` in mesh order (tp innermost).

    Example:
        >>> lay = trainer_layouts(ModelConfig(dim=64, n_heads=4, n_kv_heads=2, n_layers=1), (0, 1, 2, 3), dp=2, tp=2, fsdp=True)
        >>> str(lay["layers.0.attention.wq.weight"]), str(lay["norm.weight"])
        ('[dp=2,tp=2](S(0),S(0)) on ranks [0, 1, 2, 3] order=[1, 0]', '[dp=2,tp=2](S(0),R) on ranks [0, 1, 2, 3]')

    Raises:
        ConfigError: as ``tensor_parallel.param_splits``, or ``dp * tp != len(ranks)``.
    """
    from flowrl.models.lora import adapter_shapes, lora_of
    from flowrl.runtime.parallel.tensor_parallel import param_splits

    ranks = tuple(ranks)
    if dp * tp != len(ranks):
        raise ConfigError(f"trainer_layouts: dp={dp} x tp={tp} != {len(ranks)} ranks {list(ranks)}")
    if dp == 1:
        kinds = {"column": tp_column(ranks), "row": tp_row(ranks), "replicated": replicated(ranks, axis="tp")}
    elif fsdp:  # FSDP2 chunks dim 0 over dp inside each tp shard; a replicated weight's dim 0 over dp, alike on every tp rank
        kinds = {
            "column": dp_tp(ranks, dp=dp, tp=tp, tp_dim=0, fsdp=True),
            "row": dp_tp(ranks, dp=dp, tp=tp, tp_dim=1, fsdp=True),
            "replicated": ShardLayout(ranks=ranks, mesh_shape=(dp, tp), placements=(Shard(dim=0), Replicate()), axis_names=("dp", "tp")),
        }
    else:
        raise ConfigError(f"trainer_layouts: dp={dp} x tp={tp} without FSDP is not a layout a policy trains in (check_tp_policy refuses it)")
    splits = param_splits(model)
    if lora_of(model) is not None:  # the adapters travel (``<module>.lora_A.weight``): split as ``tp_plan`` splits them
        adapters: dict[str, Split] = {}
        for name in adapter_shapes(model):
            module, side, _ = name.rsplit(".", 2)
            target = splits.get(f"{module}.weight", "replicated")
            by_side: dict[tuple[str, str], Split] = {("column", "lora_B"): "column", ("row", "lora_A"): "row"}
            adapters[name] = by_side.get((target, side), "replicated")
        splits = adapters
    return {name: kinds[split] for name, split in splits.items()}
