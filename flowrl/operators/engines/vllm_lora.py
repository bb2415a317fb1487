"""A vLLM generator's LoRA adapters: one peft adapter directory and one ``LoRARequest`` per version.

vLLM holds the base weights (never reloaded for a LoRA policy) and applies an adapter per request
(``LLM(enable_lora=True, max_lora_rank=...)``, ``generate(..., lora_request=LoRARequest(name, id,
path))``). ``VLLMAdapters`` keeps the adapters a transport writes into (``targets``, the names of
``flowrl.models.lora.adapter_weights``); ``publish(llm, version, tmp)`` saves them with
``flowrl.models.lora.save_adapter`` under the engine's staging directory (``/dev/shm`` where it
exists), makes ``request`` a ``LoRARequest`` with the new id ``version + 1`` (vLLM caches adapters by
id, so an id is never reused for other weights), and drops the previous adapter from vLLM and from
the directory. Before the first publish ``request`` is None: version 0's ``B`` is zero, the base model.

Example (needs vLLM, so not run as a doctest)::

    adapters = VLLMAdapters.for_model(HFModelConfig(path=DIR, lora=LoraConfig(r=8)))
    llm = LLM(model=DIR, **adapters.engine_options())
    adapters.publish(llm, 1, "/dev/shm/tmp")  # after a transport filled adapters.targets
    llm.generate(prompts, params, lora_request=adapters.request)
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from torch import Tensor

from flowrl.graph.configs import HFModelConfig, LoraConfig

__all__ = ["VLLMAdapters"]


class VLLMAdapters:
    """The adapters of a vLLM generator (see the module docstring).

    Args:
        config: the generator's model description (with ``lora``).
        targets: zero adapters to fetch into (``flowrl.models.lora.adapter_targets``).

    Attributes:
        lora: the adapters' shape.
        targets: the adapters, CPU float32, by transport name.
        request: the ``LoRARequest`` of the newest published version, or None (the base model).
    """

    def __init__(self, config: HFModelConfig, targets: dict[str, Tensor]) -> None:
        assert config.lora is not None  # for_model returns None otherwise
        self.lora: LoraConfig = config.lora
        self.base = str(Path(config.path).expanduser())
        self.targets = targets
        self.request: Any = None
        self._dir: Path | None = None

    @classmethod
    def for_model(cls, config: HFModelConfig, *, owner: str = "generator") -> VLLMAdapters | None:
        """The adapters ``config.lora`` asks for (shapes from the model on the meta device), or None.

        Raises:
            ConfigError: for target modules the model lacks (``flowrl.models.lora.lora_modules``) or
                a rank vLLM cannot hold.
        """
        if config.lora is None:
            return None
        import msgspec

        from flowrl.models.causal_lm import as_module
        from flowrl.models.lora import adapter_targets, vllm_max_rank
        from flowrl.models.registry import meta_model

        vllm_max_rank(config.lora, owner=owner)
        model = as_module(meta_model(msgspec.structs.replace(config, lora=None)))
        return cls(config, adapter_targets(model, config.lora, owner=owner, device="cpu"))

    def engine_options(self) -> dict[str, Any]:
        """``vllm.LLM`` keyword arguments that enable LoRA for these adapters (one adapter at a time)."""
        from flowrl.models.lora import vllm_max_rank

        return {"enable_lora": True, "max_lora_rank": vllm_max_rank(self.lora), "max_loras": 1}

    def publish(self, llm: Any, version: int, tmp: str) -> None:
        """Save ``targets`` as version ``version``'s adapter under ``tmp`` and make it ``request``;
        the previous one is removed from vLLM and deleted."""
        from vllm.lora.request import LoRARequest

        from flowrl.models.lora import save_adapter

        path = save_adapter(self.targets, self.lora, Path(tmp) / f"adapter-v{version}", base_model=self.base)
        old, old_dir = self.request, self._dir
        self.request = LoRARequest(lora_name=f"flowrl-v{version}", lora_int_id=version + 1, lora_path=str(path))
        self._dir = path
        if old is not None:
            llm.llm_engine.remove_lora(old.lora_int_id)  # False when vLLM never loaded it: nothing held
            if old_dir is not None and old_dir != path:
                shutil.rmtree(old_dir, ignore_errors=True)
