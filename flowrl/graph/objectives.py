"""Which passes an objective makes the trainer run: the one table the trainer and the planner read.

The trainer (``flowrl.operators.trainer``) and the planner's cost of a policy step
(``flowrl.planners.roles.policy_role``) both ask ``recomputes_logprobs``, so the planner prices the
forward passes the trainer runs. A policy step over one rollout batch runs::

    num_iterations                       forward + backward passes over the batch (with gradients)
    + 1 if recomputes_logprobs(...)      a forward pass without gradients: log pi_prox, the weights the
                                         batch starts with (batch field ``proximal_logprobs``)

The recompute runs for an objective that reads log pi_prox itself (``NEEDS_PROXIMAL``) and for any
objective with several optimizer steps a batch (``updates_per_batch > 1``: the later steps' "old"
policy is no longer pi). With one step a batch, the other objectives read mu's log-probs, the
generator's, and the PPO-style ones (``ANCHORED_AT_OLD``) take pi's own values as pi_old.

Example:
    >>> recomputes_logprobs("grpo", updates_per_batch=1), recomputes_logprobs("grpo", updates_per_batch=2)
    (False, True)
    >>> recomputes_logprobs("decoupled_ppo", updates_per_batch=1)
    True
"""

from __future__ import annotations

__all__ = ["NEEDS_PROXIMAL", "ANCHORED_AT_OLD", "READS_TEACHER", "recomputes_logprobs"]

#: Objectives that read the proximal policy's log-probs (batch field ``proximal_logprobs``, which the
#: trainer computes once per batch with the weights it starts the batch with).
NEEDS_PROXIMAL: frozenset[str] = frozenset({"decoupled_ppo"})

#: PPO-style objectives whose clipped ratio is taken against the old policy: ``proximal_logprobs``
#: when the batch has them (several updates per batch: TRL's ``old_per_token_logps``), else mu.
ANCHORED_AT_OLD: frozenset[str] = frozenset({"grpo", "ppo_clip", "ppo", "gspo", "cispo"})


#: Objectives that read a teacher node's per-token log-probs (batch field ``teacher_logprobs``: ``flowrl.operators.distill``).
READS_TEACHER: frozenset[str] = frozenset({"opd"})


def recomputes_logprobs(objective: str, *, updates_per_batch: int) -> bool:
    """Whether a policy step runs the extra no-gradient forward pass for log pi_prox (module docstring)."""
    return updates_per_batch > 1 or objective in NEEDS_PROXIMAL
