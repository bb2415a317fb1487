"""The entry points the operators use for any family: ``family_of``, ``build_model``, ``weight_shapes``,
``meta_model``, ``model_tokens`` (torchtitan's ``TrainSpec`` idea: one small record per family).

Each reads the family's record in ``flowrl.models.families.FAMILIES`` and calls its adapter. A
node's model description picks its family: a ``ModelConfig`` is ``"builtin"``; an ``HFModelConfig``
is its directory's ``model_type``.

Example:
    >>> from flowrl.graph.configs import ModelConfig
    >>> family_of(ModelConfig()).name
    'builtin'
    >>> model_tokens(ModelConfig()).eos_ids
    (2,)
"""

from __future__ import annotations

import torch

from flowrl.graph.configs import AnyModelConfig, ModelConfig
from flowrl.models.causal_lm import CausalLM
from flowrl.models.families import FAMILIES
from flowrl.models.family import ModelFamily, ModelTokens

__all__ = ["family_of", "build_model", "weight_shapes", "meta_model", "model_tokens"]


def family_of(config: AnyModelConfig, *, owner: str = "model") -> ModelFamily:
    """The family of a model description (an HF one reads its directory's ``config.json``).

    ``owner`` starts the message of an error.

    Raises:
        ConfigError: for an HF directory that fails ``flowrl.models.hf.check_hf_dir``.
    """
    if isinstance(config, ModelConfig):
        return FAMILIES["builtin"]
    from flowrl.models.hf import check_hf_dir

    return FAMILIES[check_hf_dir(config, owner=owner)["model_type"]]


def build_model(config: AnyModelConfig, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> CausalLM:
    """The model of ``config`` in ``dtype`` on ``device``: seeded or pretrained weights, gradients on.

    Raises:
        ConfigError: for a description that cannot be built (a preset shape, a bad HF directory).
    """
    return family_of(config).load_adapter().build(config, dtype, device)


def weight_shapes(config: AnyModelConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of the tensors ``weight_dict`` gives for ``config``'s float32 model,
    from a model built on the meta device (no memory, no weights read).

    Raises:
        ConfigError: as ``build_model``.
    """
    from flowrl.models.causal_lm import as_module, weight_dict

    return {n: (tuple(t.shape), t.dtype) for n, t in weight_dict(as_module(meta_model(config))).items()}


def meta_model(config: AnyModelConfig) -> CausalLM:
    """``config``'s float32 model on the meta device: its modules and shapes, no memory, no weights read.

    Raises:
        ConfigError: as ``build_model``.
    """
    return family_of(config).load_adapter().meta_model(config)


def model_tokens(config: AnyModelConfig) -> ModelTokens:
    """Pad id, end ids and decoder of the model's tokenizer: the built-in digit tokenizer, or the
    HF tokenizer at ``config.tokenizer_path`` (checked against the embeddings' size).

    Raises:
        ConfigError: for a missing tokenizer, or one whose vocabulary exceeds the model's embeddings.
    """
    return family_of(config).load_adapter().tokens(config)
