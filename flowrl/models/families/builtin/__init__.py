"""The built-in family: a small Llama-shaped transformer (``model``), its character tokenizer
(``tokenizer``) and its adapter (``adapter``), described by ``flowrl.graph.configs.ModelConfig``.

Its tensor-parallel split (``flowrl.runtime.parallel.tensor_parallel``): ``attention.wq / wk / wv`` column
(each rank its whole heads), ``attention.wo`` row, ``feed_forward.w1 / w3`` column (the rank's SwiGLU
hidden units), ``feed_forward.w2`` row; embeddings, norms and ``output`` replicated. It exports as
``LlamaForCausalLM`` under the names of ``EXPORT_NAMES`` (the mapping is exact, see ``adapter``).
"""

from __future__ import annotations

from flowrl.models.family import ModelFamily, Split

__all__ = ["SPLIT_TABLE", "EXPORT_NAMES", "FAMILY"]

SPLIT_TABLE: tuple[tuple[str, Split], ...] = (
    (r"layers\.\d+\.attention\.w[qkv]\.weight", "column"),
    (r"layers\.\d+\.attention\.wo\.weight", "row"),
    (r"layers\.\d+\.feed_forward\.w[13]\.weight", "column"),
    (r"layers\.\d+\.feed_forward\.w2\.weight", "row"),
)

#: Built-in weight name -> its ``LlamaForCausalLM`` name.
EXPORT_NAMES: tuple[tuple[str, str], ...] = (
    (r"tok_embeddings\.weight", "model.embed_tokens.weight"),
    (r"norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"layers\.(\d+)\.attention\.wq\.weight", r"model.layers.\1.self_attn.q_proj.weight"),
    (r"layers\.(\d+)\.attention\.wk\.weight", r"model.layers.\1.self_attn.k_proj.weight"),
    (r"layers\.(\d+)\.attention\.wv\.weight", r"model.layers.\1.self_attn.v_proj.weight"),
    (r"layers\.(\d+)\.attention\.wo\.weight", r"model.layers.\1.self_attn.o_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w1\.weight", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w3\.weight", r"model.layers.\1.mlp.up_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w2\.weight", r"model.layers.\1.mlp.down_proj.weight"),
    (r"layers\.(\d+)\.attention_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"layers\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
)

FAMILY = ModelFamily(
    name="builtin",
    description="builtin",
    hf_architecture="LlamaForCausalLM",
    adapter="flowrl.models.families.builtin.adapter",
    split_table=SPLIT_TABLE,
    export_names=EXPORT_NAMES,
    packing=True,
)
