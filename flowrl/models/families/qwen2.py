"""The Qwen2 family (``model_type`` ``qwen2``, ``Qwen2ForCausalLM``): Llama blocks with q/k/v biases.

Its split table is the Llama block's (a column-parallel layer's bias splits with its rows).
"""

from __future__ import annotations

from flowrl.models.families.llama import LLAMA_BLOCK
from flowrl.models.family import ModelFamily

__all__ = ["FAMILY"]

FAMILY = ModelFamily(
    name="qwen2", description="hf", hf_architecture="Qwen2ForCausalLM", adapter="flowrl.models.families.llama_style", split_table=LLAMA_BLOCK, packing=True
)
