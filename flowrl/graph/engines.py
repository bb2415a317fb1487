"""Generator engines as plain data: their names and the node settings each one accepts.

A generator node names the engine that samples for it (``GeneratorNode.engine``):

- ``"builtin"``: flowrl's own decode loop (``flowrl.operators.generation.Generator``, and
  ``flowrl.operators.slots`` for continuous batching). Every model description and every
  ``SamplingConfig`` setting.
- ``"vllm"``: a vLLM engine (``flowrl.operators.engines.vllm_engine``). A Hugging Face model only
  (vLLM loads a directory: export a built-in model first), lock-step or continuous batching (samples
  streamed into vLLM across steps, weights updated in flight: ``vllm_stream``), the KV cache on, and
  a float precision (vLLM loads the weights in that dtype). Environments (``env=``) run on either
  engine, in lock step or with continuous batching; agent programs over the chat endpoint in lock
  step only (``GeneratorNode`` refuses continuous batching for them).

``check_engine_options`` is the node-level check (``GeneratorNode.__post_init__``): what is wrong
with the graph, before anything is installed or loaded. What needs the machine (vLLM installed, a
model family it loads, head sizes its CPU kernels support) is checked when a run starts
(``flowrl.operators.engines.check_engine``). Which class runs an engine is the runtime's table,
``flowrl.operators.engines.ENGINES``.

Example:
    >>> from flowrl.graph.configs import ModelConfig
    >>> from flowrl.graph.nodes import GeneratorNode
    >>> GeneratorNode(name="gen", model=ModelConfig(), engine="vllm")
    Traceback (most recent call last):
    ...
    flowrl.errors.ConfigError: generator 'gen': engine='vllm' needs a Hugging Face model (HFModelConfig: a directory vLLM loads), but its model is the built-in ModelConfig (2L64d); export a trained built-in policy first ('flowrl export RUN_DIR DIR') and pass HFModelConfig(path=DIR), or use engine='builtin'
"""

from __future__ import annotations

from typing import Literal, get_args

from flowrl.errors import ConfigError
from flowrl.graph.configs import AnyModelConfig, ModelConfig, SamplingConfig

__all__ = ["Engine", "ENGINE_NAMES", "VLLM_PRECISIONS", "check_engine_options"]

#: A generator's engine (``GeneratorNode.engine``).
Engine = Literal["builtin", "vllm"]
ENGINE_NAMES: tuple[str, ...] = get_args(Engine)

#: The precisions the vLLM engine loads weights in (its ``dtype``); the weight-only quantized ones
#: are the built-in engine's (``flowrl.models.quantize``).
VLLM_PRECISIONS: tuple[str, ...] = ("float32", "bfloat16", "float16")


def check_engine_options(name: str, engine: str, model: AnyModelConfig, sampling: SamplingConfig) -> None:
    """Refuse settings generator ``name``'s ``engine`` cannot honour, naming the setting and the fix.

    Raises:
        ConfigError: for an unknown engine, or (``"vllm"``) a built-in ``ModelConfig``,
            ``use_kv_cache=False``, or a quantized precision.
    """
    owner = f"generator {name!r}"
    if engine not in ENGINE_NAMES:
        raise ConfigError(f"{owner}: engine={engine!r} is not one of {list(ENGINE_NAMES)}")
    if engine != "vllm":
        return
    s = sampling
    if isinstance(model, ModelConfig):
        raise ConfigError(
            f"{owner}: engine='vllm' needs a Hugging Face model (HFModelConfig: a directory vLLM loads), but its model is "
            f"the built-in ModelConfig ({model.short()}); export a trained built-in policy first "
            "('flowrl export RUN_DIR DIR') and pass HFModelConfig(path=DIR), or use engine='builtin'"
        )
    if not s.use_kv_cache:
        raise ConfigError(f"{owner}: engine='vllm' always decodes with its (paged) KV cache; drop use_kv_cache=False")
    if s.precision not in VLLM_PRECISIONS:
        raise ConfigError(
            f"{owner}: engine='vllm' loads weights in {list(VLLM_PRECISIONS)}, not precision={s.precision!r} "
            "(flowrl's weight-only quantization is the built-in engine's); pick one of those, or use engine='builtin'"
        )
