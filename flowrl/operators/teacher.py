"""The teacher node's operator: a frozen model of its own scoring each sampled token of a rollout.

``Teacher`` is the reference's operator (``flowrl.operators.reference.Reference``: the model built by
``flowrl.models.build_model`` from the node's own config, float32, no gradients, one forward pass of
``completion_logprobs`` over prompt and completion) writing ``teacher_logprobs`` and scoring under the
whole vocabulary at the rollout's ``sampling_temperature``: a token the student sampled from its own
top-k / top-p kept set still gets the teacher's finite log-prob, so the reverse KL of
``flowrl.operators.distill`` is finite for every sampled token.

``check_same_tokenizer`` compares two Hugging Face tokenizer directories (run at run start by
``flowrl.runtime.preflight.check_teachers``; the configs alone are compared when the graph is built,
``flowrl.graph.teacher``).

Example:
    >>> from flowrl.graph.configs import ModelConfig
    >>> from flowrl.graph.teacher import TeacherNode
    >>> teacher = Teacher(TeacherNode(name="teacher", model=ModelConfig(vocab_size=16, dim=32, n_layers=1, n_heads=2, n_kv_heads=1)))
    >>> out = teacher.logprobs({"sample_prompt_ids": torch.tensor([[1, 4, 14]]), "sample_prompt_lens": torch.tensor([3]),
    ...                         "completion_ids": torch.tensor([[4, 2]]), "completion_mask": torch.tensor([[True, True]]),
    ...                         "sampling_top_k": torch.tensor([1])})
    >>> out["teacher_logprobs"].shape, bool(torch.isfinite(out["teacher_logprobs"]).all())
    (torch.Size([1, 2]), True)
"""

from __future__ import annotations

from typing import Any

import torch

from flowrl.errors import ConfigError
from flowrl.graph.teacher import TEACHER_FIELD
from flowrl.operators.reference import Reference

__all__ = ["Teacher", "check_same_tokenizer"]


class Teacher(Reference):
    """A teacher's per-token log-probs of the student's completions (module docstring)."""

    output = TEACHER_FIELD
    truncates = False


def _vocabulary(tok: Any) -> tuple[dict[str, int], dict[str, Any]]:
    """A tokenizer's token -> id map and its special tokens (what decides which text an id names)."""
    return dict(tok.get_vocab()), {k: v for k, v in tok.special_tokens_map.items()}


def check_same_tokenizer(teacher_dir: str, student_dir: str, *, owner: str) -> None:
    """Refuse two tokenizer directories whose vocabularies or special tokens differ.

    Raises:
        ConfigError: naming ``owner``, both directories, and the first difference.
    """
    from flowrl.models.tokenizer import load_tokenizer

    teacher, student = (load_tokenizer(d, owner=owner) for d in (teacher_dir, student_dir))
    (tv, ts), (sv, ss) = _vocabulary(teacher), _vocabulary(student)
    if tv == sv and ts == ss:
        return
    if len(tv) != len(sv):
        what = f"{len(tv)} tokens against the student's {len(sv)}"
    elif tv != sv:
        token = next(t for t in sorted(tv) if sv.get(t) != tv[t])
        what = f"token {token!r} is id {tv[token]} in the teacher's and {sv.get(token)} in the student's"
    else:
        what = f"special tokens {ts} against the student's {ss}"
    raise ConfigError(
        f"{owner}: its tokenizer ({teacher_dir}) is not the student's ({student_dir}): {what}. A teacher scores the student's "
        "token ids as they are, so both must share one tokenizer (cross-tokenizer distillation is not supported): "
        "give the teacher a model trained with the student's tokenizer"
    )
