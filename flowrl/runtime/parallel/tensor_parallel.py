"""Tensor parallelism of the built-in transformer and of Hugging Face Llama-family models: Megatron-style
explicit sharding over a tp process group.

Which weight splits how is its family's ``ModelFamily.split_table`` (``flowrl.models.families``: the
built-in one in ``builtin/__init__.py``, the Llama block's in ``llama.py``), over ``tp`` ranks with
``torch.chunk`` bounds (``flowrl.placement.resharding``), for an ``nn.Linear`` weight ``[out, in]``:

- the q / k / v projections (``attention.wq / wk / wv``, ``self_attn.{q,k,v}_proj`` weight and bias):
  column-parallel (dim 0 split): each rank computes its own whole heads (q: ``n_heads / tp``, k and
  v: ``n_kv_heads / tp``); no communication.
- the output projection (``attention.wo``, ``self_attn.o_proj``): row-parallel (dim 1 split): a
  partial sum over the rank's heads, then ``all_reduce(SUM)`` over the tp group.
- the SwiGLU gate and up projections (``feed_forward.w1 / w3``, ``mlp.{gate,up}_proj``): column-parallel,
  the rank's slice of the hidden units; the down projection (``feed_forward.w2``, ``mlp.down_proj``):
  row-parallel, a partial sum, then ``all_reduce(SUM)``.
- everything else (embeddings, norms, the output head, qwen3's per-head ``q_norm`` / ``k_norm``, a
  row-parallel layer's bias): replicated. A row-parallel layer adds its bias after the all-reduce,
  so once, not ``tp`` times.

For a Hugging Face model, transformers' attention reshapes q/k/v with ``view(..., -1, head_dim)`` and
repeats kv heads by the ratio ``num_key_value_groups``, so a rank's whole local heads need no change
to the attention module, and the ``DynamicCache`` grows with whatever head count it is handed (the
local one).

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
the same tokens. ``ParallelGenerator`` (``flowrl.runtime.backends.torchrun.rank_programs``) checks this
after each batch (a checksum of the rollout over the tp group) rather than trusting it.

API:

- :func:`tp_param_layouts` ``(config_or_model, ranks, *, dp=1)``: name -> ``ShardLayout`` for every
  name of the full model's ``weight_dict`` (the generator's ``weight_targets()`` names), for a
  ``ModelConfig`` / ``Transformer`` or an ``HFModelConfig`` / ``HFCausalLM``. With
  ``dp > 1``: ``dp`` replicas of a tp group, ranks in mesh order (tp innermost). A rank's local shard
  is ``full[local_slice(layout, full.shape, rank)]``, which is what ``CollectiveTransport`` delivers.
- :func:`shard_transformer_` ``(model, ranks, rank, group)``: turn a full ``Transformer`` into this
  rank's tensor-parallel model, in place; ``Generator.generate`` then runs unchanged.
- :func:`shard_hf_` ``(model, ranks, rank, group)``: the same for an ``HFCausalLM`` of a Llama family
  (it stays an ``HFCausalLM``); :func:`shard_model_` picks one of the two by the model's type.
- :func:`copy_local_shards_` ``(targets, full_state, ranks, rank, config)``: copy a rank's slices of a
  full state into its shard tensors.

Example (the layouts; tests run the model itself at tp=2 and tp=4 over gloo):
    >>> from flowrl.graph.configs import ModelConfig
    >>> from flowrl.placement.resharding import local_shape
    >>> layouts = tp_param_layouts(ModelConfig(dim=64, n_heads=4, n_kv_heads=2, n_layers=1), (4, 5))
    >>> str(layouts["layers.0.attention.wk.weight"]), str(layouts["layers.0.attention.wo.weight"])
    ('[tp=2](S(0)) on ranks [4, 5]', '[tp=2](S(1)) on ranks [4, 5]')
    >>> local_shape(layouts["layers.0.attention.wk.weight"], (32, 64), 5)  # kv head 1 of 2 (head_dim 16)
    (16, 64)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from collections.abc import Callable
from typing import Any, cast

import msgspec
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flowrl.errors import ConfigError
from flowrl.graph.configs import HFModelConfig, ModelConfig
from flowrl.models.causal_lm import weight_dict
from flowrl.models.families import FAMILIES
from flowrl.models.families.builtin.model import Block, KVCache, Transformer
from flowrl.models.family import Split
from flowrl.models.hf import HFCausalLM
from flowrl.models.registry import weight_shapes
from flowrl.placement.resharding import ShardLayout, dp_tp, local_slice, replicated, tp_column, tp_row

__all__ = [
    "check_tp",
    "param_splits",
    "tp_param_layouts",
    "tp_rows",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TensorParallelTransformer",
    "shard_transformer_",
    "TensorParallelHFCausalLM",
    "shard_hf_",
    "shard_model_",
    "copy_local_shards_",
]


class _Shape(msgspec.Struct, frozen=True):
    """What sharding needs to know of a model: its family, each weight's split, its head counts."""

    family: str
    splits: dict[str, Split]  # weight_dict order
    heads: dict[str, int]  # the two head counts, as the family's config names them (for errors)


def _splits(family: str, names: list[str]) -> dict[str, Split]:
    """Name -> split by ``family``'s split table."""
    if family not in FAMILIES or not FAMILIES[family].split_table:
        have = sorted(n for n, f in FAMILIES.items() if f.split_table)
        raise ConfigError(f"tensor parallelism splits the model families {have}; got {family!r}")
    return {n: FAMILIES[family].split_of(n) for n in names}


def _hf_shape(family: str, names: list[str], config: Mapping[str, Any] | Any) -> _Shape:
    """``config``: the ``config.json`` dict or the transformers config object; no ``names``: no splits."""
    get: Callable[..., Any] = config.get if isinstance(config, Mapping) else lambda key, default=None: getattr(config, key, default)
    heads = int(get("num_attention_heads"))
    return _Shape(family, _splits(family, names), {"num_attention_heads": heads, "num_key_value_heads": int(get("num_key_value_heads", None) or heads)})


def _shape_of(config_or_model: Any, *, splits: bool = True) -> _Shape:
    """The ``_Shape`` of a ``ModelConfig``, ``Transformer``, ``HFModelConfig`` or ``HFCausalLM``
    (``splits=False``: the head counts only, no model built, so a preset ``ModelConfig`` works too)."""
    if isinstance(config_or_model, HFCausalLM):
        hf_config = config_or_model.hf.config
        return _hf_shape(str(hf_config.model_type), list(weight_dict(config_or_model)), hf_config)
    if isinstance(config_or_model, HFModelConfig):
        from flowrl.models.hf import check_hf_dir

        raw = check_hf_dir(config_or_model)
        return _hf_shape(str(raw["model_type"]), list(weight_shapes(config_or_model)) if splits else [], raw)
    config = getattr(config_or_model, "config", config_or_model)
    if not isinstance(config, ModelConfig):
        raise ConfigError(
            "tp_param_layouts wants a ModelConfig or a Transformer (or an HFModelConfig or HFCausalLM), "
            f"got {type(config_or_model).__name__}"
        )
    names = list(weight_dict(config_or_model) if isinstance(config_or_model, nn.Module) else weight_shapes(config) if splits else [])
    return _Shape("builtin", _splits("builtin", names), {"n_heads": config.n_heads, "n_kv_heads": config.n_kv_heads})


def _check_heads(shape: _Shape, tp: int) -> None:
    if not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"tensor parallelism: tp={tp!r} must be an integer >= 1")
    bad = [f"{name}={n}" for name, n in shape.heads.items() if n % tp]
    if bad:
        owner = "ModelConfig" if shape.family == "builtin" else f"{shape.family} config.json"
        raise ConfigError(
            f"tensor parallelism splits attention by whole heads: tp={tp} must divide {' and '.join(bad)} "
            f"({owner} {', '.join(f'{k}={v}' for k, v in shape.heads.items())}); pick a tp size dividing "
            f"both, or change the model's head counts"
        )


def check_tp(config: ModelConfig | HFModelConfig | nn.Module, tp: int) -> None:
    """Refuse a tp size the model cannot be split into (whole heads per rank).

    Args:
        config: a ``ModelConfig`` or ``HFModelConfig``, or the model itself.
        tp: the tensor-parallel size.

    Raises:
        ConfigError: naming the head counts (``n_heads`` / ``n_kv_heads``, or the Hugging Face
            ``num_attention_heads`` / ``num_key_value_heads``) and the tp size, when ``tp`` is not a
            positive integer dividing both.
    """
    _check_heads(_shape_of(config, splits=False), tp)


def param_splits(config: ModelConfig | HFModelConfig | nn.Module) -> dict[str, Split]:
    """How each parameter of the full model splits: name (``weight_dict`` order) -> column / row / replicated.

    Args:
        config: a ``ModelConfig`` or ``HFModelConfig`` (its model is built on the meta device for the
            names), or the model itself (``Transformer`` or ``HFCausalLM``, full or sharded).

    Raises:
        ConfigError: for anything else, or a Hugging Face family without a split table.
    """
    return _shape_of(config).splits


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


def tp_param_layouts(config_or_model: ModelConfig | HFModelConfig | nn.Module, ranks: Sequence[int], *, dp: int = 1) -> dict[str, ShardLayout]:
    """The layout of every parameter of the full model across the generator's ranks.

    Args:
        config_or_model: the model's config (``ModelConfig`` or ``HFModelConfig``), or the (full or
            sharded) model itself (``Transformer`` or ``HFCausalLM``).
        ranks: global ranks; with ``dp == 1`` the tp group in tp order, else ``dp * tp`` ranks in mesh
            order (``dp`` replicas of ``tp`` consecutive ranks).
        dp: number of tensor-parallel replicas.

    Returns:
        name -> layout, for every name of the full model's ``weight_dict`` (= ``Generator.weight_targets()``).

    Raises:
        ConfigError: when ``len(ranks)`` is not a multiple of ``dp``, the tp size does not divide the
            heads, or the model's family has no split table.
    """
    ranks = tuple(ranks)
    if not isinstance(dp, int) or dp < 1 or len(ranks) % dp:
        raise ConfigError(f"tp_param_layouts: dp={dp!r} must be an integer >= 1 dividing len(ranks)={len(ranks)} ({list(ranks)})")
    tp = len(ranks) // dp
    shape = _shape_of(config_or_model)
    _check_heads(shape, tp)
    if dp == 1:
        layouts: dict[str, ShardLayout] = {"column": tp_column(ranks), "row": tp_row(ranks), "replicated": replicated(ranks, axis="tp")}
    else:
        layouts = {
            "column": dp_tp(ranks, dp=dp, tp=tp, tp_dim=0),
            "row": dp_tp(ranks, dp=dp, tp=tp, tp_dim=1),
            "replicated": replicated(ranks, axis="dp"),
        }
    return {name: layouts[split] for name, split in shape.splits.items()}


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
    """``y_local = x @ W[rows]^T + b[rows]``: this rank's slice of the output features; input replicated, no communication."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None, *, requires_grad: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=requires_grad)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=requires_grad)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"local out={self.weight.shape[0]}, in={self.weight.shape[1]}, bias={self.bias is not None}"


class RowParallelLinear(nn.Module):
    """``y = all_reduce_sum(x_local @ W[:, cols]^T) + b``: input split over the tp ranks, output replicated;
    the (replicated) bias is added after the sum, so once."""

    def __init__(
        self, weight: Tensor, group: Any, bias: Tensor | None = None, *, requires_grad: bool = False, comm_device: torch.device | None = None
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=requires_grad)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=requires_grad)
        self.group = group
        self.comm_device = comm_device

    def forward(self, x: Tensor) -> Tensor:
        y = _all_reduce_sum(F.linear(x, self.weight), self.group, self.comm_device)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"out={self.weight.shape[0]}, local in={self.weight.shape[1]}, bias={self.bias is not None}, all_reduce"


class _TensorParallelModel:
    """What every sharded model class adds to its full model's class: its place in the tp group.
    A sharded model is made by a shard function (which swaps ``__class__``), never constructed.

    Attributes:
        tp_ranks: the tp group's global ranks, in tp order.
        tp_rank: this rank's global rank.
        tp_index: its position in ``tp_ranks``.
    """

    tp_ranks: tuple[int, ...]
    tp_rank: int
    tp_index: int
    built_by = ""  # the call that makes one, for the error below

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(f"build a {type(self).__name__} with {self.built_by}")


class TensorParallelTransformer(_TensorParallelModel, Transformer):
    """A ``Transformer`` after :func:`shard_transformer_`: same forward, sharded layers, local KV cache."""

    built_by = "shard_transformer_(Transformer(config), ranks, rank, group)"

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty KV cache for the local heads only."""
        c, tp = self.config, len(self.tp_ranks)
        local = msgspec.structs.replace(c, n_heads=c.n_heads // tp, n_kv_heads=c.n_kv_heads // tp, dim=c.head_dim * (c.n_heads // tp))
        weight = self.tok_embeddings.weight
        return KVCache(local, batch, max_len, dtype=weight.dtype, device=weight.device)


def _check_shard_call(model: nn.Module, ranks: Sequence[int], rank: int, group: Any) -> tuple[int, ...]:
    """``ranks`` as a tuple, after refusing a sharded model, a rank outside ``ranks`` or a missing group."""
    if isinstance(model, _TensorParallelModel):
        raise ConfigError(f"the model is already tensor-parallel (tp ranks {list(model.tp_ranks)}); shard a full model")
    ranks = tuple(ranks)
    if rank not in ranks:
        raise ConfigError(f"rank {rank} is not in the tp group {list(ranks)}; pass this process's global rank and its tp group's ranks")
    if len(ranks) > 1 and group is None:
        raise ConfigError(f"tensor parallelism over {len(ranks)} ranks {list(ranks)} needs their process group (got group=None)")
    return ranks


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
    if type(model) is not Transformer and not isinstance(model, TensorParallelTransformer):
        raise ConfigError(f"shard_transformer_ shards the built-in Transformer, got {type(model).__name__}")
    ranks = _check_shard_call(model, ranks, rank, group)
    tp = len(ranks)
    config = model.config
    layouts = tp_param_layouts(config, ranks)
    splits = param_splits(config)
    for i, block in enumerate(model.layers):
        assert isinstance(block, Block)  # the built-in Transformer's layers
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
    sharded = cast(TensorParallelTransformer, model)  # the same object, its class swapped on the line above
    sharded.tp_ranks, sharded.tp_rank, sharded.tp_index = ranks, rank, ranks.index(rank)
    return sharded


class TensorParallelHFCausalLM(_TensorParallelModel, HFCausalLM):
    """An ``HFCausalLM`` after :func:`shard_hf_`: same forward and ``DynamicCache``, sharded projections."""

    built_by = "shard_hf_(build_model(HFModelConfig(...)), ranks, rank, group)"


@torch.no_grad()
def shard_hf_(
    model: HFCausalLM, ranks: Sequence[int], rank: int, group: Any, *, comm_device: torch.device | None = None
) -> TensorParallelHFCausalLM:
    """Turn a full Hugging Face Llama-family ``model`` into global rank ``rank``'s part of a tensor-parallel model, in place.

    Each ``nn.Linear`` whose weight its family's split table calls column-parallel becomes a
    :class:`ColumnParallelLinear` holding its rows (weight and bias) of this rank; a row-parallel one
    a :class:`RowParallelLinear` holding its weight's columns and the whole bias (all-reduce over
    ``group``, then the bias once). Parameter names stay the Hugging Face names; each shard is
    ``full[local_slice(layout, full.shape, rank)]`` (a copy) for the layout of :func:`tp_param_layouts`.
    The attention modules need no change (they reshape by ``head_dim``), nor does the cache. The
    model's class becomes :class:`TensorParallelHFCausalLM` (still an ``HFCausalLM``).

    Args:
        model: a full ``HFCausalLM`` of a family with a split table (any dtype).
        ranks: the tp group's global ranks, in tp order (every rank of the group passes the same).
        rank: this process's global rank (in ``ranks``).
        group: the tp process group (``None`` only when ``ranks`` has one rank).
        comm_device: where the all-reduces run when it is not where the model lives; None: the model's device.

    Returns:
        ``model``, now a ``TensorParallelHFCausalLM``.

    Raises:
        ConfigError: a tp size that does not divide the head counts, a family without a split table,
            a rank not in ``ranks``, a model already sharded, a missing group, or a split parameter
            that is not an ``nn.Linear``'s.
    """
    if not isinstance(model, HFCausalLM):
        raise ConfigError(f"shard_hf_ shards an HFCausalLM, got {type(model).__name__}")
    ranks = _check_shard_call(model, ranks, rank, group)
    layouts = tp_param_layouts(model, ranks)
    splits = param_splits(model)  # cheap for a model: its weight_dict names and config
    done: set[str] = set()
    for name, module in list(model.named_modules()):
        split = splits.get(f"{name}.weight")
        if split not in ("column", "row"):
            continue
        if type(module) is not nn.Linear:
            raise ConfigError(f"{name}.weight splits {split}-parallel but {name} is a {type(module).__name__}, not an nn.Linear")
        parent, _, attr = name.rpartition(".")
        weight = module.weight.detach()[local_slice(layouts[f"{name}.weight"], module.weight.shape, rank)].clone()
        bias = None
        if module.bias is not None:
            bias = module.bias.detach()[local_slice(layouts[f"{name}.bias"], module.bias.shape, rank)].clone()
        grad = module.weight.requires_grad
        if split == "row":
            shard: nn.Module = RowParallelLinear(weight, group, bias, requires_grad=grad, comm_device=comm_device)
        else:
            shard = ColumnParallelLinear(weight, bias, requires_grad=grad)
        setattr(model.get_submodule(parent), attr, shard)
        done.update(n for n in (f"{name}.weight", f"{name}.bias") if n in splits)
    missed = sorted(n for n, split in splits.items() if split != "replicated" and n not in done)
    if missed:
        raise ConfigError(f"shard_hf_: parameters {missed[:5]} split by the {model.hf.config.model_type!r} split table belong to no nn.Linear")
    model.__class__ = TensorParallelHFCausalLM  # same forward and cache
    sharded = cast(TensorParallelHFCausalLM, model)  # the same object, its class swapped on the line above
    sharded.tp_ranks, sharded.tp_rank, sharded.tp_index = ranks, rank, ranks.index(rank)
    return sharded


def shard_model_(
    model: nn.Module, ranks: Sequence[int], rank: int, group: Any, *, comm_device: torch.device | None = None
) -> nn.Module:
    """:func:`shard_hf_` for an ``HFCausalLM``, else :func:`shard_transformer_` (same arguments and errors)."""
    if isinstance(model, HFCausalLM):
        return shard_hf_(model, ranks, rank, group, comm_device=comm_device)
    if not isinstance(model, Transformer):
        raise ConfigError(f"shard_transformer_ shards the built-in Transformer, got {type(model).__name__}")
    return shard_transformer_(model, ranks, rank, group, comm_device=comm_device)


@torch.no_grad()
def copy_local_shards_(
    targets: Mapping[str, Tensor], full_state: Mapping[str, Tensor], ranks: Sequence[int], rank: int, config: ModelConfig | HFModelConfig | nn.Module
) -> None:
    """Copy rank ``rank``'s slice of every tensor of ``full_state`` into ``targets`` (same names; cast to their dtype).

    ``config`` is what :func:`tp_param_layouts` takes (a sharded model itself is cheapest for an HF one).

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
