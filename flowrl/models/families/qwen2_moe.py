"""The Qwen2-MoE family (``model_type`` ``qwen2_moe``, ``Qwen2MoeForCausalLM``): Qwen3-MoE's block plus a shared expert.

Each MoE block adds a dense shared expert (``mlp.shared_expert.{gate,up,down}_proj``) to the routed
experts' output, scaled by a sigmoid gate (``mlp.shared_expert_gate``); see ``qwen3_moe`` for the
router and the stacked experts. Tensor parallelism splits the attention and the shared expert (as a
Llama MLP); the router, the shared expert's gate and the stacked experts stay whole. LoRA adapts the
attention's projections and the shared expert's (``gate_proj``, ``up_proj``, ``down_proj`` name those of
the shared expert: the routed experts are stacked tensors and take none), not the router or the experts.
"""

from __future__ import annotations

import dataclasses

from flowrl.models.families import qwen3_moe
from flowrl.models.family import Split

__all__ = ["FAMILY"]

_SHARED_EXPERT: tuple[tuple[str, Split], ...] = (
    (r"model\.layers\.\d+\.mlp\.shared_expert\.(gate|up)_proj\.weight", "column"),
    (r"model\.layers\.\d+\.mlp\.shared_expert\.down_proj\.weight", "row"),
)

#: Qwen3-MoE's row (router, stacked experts, vLLM's names, LoRA refusals, fixed keys), its split table
#: with the shared expert's projections
FAMILY = dataclasses.replace(
    qwen3_moe.FAMILY, name="qwen2_moe", hf_architecture="Qwen2MoeForCausalLM", split_table=qwen3_moe.MOE_ATTENTION + _SHARED_EXPERT
)
