"""The adapter the Hugging Face families with Llama-style blocks share (``llama``, ``qwen2``, ``qwen3``).

``flowrl.models.family.FamilyAdapter`` over a local directory (``HFModelConfig``): the model is
``flowrl.models.hf.HFCausalLM`` (Hugging Face parameter names, so weights export unrenamed), the
tokenizer is the directory's (or ``HFModelConfig.tokenizer``'s), the export config is the
directory's ``config.json``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from flowrl.graph.configs import AnyModelConfig, HFModelConfig
from flowrl.models.family import ModelTokens
from flowrl.models.hf import HFCausalLM, check_hf_dir, hf_eos_ids, load_hf
from flowrl.models.local import require_transformers
from flowrl.models.tokenizer import check_vocab, load_tokenizer

__all__ = ["build", "meta_model", "tokens", "hf_config", "save_tokenizer"]


def _config(config: AnyModelConfig) -> HFModelConfig:
    assert isinstance(config, HFModelConfig)  # the registry routes an HFModelConfig here, nothing else
    return config


def build(config: AnyModelConfig, dtype: torch.dtype, device: str | torch.device) -> HFCausalLM:
    """``load_hf``: pretrained weights, or seeded random ones."""
    return load_hf(_config(config), dtype=dtype, device=device)


def meta_model(config: AnyModelConfig) -> HFCausalLM:
    """The directory's architecture on the meta device (``config.json`` only)."""
    c = _config(config)
    raw = check_hf_dir(c)
    with torch.device("meta"):
        hf = require_transformers("a Hugging Face model").AutoModelForCausalLM.from_config(hf_config(c), dtype=torch.float32)
    return HFCausalLM(hf, max_seq_len=c.max_seq_len or int(raw.get("max_position_embeddings") or 1))


def tokens(config: AnyModelConfig) -> ModelTokens:
    """The tokenizer at ``config.tokenizer_path``, checked against the embeddings' size; its end ids
    and those of ``config.json`` / ``generation_config.json``."""
    c = _config(config)
    raw = check_hf_dir(c)
    tok = load_tokenizer(c.tokenizer_path)
    check_vocab(tok, int(raw.get("vocab_size") or 0), owner=f"model {c.short()}")
    eos = tuple(dict.fromkeys(([tok.eos_token_id] if tok.eos_token_id is not None else []) + list(hf_eos_ids(c.path, raw))))
    return ModelTokens(int(tok.pad_token_id), eos, lambda ids: tok.decode(ids, skip_special_tokens=False))


def hf_config(config: AnyModelConfig) -> Any:
    """The directory's transformers config."""
    transformers = require_transformers("a Hugging Face model")
    return transformers.AutoConfig.from_pretrained(str(Path(_config(config).path).expanduser()), local_files_only=True)


def save_tokenizer(config: AnyModelConfig, out: Path) -> None:
    """The directory's tokenizer and, if it has one, its ``generation_config.json``."""
    import shutil

    c = _config(config)
    load_tokenizer(c.tokenizer_path, owner="export").save_pretrained(str(out))
    gen_cfg = Path(c.path).expanduser() / "generation_config.json"
    if gen_cfg.is_file():
        shutil.copyfile(gen_cfg, out / "generation_config.json")
