"""The teacher node kind: a frozen model of its own that scores a student's rollout token by token.

A ``teacher`` node holds a causal LM (built-in or a Hugging Face directory), frozen, on devices of its
own. Each step it reads a generator's rollout and writes ``teacher_logprobs`` (``[sample, ctime]``):
log pi_teacher(y_t | x, y_<t) of every sampled completion token, under the rollout's sampling
temperature and the teacher's whole vocabulary (``flowrl.operators.teacher``). A loss with
``objective="opd"`` (on-policy distillation, ``flowrl.operators.distill``) reads them.

The teacher and the student must share one vocabulary: the teacher scores the student's token ids as
they are, so a different tokenizer would score other text. Cross-tokenizer distillation (aligning
two tokenizations of the same text) is not built, so such a pair is refused:

- at graph build (``teacher_problems``, run by ``flowrl.graph.validate``): a built-in teacher of
  another ``vocab_size`` than its generator's built-in model, or a built-in model beside a Hugging
  Face one (the built-in model reads the task's token ids, the other its tokenizer's);
- at run start (``flowrl.runtime.preflight.check_teachers``, every backend and every torchrun rank,
  before any work): two Hugging Face directories whose tokenizers (vocabulary and special tokens) or
  ``vocab_size`` differ (nothing is read from disk while a graph is built).

Also refused at graph build: an ``"opd"`` loss that no teacher feeds (``no_teacher``), and a teacher
that no loss reads (``flowrl.graph.validate``'s unread-output rule).

Across the layers: the teacher's operator is the reference's (``flowrl.operators.teacher.Teacher``
subclasses ``Reference``: its own output field, the whole vocabulary at the rollout's temperature)
and its program is the frozen ``ReferenceProgram``
(``flowrl.runtime.programs.nodes.build_teacher``); the planner prices it with ``reference_role``.
The objective ``opd`` (``flowrl.operators.distill``, named in ``LOSSES`` and
``flowrl.graph.objectives.READS_TEACHER``) turns ``log mu - log teacher`` into a negative per-token
advantage beside the reward's. Under torchrun it runs on one rank; a mesh of several is refused
(``flowrl.mesh_support``).

Example:
    >>> from flowrl.graph.builder import GraphBuilder
    >>> from flowrl.graph.configs import ModelConfig
    >>> b = GraphBuilder("distill", model=ModelConfig(vocab_size=16))
    >>> gen = b.generator("gen", b.source("prompts", task="copy"))
    >>> b.teacher("teacher", gen, model=ModelConfig(vocab_size=16, n_layers=4)).describe()
    'model=4L64d'
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import msgspec

from flowrl.graph.configs import AnyModelConfig, HFModelConfig, ModelConfig
from flowrl.graph.fields import FIELDS
from flowrl.graph.nodes import GeneratorNode, NodeBase, Signature

if TYPE_CHECKING:
    from flowrl.graph.structure import GraphStructure

__all__ = ["TeacherNode", "TEACHER_INPUTS", "TEACHER_FIELD", "teacher_problems", "no_teacher", "vocabulary_mismatch"]

#: Rollout fields a teacher reads.
TEACHER_INPUTS: tuple[str, ...] = (
    "sample_prompt_ids", "sample_prompt_lens", "completion_ids", "completion_mask", "completion_lens", "sampling_temperature",
)  # fmt: skip
#: What a teacher writes, and an ``"opd"`` loss reads.
TEACHER_FIELD = "teacher_logprobs"


class TeacherNode(NodeBase, tag="teacher", frozen=True):
    """A frozen teacher model (module docstring).

    Attributes:
        model: its model: a built-in shape (``ModelConfig``, seeded weights) or a Hugging Face
            directory (``HFModelConfig``, ``init="pretrained"`` to load trained weights); its
            vocabulary must be the student's.
    """

    model: AnyModelConfig = msgspec.field(default_factory=ModelConfig)

    def signature(self) -> Signature:
        return Signature({n: FIELDS[n] for n in TEACHER_INPUTS}, {TEACHER_FIELD: FIELDS[TEACHER_FIELD]})

    def describe(self) -> str:
        return f"model={self.model.short()}"


def vocabulary_mismatch(teacher: AnyModelConfig, student: AnyModelConfig) -> str | None:
    """Why ``teacher`` cannot score ``student``'s token ids, as far as the configs tell (no file read); None: it may.

    Example:
        >>> vocabulary_mismatch(ModelConfig(vocab_size=16), ModelConfig(vocab_size=32))
        "its vocab_size=16 differs from the student model's vocab_size=32"
    """
    if isinstance(teacher, ModelConfig) and isinstance(student, ModelConfig):
        if teacher.vocab_size != student.vocab_size:
            return f"its vocab_size={teacher.vocab_size} differs from the student model's vocab_size={student.vocab_size}"
        return None
    if isinstance(teacher, HFModelConfig) and isinstance(student, HFModelConfig):
        return None  # their tokenizer files are compared at run start (flowrl.runtime.preflight.check_teachers)
    kinds = {ModelConfig: "a built-in model (the task's token ids)", HFModelConfig: "a Hugging Face model (its tokenizer's ids)"}
    return f"it is {kinds[type(teacher)]} and the student is {kinds[type(student)]}: their token ids name different text"


def _students(g: GraphStructure, teacher: TeacherNode) -> list[GeneratorNode]:
    return [p for p in g.producers(teacher.name) if isinstance(p, GeneratorNode)]


def teacher_problems(g: GraphStructure) -> Iterable[str]:
    """A teacher whose vocabulary is not its student's (module docstring), as messages."""
    for teacher in g.nodes_of(TeacherNode):
        for gen in _students(g, teacher):
            why = vocabulary_mismatch(teacher.model, gen.model)
            if why is not None:
                yield (
                    f"teacher {teacher.name!r} ({teacher.model.short()}) cannot score the rollout of generator {gen.name!r} "
                    f"({gen.model.short()}): {why}. A teacher scores the student's token ids as they are, so it must share "
                    "the student's tokenizer and vocabulary (cross-tokenizer distillation is not supported): give the teacher "
                    "a model with the student's vocabulary"
                )


def no_teacher(g: GraphStructure, loss: NodeBase) -> str:
    """An ``"opd"`` loss that no teacher feeds: the builder calls that add one."""
    gens = [p.name for p in g.producers(loss.name) if p.kind == "generator"] or [n.name for n in g.nodes_of_kind("generator")]
    gen = gens[0] if gens else "gen"
    objective = getattr(getattr(loss, "loss", None), "objective", "opd")
    return (
        f"loss {loss.name!r} has objective={objective!r}, on-policy distillation from a teacher's per-token log-probs, but no "
        f"teacher node feeds it; add one: teacher = b.teacher('teacher', {gen!r}, model=...), and list it: "
        f"b.loss({loss.name!r}, ..., teacher) (or use a reward-only objective such as 'aipo')"
    )
