"""Objectives as rows: the one table the trainer, the validator and the planner read.

An objective is an ``ObjectiveRow``: its name, its loss function (a built-in's found by name in
``flowrl.operators.losses.LOSSES``, a user's a reference ``module:function``), the log-probs it reads, whether it is anchored at the old
policy, the advantages it takes, the correction it already applies and its own options. Nothing here
imports torch: a graph holds the row's facts, the trainer resolves its function by name.

Reads (``ObjectiveRow.reads``), each a batch field the trainer hands the loss function:

    mu         the generator's recorded log-probs (``behaviour_logprobs``); every objective has them
    proximal   log pi_prox, the trainer's weights at the batch's start (``proximal_logprobs``): the
               trainer runs one more forward pass without gradients for it (``recomputes_logprobs``)
    values     a critic's values (``values``): token-level GAE advantages (``advantages="gae"``)
    teacher    a teacher's per-token log-probs of the sampled tokens (``teacher_logprobs``)

The trainer (``flowrl.operators.trainer``) and the planner's cost of a policy step
(``flowrl.planners.roles.policy_role``) both ask ``recomputes_logprobs``, so the planner prices the
forward passes the trainer runs. A policy step over one rollout batch runs::

    num_iterations                       forward + backward passes over the batch (with gradients)
    + 1 if recomputes_logprobs(...)      a forward pass without gradients: log pi_prox

The recompute runs for an objective that reads log pi_prox itself and for any objective with several
optimizer steps a batch (``updates_per_batch > 1``: the later steps' "old" policy is no longer pi).
With one step a batch an objective anchored at the old policy (``anchored_at_old``) takes mu's
log-probs as pi_old, or pi's own values when a rollout correction (``flowrl.graph.corrections``) takes
the mu -> pi_old gap.

A user's objective is one ``register_objective`` call in their module; the builder copies its row into
the loss's config (``LossConfig.row``), so a saved graph file holds it, and its function is imported
by reference where the run starts (``flowrl.runtime.names``): one that cannot be imported is a
``ConfigError`` there.

Example:
    >>> recomputes_logprobs("grpo", updates_per_batch=1), recomputes_logprobs("grpo", updates_per_batch=2)
    (False, True)
    >>> recomputes_logprobs("decoupled_ppo", updates_per_batch=1)
    True
    >>> OBJECTIVES["ppo"].reads, OBJECTIVES["ppo"].advantages
    (('mu', 'values'), 'gae')
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

import msgspec

from flowrl.errors import ConfigError
from flowrl.graph.refs import check_reference, reference_of

__all__ = [
    "READS",
    "READ_FIELDS",
    "ObjectiveRow",
    "OBJECTIVES",
    "BUILTIN_OBJECTIVES",
    "NEEDS_PROXIMAL",
    "ANCHORED_AT_OLD",
    "READS_TEACHER",
    "register_objective",
    "row_of",
    "known_objectives",
    "recomputes_logprobs",
]

#: What an objective may read, in the order a row lists them.
READS: tuple[str, ...] = ("mu", "proximal", "values", "teacher")

#: The batch field of each read.
READ_FIELDS: dict[str, str] = {
    "mu": "behaviour_logprobs",
    "proximal": "proximal_logprobs",
    "values": "values",
    "teacher": "teacher_logprobs",
}


class ObjectiveRow(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One objective (module docstring).

    Attributes:
        name: ``LossConfig.objective``.
        fn: a user's loss, ``module:function`` (or ``file.py:function``); "" for a built-in (its
            function is ``flowrl.operators.losses.LOSSES[name]``). The loss is
            ``fn(config, logprobs, old, advantages, mask, *, normalizer, lengths, options, **reads)``
            returning ``(loss, metrics)``: ``old`` is the log-probs of the policy its ratio is taken
            against (mu, or pi_old when ``anchored_at_old``), ``reads`` holds ``proximal=`` /
            ``teacher=`` for the rows that read them, ``options`` the row's options with the loss's values.
        reads: a subset of ``READS``, always with ``"mu"``.
        anchored_at_old: its ratio is pi / pi_old (PPO-style): pi_prox when the trainer computed it,
            pi's own values under a correction, else mu.
        advantages: ``"group"`` (a group baseline of the rewards, ``[S]``) or ``"gae"`` (a critic's
            whitened GAE, ``[S, C]``; reads ``"values"``).
        corrects: the mismatch correction the objective applies itself, named ("" for none): a
            ``correction=`` on it is refused.
        options: its own options and their defaults (``LossConfig.options`` sets them).
        summary: its formula in one line (the objective guide, ``docs/objectives.md``).
    """

    name: str
    fn: str = ""
    reads: tuple[str, ...] = ("mu",)
    anchored_at_old: bool = False
    advantages: Literal["group", "gae"] = "group"
    corrects: str = ""
    options: dict[str, float] = msgspec.field(default_factory=dict)
    summary: str = ""

    def __post_init__(self) -> None:
        where = f"objective {self.name!r}"
        if not self.name.isidentifier():
            raise ConfigError(f"{where}: the name must be letters, digits and '_' (it is LossConfig.objective)")
        message = check_reference(self.fn) if self.fn else None
        if message:
            raise ConfigError(f"{where}: fn: {message}")
        unknown = [r for r in self.reads if r not in READS]
        if unknown or "mu" not in self.reads or len(set(self.reads)) != len(self.reads):
            raise ConfigError(f"{where}: reads={self.reads} must hold 'mu' and only {READS}, each once (unknown: {unknown})")
        if self.advantages not in ("group", "gae"):
            raise ConfigError(f"{where}: advantages={self.advantages!r} must be 'group' or 'gae'")
        if (self.advantages == "gae") != ("values" in self.reads):
            raise ConfigError(f"{where}: advantages={self.advantages!r} and reads={self.reads}: GAE advantages read a critic's 'values', and only they do")
        bad = [k for k, v in self.options.items() if not k.isidentifier() or not isinstance(v, (int, float))]
        if bad:
            raise ConfigError(f"{where}: options {bad} must be identifiers with numeric defaults")

    def describe(self) -> str:
        """Its function's reference (a built-in's name)."""
        return self.fn or self.name

    @property
    def recomputes(self) -> bool:
        """Whether the trainer computes log pi_prox for it whatever the updates per batch."""
        return "proximal" in self.reads


def _row(name: str, **kw: Any) -> ObjectiveRow:
    return ObjectiveRow(name=name, **kw)


_CLIP = "min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)"

#: The built-in rows (formulas and papers in ``flowrl.operators.losses``).
BUILTIN_OBJECTIVES: dict[str, ObjectiveRow] = {
    r.name: r
    for r in (
        _row("aipo", corrects="AIPO's one-sided truncation of pi/mu at rho", summary="- sg[min(pi/mu, rho)] A log pi"),
        _row("pg", summary="- A log pi (mu ignored)"),
        _row("grpo", anchored_at_old=True, summary=f"- {_CLIP}, r = pi/pi_old"),
        _row("ppo_clip", anchored_at_old=True, summary="grpo's, under the PPO paper's name"),
        _row("ppo", reads=("mu", "values"), anchored_at_old=True, advantages="gae",
             summary=f"- {_CLIP}, A a critic's whitened GAE per token"),  # fmt: skip
        _row("gspo", anchored_at_old=True, summary=f"- {_CLIP}, r the sequence's geometric-mean ratio"),
        _row("cispo", anchored_at_old=True, summary="- sg[clip(r, 1 - eps_low, 1 + eps_high)] A log pi"),
        _row("tis", corrects="truncated IS of pi/mu (the tis objective)", summary="- sg[min(pi/mu, rho)] A log pi, per token or sequence"),
        _row("mis", corrects="masked IS of pi/mu (the mis objective)", summary="- sg[pi/mu 1[rho_low <= pi/mu <= rho]] A log pi"),
        _row("decoupled_ppo", reads=("mu", "proximal"), corrects="decoupled PPO's pi_prox/mu weight capped at rho",
             summary=f"- sg[pi_prox/mu 1[pi_prox/mu <= rho]] {_CLIP}, r = pi/pi_prox"),  # fmt: skip
        _row("dppo", corrects="DPPO's probability-difference mask against mu",
             options={"mask_low": 0.2, "mask_high": 0.2, "adv_tau": 1.0, "kl_tau": 1e-3},
             summary="- 1[keep] adv_tau A pi/mu + kl_tau (log pi/mu)^2; keep: pi - mu <= mask_high (A > 0), >= -mask_low (A < 0)"),  # fmt: skip
        _row("opd", reads=("mu", "teacher"), corrects="AIPO's one-sided truncation of pi/mu at rho",
             summary="- sg[min(pi/mu, rho)] (A - distill_coef (log mu - log teacher)) log pi, per token"),  # fmt: skip
        _row("sapo", anchored_at_old=True, options={"tau_pos": 1.0, "tau_neg": 1.05},
             summary="- (4/tau) sigmoid(tau (r - 1)) A, tau = tau_pos (A > 0) or tau_neg, r = pi/pi_old"),  # fmt: skip
    )
}

#: Every objective this process knows: the built-in rows and those ``register_objective`` added.
OBJECTIVES: dict[str, ObjectiveRow] = dict(BUILTIN_OBJECTIVES)

#: The built-in objectives that read the proximal policy's log-probs (``reads`` holds ``"proximal"``).
NEEDS_PROXIMAL: frozenset[str] = frozenset(n for n, r in BUILTIN_OBJECTIVES.items() if r.recomputes)

#: The built-in PPO-style objectives whose ratio is taken against the old policy (``anchored_at_old``).
ANCHORED_AT_OLD: frozenset[str] = frozenset(n for n, r in BUILTIN_OBJECTIVES.items() if r.anchored_at_old)

#: The built-in objectives that read a teacher node's per-token log-probs (``reads`` holds ``"teacher"``:
#: batch field ``teacher_logprobs``, ``flowrl.graph.teacher``, ``flowrl.operators.distill``).
READS_TEACHER: frozenset[str] = frozenset(n for n, r in BUILTIN_OBJECTIVES.items() if "teacher" in r.reads)


def register_objective(
    name: str,
    fn: Callable[..., Any] | str,
    *,
    reads: tuple[str, ...] = ("mu",),
    anchored_at_old: bool = False,
    advantages: Literal["group", "gae"] = "group",
    corrects: str = "",
    options: Mapping[str, float] | None = None,
    summary: str = "",
) -> ObjectiveRow:
    """Add a user's objective (its row, ``ObjectiveRow``'s fields) to this process's table; returns it.

    ``fn`` is a module-level function (or its reference); graphs store it by reference, as a scorer's
    function. Registering a name again replaces its row (a script run again in one process, edited).

    Example:
        >>> row = register_objective("my_pg", "flowrl.operators.losses:pg_objective")
        >>> row.fn, OBJECTIVES["my_pg"] is row
        ('flowrl.operators.losses:pg_objective', True)
        >>> del OBJECTIVES["my_pg"]

    Raises:
        ConfigError: a built-in's name or a malformed row.
    """
    try:
        ref = reference_of(fn)  # a user's function, stored by reference
    except Exception as exc:  # a lambda or a nested function: GraphError
        raise ConfigError(f"objective {name!r}: {exc}") from None
    row = ObjectiveRow(
        name=name, fn=ref, reads=tuple(reads), anchored_at_old=anchored_at_old, advantages=advantages,
        corrects=corrects, options=dict(options or {}), summary=summary,
    )  # fmt: skip
    if name in BUILTIN_OBJECTIVES:
        raise ConfigError(f"objective {name!r} is built in; register yours under another name")
    OBJECTIVES[name] = row
    return row


def known_objectives() -> str:
    """The names of every objective this process knows, for error messages."""
    return ", ".join(sorted(OBJECTIVES))


def row_of(config: Any, *, owner: str = "loss") -> ObjectiveRow:
    """The row of a ``LossConfig`` (or of an objective's name): the row it carries (a user's, from a
    graph file), else this process's table.

    Raises:
        ConfigError: an objective no table knows, listing the known ones.
    """
    if isinstance(config, str):
        name, carried = config, None
    else:
        name, carried = config.objective, getattr(config, "row", None)
    if carried is not None:
        return carried
    if name not in OBJECTIVES:
        raise ConfigError(
            f"{owner}: unknown objective {name!r}; known objectives are {known_objectives()} "
            "(a user's objective: flowrl.graph.objectives.register_objective in the module that builds the graph)"
        )
    return OBJECTIVES[name]


def recomputes_logprobs(objective: Any, *, updates_per_batch: int) -> bool:
    """Whether a policy step runs the extra no-gradient forward pass for log pi_prox (module
    docstring); ``objective`` is a name or a ``LossConfig``. An unknown name is priced as one that
    does not (the run refuses it at start)."""
    if updates_per_batch > 1:
        return True
    try:
        return row_of(objective).recomputes
    except ConfigError:
        return False
