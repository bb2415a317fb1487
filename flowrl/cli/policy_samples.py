"""The arguments ``flowrl sample`` and ``flowrl eval`` share; what they do with a checkpoint is
``flowrl.runtime.evaluation.policy_samples`` (which evaluation during training uses too)."""

from __future__ import annotations

from typing import Any

__all__ = ["add_checkpoint_arguments"]


def add_checkpoint_arguments(p: Any) -> None:
    """The arguments ``flowrl sample`` and ``flowrl eval`` share: CHECKPOINT, ``--seed``, ``--data``."""
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="a checkpoint directory (its LATEST is used) or a step-* directory")
    p.add_argument("--seed", type=int, default=0, help="seed of sampling (default: 0)")
    p.add_argument("--data", metavar="FILE", help="held-out prompt file (same fields as training), for a graph whose source reads a file")
