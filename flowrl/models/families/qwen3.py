"""The Qwen3 family (``model_type`` ``qwen3``, ``Qwen3ForCausalLM``): Llama blocks with per-head q/k norms.

Its split table is the Llama block's: the per-head ``q_norm`` / ``k_norm`` weights (``[head_dim]``,
shared by every head) stay replicated.
"""

from __future__ import annotations

from flowrl.models.families.llama import LLAMA_BLOCK
from flowrl.models.family import ModelFamily

__all__ = ["FAMILY"]

FAMILY = ModelFamily(
    name="qwen3", description="hf", hf_architecture="Qwen3ForCausalLM", adapter="flowrl.models.families.llama_style", split_table=LLAMA_BLOCK, packing=True
)
