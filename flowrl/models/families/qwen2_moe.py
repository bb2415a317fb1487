"""The Qwen2-MoE family (``model_type`` ``qwen2_moe``, ``Qwen2MoeForCausalLM``): Qwen3-MoE's block plus a shared expert.

Each MoE block adds a dense shared expert (``mlp.shared_expert.{gate,up,down}_proj``) to the routed
experts' output, scaled by a sigmoid gate (``mlp.shared_expert_gate``); see ``qwen3_moe`` for the
router and the stacked experts. Tensor parallelism splits the attention and the shared expert (as a
Llama MLP); the router, the shared expert's gate and the stacked experts stay whole.
"""

from __future__ import annotations

from flowrl.models.families.qwen3_moe import MOE_ATTENTION, MOE_ROUTER
from flowrl.models.family import ModelFamily, Split

__all__ = ["FAMILY"]

_SHARED_EXPERT: tuple[tuple[str, Split], ...] = (
    (r"model\.layers\.\d+\.mlp\.shared_expert\.(gate|up)_proj\.weight", "column"),
    (r"model\.layers\.\d+\.mlp\.shared_expert\.down_proj\.weight", "row"),
)

FAMILY = ModelFamily(
    name="qwen2_moe",
    description="hf",
    hf_architecture="Qwen2MoeForCausalLM",
    adapter="flowrl.models.families.llama_style",
    split_table=MOE_ATTENTION + _SHARED_EXPERT,
    packing=True,
    router=MOE_ROUTER,
)
