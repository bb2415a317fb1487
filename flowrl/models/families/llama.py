"""The Llama family (``model_type`` ``llama``, ``LlamaForCausalLM``) and the Llama block's split table.

Its tensor-parallel split (Megatron-style, ``flowrl.runtime.parallel.tensor_parallel``) over the Hugging Face
names ``model.layers.N.``: ``self_attn.{q,k,v}_proj`` column (weight and bias rows), ``self_attn.o_proj``
row, ``mlp.{gate,up}_proj`` column, ``mlp.down_proj`` row; everything else (embeddings, norms,
``lm_head``, a row-parallel layer's bias, added once after the all-reduce) replicated. Weights
export under their own (Hugging Face) names.
"""

from __future__ import annotations

from flowrl.models.family import ModelFamily, Split

__all__ = ["LLAMA_BLOCK", "FAMILY"]

#: The split table of a Llama-style block; the families with the same layout share it.
LLAMA_BLOCK: tuple[tuple[str, Split], ...] = (
    (r"model\.layers\.\d+\.self_attn\.[qkv]_proj\.(weight|bias)", "column"),
    (r"model\.layers\.\d+\.self_attn\.o_proj\.weight", "row"),
    (r"model\.layers\.\d+\.mlp\.(gate|up)_proj\.(weight|bias)", "column"),
    (r"model\.layers\.\d+\.mlp\.down_proj\.weight", "row"),
)

FAMILY = ModelFamily(
    name="llama", description="hf", hf_architecture="LlamaForCausalLM", adapter="flowrl.models.families.llama_style", split_table=LLAMA_BLOCK, packing=True
)
