"""The reference node's operator: a frozen copy of the initial policy that scores completions for a KL penalty.

It builds the same model as the policy (``flowrl.models.build_model``: the same seeded or pretrained
weights, so it *is* the policy's version 0) and never trains. ``logprobs`` uses
``completion_logprobs`` at the rollout's ``sampling_temperature``, ``sampling_top_k`` and
``sampling_top_p`` (the reference truncated by its own kept set), the computation the trainer uses
for pi, so a KL estimate between them is exactly 0 before the first step. A token outside the
reference's kept set gets ``-inf``; the KL penalty leaves it out (``losses.kl_penalty``).

The model lives on ``device``; the rollout arrives as CPU tensors and ``ref_logprobs`` returns on the CPU.

Example:
    >>> from flowrl.graph.nodes import ReferenceNode
    >>> from flowrl.graph.configs import ModelConfig
    >>> ref = Reference(ReferenceNode(name="ref", model=ModelConfig(vocab_size=16, dim=32, n_layers=1, n_heads=2, n_kv_heads=1)))
    >>> out = ref.logprobs({"sample_prompt_ids": torch.tensor([[1, 4, 14]]), "sample_prompt_lens": torch.tensor([3]),
    ...                     "completion_ids": torch.tensor([[4, 2]]), "completion_mask": torch.tensor([[True, True]])})
    >>> out["ref_logprobs"].shape
    torch.Size([1, 2])
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from flowrl.graph.nodes import ReferenceNode
from flowrl.operators.batch import Batch
from flowrl.operators.logprobs import completion_logprobs
from flowrl.models.registry import build_model

__all__ = ["Reference"]


class Reference:
    """Log-probs of completions under the frozen initial weights.

    Args:
        node: the reference node (its model).
        device: where the model runs (``"cpu"``, ``"cuda:N"``).

    Attributes:
        model: the frozen model (float32, no gradients), on ``device``.
    """

    def __init__(self, node: ReferenceNode, *, device: str | torch.device = "cpu") -> None:
        self.name = node.name
        self.device = torch.device(device)
        self.model = build_model(node.model, device=self.device).eval().requires_grad_(False)

    def logprobs(self, rollout: Mapping[str, Tensor]) -> Batch:
        """``{"ref_logprobs": float32[sample, ctime]}``, 0 on padding, ``-inf`` outside the kept set, on the CPU."""
        fields = ("sample_prompt_ids", "sample_prompt_lens", "completion_ids", "completion_mask")
        prompt_ids, prompt_lens, completion_ids, completion_mask = (rollout[f].to(self.device) for f in fields)
        temperature = rollout.get("sampling_temperature", 1.0)
        if isinstance(temperature, Tensor):
            temperature = temperature.to(self.device)
        top_k, top_p = rollout.get("sampling_top_k", 0), rollout.get("sampling_top_p", 1.0)
        with torch.no_grad():
            lp = completion_logprobs(
                self.model, prompt_ids, prompt_lens, completion_ids, completion_mask, temperature=temperature, top_k=top_k, top_p=top_p
            )
        return {"ref_logprobs": lp.cpu()}
