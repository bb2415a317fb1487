"""A checkpoint's policy as a Hugging Face directory that ``AutoModelForCausalLM.from_pretrained`` loads.

``export_hf(state, out_dir)`` takes a policy state (``Trainer.state()``: ``model_config`` and
``model``; a checkpoint's is ``flowrl.runtime.checkpointing.store.read_policy_state``, a sharded policy's
shards consolidated) and writes weights (safetensors), ``config.json`` and the tokenizer.

Any family is written as its ``ModelFamily.hf_architecture`` class with its adapter's
``hf_config`` and tokenizer, its weights renamed by its ``export_names`` (a Hugging Face policy keeps
its own names, directory config and tokenizer; the built-in transformer is written as
``LlamaForCausalLM``, an exact mapping, see ``flowrl.models.families.builtin.adapter``).

- A LoRA policy is written merged (peft's ``merge_and_unload`` over its base model), or with
  ``adapter=True`` as a peft adapter directory.

A non-empty ``out_dir`` is refused unless ``overwrite=True``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import torch

from flowrl.errors import CheckpointError, ConfigError
from flowrl.graph.configs import AnyModelConfig, HFModelConfig
from flowrl.models.local import require_transformers
from flowrl.models.lora import lora_of, merged_model, save_adapter
from flowrl.models.registry import family_of

__all__ = ["export_hf", "hf_config_and_state"]


def hf_config_and_state(config: AnyModelConfig, state: dict[str, torch.Tensor]) -> tuple[Any, dict[str, torch.Tensor]]:
    """The transformers config an export of ``config``'s family writes, and ``state`` under its Hugging Face names.

    Raises:
        ConfigError: for a weight name the family cannot export.
    """
    family = family_of(config)
    return family.load_adapter().hf_config(config), {family.export_name(n): t for n, t in state.items()}


def export_hf(state: dict[str, Any], out_dir: str | Path, *, overwrite: bool = False, adapter: bool = False) -> Path:
    """Write the policy of ``source`` as a Hugging Face directory at ``out_dir``.

    A LoRA policy (its model description has ``lora``) is written merged by default: its base model
    with peft's ``merge_and_unload`` of the adapters, a plain model; with ``adapter=True`` as a peft
    adapter directory (``PeftModel.from_pretrained(base, out_dir)``), ``flowrl.models.lora.save_adapter``.

    Args:
        state: a ``Trainer.state()`` dict (a checkpoint's: ``flowrl.runtime.checkpointing.store.read_policy_state``).
        out_dir: where to write; created if missing.
        overwrite: allow writing into a non-empty ``out_dir`` (its files of the same names are replaced).
        adapter: write a LoRA policy's adapters only (refused for a policy without ``lora``).

    Returns:
        ``out_dir`` as a ``Path``.

    Raises:
        ConfigError: for a non-empty ``out_dir`` without ``overwrite``, or a model that cannot be exported.
        CheckpointError: for a state that is not a policy's.
    """
    out = Path(out_dir).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ConfigError(f"export: {str(out)!r} exists and is not an empty directory; pick another -o or pass --overwrite")
    try:
        config = msgspec.convert({"family": "builtin", **dict(state["model_config"])}, AnyModelConfig)
    except msgspec.ValidationError as exc:
        raise CheckpointError(f"export: the checkpoint's model_config is not a model description: {exc}") from None
    weights = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in state["model"].items()}
    lora = lora_of(config)
    if adapter and lora is None:
        raise ConfigError(f"export: --adapter writes a LoRA policy's adapters, and this policy ({config.short()}) has no lora; drop --adapter")
    if adapter:
        assert isinstance(config, HFModelConfig) and lora is not None  # lora_of is None for the built-in family
        return save_adapter(weights, lora, out, base_model=config.path)
    probe = msgspec.structs.replace(config, init="random") if isinstance(config, HFModelConfig) else config  # config.json, not weights
    family = family_of(probe, owner="export")
    transformers = require_transformers("flowrl export")
    transformers.utils.logging.disable_progress_bar()  # one line of output, not a bar per shard
    if lora is not None:
        model = merged_model(config, weights)
        hf_config, hf_state = model.config, None
    else:
        hf_config, hf_state = hf_config_and_state(probe, weights)
        with torch.device("meta"):
            model = getattr(transformers, family.hf_architecture)(hf_config)
    if hf_state is not None:
        model.load_state_dict(hf_state, strict=False, assign=True)
    if hf_config.tie_word_embeddings:
        model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise CheckpointError(f"export: the checkpoint lacks weights {missing[:5]}")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    family.load_adapter().save_tokenizer(config, out)
    return out
