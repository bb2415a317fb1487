"""What each node computes: tasks, prompt source, generator, scorers, losses, trainer.

Modules, one concept each:

- ``batch``: ``Batch`` (field name -> tensor) and helpers to merge, split and measure batches.
- ``logprobs``: log-probs of completions under a model, the one computation the generator, the
  reference and the trainer share (so that equal weights give equal log-probs).
- ``tasks``: the built-in tasks (``copy``, ``add``) and their reward functions.
- ``source``: the prompt source node's operator (an endless, seeded, resumable prompt stream).
- ``generation``: the generator node's operator (batched sampling that records mu's log-probs).
- ``scoring``: the scorer node's operator (user reward functions, validated).
- ``reference``: the reference node's operator (a frozen initial policy).
- ``losses``: advantages, AIPO, GRPO/PPO-clip as pure functions.
- ``trainer``: the policy node's operator (AdamW steps, version clock, weights in and out).

Submodules are imported on use (``from flowrl.operators.trainer import Trainer``) so that importing
``flowrl.operators`` does not import torch.
"""

from __future__ import annotations

__all__: list[str] = []
