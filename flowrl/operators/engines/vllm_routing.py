"""Routing replay from the vLLM engine: vLLM's routed experts of each completion, as the rollout field ``routed_experts``.

vLLM records the experts each token went through when it starts with ``enable_return_routed_experts``
(``LLM(enable_return_routed_experts=True)``, its ``AuxOutputConfig``) and returns them per completion
as ``CompletionOutput.routed_experts``, a numpy array ``[seq_len, layers, top_k]`` over the prompt's
tokens, then the generated ones (``SamplingParams.routed_experts_prompt_start`` 0: from the first
prompt token). Only its Model Runner V2 (``VLLM_USE_V2_MODEL_RUNNER=1``) captures them, and that
runner needs Triton: CUDA GPUs only (``flowrl.operators.engines.check_routing_replay`` refuses a
CPU before any work).

``VLLMRouting`` holds the model's routing shape read from its ``config.json`` (the MoE layers, the
expert count, top-k), the options and environment vLLM starts with, and lays each completion's
array into the rollout's ``[sample, prompt width + max_new_tokens, layers, top_k]`` layout, as the
built-in engine records it: the left-padded prompt's columns then the completion's, "not recorded"
(``flowrl.models.routing.unrecorded``) on padding and on each completion's last token.

Example:
    >>> r = VLLMRouting.from_config({"num_hidden_layers": 3, "num_experts": 8, "num_experts_per_tok": 2}, owner="generator 'gen'")
    >>> (r.layers, r.experts, r.top_k), r.empty(1, 4).shape
    ((3, 8, 2), torch.Size([1, 4, 3, 2]))
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from flowrl.errors import ConfigError
from flowrl.models.routing import expert_dtype, unrecorded

__all__ = ["VLLMRouting", "ROUTED_EXPERTS_ENVIRONMENT"]

#: What vLLM's engine must see to capture routed experts: its Model Runner V2.
ROUTED_EXPERTS_ENVIRONMENT: dict[str, str] = {"VLLM_USE_V2_MODEL_RUNNER": "1"}


@dataclass(frozen=True)
class VLLMRouting:
    """A MoE model's routing shape as vLLM reports it, and how its arrays become ``routed_experts``.

    Attributes:
        layers: MoE layers (each a ``layers`` entry of vLLM's array).
        experts: experts per layer.
        top_k: experts per token.
        owner: names the generator in errors.
    """

    layers: int
    experts: int
    top_k: int
    owner: str

    @classmethod
    def from_config(cls, raw: Mapping[str, Any], *, owner: str) -> VLLMRouting:
        """From a MoE ``config.json`` (Qwen3-MoE / Qwen2-MoE keys: ``num_experts``, ``num_experts_per_tok``,
        ``decoder_sparse_step``, ``mlp_only_layers``).

        Raises:
            ConfigError: for a config without experts.
        """
        experts, top_k = int(raw.get("num_experts") or 0), int(raw.get("num_experts_per_tok") or 0)
        if experts < 1 or top_k < 1:
            raise ConfigError(f"{owner}: routing_replay=True needs a mixture of experts; config.json has num_experts={experts}, num_experts_per_tok={top_k}")
        step, dense = int(raw.get("decoder_sparse_step") or 1), set(raw.get("mlp_only_layers") or ())
        layers = sum(1 for i in range(int(raw.get("num_hidden_layers") or 0)) if i not in dense and (i + 1) % step == 0)
        return cls(layers=layers, experts=experts, top_k=top_k, owner=owner)

    def engine_options(self) -> dict[str, Any]:
        """``LLM(...)`` keyword arguments that make vLLM return routed experts."""
        return {"enable_return_routed_experts": True}

    def empty(self, samples: int, width: int) -> Tensor:
        """``[samples, width, layers, top_k]`` all "not recorded", in ``expert_dtype``."""
        return torch.full((samples, width, self.layers, self.top_k), unrecorded(self.experts), dtype=expert_dtype(self.experts))

    def place(self, routed: Tensor, row: int, start: int, fed: int, array: Any) -> None:
        """Write one completion's routed experts (vLLM's ``[seq_len, layers, top_k]``) into ``routed[row]``
        from column ``start`` (its first real prompt token), its first ``fed`` tokens (the prompt's and
        the generated ones fed back: all but the last).

        Raises:
            ConfigError: when vLLM returned none, another shape, or fewer tokens than were fed.
        """
        if array is None:
            raise ConfigError(f"{self.owner}: vLLM returned no routed_experts; it must start with enable_return_routed_experts=True and Model Runner V2")
        got = torch.as_tensor(array)
        if got.dim() != 3 or tuple(got.shape[1:]) != (self.layers, self.top_k) or got.shape[0] < fed:
            raise ConfigError(
                f"{self.owner}: vLLM's routed_experts has shape {tuple(got.shape)}; the model routes {fed} fed tokens through "
                f"{self.layers} MoE layers with top_k={self.top_k}, so it must be [>= {fed}, {self.layers}, {self.top_k}]"
            )
        routed[row, start : start + fed] = got[:fed].to(routed.dtype)
