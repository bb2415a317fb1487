"""Tensor parallelism of the built-in transformer: Megatron-style explicit sharding over a tp process group.

Which parameter is split how (``tp`` ranks, ``torch.chunk`` bounds, see ``flowrl.runtime.resharding``),
for an ``nn.Linear`` weight ``[out, in]``:

- ``attention.wq / wk / wv``: column-parallel (dim 0 split): each rank computes its own whole heads
  (q: ``n_heads / tp``, k and v: ``n_kv_heads / tp``); no communication.
- ``attention.wo``: row-parallel (dim 1 split): a partial sum over the rank's heads, then
  ``all_reduce(SUM)`` over the tp group.
- ``feed_forward.w1 / w3``: column-parallel: the rank's slice of the SwiGLU hidden units.
- ``feed_forward.w2``: row-parallel: a partial sum, then ``all_reduce(SUM)``.
- ``tok_embeddings``, the norms, ``output``: replicated.

So the residual stream ``x`` is replicated: every block's input is identical on every tp rank, and
its two all-reduces (two per layer, as in Megatron-LM) make its output identical again. Grouped-query
attention shards consistently because query head ``h`` reads kv head ``h // (n_heads / n_kv_heads)``
and both counts are split into ``tp`` equal runs of whole heads (hence: ``tp`` must divide both). The
KV cache holds only the local kv heads. The SwiGLU hidden width may split unevenly (``torch.chunk``
sizes; a rank may even hold none): w1, w3 rows and w2 columns use the same bounds.

Half precision: the partial sums are all-reduced in float32 and cast back (more accurate than a bf16
sum, and gloo's bfloat16 support varies between versions); a float32 model reduces in place.

Identical sampling on every tp rank: the logits come out of replicated computations on identical
inputs (the all-reduce hands every rank the same sum), so ranks that seed their sampling alike draw
the same tokens. ``TensorParallelGenerator`` (``flowrl.runtime.backends.rank_programs``) checks this
after each batch (a checksum of the rollout over the tp group) rather than trusting it.

API:

- :func:`tp_param_layouts` ``(config_or_model, ranks, *, dp=1)``: name -> ``ShardLayout`` for every
  name of the full model's ``state_dict()`` (the generator's ``weight_targets()`` names). With
  ``dp > 1``: ``dp`` replicas of a tp group, ranks in mesh order (tp innermost). A rank's local shard
  is ``full[local_slice(layout, full.shape, rank)]``, which is what ``CollectiveTransport`` delivers.
- :func:`shard_transformer_` ``(model, ranks, rank, group)``: turn a full ``Transformer`` into this
  rank's tensor-parallel model, in place; ``Generator.generate`` then runs unchanged.
- :func:`copy_local_shards_` ``(targets, full_state, ranks, rank, config)``: copy a rank's slices of a
  full state into its shard tensors.

Example (the layouts; tests run the model itself at tp=2 and tp=4 over gloo):
    >>> from flowrl.graph.configs import ModelConfig
    >>> from flowrl.runtime.resharding import local_shape
    >>> layouts = tp_param_layouts(ModelConfig(dim=64, n_heads=4, n_kv_heads=2, n_layers=1), (4, 5))
    >>> str(layouts["layers.0.attention.wk.weight"]), str(layouts["layers.0.attention.wo.weight"])
    ('[tp=2](S(0)) on ranks [4, 5]', '[tp=2](S(1)) on ranks [4, 5]')
    >>> local_shape(layouts["layers.0.attention.wk.weight"], (32, 64), 5)  # kv head 1 of 2 (head_dim 16)
    (16, 64)
"""

from __future__ import annotations

import math

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import msgspec
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flowrl.errors import ConfigError
from flowrl.graph.configs import ModelConfig
from flowrl.operators.model import KVCache, Transformer
from flowrl.runtime.resharding import ShardLayout, dp_tp, local_slice, replicated, tp_column, tp_row

__all__ = [
    "Split",
    "check_tp",
    "param_splits",
    "tp_param_layouts",
    "tp_rows",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TensorParallelTransformer",
    "shard_transformer_",
    "copy_local_shards_",
]

Split = Literal["column", "row", "replicated"]



def check_tp(config: ModelConfig, tp: int) -> None:
    """Refuse a tp size the model cannot be split into (whole heads per rank).

    Raises:
        ConfigError: naming ``n_heads`` / ``n_kv_heads`` and the tp size, when ``tp`` is not a positive
            integer dividing both.
    """
    if not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"tensor parallelism: tp={tp!r} must be an integer >= 1")
    bad = [f"{name}={getattr(config, name)}" for name in ("n_heads", "n_kv_heads") if getattr(config, name) % tp]
    if bad:
        raise ConfigError(
            f"tensor parallelism splits attention by whole heads: tp={tp} must divide {' and '.join(bad)} "
            f"(ModelConfig n_heads={config.n_heads}, n_kv_heads={config.n_kv_heads}); pick a tp size dividing "
            f"both, or change the model's head counts"
        )


def param_splits(config: ModelConfig) -> dict[str, Split]:
    """How each parameter of the full model splits: name (``state_dict()`` order) -> column / row / replicated."""
    out: dict[str, Split] = {"tok_embeddings.weight": "replicated"}
    for i in range(config.n_layers):
        p = f"layers.{i}."
        out[p + "attention_norm.weight"] = "replicated"
        out[p + "attention.wq.weight"] = "column"
        out[p + "attention.wk.weight"] = "column"
        out[p + "attention.wv.weight"] = "column"
        out[p + "attention.wo.weight"] = "row"
        out[p + "ffn_norm.weight"] = "replicated"
        out[p + "feed_forward.w1.weight"] = "column"
        out[p + "feed_forward.w2.weight"] = "row"
        out[p + "feed_forward.w3.weight"] = "column"
    out["norm.weight"] = "replicated"
    if not config.tie_embeddings:
        out["output.weight"] = "replicated"
    return out


def _config_of(config_or_model: ModelConfig | nn.Module) -> ModelConfig:
    config = getattr(config_or_model, "config", config_or_model)
    if not isinstance(config, ModelConfig):
        raise ConfigError(f"tp_param_layouts wants a ModelConfig or a Transformer, got {type(config_or_model).__name__}")
    return config


def tp_rows(ranks: Sequence[int], names: Sequence[str], shape: Sequence[int]) -> list[tuple[int, ...]]:
    """A generator's ranks as ``dp`` replicas of tp groups: ``ranks`` (mesh order) reshaped to the
    mesh ``shape`` with axis ``names``, the ``tp`` axis moved innermost; one row per replica.
    ``tp_param_layouts(config, [r for row in rows for r in row], dp=len(rows))`` is their layout.

    Raises:
        ConfigError: no ``tp`` axis, an axis other than ``dp``/``tp`` larger than 1, or a shape that
            does not hold ``len(ranks)`` ranks.
    """
    names, shape = list(names), [int(n) for n in shape]
    sizes = dict(zip(names, shape))
    other = {a: n for a, n in sizes.items() if a not in ("dp", "tp") and n > 1}
    if "tp" not in sizes or other or len(names) != len(shape) or math.prod(shape) != len(ranks):
        raise ConfigError(
            f"a tensor-parallel generator needs a mesh of dp and tp axes holding its {len(ranks)} ranks; got {sizes}"
            + (f" ({other} must be 1: re-plan with pp=1)" if other else "")
        )
    grid = torch.tensor([int(r) for r in ranks]).reshape(shape).movedim(names.index("tp"), -1).reshape(-1, sizes["tp"])
    return [tuple(int(r) for r in row) for row in grid.tolist()]


def tp_param_layouts(config_or_model: ModelConfig | nn.Module, ranks: Sequence[int], *, dp: int = 1) -> dict[str, ShardLayout]:
    """The layout of every parameter of the full model across the generator's ranks.

    Args:
        config_or_model: the model's config, or the (full or sharded) model itself.
        ranks: global ranks; with ``dp == 1`` the tp group in tp order, else ``dp * tp`` ranks in mesh
            order (``dp`` replicas of ``tp`` consecutive ranks).
        dp: number of tensor-parallel replicas.

    Returns:
        name -> layout, for every name of ``Transformer(config).state_dict()`` (= ``Generator.weight_targets()``).

    Raises:
        ConfigError: when ``len(ranks)`` is not a multiple of ``dp`` or the tp size does not divide the heads.
    """
    config = _config_of(config_or_model)
    ranks = tuple(ranks)
    if not isinstance(dp, int) or dp < 1 or len(ranks) % dp:
        raise ConfigError(f"tp_param_layouts: dp={dp!r} must be an integer >= 1 dividing len(ranks)={len(ranks)} ({list(ranks)})")
    tp = len(ranks) // dp
    check_tp(config, tp)
    if dp == 1:
        layouts: dict[str, ShardLayout] = {"column": tp_column(ranks), "row": tp_row(ranks), "replicated": replicated(ranks, axis="tp")}
    else:
        layouts = {
            "column": dp_tp(ranks, dp=dp, tp=tp, tp_dim=0),
            "row": dp_tp(ranks, dp=dp, tp=tp, tp_dim=1),
            "replicated": replicated(ranks, axis="dp"),
        }
    return {name: layouts[split] for name, split in param_splits(config).items()}


def _all_reduce_sum(x: Tensor, group: Any, comm_device: torch.device | None) -> Tensor:
    """Sum ``x`` over ``group`` (in float32 for half types, on ``comm_device`` if given); no-op without a group."""
    if group is None:
        return x
    import torch.distributed as dist

    wide = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    if comm_device is not None and wide.device != comm_device:
        wide = wide.to(comm_device)  # NCCL reduces CUDA tensors only; the generator's model may live on the CPU
    dist.all_reduce(wide, op=dist.ReduceOp.SUM, group=group)
    return wide.to(device=x.device, dtype=x.dtype)


class ColumnParallelLinear(nn.Module):
    """``y_local = x @ W[rows]^T``: this rank's slice of the output features; input replicated, no communication."""

    def __init__(self, weight: Tensor, *, requires_grad: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=requires_grad)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"local out={self.weight.shape[0]}, in={self.weight.shape[1]}"


class RowParallelLinear(nn.Module):
    """``y = all_reduce_sum(x_local @ W[:, cols]^T)``: input split over the tp ranks, output replicated."""

    def __init__(self, weight: Tensor, group: Any, *, requires_grad: bool = False, comm_device: torch.device | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=requires_grad)
        self.group = group
        self.comm_device = comm_device

    def forward(self, x: Tensor) -> Tensor:
        return _all_reduce_sum(F.linear(x, self.weight), self.group, self.comm_device)

    def extra_repr(self) -> str:
        return f"out={self.weight.shape[0]}, local in={self.weight.shape[1]}, all_reduce"


class TensorParallelTransformer(Transformer):
    """A ``Transformer`` after :func:`shard_transformer_`: same forward, sharded layers, local KV cache.

    Attributes:
        tp_ranks: the tp group's global ranks, in tp order.
        tp_rank: this rank's global rank.
        tp_index: its position in ``tp_ranks``.
    """

    tp_ranks: tuple[int, ...]
    tp_rank: int
    tp_index: int

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("build a TensorParallelTransformer with shard_transformer_(Transformer(config), ranks, rank, group)")

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty KV cache for the local heads only."""
        c, tp = self.config, len(self.tp_ranks)
        local = msgspec.structs.replace(c, n_heads=c.n_heads // tp, n_kv_heads=c.n_kv_heads // tp, dim=c.head_dim * (c.n_heads // tp))
        weight = self.tok_embeddings.weight
        return KVCache(local, batch, max_len, dtype=weight.dtype, device=weight.device)


@torch.no_grad()
def shard_transformer_(
    model: Transformer, ranks: Sequence[int], rank: int, group: Any, *, comm_device: torch.device | None = None
) -> TensorParallelTransformer:
    """Turn a full ``model`` into global rank ``rank``'s part of a tensor-parallel model, in place.

    Every parameter keeps its name; its data becomes ``full[local_slice(layout, full.shape, rank)]``
    for the layout :func:`tp_param_layouts` gives (a copy: the full tensors are freed). Attention
    modules keep only their local heads; ``wo`` and ``w2`` become :class:`RowParallelLinear` (all-reduce
    over ``group``), the column-parallel projections :class:`ColumnParallelLinear`. The model's class
    becomes :class:`TensorParallelTransformer`, whose ``new_cache`` allocates local kv heads only;
    ``forward`` is unchanged. ``requires_grad`` of each parameter is kept.

    Args:
        model: a full ``Transformer`` (any dtype).
        ranks: the tp group's global ranks, in tp order (every rank of the group passes the same).
        rank: this process's global rank (in ``ranks``).
        group: the tp process group (``None`` only when ``ranks`` has one rank).
        comm_device: where the all-reduces run when it is not where the model lives (a CUDA device
            for NCCL with a CPU model); None: on the model's device.

    Returns:
        ``model``, now a ``TensorParallelTransformer``.

    Raises:
        ConfigError: a tp size that does not divide the head counts, a rank not in ``ranks``, a model
            already sharded, or a missing group.
    """
    if isinstance(model, TensorParallelTransformer):
        raise ConfigError(f"the model is already tensor-parallel (tp ranks {list(model.tp_ranks)}); shard a full Transformer")
    if type(model) is not Transformer:
        raise ConfigError(f"shard_transformer_ shards the built-in Transformer, got {type(model).__name__}")
    ranks = tuple(ranks)
    if rank not in ranks:
        raise ConfigError(f"rank {rank} is not in the tp group {list(ranks)}; pass this process's global rank and its tp group's ranks")
    tp = len(ranks)
    if tp > 1 and group is None:
        raise ConfigError(f"tensor parallelism over {tp} ranks {list(ranks)} needs their process group (got group=None)")
    config = model.config
    layouts = tp_param_layouts(config, ranks)
    splits = param_splits(config)
    for i, block in enumerate(model.layers):
        p = f"layers.{i}."
        for owner, attr in ((block.attention, "wq"), (block.attention, "wk"), (block.attention, "wv"),
                            (block.attention, "wo"), (block.feed_forward, "w1"), (block.feed_forward, "w2"),
                            (block.feed_forward, "w3")):
            name = p + ("attention." if owner is block.attention else "feed_forward.") + attr + ".weight"
            full = getattr(owner, attr).weight
            shard = full.detach()[local_slice(layouts[name], full.shape, rank)].clone()
            if splits[name] == "row":
                setattr(owner, attr, RowParallelLinear(shard, group, requires_grad=full.requires_grad, comm_device=comm_device))
            else:
                setattr(owner, attr, ColumnParallelLinear(shard, requires_grad=full.requires_grad))
        block.attention.n_heads = config.n_heads // tp
        block.attention.n_kv_heads = config.n_kv_heads // tp
    model.__class__ = TensorParallelTransformer  # same forward; only new_cache differs (local kv heads)
    model.tp_ranks, model.tp_rank, model.tp_index = ranks, rank, ranks.index(rank)
    return model  # type: ignore[return-value]


@torch.no_grad()
def copy_local_shards_(
    targets: Mapping[str, Tensor], full_state: Mapping[str, Tensor], ranks: Sequence[int], rank: int, config: ModelConfig
) -> None:
    """Copy rank ``rank``'s slice of every tensor of ``full_state`` into ``targets`` (same names; cast to their dtype).

    Raises:
        ConfigError: for names that do not match or a shard whose shape differs from the slice.
    """
    layouts = tp_param_layouts(config, ranks)
    missing, unexpected = sorted(set(targets) - set(full_state)), sorted(set(full_state) - set(targets))
    if missing or unexpected:
        raise ConfigError(f"tensor-parallel shards and the full state disagree: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, target in targets.items():
        full = full_state[name]
        piece = full[local_slice(layouts[name], full.shape, rank)]
        if piece.shape != target.shape:
            raise ConfigError(f"shard {name!r} has shape {tuple(target.shape)}, its slice of {tuple(full.shape)} is {tuple(piece.shape)}")
        target.copy_(piece)
