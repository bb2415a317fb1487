"""Model families and their builders (torchtitan's ``TrainSpec`` idea): one small record per family.

``FAMILIES`` maps a family name to a ``ModelFamily`` naming its builder. A node's model description
picks its family: a ``ModelConfig`` is ``"builtin"``; an ``HFModelConfig`` is its directory's
``model_type`` (one of ``HF_FAMILIES``: ``llama``, ``qwen2``, ``qwen3``). ``build_model`` is the one
entry point the operators use; ``model_tokens`` gives the pad id, end ids and a decoder for the
family's tokenizer.

Example:
    >>> from flowrl.graph.configs import ModelConfig
    >>> family_of(ModelConfig()).name, sorted(FAMILIES)
    ('builtin', ['builtin', 'llama', 'qwen2', 'qwen3'])
    >>> model_tokens(ModelConfig()).eos_ids
    (2,)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from flowrl.graph.configs import HF_FAMILIES, AnyModelConfig, HFModelConfig, ModelConfig
from flowrl.models.causal_lm import CausalLM

__all__ = ["ModelFamily", "FAMILIES", "family_of", "build_model", "weight_shapes", "meta_model", "ModelTokens", "model_tokens"]


@dataclass(frozen=True)
class ModelFamily:
    """One model family.

    Attributes:
        name: ``"builtin"`` or a Hugging Face ``model_type``.
        build: ``(config, dtype, device) -> CausalLM``.
        hf_architecture: the transformers class a checkpoint of this family exports as.
    """

    name: str
    build: Callable[[AnyModelConfig, torch.dtype, str | torch.device], CausalLM]
    hf_architecture: str


def _build_builtin(config: AnyModelConfig, dtype: torch.dtype, device: str | torch.device) -> CausalLM:
    from flowrl.operators.model import Transformer

    assert isinstance(config, ModelConfig)  # the registry routes by config type
    return Transformer(config).to(device=device, dtype=dtype)


def _build_hf(config: AnyModelConfig, dtype: torch.dtype, device: str | torch.device) -> CausalLM:
    from flowrl.models.hf import load_hf

    assert isinstance(config, HFModelConfig)  # the registry routes by config type
    return load_hf(config, dtype=dtype, device=device)


_HF_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

FAMILIES: dict[str, ModelFamily] = {
    "builtin": ModelFamily("builtin", _build_builtin, "LlamaForCausalLM"),
    **{name: ModelFamily(name, _build_hf, _HF_ARCH[name]) for name in HF_FAMILIES},
}


def family_of(config: AnyModelConfig) -> ModelFamily:
    """The family of a model description (an HF one reads its directory's ``config.json``).

    Raises:
        ConfigError: for an HF directory that fails ``flowrl.models.hf.check_hf_dir``.
    """
    if isinstance(config, ModelConfig):
        return FAMILIES["builtin"]
    from flowrl.models.hf import check_hf_dir

    return FAMILIES[check_hf_dir(config)["model_type"]]


def build_model(config: AnyModelConfig, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> CausalLM:
    """The model of ``config`` in ``dtype`` on ``device``: seeded or pretrained weights, gradients on.

    Raises:
        ConfigError: for a description that cannot be built (a preset shape, a bad HF directory).
    """
    return family_of(config).build(config, dtype, device)


def weight_shapes(config: AnyModelConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of the tensors ``weight_dict`` gives for ``config``'s float32 model,
    from a model built on the meta device (no memory, no weights read).

    Raises:
        ConfigError: as ``build_model``.
    """
    from flowrl.models.causal_lm import weight_dict

    return {n: (tuple(t.shape), t.dtype) for n, t in weight_dict(meta_model(config)).items()}


def meta_model(config: AnyModelConfig) -> CausalLM:
    """``config``'s float32 model on the meta device: its modules and shapes, no memory, no weights read.

    Raises:
        ConfigError: as ``build_model``.
    """
    if isinstance(config, ModelConfig):
        from flowrl.operators.model import Transformer

        with torch.device("meta"):
            model = Transformer(config)
    else:
        from flowrl.models.hf import HFCausalLM, check_hf_dir
        from flowrl.models.local import require_transformers

        raw = check_hf_dir(config)
        transformers = require_transformers("a Hugging Face model")
        hf_config = transformers.AutoConfig.from_pretrained(str(Path(config.path).expanduser()), local_files_only=True)
        with torch.device("meta"):
            hf = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
        model = HFCausalLM(hf, max_seq_len=config.max_seq_len or int(raw.get("max_position_embeddings") or 1))
    return model


@dataclass(frozen=True)
class ModelTokens:
    """What generation needs from a model's tokenizer.

    Attributes:
        pad_id: id written after a completion ends.
        eos_ids: ids that end a completion.
        decode: ids -> text (for stop strings and text scorers).
    """

    pad_id: int
    eos_ids: tuple[int, ...]
    decode: Callable[[list[int]], str]


def model_tokens(config: AnyModelConfig) -> ModelTokens:
    """Pad id, end ids and decoder of the model's tokenizer: the built-in digit tokenizer, or the
    HF tokenizer at ``config.tokenizer_path`` (checked against the embeddings' size).

    Raises:
        ConfigError: for a missing tokenizer, or one whose vocabulary exceeds the model's embeddings.
    """
    if isinstance(config, ModelConfig):
        from flowrl.operators.tokenizer import DEFAULT_TOKENIZER

        return ModelTokens(DEFAULT_TOKENIZER.pad_id, (DEFAULT_TOKENIZER.eos_id,), DEFAULT_TOKENIZER.decode)
    from flowrl.models.hf import check_hf_dir, hf_eos_ids
    from flowrl.models.tokenizer import check_vocab, load_tokenizer

    raw = check_hf_dir(config)
    tok = load_tokenizer(config.tokenizer_path)
    check_vocab(tok, int(raw.get("vocab_size") or 0), owner=f"model {config.short()}")
    eos = tuple(dict.fromkeys(([tok.eos_token_id] if tok.eos_token_id is not None else []) + list(hf_eos_ids(config.path, raw))))
    return ModelTokens(int(tok.pad_token_id), eos, lambda ids: tok.decode(ids, skip_special_tokens=False))
