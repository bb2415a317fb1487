"""The built-in family's adapter (``flowrl.models.family.FamilyAdapter``): build, meta model, tokens, export.

It exports as ``LlamaForCausalLM``, and the mapping is exact: the same RMSNorm in float32 with
``norm_eps``, the half-split rotary layout of transformers' ``rotate_half`` with the same
``rope_theta`` frequencies, SwiGLU ``down(silu(gate x) * up x)``, grouped-query attention scaled by
``1/sqrt(head_dim)``, tied embeddings as ``tie_word_embeddings``; so the logits agree to float
rounding. Its character tokenizer is written as a ``tokenizers`` word-level tokenizer over single
characters with the same ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from flowrl.graph.configs import AnyModelConfig, ModelConfig
from flowrl.models.families.builtin.model import Transformer
from flowrl.models.families.builtin.tokenizer import DEFAULT_TOKENIZER
from flowrl.models.family import ModelTokens
from flowrl.models.local import require_transformers

__all__ = ["build", "meta_model", "tokens", "hf_config", "save_tokenizer"]


def _config(config: AnyModelConfig) -> ModelConfig:
    assert isinstance(config, ModelConfig)  # the registry routes a ModelConfig here, nothing else
    return config


def build(config: AnyModelConfig, dtype: torch.dtype, device: str | torch.device) -> Transformer:
    """``Transformer(config)`` in ``dtype`` on ``device`` (seeded weights)."""
    return Transformer(_config(config)).to(device=device, dtype=dtype)


def meta_model(config: AnyModelConfig) -> Transformer:
    """``Transformer(config)`` on the meta device."""
    with torch.device("meta"):
        return Transformer(_config(config))


def tokens(config: AnyModelConfig) -> ModelTokens:
    """The character tokenizer's pad id, end id and decoder."""
    return ModelTokens(DEFAULT_TOKENIZER.pad_id, (DEFAULT_TOKENIZER.eos_id,), DEFAULT_TOKENIZER.decode)


def hf_config(config: AnyModelConfig) -> Any:
    """The ``LlamaConfig`` of the same model."""
    c = _config(config)
    transformers = require_transformers("exporting as LlamaForCausalLM")
    return transformers.LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.dim,
        intermediate_size=c.hidden_dim,
        num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads,
        head_dim=c.head_dim,
        max_position_embeddings=c.max_seq_len,
        rms_norm_eps=c.norm_eps,
        rope_theta=c.rope_theta,
        tie_word_embeddings=c.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
        pad_token_id=DEFAULT_TOKENIZER.pad_id,
        bos_token_id=DEFAULT_TOKENIZER.bos_id,
        eos_token_id=DEFAULT_TOKENIZER.eos_id,
    )


def save_tokenizer(config: AnyModelConfig, out: Path) -> None:
    """The character tokenizer as a ``PreTrainedTokenizerFast`` (word level over single characters, same ids)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = DEFAULT_TOKENIZER
    transformers = require_transformers("exporting a tokenizer")
    vocab = {t: i for i, t in enumerate(tok.tokens)}
    inner = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    inner.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    inner.decoder = decoders.Fuse()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=inner, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(out))
