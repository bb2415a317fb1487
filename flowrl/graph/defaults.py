"""Defaults per model kind: the values ``GraphBuilder`` fills in where the user set none.

The configs' own defaults (``OptimizerConfig.lr`` 1e-3, ``SamplingConfig.max_new_tokens`` 8,
``WeightEdge.max_staleness`` 1) suit the built-in model and a Hugging Face architecture trained from
random weights (``init="random"``): small models learning a toy task from scratch, fast, with one
batch of overlap between generation and training. A pretrained Hugging Face model
(``init="pretrained"``) is fine-tuned, as TRL fine-tunes it, and takes TRL's ``GRPOConfig``
defaults instead:

- ``lr`` 1e-6 (TRL's ``learning_rate``): at 1e-3 AdamW moves every weight of a pretrained model
  by about 1e-3 a step, which wrecks it within a few steps; 1e-6 is the scale RL fine-tuning uses.
- ``max_new_tokens`` 256 (TRL's ``max_completion_length``): room for an answer with some reasoning;
  8 tokens cut nearly every completion of a real model.
- ``max_staleness`` 0 on a weight edge into a generator: synchronous on-policy training, as TRL
  trains, so a first run reproduces what its user knows; k >= 1 (overlap, rollouts up to k batches
  old, corrected by the objective) is a choice to make once that run works.

Only the builder applies them, to what its caller did not give: a keyword argument, or a whole
config (``optimizer=``, ``sampling=``), always wins, and a graph file (``from_json``) keeps the
values it stored. ``print(graph)`` names each value a kind's default set (``GraphStructure.defaults``).

The builder looks the defaults up as ``KIND_DEFAULTS[model_kind(model)]`` for ``lr``,
``max_new_tokens`` and a generator edge's ``max_staleness``; each value it set off the config's
default is a ``DefaultUsed`` held by the ``Graph`` (not by its spec, so a graph file keeps its
values).

Example:
    >>> from flowrl.graph.configs import HFModelConfig
    >>> kind = model_kind(HFModelConfig(path="/models/qwen"))
    >>> kind, KIND_DEFAULTS[kind].lr
    ('hf-pretrained', 1e-06)
"""

from __future__ import annotations

from typing import Literal

import msgspec

from flowrl.graph.configs import AnyModelConfig, HFModelConfig

__all__ = ["ModelKind", "KindDefaults", "KIND_DEFAULTS", "KIND_NAMES", "DefaultUsed", "model_kind", "defaults_line"]

ModelKind = Literal["builtin", "hf-random", "hf-pretrained"]


class KindDefaults(msgspec.Struct, frozen=True, kw_only=True):
    """The builder's defaults for one model kind.

    Attributes:
        lr: a policy's and a critic's learning rate (``OptimizerConfig.lr``).
        max_new_tokens: a generator's longest completion (``SamplingConfig.max_new_tokens``).
        max_staleness: k of a weight edge into a generator (``WeightEdge.max_staleness``).
    """

    lr: float
    max_new_tokens: int
    max_staleness: int


_SCRATCH = KindDefaults(lr=1e-3, max_new_tokens=8, max_staleness=1)  # the configs' own defaults

#: The defaults of each model kind (``model_kind``).
KIND_DEFAULTS: dict[str, KindDefaults] = {
    "builtin": _SCRATCH,
    "hf-random": _SCRATCH,
    "hf-pretrained": KindDefaults(lr=1e-6, max_new_tokens=256, max_staleness=0),
}

#: How ``print(graph)`` and the docs name each kind.
KIND_NAMES: dict[str, str] = {
    "builtin": "the built-in model",
    "hf-random": "a Hugging Face model with random weights (init='random')",
    "hf-pretrained": "a pretrained Hugging Face model (init='pretrained')",
}


def model_kind(model: AnyModelConfig) -> ModelKind:
    """Which defaults ``model`` takes: ``"builtin"``, ``"hf-random"`` or ``"hf-pretrained"``."""
    if isinstance(model, HFModelConfig):
        return "hf-pretrained" if model.init == "pretrained" else "hf-random"
    return "builtin"


class DefaultUsed(msgspec.Struct, frozen=True, kw_only=True):
    """One value the builder set from a model kind's defaults, where that kind's value differs from
    the config's own default (a value equal to it needs no note).

    Attributes:
        node: the node (or ``"src ~> dst"`` for a weight edge) holding the value.
        option: the option's name (``lr``, ``max_new_tokens``, ``max_staleness``).
        value: the value set.
        kind: the model kind whose default it is (``model_kind``).
    """

    node: str
    option: str
    value: float | int
    kind: str


def defaults_line(used: tuple[DefaultUsed, ...]) -> list[str]:
    """``print(graph)``'s lines naming the values a kind's defaults set, one line per kind.

    Example:
        >>> defaults_line((DefaultUsed(node="policy", option="lr", value=1e-6, kind="hf-pretrained"),))
        ["  defaults of a pretrained Hugging Face model (init='pretrained'): policy.lr=1e-06 (flowrl.graph.defaults)"]
    """
    lines = []
    for kind in dict.fromkeys(u.kind for u in used):
        values = ", ".join(f"{u.node}.{u.option}={u.value:g}" for u in used if u.kind == kind)
        lines.append(f"  defaults of {KIND_NAMES[kind]}: {values} (flowrl.graph.defaults)")
    return lines
