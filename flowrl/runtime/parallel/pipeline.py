"""A policy's model split into pipeline stages (a ``pp`` mesh axis): which layers each stage holds, the
stage's module, and the checks a pipeline-parallel policy must pass before any work.

Layers split into ``pp`` contiguous stages whose sizes differ by at most one, the larger ones first
(``stage_bounds``): the largest holds ``ceil(n_layers / pp)`` layers, the rule the planner prices
(``flowrl.planners.parallel.stage_layers``), so plan and runtime agree. The first stage also holds
the input embedding, the last the final norm and the output head (and the RL loss, run by
``flowrl.runtime.parallel.pipeline_trainer``).

``StageModule`` is one stage of a ``CausalLM``, built from the whole model by dropping what the stage
does not hold. Its parameters keep the whole model's names (``layers.3.attention.wq.weight``,
``model.layers.3.self_attn.q_proj.weight``), so a stage's weights, checkpoint keys and published
tensors are the whole model's by name. A tied output head (the input embedding's matrix, the built-in
default and Qwen2.5's) lives on both the first and the last stage: the last keeps a copy under the
same name (``tied``), whose gradient the trainer sums with the first stage's before each step, so
both copies take the same AdamW step and stay equal.

``forward(x, valid)``: ``x`` is the token ids ``[m, W]`` on the first stage and the hidden states
``[m, W, D]`` (float32) the stage before sent on the others; ``valid`` ``[m, W]`` (True on real
tokens) gives every stage its positions and attention mask (``flowrl.models.causal_lm``'s padded
layout). The last stage returns the logits of the last ``keep`` positions (float32), the others the
hidden states. Built-in transformer: its own blocks, positions and mask; Hugging Face Llama, Qwen2,
Qwen3: the model's own decoder forward (masks, rotary embeddings) with the layers the stage does not
hold replaced by a pass-through (``_Skip``), the embedding given as ``inputs_embeds`` after the first.

Example:
    >>> stage_bounds(5, 2), stage_bounds(4, 4)
    ([(0, 3), (3, 5)], [(0, 1), (1, 2), (2, 3), (3, 4)])
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from flowrl.errors import ConfigError
from flowrl.graph.ir import Graph
from flowrl.graph.nodes import PolicyNode
from flowrl.models.families.builtin.model import Transformer
from flowrl.models.hf import HFCausalLM

if TYPE_CHECKING:
    from flowrl.graph.configs import ModelConfig
    from flowrl.models.causal_lm import CausalLM

__all__ = ["stage_bounds", "model_layers", "pipeline_policies", "check_pipeline", "StageModule", "split_model", "stage_owners", "stage_layouts"]


def stage_bounds(n_layers: int, pp: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each stage's layers: contiguous, sizes differing by at most one, larger first.

    Raises:
        ConfigError: for ``pp`` larger than ``n_layers`` (a stage would hold no layer).
    """
    if pp > n_layers:
        raise ConfigError(f"pp={pp} stages of {n_layers} layers: a stage would hold no layer; use pp <= {n_layers}")
    sizes = [n_layers // pp + (1 if i < n_layers % pp else 0) for i in range(pp)]
    starts = [sum(sizes[:i]) for i in range(pp)]
    return [(s, s + n) for s, n in zip(starts, sizes)]


def model_layers(config: Any) -> int:
    """Transformer blocks of a model description: ``n_layers``, or a Hugging Face directory's
    ``num_hidden_layers`` (its ``config.json``, read without building the model)."""
    layers = getattr(config, "n_layers", None)
    if layers is not None:
        return int(layers)
    from flowrl.models.hf import check_hf_dir

    return int(check_hf_dir(config)["num_hidden_layers"])


def pipeline_policies(graph: Graph, axes: Mapping[str, Any], *, skip: Iterable[str] = ()) -> list[tuple[PolicyNode, dict[str, int]]]:
    """The graph's policies whose mesh has ``pp`` > 1, each with its mesh's axis sizes."""
    skip = set(skip)
    out = []
    for node in graph.nodes_of(PolicyNode):
        names, shape = axes.get(node.name, ((), ()))
        sizes = dict(zip(names, (int(s) for s in shape)))
        if sizes.get("pp", 1) > 1 and node.name not in skip:
            out.append((node, sizes))
    return out


def check_pipeline(graph: Graph, axes: Mapping[str, Any], *, skip: Iterable[str] = ()) -> None:
    """Refuse, before any work, a pipeline-parallel policy the pipeline program cannot run as asked.

    Args:
        axes: node -> (axis names, shape) of its mesh (the placement's).
        skip: user programs (they run on their lead rank, whatever the mesh).

    Raises:
        ConfigError: naming the policy, the values and the fix, for ``pp`` larger than the model's
            layers, a ``tp`` axis beside ``pp``, ``sharding="fsdp"``, ``packing=True`` or LoRA adapters.
            (Its weight edges into vLLM take the hop, never the direct route, which sends whole buckets
            from every rank: ``flowrl.placement.weight_routes``.)
    """
    for node, sizes in pipeline_policies(graph, axes, skip=skip):
        pp, where = sizes["pp"], f"policy {node.name!r} (mesh {({a: n for a, n in sizes.items() if n > 1})})"
        layers = model_layers(node.model)
        if pp > layers:
            raise ConfigError(
                f"{where}: pp={pp} pipeline stages but its model has {layers} layers, so a stage would hold none; "
                f"give the policy a mesh with pp <= {layers} (e.g. {{\"pp\": {layers}}}), or a model with more layers"
            )
        if sizes.get("tp", 1) > 1:
            raise ConfigError(
                f"{where}: a pipeline-parallel policy runs each stage whole on its rank, so pp x tp is not executed; "
                f"use a mesh of pp and dp only (e.g. {{\"pp\": {pp}, \"dp\": {sizes['tp'] * sizes.get('dp', 1)}}})"
            )
        opt = node.optimizer
        if opt.sharding == "fsdp":
            raise ConfigError(
                f"{where}: sharding='fsdp' shards over dp ranks, which a pipeline-parallel policy does not; "
                "set sharding='replicate' (each stage's dp ranks then reduce its gradients), or drop the pp axis"
            )
        if opt.packing:
            raise ConfigError(
                f"{where}: packing=True, but pipeline stages exchange activations of one shape per micro-batch, "
                "so a pipeline-parallel policy runs padded; set packing=None (the default) or False"
            )
        lora = getattr(node.model, "lora", None)
        if lora is not None:
            raise ConfigError(
                f"{where}: LoRA adapters are not split into pipeline stages; train it without pp "
                "(dp, or sharding='fsdp'), or drop the model's lora"
            )


class _Skip(nn.Module):
    """A Hugging Face decoder layer this stage does not hold: its hidden states pass through."""

    def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return hidden_states


def _full_names(model: nn.Module) -> dict[int, str]:
    """Tensor id -> its name in the whole model's ``weight_dict`` (a tied head: the embedding's name)."""
    names: dict[int, str] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        names.setdefault(id(t), name)
    return names


class StageModule(nn.Module):
    """Stage ``index`` of ``count`` of a ``CausalLM`` (see the module docstring).

    Attributes:
        index, count: the stage and the number of stages.
        layers: ``(start, end)`` of the blocks it holds.
        keep: logits of the last ``keep`` positions (the last stage; set per mini-batch; 0: all).
        autocast: the dtype the forward runs under ``torch.autocast`` in (None: off).
        tied_head: ``(name, shape)`` of the whole model's tied head matrix (the input embedding's), on
            every stage, else None; the first and the last stage each hold a copy (``tied_parameter``).
        names: parameter name here -> its name in the whole model's ``weight_dict``.
    """

    # What a split of the built-in transformer holds (the parts of other stages are None) ...
    config: ModelConfig
    gradient_checkpointing: bool
    tok_embeddings: nn.Embedding | None
    layers: nn.ModuleDict
    norm: nn.Module | None
    output: nn.Linear | None
    # ... or of a Hugging Face model: transformers' modules, which the checker does not follow (Any).
    hf: Any
    model: Any
    lm_head: Any

    def __init__(self, model: CausalLM | nn.Module, index: int, count: int, n_layers: int) -> None:
        super().__init__()
        self.index, self.count = index, count
        self.layers_range = stage_bounds(n_layers, count)[index]
        self.first, self.last = index == 0, index == count - 1
        self.keep = 0
        self.autocast: torch.dtype | None = None
        whole = _whole(model)
        full = _full_names(whole)
        self._hf = isinstance(whole, HFCausalLM)
        start, end = self.layers_range
        if isinstance(whole, Transformer):
            embedding = full[id(whole.tok_embeddings.weight)]
            whole_head = whole.tok_embeddings.weight if whole.output is None else whole.output.weight
            self._split_builtin(whole, start, end)
        else:
            embedding = full[id(whole.hf.get_input_embeddings().weight)]
            whole_head = whole.hf.get_output_embeddings().weight
            self._split_hf(whole, start, end)
        self.names = {name: full[id(t)] for name, t in self.state_dict(keep_vars=True).items()}
        self.tied_head = (embedding, tuple(whole_head.shape)) if full[id(whole_head)] == embedding else None

    # -- splitting ---------------------------------------------------------------------------------
    def _split_builtin(self, model: Transformer, start: int, end: int) -> None:
        self.config = model.config
        self.gradient_checkpointing = bool(getattr(model, "gradient_checkpointing", False))
        tied = model.output is None
        self.tok_embeddings = model.tok_embeddings if self.first or (self.last and tied) else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(start, end)})
        self.norm = model.norm if self.last else None
        self.output = model.output if self.last else None

    def _split_hf(self, model: HFCausalLM, start: int, end: int) -> None:
        hf = model.hf
        inner = hf.model
        for i in range(len(inner.layers)):
            if not start <= i < end:
                inner.layers[i] = _Skip()
        if not self.first:
            inner.embed_tokens = None
        if not self.last:
            inner.norm = nn.Identity()
        self.model = inner  # names: model.layers.3..., model.embed_tokens..., model.norm...
        self.lm_head = hf.lm_head if self.last else None
        self.__dict__["hf"] = hf

    def _head_weight(self) -> Tensor | None:
        if not self.last:
            return None
        if self._hf:
            weight: Tensor = self.lm_head.weight
            return weight
        if self.output is not None:
            return self.output.weight
        assert self.tok_embeddings is not None  # the last stage of a tied model holds the embedding
        return self.tok_embeddings.weight

    def tied_parameter(self) -> nn.Parameter | None:
        """This stage's copy of the tied head matrix (the first and the last stage hold one), else None."""
        if self.tied_head is None:
            return None
        return next((p for local, p in self.named_parameters() if self.names[local] == self.tied_head[0]), None)

    def enable_gradient_checkpointing(self) -> None:
        """Recompute each block's activations in the backward pass."""
        if self._hf:  # transformers' own mechanism, as HFCausalLM.enable_gradient_checkpointing
            enable = getattr(self.hf, "activation_checkpointing_enable", None)
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                self.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            self.gradient_checkpointing = True

    # -- forward -----------------------------------------------------------------------------------
    def forward(self, x: Tensor, valid: Tensor) -> Tensor:
        device_type = x.device.type
        with torch.autocast(device_type, dtype=self.autocast or torch.float32, enabled=self.autocast is not None):
            h = self._hf_forward(x, valid) if self._hf else self._builtin_forward(x, valid)
        if not self.last:
            return h.float()
        return (h[:, -self.keep :] if self.keep else h).float()

    def _hf_forward(self, x: Tensor, valid: Tensor) -> Tensor:
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
        given = {"input_ids": x} if self.first else {"inputs_embeds": x}
        h = self.model(**given, attention_mask=valid.long(), position_ids=positions, use_cache=False).last_hidden_state
        if not self.last:
            return h
        return self.lm_head(h[:, -self.keep :] if self.keep else h)

    def _builtin_forward(self, x: Tensor, valid: Tensor) -> Tensor:
        import torch.nn.functional as F
        from torch.utils.checkpoint import checkpoint

        from flowrl.models.families.builtin.model import attention_mask, positions_from_valid

        config = self.config
        positions = positions_from_valid(valid)
        mask = attention_mask(valid, 0, valid.shape[1])
        head_dim = config.head_dim
        inv_freq = config.rope_theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=valid.device) / head_dim)
        angles = positions.to(torch.float32)[:, None, :, None] * inv_freq
        cos, sin = angles.cos(), angles.sin()
        if self.first:
            assert self.tok_embeddings is not None  # the first stage holds the embedding
            h = self.tok_embeddings(x)
        else:
            h = x
        for key, layer in self.layers.items():
            if self.gradient_checkpointing and self.training:
                h = checkpoint(layer, h, cos, sin, mask, None, int(key), use_reentrant=False)
            else:
                h = layer(h, cos, sin, mask, None, int(key))
        if not self.last:
            return h
        assert self.norm is not None  # the last stage holds the final norm
        h = self.norm(h[:, -self.keep :] if self.keep else h)
        if self.output is not None:
            return self.output(h)
        assert self.tok_embeddings is not None  # the last stage of a tied model holds the embedding
        return F.linear(h, self.tok_embeddings.weight)

    # -- shapes of what crosses stages (static pipelining metadata) ----------------------------------
    def hidden_size(self) -> int:
        return int(self.hf.config.hidden_size) if self._hf else int(self.config.dim)

    def vocab_rows(self) -> int:
        head = self._head_weight()
        assert head is not None  # the last stage
        return int(head.shape[0])


def _whole(model: CausalLM | nn.Module) -> HFCausalLM | Transformer:
    """``model`` as what pipelining splits: a built-in ``Transformer`` or an ``HFCausalLM``.

    Raises:
        ConfigError: for any other model.
    """
    if isinstance(model, (HFCausalLM, Transformer)):
        return model
    raise ConfigError(f"pipeline parallelism splits a built-in Transformer or an HFCausalLM, got {type(model).__name__}")


def split_model(model: CausalLM | nn.Module, index: int, count: int, n_layers: int) -> StageModule:
    """Stage ``index`` of ``count`` of ``model`` (a built-in ``Transformer`` or an ``HFCausalLM``):
    the parts it does not hold are dropped (freed once ``model`` is)."""
    return StageModule(model, index, count, n_layers)


def stage_owners(model: CausalLM | nn.Module, pp: int) -> dict[str, int]:
    """``weight_dict`` name of ``model`` (the whole model, any device: the meta one will do) -> the stage
    that publishes it: a block's, its stage; the input embedding (a tied head's matrix too), the first;
    the final norm and an untied head, the last (``StageModule``'s split)."""
    from flowrl.runtime.parallel.fsdp import blocks

    whole = _whole(model)
    layers = blocks(whole)
    stage_of: dict[int, int] = {}
    for s, (start, end) in enumerate(stage_bounds(len(layers), pp)):
        for block in layers[start:end]:
            stage_of.update((id(p), s) for p in block.parameters())
    embedding = whole.tok_embeddings.weight if isinstance(whole, Transformer) else whole.hf.get_input_embeddings().weight
    owners: dict[str, int] = {}
    seen: set[int] = set()
    for name, t in whole.state_dict(keep_vars=True).items():  # weight_dict's names: each tensor once, under its first name
        if id(t) not in seen:
            seen.add(id(t))
            owners[name] = stage_of.get(id(t), 0 if t is embedding else pp - 1)
    return owners


def stage_layouts(config: Any, ranks: tuple[int, ...], sizes: Mapping[str, int]) -> dict[str, Any]:
    """The trainer layout of a pipeline-parallel policy on a collective weight edge: each weight
    replicated over the ranks of the stage that publishes it (its dp replicas), so each stage sends
    its own layers and no rank gathers the model (``flowrl.placement.resharding.dp_replicas`` per name).

    Args:
        config: the policy's model description.
        ranks: the policy's ranks, row-major over its mesh (pp, dp, tp).
        sizes: its mesh's axis sizes.
    """
    from flowrl.models.registry import meta_model
    from flowrl.placement.resharding import dp_replicas

    pp = sizes["pp"]
    per_stage = len(ranks) // pp
    stage_ranks = [tuple(ranks[s * per_stage : (s + 1) * per_stage]) for s in range(pp)]
    return {name: dp_replicas(stage_ranks[s]) for name, s in stage_owners(meta_model(config), pp).items()}
