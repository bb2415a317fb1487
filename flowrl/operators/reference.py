"""The reference node's operator: a copy of the initial policy that scores completions for a KL penalty.

It builds the same model as the policy (``flowrl.models.build_model``: the same seeded or pretrained
weights, so it *is* the policy's version 0) and never trains. ``logprobs`` uses
``completion_logprobs`` at the rollout's ``sampling_temperature``, ``sampling_top_k`` and
``sampling_top_p`` (the reference truncated by its own kept set), the computation the trainer uses
for pi, so a KL estimate between them is exactly 0 before the first step. A token outside the
reference's kept set gets ``-inf``; the KL penalty leaves it out (``losses.kl_penalty``).

It never trains; a reference with ``ReferenceConfig.sync_steps`` takes the policy's weights in
by ``mix`` (TRL's ``sync_ref_model``): ``reference = alpha * policy + (1 - alpha) * reference``.

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

from flowrl.errors import ConfigError
from flowrl.graph.nodes import ReferenceNode
from flowrl.operators.batch import Batch
from flowrl.operators.logprobs import completion_logprobs
from flowrl.operators.packing import packs
from flowrl.models.causal_lm import weight_dict
from flowrl.models.registry import build_model

__all__ = ["Reference", "mix"]


def mix(reference: Mapping[str, Tensor], policy: Mapping[str, Tensor], alpha: float) -> None:
    """TRL's reference sync, in place: ``reference[n] = alpha * policy[n] + (1 - alpha) * reference[n]``
    for every weight ``n`` of ``reference`` (float32 arithmetic on float32 weights).

    Raises:
        ConfigError: when a name is missing from ``policy`` or a shape differs (the weights of another model).
    """
    if any(n not in policy or reference[n].shape != policy[n].shape for n in reference):
        raise ConfigError(
            f"reference sync: the policy's weights {sorted(policy)[:3]}... do not match the reference's {sorted(reference)[:3]}...; "
            "a reference syncs with a policy of the same model"
        )
    with torch.no_grad():
        for name, ref in reference.items():
            ref.copy_(alpha * policy[name] + (1 - alpha) * ref)


class Reference:
    """Log-probs of completions under the frozen initial weights.

    Args:
        node: the reference node (its model).
        device: where the model runs (``"cpu"``, ``"cuda:N"``).

    Class attributes (a kind built on it sets its own: ``flowrl.operators.teacher.Teacher``):
        output: the field ``logprobs`` writes.
        truncates: score under the rollout's top-k / top-p kept set (else the whole vocabulary, at its temperature).

    Attributes:
        model: the model (float32, no gradients), on ``device``.
        weights: its weights by name (``weight_dict``: views; a policy's weight edge carries these).
        parameters: the entries of ``weights`` that are parameters, which a sync mixes (TRL's sync
            zips ``parameters()``; buffers, such as rotary frequencies, are the same in both models).
    """

    output = "ref_logprobs"
    truncates = True

    def __init__(self, node: ReferenceNode, *, device: str | torch.device = "cpu") -> None:
        self.name = node.name
        config = getattr(node, "reference", None)  # another kind built on Reference packs not
        self.packing = config is not None and packs(config.packing, node.model, owner=f"reference {node.name!r}")
        self.device = torch.device(device)
        self.model = build_model(node.model, device=self.device).eval().requires_grad_(False)
        self.weights = weight_dict(self.model)
        names = {n for n, _ in self.model.named_parameters()}
        self.parameters = {n: t for n, t in self.weights.items() if n in names}

    def mix(self, policy: Mapping[str, Tensor], alpha: float) -> None:
        """Sync with the policy's ``weights`` (``mix`` over ``parameters``)."""
        mix(self.parameters, policy, alpha)

    def logprobs(self, rollout: Mapping[str, Tensor]) -> Batch:
        """``{output: float32[sample, ctime]}``, 0 on padding, ``-inf`` outside the kept set (``truncates``), on the CPU."""
        fields = ("sample_prompt_ids", "sample_prompt_lens", "completion_ids", "completion_mask")
        prompt_ids, prompt_lens, completion_ids, completion_mask = (rollout[f].to(self.device) for f in fields)
        temperature = rollout.get("sampling_temperature", 1.0)
        if isinstance(temperature, Tensor):
            temperature = temperature.to(self.device)
        top_k, top_p = (rollout.get("sampling_top_k", 0), rollout.get("sampling_top_p", 1.0)) if self.truncates else (0, 1.0)
        extent = rollout.get("completion_lens")  # a multi-turn sample's environment tokens are attended, as the trainer attends them
        routed = rollout.get("routed_experts")  # a generator's routing_replay: the reference routes as the engine did
        with torch.no_grad():
            lp = completion_logprobs(
                self.model, prompt_ids, prompt_lens, completion_ids, completion_mask, temperature=temperature, top_k=top_k, top_p=top_p,
                completion_lens=extent.to(self.device) if extent is not None else None,
                packing=self.packing,
                routed_experts=routed.to(self.device) if routed is not None else None,
            )
        return {self.output: lp.cpu()}
