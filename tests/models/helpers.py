"""Independent references for the HF tests: the Hugging Face model called directly, no flowrl code."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowrl.graph.configs import HFModelConfig, SamplingConfig
from flowrl.graph.nodes import GeneratorNode, PolicyNode
from flowrl.graph.configs import OptimizerConfig

__all__ = ["hf_reference_model", "reference_logprobs", "hf_generator_node", "hf_policy_node", "left_padded"]


def hf_reference_model(directory: Path) -> torch.nn.Module:
    """The directory's model as transformers loads it (float32)."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True, dtype=torch.float32)


def reference_logprobs(model: torch.nn.Module, rollout: dict[str, torch.Tensor], *, temperature: float = 1.0, padded: bool = False) -> torch.Tensor:
    """log p(y_t | x, y_<t) of every completion token by calling the HF model itself.

    ``padded=False``: each row alone, unpadded, with transformers' default positions.
    ``padded=True``: all rows at once, left-padded, with the model's own ``attention_mask`` and
    ``position_ids`` built here (real tokens before each token).
    """
    ids, lens = rollout["sample_prompt_ids"], rollout["sample_prompt_lens"]
    comp, mask = rollout["completion_ids"], rollout["completion_mask"]
    S, Tp = ids.shape
    out = torch.zeros(comp.shape, dtype=torch.float32)
    if padded:
        real = torch.cat([torch.arange(Tp)[None, :] >= (Tp - lens)[:, None], mask], dim=1)
        seq = torch.cat([ids, comp], dim=1)
        pos = (real.long().cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=seq, attention_mask=real.long(), position_ids=pos).logits.float()
        logp = torch.log_softmax(logits[:, Tp - 1 : -1] / temperature, dim=-1)
        out = logp.gather(-1, comp[..., None]).squeeze(-1)
        return torch.where(mask, out, 0.0)
    for s in range(S):
        n, c = int(lens[s]), int(mask[s].sum())
        seq = torch.cat([ids[s, Tp - n :], comp[s, :c]])[None]
        logits = model(input_ids=seq).logits.float()[0]
        logp = torch.log_softmax(logits[n - 1 : n + c - 1] / temperature, dim=-1)
        out[s, :c] = logp.gather(-1, comp[s, :c, None]).squeeze(-1)
    return out


def hf_generator_node(directory: Path, **sampling: object) -> GeneratorNode:
    sampling.setdefault("n_samples", 3)
    sampling.setdefault("max_new_tokens", 6)
    return GeneratorNode(name="gen", model=HFModelConfig(path=str(directory)), sampling=SamplingConfig(**sampling))  # type: ignore[arg-type]


def hf_policy_node(directory: Path, **optimizer: object) -> PolicyNode:
    return PolicyNode(name="policy", model=HFModelConfig(path=str(directory)), optimizer=OptimizerConfig(**optimizer))  # type: ignore[arg-type]


def left_padded(rows: list[list[int]], pad: int = 0, start: int = 0) -> dict[str, torch.Tensor]:
    """A source batch of ``rows`` (token ids), left-padded."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    return {"prompt_ids": ids, "prompt_lens": torch.tensor([len(r) for r in rows]), "prompt_index": torch.arange(start, start + len(rows))}
