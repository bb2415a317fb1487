"""A model family declared outside flowrl, for ``test_families.py``'s "a family is one module and one
entry" test: Mistral (Llama blocks with sliding-window attention) on the shared Llama-style adapter."""

from __future__ import annotations

from flowrl.models.families.llama import LLAMA_BLOCK
from flowrl.models.family import ModelFamily

__all__ = ["FAMILY"]

FAMILY = ModelFamily(
    name="mistral", description="hf", hf_architecture="MistralForCausalLM", adapter="flowrl.models.families.llama_style", split_table=LLAMA_BLOCK
)
