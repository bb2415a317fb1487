"""What a model family is: the ``ModelFamily`` record, the ``FamilyAdapter`` its code implements, ``ModelTokens``.

A family's facts are plain data in its module under ``flowrl/models/families/`` (no torch import):
its name, the transformers class it exports as, its tensor-parallel split table and its export
names. Its code (build, meta model, tokenizer, export config) is an adapter module named by a
string and imported on first use, so declaring the table imports no model code.

Example:
    >>> from flowrl.models.families import FAMILIES
    >>> fam = FAMILIES["qwen2"]
    >>> fam.split_of("model.layers.3.self_attn.k_proj.bias"), fam.split_of("model.norm.weight")
    ('column', 'replicated')
    >>> FAMILIES["builtin"].export_name("layers.0.feed_forward.w1.weight")
    'model.layers.0.mlp.gate_proj.weight'
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast

from flowrl.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from flowrl.graph.configs import AnyModelConfig
    from flowrl.models.causal_lm import CausalLM

__all__ = ["Split", "ModelFamily", "FamilyAdapter", "ModelTokens", "StackedRow"]

#: How tensor parallelism splits a weight (``flowrl.runtime.parallel.tensor_parallel``): ``column`` (dim 0,
#: output rows), ``row`` (dim 1, input columns; all-reduce after), or ``replicated``.
Split = Literal["column", "row", "replicated"]

#: One row of ``ModelFamily.stacked``: (regular expression a stacked weight's whole name matches, its
#: group 1 the experts module's name; the per-expert tensor names of its checkpoint layout, templates
#: with ``{module}`` and ``{expert}``), e.g. ``(r"(.*\.experts)\.gate_up_proj", ("{module}.{expert}.gate_proj.weight",
#: "{module}.{expert}.up_proj.weight"))``: expert ``e``'s slice ``[e]`` is those tensors concatenated on dim 0.
StackedRow = tuple[str, tuple[str, ...]]


@dataclass(frozen=True)
class ModelTokens:
    """What generation needs from a model's tokenizer.

    Attributes:
        pad_id: id written after a completion ends.
        eos_ids: ids that end a completion.
        decode: ids -> text (for stop strings and text scorers).
    """

    pad_id: int
    eos_ids: tuple[int, ...]
    decode: Callable[[list[int]], str]


class FamilyAdapter(Protocol):
    """The functions a family's adapter module defines (the Llama-style Hugging Face families share one)."""

    def build(self, config: AnyModelConfig, dtype: torch.dtype, device: str | torch.device) -> CausalLM:
        """The model of ``config``: seeded or pretrained weights, gradients on."""
        ...

    def meta_model(self, config: AnyModelConfig) -> CausalLM:
        """``config``'s float32 model on the meta device (modules and shapes, no memory, no weights read)."""
        ...

    def tokens(self, config: AnyModelConfig) -> ModelTokens:
        """Pad id, end ids and decoder of the model's tokenizer."""
        ...

    def hf_config(self, config: AnyModelConfig) -> Any:
        """The transformers config an export writes (``config.json``)."""
        ...

    def save_tokenizer(self, config: AnyModelConfig, out: Path) -> None:
        """Write the model's tokenizer (and generation config, if any) into the export directory ``out``."""
        ...


@dataclass(frozen=True)
class ModelFamily:
    """One model family: one module under ``flowrl/models/families/`` and one entry in ``FAMILIES``.

    Attributes:
        name: ``"builtin"`` or the Hugging Face ``model_type`` of the family's ``config.json``.
        description: which model description builds it: ``"builtin"`` (``ModelConfig``) or ``"hf"``
            (``HFModelConfig``, whose directory's ``model_type`` is ``name``).
        hf_architecture: the transformers ``*ForCausalLM`` class its export writes (and vLLM loads).
        adapter: the module implementing ``FamilyAdapter`` for it, imported on first use.
        split_table: (regular expression a whole weight name matches, its split), first match wins;
            a name no row matches is replicated. Empty: the family has no tensor parallelism.
        export_names: (regular expression over a weight name, replacement) for the Hugging Face
            name an export writes, first match wins; empty: the names are already Hugging Face's.
        stacked: the weights its model holds stacked over experts (``[experts, ...]``) that its
            Hugging Face checkpoints (``save_pretrained``'s files, vLLM's loader) hold per expert, one
            ``StackedRow`` each; ``checkpoint_names`` reads them. Empty: every weight is
            stored under its own name.
        vllm_names: (regular expression over a weight name, replacement) for the name of the tensor
            vLLM's model holds it in, first match wins (a mixture of experts' stacked experts are vLLM's
            fused ``w13_weight`` / ``w2_weight``); what ``vllm_engine.VLLMGenerator.weights_differ``
            compares, bit for bit. Empty: vLLM's names are the Hugging Face ones (its fused
            ``qkv_proj`` and ``gate_up_proj`` aside, which it reports itself).
        lora_refused: modules LoRA does not adapt, ``(regular expression a module's dotted path matches,
            what it is)``: a ``LoraConfig.target_modules`` entry naming one is refused naming the module,
            the family and the linear layers it adapts (``flowrl.models.lora.lora_modules``).
        fixed_keys: ``config.json`` keys flowrl reads at one value only, ``(key, value)``: a directory
            with another value is refused by ``flowrl.models.hf.check_hf_dir`` before any work, naming the
            key (a mixture of experts with dense blocks among its sparse ones: the planner counts
            neither, the tests exercise neither).
        packing: its model takes packed rows (``CausalLM.forward(tokens, packed_positions=)``:
            positions restarting per sequence, attention kept within each), which a policy's
            ``OptimizerConfig.packing`` needs. A Hugging Face family declares it when transformers
            keeps packed sequences apart from their ``position_ids`` (``masking_utils``' packed-sequence
            detection for sdpa, eager and flex attention; flash-attention's varlen kernel).
        router: a regular expression a mixture-of-experts router's module name ends with (``re.search``),
            its decoder layer's index as group 1; the router's ``forward(h)`` returns ``(logits [T, E],
            top-k weights [T, k], top-k indices [T, k])`` and it has ``num_experts``, ``top_k`` and
            ``norm_topk_prob`` (``flowrl.models.routing`` records and replays through it; the trainer
            counts the experts' load and adds the load-balancing loss through it,
            ``flowrl.operators.router_load``). Empty: a dense family, no routers.
    """

    name: str
    description: Literal["builtin", "hf"]
    hf_architecture: str
    adapter: str
    split_table: tuple[tuple[str, Split], ...] = ()
    export_names: tuple[tuple[str, str], ...] = ()
    stacked: tuple[StackedRow, ...] = ()
    vllm_names: tuple[tuple[str, str], ...] = ()
    router: str = ""
    lora_refused: tuple[tuple[str, str], ...] = ()
    fixed_keys: tuple[tuple[str, Any], ...] = ()
    packing: bool = False

    def load_adapter(self) -> FamilyAdapter:
        """The adapter module (imported now)."""
        return cast("FamilyAdapter", importlib.import_module(self.adapter))  # a module: its functions are the protocol's

    def split_of(self, name: str) -> Split:
        """The tensor-parallel split of weight ``name``.

        Raises:
            ConfigError: for a family without a split table.
        """
        if not self.split_table:
            raise ConfigError(f"model family {self.name!r} has no tensor-parallel split table; run it with tp=1")
        return next((split for pattern, split in self.split_table if re.fullmatch(pattern, name)), "replicated")

    def export_name(self, name: str) -> str:
        """The Hugging Face name an export writes for weight ``name``.

        Raises:
            ConfigError: for a name no row of ``export_names`` matches (when there are rows).
        """
        if not self.export_names:
            return name
        for pattern, repl in self.export_names:
            match = re.fullmatch(pattern, name)
            if match:
                return match.expand(repl)
        raise ConfigError(f"{self.name} weight {name!r} has no Hugging Face ({self.hf_architecture}) name")

    def vllm_name(self, name: str) -> str:
        """The name of the tensor vLLM's model holds weight ``name`` in (``vllm_names``; unchanged when no row matches).

        Example:
            >>> from flowrl.models.families import FAMILIES
            >>> FAMILIES["qwen3_moe"].vllm_name("model.layers.0.mlp.experts.down_proj")
            'model.layers.0.mlp.experts.routed_experts.w2_weight'
        """
        for pattern, repl in self.vllm_names:
            match = re.fullmatch(pattern, name)
            if match:
                return match.expand(repl)
        return name

    def checkpoint_names(self, name: str, expert: int) -> tuple[str, ...]:
        """The checkpoint tensors whose concatenation (dim 0) is expert ``expert``'s slice of the stacked
        weight ``name``; ``()`` for a weight stored whole under its own name.

        Example:
            >>> from flowrl.models.families import FAMILIES
            >>> FAMILIES["qwen3_moe"].checkpoint_names("model.layers.1.mlp.experts.gate_up_proj", 3)
            ('model.layers.1.mlp.experts.3.gate_proj.weight', 'model.layers.1.mlp.experts.3.up_proj.weight')
        """
        for pattern, parts in self.stacked:
            match = re.fullmatch(pattern, name)
            if match:
                return tuple(p.format(module=match.group(1), expert=expert) for p in parts)
        return ()
