"""Generator engines as plain data: one capability table, ``ENGINE_CAPS``, of what each accepts and where it runs.

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

Every part of flowrl that treats engines differently reads ``ENGINE_CAPS`` (not an engine's name):
the node check below, ``flowrl run --engine``'s choices, preflight (the backends an engine runs
under, its tensor parallelism, whether this machine must be checked), colocated offloading
(whether it sleeps) and the planner (the weights' hop into its workers). ``Engine``, the node
field's type, lists the same names (``tests/graph/test_engines.py`` checks).

``check_engine_options`` is the node-level check (``GeneratorNode.__post_init__``): what is wrong
with the graph, before anything is installed or loaded. What needs the machine (vLLM installed, a
model family it loads, head sizes its CPU kernels support) is checked when a run starts
(``flowrl.operators.engines.check_engine``). Which class runs an engine is the operators' table,
``flowrl.operators.engines.ENGINES``, with the same names.

``VLLMConfig`` holds a vLLM generator's own ``gpu_memory_utilization``, ``max_model_len`` and
``max_num_seqs`` (builder keywords, refused by name on an engine whose row lacks ``vllm_options``);
the runtime passes them to ``vllm.LLM`` (``vllm_engine.memory_settings``) and the planner counts the
node's share.

Example:
    >>> from flowrl.graph.configs import ModelConfig
    >>> from flowrl.graph.nodes import GeneratorNode
    >>> GeneratorNode(name="gen", model=ModelConfig(), engine="vllm")
    Traceback (most recent call last):
    ...
    flowrl.errors.ConfigError: generator 'gen': engine='vllm' needs a Hugging Face model (HFModelConfig: a directory it loads), but its model is the built-in ModelConfig (2L64d); export a trained built-in policy first ('flowrl export RUN_DIR DIR') and pass HFModelConfig(path=DIR), or use engine='builtin'
"""

from __future__ import annotations

from typing import Literal

import msgspec

from flowrl.errors import ConfigError
from flowrl.graph.configs import AnyModelConfig, ModelConfig, SamplingConfig

__all__ = ["Engine", "EngineCaps", "ENGINE_CAPS", "ENGINE_NAMES", "DEFAULT_ENGINE", "VLLM_PRECISIONS", "VLLMConfig", "check_engine_options"]

#: A generator's engine (``GeneratorNode.engine``): the keys of ``ENGINE_CAPS``.
Engine = Literal["builtin", "vllm"]

#: The precisions the vLLM engine loads weights in (its ``dtype``); the weight-only quantized ones
#: are the built-in engine's (``flowrl.models.quantize``).
VLLM_PRECISIONS: tuple[str, ...] = ("float32", "bfloat16", "float16")


class EngineCaps(msgspec.Struct, frozen=True, kw_only=True):
    """What one engine accepts, where it runs, and how the planner costs it (``refills_rows``,
    ``python_loop``, ``cpu_kernels``, ``weight_hop``: ``planners.estimate`` reads these, never a name).

    Attributes:
        builtin_models: it samples from flowrl's built-in ``ModelConfig`` (else a Hugging Face directory only).
        precisions: the ``SamplingConfig.precision`` values it loads weights in; ``()``: every one.
        kv_cache_optional: it decodes with ``use_kv_cache=False`` too.
        continuous_episodes: environments (``env=``) run with ``batching="continuous"`` on it.
        backends: the run backends (``RunConfig.backend``) it runs under; ``()``: every one, a user's too.
        tensor_parallel: flowrl's tensor-parallel ranks shard it (a torchrun mesh with a ``tp`` axis > 1).
        machine_check: a run checks this machine can run it before anything is loaded (installed,
            a model family it loads, kernels: ``flowrl.operators.engines.check_engine``).
        sleeps: it may sleep while its trainer runs on shared devices (colocated offloading), where
            the platform has a sleep mode.
        weight_hop: after the weight edge, the weights move on once more into its own worker
            processes (the planner prices that hop: ``planners.estimate.sync.add_engine_load``).
        refills_rows: its scheduler lets rows leave a generate call as they finish and waiting ones
            take their place (continuous within a call, whatever the node's ``batching``); called
            once per batch, it keeps no slots across steps unless it streams (``batching="continuous"``).
        python_loop: it decodes in flowrl's Python loop, paying ``DeviceSpec.cpu.decode_step_overhead_s``
            per decode step and, with continuous batching, ``slot_row_overhead_s`` per busy row.
        cpu_kernels: on a CPU device it decodes with fused kernels of its own, at the planner's
            measured speed-up over the built-in engine (``Tuning.vllm_cpu_decode_speedup``).
        cuda_memory_fraction: on a CUDA GPU it claims this fraction of each of its GPUs' memory when
            it starts (weights, activations and its KV cache pool) and holds it for the run unless it
            sleeps (vLLM's ``gpu_memory_utilization``, which the runtime passes from here and the
            planner counts, unless the node sets its own: ``VLLMConfig``); 0: it allocates as it runs.
        vllm_options: it takes a node's ``VLLMConfig`` (vLLM's memory and batch settings); an engine
            that does not refuses one that sets any.
    """

    builtin_models: bool
    precisions: tuple[str, ...] = ()
    kv_cache_optional: bool = True
    continuous_episodes: bool = True
    backends: tuple[str, ...] = ()
    tensor_parallel: bool = False
    machine_check: bool = False
    sleeps: bool = False
    weight_hop: bool = False
    refills_rows: bool = False
    python_loop: bool = True
    cpu_kernels: bool = False
    cuda_memory_fraction: float = 0.0
    vllm_options: bool = False


#: Every engine. vLLM's engine is its own processes, started by the generator's process (the local
#: backend's, a process backend's worker, or each replica's first torchrun rank), so it runs under
#: every backend, one engine per replica: a ``tp`` axis of its torchrun mesh is vLLM's own tensor
#: parallelism (``runtime/parallel/vllm_replicas.py``), not flowrl's tp ranks (``tensor_parallel``).
ENGINE_CAPS: dict[str, EngineCaps] = {
    "builtin": EngineCaps(builtin_models=True, tensor_parallel=True),
    "vllm": EngineCaps(
        builtin_models=False, precisions=VLLM_PRECISIONS, kv_cache_optional=False,
        backends=("local", "process", "torchrun"), machine_check=True, sleeps=True, weight_hop=True,
        refills_rows=True, python_loop=False, cpu_kernels=True, vllm_options=True,
        cuda_memory_fraction=0.45,  # half a GPU, less slack: a policy colocated on it keeps the other half
    ),
}
ENGINE_NAMES: tuple[str, ...] = tuple(ENGINE_CAPS)
#: A generator's engine when it names none (``GeneratorNode.engine``'s default).
DEFAULT_ENGINE: Engine = "builtin"


class VLLMConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """vLLM's own settings of a generator with ``engine="vllm"``: ``b.generator(..., gpu_memory_utilization=0.3)``.

    Each is passed to ``vllm.LLM`` under its own name; None is flowrl's default (docs/vllm.md).

    Attributes:
        gpu_memory_utilization: the share of each device's memory vLLM claims when it starts (weights,
            activations, KV cache pool), in (0, 1]. None: on a CUDA GPU ``EngineCaps.cuda_memory_fraction``
            (0.45: a policy colocated on the GPU keeps the rest), which the planner counts (a set value
            too); on a CPU, where vLLM reads it as the share of *host* memory it reserves and refuses to
            start when that much is not free (its own default 0.92 on a busy machine), flowrl passes none
            and sizes the KV cache itself (``kv_cache_memory_bytes``: room for ``max_num_seqs``
            full-length sequences, 64 MiB to 4 GiB), which starts beside other processes.
        max_model_len: longest prompt + completion vLLM takes (tokens). None: ``HFModelConfig.max_seq_len``,
            else the model's ``max_position_embeddings``; more than the latter is refused at start.
        max_num_seqs: sequences vLLM decodes at once. None: ``slots`` under ``batching="continuous"``
            with ``slots`` set, else 256 (vLLM's default on GPUs).

    Example:
        >>> VLLMConfig(gpu_memory_utilization=0.3).given()
        {'gpu_memory_utilization': 0.3}
        >>> VLLMConfig(max_num_seqs=0)
        Traceback (most recent call last):
        ...
        flowrl.errors.ConfigError: VLLMConfig: max_num_seqs=0 must be >= 1
    """

    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None

    def __post_init__(self) -> None:
        u = self.gpu_memory_utilization
        if u is not None and not 0 < u <= 1:
            raise ConfigError(f"VLLMConfig: gpu_memory_utilization={u} must be in (0, 1] (a share of each device's memory)")
        for name in ("max_model_len", "max_num_seqs"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"VLLMConfig: {name}={value} must be >= 1")

    def given(self) -> dict[str, float | int]:
        """The settings that are set (not None), by name."""
        return {k: v for k in self.__struct_fields__ if (v := getattr(self, k)) is not None}


def check_engine_options(
    name: str, engine: str, model: AnyModelConfig, sampling: SamplingConfig, vllm: VLLMConfig | None = None
) -> None:
    """Refuse settings generator ``name``'s ``engine`` cannot honour, naming the setting and the fix.

    Raises:
        ConfigError: for an unknown engine, vLLM's settings (``vllm``) on an engine that does not take
            them, or (``"vllm"``) a built-in ``ModelConfig``, ``use_kv_cache=False``, a quantized
            precision, ``max_num_seqs`` other than continuous batching's ``slots``, or a
            ``max_model_len`` with no room for a prompt beside ``max_new_tokens``.
    """
    owner = f"generator {name!r}"
    if engine not in ENGINE_CAPS:
        raise ConfigError(f"{owner}: engine={engine!r} is not one of {list(ENGINE_CAPS)}")
    caps, s = ENGINE_CAPS[engine], sampling
    given = vllm.given() if vllm is not None else {}
    if given and not caps.vllm_options:
        listed = ", ".join(f"{k}={v}" for k, v in given.items())
        raise ConfigError(
            f"{owner}: {listed} {'is' if len(given) == 1 else 'are'} vLLM's setting{'s' if len(given) > 1 else ''}, which "
            f"engine={engine!r} does not use (it allocates as it decodes); pass engine='vllm', or drop {', '.join(given)}"
        )
    if vllm is not None and vllm.max_num_seqs is not None and s.batching == "continuous" and s.slots and vllm.max_num_seqs != s.slots:
        raise ConfigError(
            f"{owner}: max_num_seqs={vllm.max_num_seqs} and slots={s.slots}: under batching='continuous' slots is what vLLM "
            "decodes at once (its max_num_seqs); set one of them"
        )
    if vllm is not None and vllm.max_model_len is not None and vllm.max_model_len <= s.max_new_tokens:
        raise ConfigError(
            f"{owner}: max_model_len={vllm.max_model_len} leaves no room for a prompt beside max_new_tokens={s.max_new_tokens}; "
            "raise max_model_len (prompt + completion tokens) or lower max_new_tokens"
        )
    if isinstance(model, ModelConfig) and not caps.builtin_models:
        raise ConfigError(
            f"{owner}: engine={engine!r} needs a Hugging Face model (HFModelConfig: a directory it loads), but its model is "
            f"the built-in ModelConfig ({model.short()}); export a trained built-in policy first "
            "('flowrl export RUN_DIR DIR') and pass HFModelConfig(path=DIR), or use engine='builtin'"
        )
    if not s.use_kv_cache and not caps.kv_cache_optional:
        raise ConfigError(f"{owner}: engine={engine!r} always decodes with its (paged) KV cache; drop use_kv_cache=False")
    if caps.precisions and s.precision not in caps.precisions:
        raise ConfigError(
            f"{owner}: engine={engine!r} loads weights in {list(caps.precisions)}, not precision={s.precision!r} "
            "(flowrl's weight-only quantization is the built-in engine's); pick one of those, or use engine='builtin'"
        )
