"""Typed batch fields: what flows along data edges, with the standard fields of an RL rollout.

A field is a name plus a type: a dtype and named dims. Dims are symbolic, written the way the shape
comments in the operators read (``sample``, ``time``): ``prompt`` counts prompts in a batch, ``sample``
counts completions (``prompt * n_samples``), ``ptime`` and ``ctime`` are prompt and completion
positions, ``time`` both (the prompt's columns, then the completion's). A scalar has no dims.

Example:
    >>> FIELDS["behaviour_logprobs"]
    FieldType(dtype='float32', dims=('sample', 'ctime'))
    >>> str(FIELDS["behaviour_logprobs"])
    'float32[sample,ctime]'
"""

from __future__ import annotations

from typing import Literal

import msgspec

__all__ = ["Dtype", "FieldType", "FIELDS", "SOURCE_FIELDS", "ROLLOUT_FIELDS", "OPTIONAL_FIELDS", "field_type"]

Dtype = Literal["int64", "float32", "bool", "uint8"]


class FieldType(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The type of one batch field.

    Attributes:
        dtype: element type of the tensor.
        dims: symbolic dim names, outermost first; ``()`` for a scalar.
    """

    dtype: Dtype
    dims: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(self.dims)}]"


def _t(dtype: Dtype, *dims: str) -> FieldType:
    return FieldType(dtype=dtype, dims=tuple(dims))


#: The standard fields, by name. Node kinds declare their inputs and outputs from this table
#: (``flowrl.graph.kinds.signature``); scorer outputs (``rewards`` by default) are float32[sample].
FIELDS: dict[str, FieldType] = {
    # source -> generator
    "prompt_ids": _t("int64", "prompt", "ptime"),  # left-padded prompt tokens
    "prompt_lens": _t("int64", "prompt"),  # real (unpadded) prompt lengths
    "prompt_index": _t("int64", "prompt"),  # position of each prompt in the source stream
    # generator -> scorer / loss / reference
    "sample_prompt_ids": _t("int64", "sample", "ptime"),  # the prompt of each sample, left-padded
    "sample_prompt_lens": _t("int64", "sample"),
    "completion_ids": _t("int64", "sample", "ctime"),  # right-padded completion tokens
    "completion_mask": _t("bool", "sample", "ctime"),  # True on real completion tokens
    "completion_lens": _t("int64", "sample"),
    "behaviour_logprobs": _t("float32", "sample", "ctime"),  # log mu(y_t | x, y_<t)
    "sampling_temperature": _t("float32", "sample"),  # softmax temperature mu sampled at
    "sampling_top_k": _t("int64", "sample"),  # top-k mu sampled with (0: off)
    "sampling_top_p": _t("float32", "sample"),  # top-p mu sampled with (1: off)
    "group_ids": _t("int64", "sample"),  # which prompt of the batch each sample answers
    "rollout_version": _t("int64"),  # policy version of the weights that sampled (the oldest token's)
    "token_versions": _t("int64", "sample", "ctime"),  # version of the weights that drew each token
    # generator with routing_replay (a mixture of experts; flowrl.models.routing) -> loss, reference, critic: each
    # token's experts per MoE layer, over the left-padded prompt then the completion; the expert count marks
    # "not recorded"; uint8, or int16 for a model of more than 255 experts (routing.expert_dtype)
    "routed_experts": _t("uint8", "sample", "time", "layer", "top_k"),
    # generator with an environment (flowrl.graph.envs.ENV_FIELDS) -> loss, metrics
    "env_rewards": _t("float32", "sample"),  # the sum of the environment's step rewards (0 for a failed sample)
    "env_failed": _t("bool", "sample"),  # the episode failed (the environment raised, hung or returned garbage)
    "env_turns": _t("int64", "sample"),  # model turns the episode took
    # reference -> loss
    "ref_logprobs": _t("float32", "sample", "ctime"),
    # teacher -> loss (flowrl.graph.teacher): log pi_teacher of each sampled token, at the rollout's temperature
    "teacher_logprobs": _t("float32", "sample", "ctime"),
    # critic -> loss (flowrl.graph.critic)
    "values": _t("float32", "sample", "ctime"),  # V(x, y_<t): the critic's value of the state before each completion token
    "value_version": _t("int64"),  # the critic's version (its optimizer steps) whose weights computed ``values``
    # loss -> policy
    "objective": _t("float32"),
}

SOURCE_FIELDS: tuple[str, ...] = ("prompt_ids", "prompt_lens", "prompt_index")
ROLLOUT_FIELDS: tuple[str, ...] = (
    "sample_prompt_ids",
    "sample_prompt_lens",
    "completion_ids",
    "completion_mask",
    "completion_lens",
    "behaviour_logprobs",
    "sampling_temperature",
    "sampling_top_k",
    "sampling_top_p",
    "group_ids",
    "rollout_version",
    "prompt_index",
    "token_versions",
)

#: Inputs a node reads when an edge carries them and does without otherwise (a graph saved before
#: the field existed still validates): the trainer and the reference take temperature 1 and no
#: truncation then, the mismatch metrics take ``rollout_version`` for every token's version, and a
#: mixture of experts routes by its own routers where no ``routed_experts`` arrive (no routing replay).
OPTIONAL_FIELDS: frozenset[str] = frozenset({"sampling_temperature", "sampling_top_k", "sampling_top_p", "token_versions", "routed_experts"})

REWARD_TYPE = _t("float32", "sample")


def field_type(name: str) -> FieldType:
    """The type of a standard field; any other name is a reward field (float32[sample])."""
    return FIELDS.get(name, REWARD_TYPE)
