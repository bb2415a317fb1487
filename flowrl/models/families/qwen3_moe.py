"""The Qwen3-MoE family (``model_type`` ``qwen3_moe``, ``Qwen3MoeForCausalLM``) and the MoE block facts the MoE families share.

Both run on the Llama-style adapter (``flowrl.models.families.llama_style``): transformers builds the
model from the directory's ``config.json``; each MoE block is a router (``mlp.gate.weight``,
``[experts, hidden]``) choosing ``num_experts_per_tok`` experts per token, and the experts' weights
stacked in two tensors per layer (``mlp.experts.gate_up_proj`` ``[experts, 2 * moe_intermediate,
hidden]``, ``mlp.experts.down_proj`` ``[experts, hidden, moe_intermediate]``), the names an export
writes and vLLM loads. Qwen2-MoE adds a dense shared expert (``mlp.shared_expert.{gate,up,down}_proj``)
scaled by a sigmoid gate (``mlp.shared_expert_gate``).

Its tensor-parallel split is the attention's (the Llama block's attention rows); the router and the
stacked experts stay whole on every tp rank.
"""

from __future__ import annotations

from flowrl.models.families.llama import LLAMA_BLOCK
from flowrl.models.family import ModelFamily

__all__ = ["MOE_ATTENTION", "MOE_ROUTER", "FAMILY"]

#: The Llama block's attention rows: what tensor parallelism splits in an MoE block.
MOE_ATTENTION = LLAMA_BLOCK[:2]

#: The router of each MoE block (transformers' ``Qwen3MoeTopKRouter`` / ``Qwen2MoeTopKRouter``), by module name.
MOE_ROUTER = r"layers\.(\d+)\.mlp\.gate$"

FAMILY = ModelFamily(
    name="qwen3_moe",
    description="hf",
    hf_architecture="Qwen3MoeForCausalLM",
    adapter="flowrl.models.families.llama_style",
    split_table=MOE_ATTENTION,
    packing=True,
    router=MOE_ROUTER,
)
