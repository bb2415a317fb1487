"""The model families flowrl trains, one module (or folder) each, and ``FAMILIES``, the one table of them.

Every family's facts live in its own module here: ``builtin/`` (the built-in transformer, its
character tokenizer and its adapter), ``llama``, ``qwen2``, ``qwen3`` (Hugging Face families with
Llama-style blocks, sharing the adapter ``llama_style``), ``qwen3_moe`` and ``qwen2_moe`` (mixtures of
experts, on the same adapter). ``build_model``, ``weight_shapes``,
``model_tokens`` (``flowrl.models.registry``), the Hugging Face directory check, tensor
parallelism's split lookup and ``export_hf`` all read ``FAMILIES``; ``tests/models/test_families.py``
walks every entry through build, weight shapes, a tp split and an export.

Adding a Llama-style Hugging Face family is one module declaring its ``ModelFamily`` and one entry
below; another architecture also writes its ``FamilyAdapter`` module.

Example:
    >>> sorted(FAMILIES), hf_family_names()
    (['builtin', 'llama', 'qwen2', 'qwen2_moe', 'qwen3', 'qwen3_moe'], ['llama', 'qwen2', 'qwen3', 'qwen3_moe', 'qwen2_moe'])
"""

from __future__ import annotations

from flowrl.models.families import builtin, llama, qwen2, qwen2_moe, qwen3, qwen3_moe
from flowrl.models.family import ModelFamily

__all__ = ["FAMILIES", "hf_family_names"]

#: Family name -> its record; one entry per family.
FAMILIES: dict[str, ModelFamily] = {f.name: f for f in (builtin.FAMILY, llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY, qwen3_moe.FAMILY, qwen2_moe.FAMILY)}


def hf_family_names() -> list[str]:
    """The Hugging Face ``model_type`` values flowrl trains (families built from an ``HFModelConfig``)."""
    return [name for name, f in FAMILIES.items() if f.description == "hf"]
