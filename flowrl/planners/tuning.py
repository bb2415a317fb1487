"""The planner's tunable constants: efficiencies, byte sizes and host costs, each a named, documented field.

Every estimate formula reads its constants from one ``Tuning``; ``plan_graph(..., **tuning)`` and
``flowrl plan --set NAME=VALUE`` override them by name. The defaults are round figures of the kind
published for Megatron-style training and vLLM-style serving on H100s; none is fitted to a
particular result (in particular not to LlamaRL's reported speedups).

Example:
    >>> make_tuning(mfu_train=0.4).mfu_train
    0.4
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from flowrl.errors import PlanError

__all__ = ["Tuning", "make_tuning", "tuning_help", "VLLM_CPU_DECODE_SPEEDUP", "VLLM_GROUP_BANDWIDTH", "GLOO_BANDWIDTH", "HOST_GLOO_BANDWIDTH"]

#: ``Tuning.vllm_cpu_decode_speedup`` where neither the tuning nor the cluster's calibration sets it.
VLLM_CPU_DECODE_SPEEDUP = 1.3
#: ``Tuning.vllm_group_bandwidth`` where neither the tuning nor the cluster's calibration sets it.
VLLM_GROUP_BANDWIDTH = 0.4e9
#: Bytes/s of a gloo all-gather or reduce-scatter between two processes of one host (an FSDP2
#: policy's collectives on CPU ranks, ``estimate.train``) where ``flowrl calibrate`` did not measure
#: it (``CpuTerms.gloo_by_bytes``): ``flowrl.calibration.gloo_rate`` on this project's 2-core CPU
#: gave 0.06-0.12 GB/s for 64 MiB tensors and 0.24-0.55 for 16 MiB at load 8-15, and the 24-layer FSDP2 step at rest
#: (benches/RESULTS.md, 14.0 s) leaves about 9 s for its 2.15 GB of gathers and reduce-scatters per
#: rank beside its compute: ~0.24 GB/s.
GLOO_BANDWIDTH = 0.25e9
#: ``Tuning.host_gloo_bandwidth``'s default (its attribute says where it comes from).
HOST_GLOO_BANDWIDTH = 1.0e9


class Tuning(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Constants of the cost and memory model.

    Attributes:
        mfu_train: fraction of peak FLOP/s the trainer's forward/backward reaches (model FLOPs utilisation).
        mfu_prefill: fraction of peak FLOP/s the generator's prefill reaches.
        mfu_decode: fraction of peak FLOP/s the generator's decode reaches when compute-bound.
        memory_bandwidth_efficiency: fraction of the datasheet memory bandwidth a decode step streams at.
        link_efficiency: fraction of the datasheet link bandwidth a collective or a copy reaches.
        ops_per_layer: operator launches per transformer block per forward pass (kernel overhead term).
        memory_util: fraction of device memory the planner may fill (the rest: allocator slack, buffers).
        param_bytes: bytes per trainer parameter; None: the device's compute dtype (2 bf16, 4 float32).
        grad_bytes: bytes per gradient element (float32 accumulation).
        optimizer_bytes: AdamW state bytes per parameter; None: 12 with bf16 parameters (fp32 master
            copy + two moments), 8 with float32 parameters (two moments).
        backend: the backend the plan runs under (``local``, ``process``, ``torchrun``), which decides
            the axes each node's program runs (``flowrl.mesh_support``) and, on a CPU, whether a mesh is
            one process's threads or one-thread ranks; ``""``: what the cluster implies
            (``flowrl.planners.runnable.plan_backend``). ``flowrl plan --emit`` plans for ``torchrun``,
            the launch it writes.
        zero_stage: ZeRO stage of the trainer over its data-parallel axis: 0 nothing sharded, 1
            optimizer states (ZeRO-1 / Megatron's distributed optimizer), 2 also gradients (ZeRO-2),
            3 also parameters (ZeRO-3 / FSDP: gathered per micro-batch); None: 1 if
            ``shard_optimizer`` else 0. A policy whose optimizer says ``sharding="fsdp"`` is
            stage 3 whatever this says (the runtime shards it with FSDP2).
            Source: Rajbhandari et al., ZeRO (SC 2020).
        offload: ``"auto"`` moves a colocated trainer's whole state (parameters, gradients,
            optimizer states) to host memory, and puts a colocated vLLM generator to sleep (its
            weights to host memory), while another node needs the room (LlamaRL's co-located
            offloading), paying their way out and back over ``DeviceSpec.host_bandwidth``: what
            ``flowrl run --offload auto`` then does (``flowrl.runtime.programs.offload``); ``"off"`` never does.
        shard_optimizer: shard optimizer states over the data-parallel axis (ZeRO-1 / Megatron's
            distributed optimizer).
        activation_checkpointing: ``"auto"`` turns it on only for nodes that do not fit without it;
            it costs one more forward pass.
        dp_overlap: fraction of the data-parallel gradient all-reduce hidden behind the backward pass.
        recompute_logprobs: an extra forward pass per step for old-policy log-probs; None: where the
            trainer runs one (``flowrl.graph.objectives.recomputes_logprobs``: ``decoupled_ppo``, or
            several optimizer steps a batch).
        packed_sequences: whether the trainer packs its sequences (time follows the mean length)
            or pads each micro-batch to its longest sequence (time follows the longest of ``mb``
            completions, ``LengthDistribution.expected_max``, as flowrl's built-in trainer runs,
            which also takes an optimizer ``micro_batch_size`` of 0 as the whole batch in one pass);
            None: as the policy's ``OptimizerConfig.packing`` says (its default packs, on any
            device, as flowrl's trainer does; ``packing=False``: padded on a CPU device, packed
            on GPUs as production trainers run).
        cross_step_slots: whether a continuous generator in an asynchronous run fills the slots the
            tail frees with the next step's prompts (its steady step pays the mean length, not the
            tail: in-flight engines such as PipelineRL's); None: on GPUs yes, on a CPU device no
            (flowrl's slot batcher with its default slots, one step's samples, and its deadline
            admission holds about one step's groups, so each step waits for its longest group).
        gen_precision: dtype of the generator's weights; None: the node's ``sampling.precision``.
            ``"float8"`` is LlamaRL's choice (halves the bytes each decode step reads).
        kv_bytes: bytes per KV-cache element; None: 2 on GPUs, the generator's dtype on CPU.
        vllm_cpu_decode_speedup: on a CPU device, how many times the built-in engine's decode rate a
            generator with ``engine="vllm"`` decodes at (``flowrl.planners.estimate.generate``); None:
            the cluster's calibrated figure (``CpuTerms.vllm_decode_speedup``, ``flowrl calibrate
            --vllm``), else ``VLLM_CPU_DECODE_SPEEDUP`` = 1.3. Source of 1.3:
            a 29M-parameter Llama in float32 on this project's 2-core CPU, 512 rows x 128 new tokens,
            one engine after the other on an idle machine: vllm-cpu 0.32 847-877 tokens/s against the
            built-in engine's 642 (1.3x; both spend their time in float32 matrix products).
            ``benches/engines.py`` measures it again (interleaved); on a loaded machine (load 4-6) it
            gave 3.6x at 64 rows and 4.7x at 128 (vLLM's fused kernels lose less to contention), so
            1.3 is the conservative, idle-machine figure; on an idle machine at the 0.5B shape's width
            (896, 8 rows) vLLM's generate was still 1.3-1.5x faster than 1.3 predicts (RESULTS.md).
        scorer_s_per_sample: host seconds a rule scorer spends per completion.
        source_s_per_prompt: host seconds a source spends per prompt.
        file_bandwidth: bytes/s of the shared file system the ``file`` weight transport goes through.
        vllm_group_bandwidth: bytes/s of the last hop of a sync into a vLLM generator: its
            generator process broadcasting the weights in buckets over the weight-sync group (gloo)
            while vLLM's worker reloads them in place (``flowrl.operators.engines.vllm_sync``).
            None: the cluster's calibrated figure (``CpuTerms.vllm_sync_bandwidth``, ``flowrl calibrate
            --vllm``), else ``VLLM_GROUP_BANDWIDTH`` = 0.4e9: measured by ``benches/weight_sync.py`` on
            a 2-core CPU at load 6-7 (RESULTS.md): 1.43 GB in 2.2-4.0 s (0.36-0.65 GB/s), bound by
            vLLM's reload, not the wire, its lower end (at rest: 1.6-2.0 s, ~0.8 GB/s). A CPU figure:
            on a GPU cluster the planner prices the group with the GPU host's rates instead
            (``estimate.rates``), unless this is set.
        host_gloo_bandwidth: bytes/s of gloo between two processes of a GPU host over host memory:
            the weight-sync group of the hop into a vLLM generator on GPUs (the generator's process
            and vLLM's worker share a GPU, so the runtime's group is gloo there: ``vllm_sync``).
            ``HOST_GLOO_BANDWIDTH`` = 1.0e9: gloo's TCP transport between two processes pinned to
            one core each of a Xeon E5-2620 v4 reached 1.07 GB/s (pytorch/gloo issue #248, its
            benchmark tool), one core's TCP processing being the bound, as on loopback. A documented
            figure, not measured on a GPU host: measure it there (``flowrl calibrate --gloo`` on
            that host reports gloo's rate between two of its processes) and ``--set`` it.
        sync_overlap: fraction of a weight sync hidden behind compute (0: both sides stop for it).
        split_multipliers: the search tries device counts ``m * 2**k`` for these ``m`` (both for
            each side of a split and for colocated meshes).
        top_k: how many losing candidates a plan keeps, each with the reason it lost.
    """

    mfu_train: float = 0.45
    mfu_prefill: float = 0.55
    mfu_decode: float = 0.5
    memory_bandwidth_efficiency: float = 0.8
    link_efficiency: float = 0.8
    ops_per_layer: int = 16
    memory_util: float = 0.9
    param_bytes: float | None = None
    grad_bytes: float = 4.0
    optimizer_bytes: float | None = None
    shard_optimizer: bool = True
    backend: Literal["", "local", "process", "torchrun"] = ""
    zero_stage: Literal[0, 1, 2, 3] | None = None
    offload: Literal["auto", "off"] = "auto"
    activation_checkpointing: Literal["auto", "on", "off"] = "auto"
    dp_overlap: float = 0.5
    recompute_logprobs: bool | None = None
    packed_sequences: bool | None = None
    cross_step_slots: bool | None = None
    gen_precision: Literal["float32", "bfloat16", "float16", "float8"] | None = None
    kv_bytes: float | None = None
    vllm_cpu_decode_speedup: float | None = None
    scorer_s_per_sample: float = 50e-6
    source_s_per_prompt: float = 5e-6
    file_bandwidth: float = 2e9
    vllm_group_bandwidth: float | None = None
    host_gloo_bandwidth: float = HOST_GLOO_BANDWIDTH
    sync_overlap: float = 0.0
    split_multipliers: tuple[int, ...] = (1, 3, 5, 7)
    top_k: int = 5

    def __post_init__(self) -> None:
        fractions = ("mfu_train", "mfu_prefill", "mfu_decode", "memory_bandwidth_efficiency", "link_efficiency", "memory_util")
        for name in fractions:
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise PlanError(f"tuning {name}={value} must be in (0, 1]")
        for name in ("dp_overlap", "sync_overlap"):
            value = getattr(self, name)
            if not 0 <= value <= 1:
                raise PlanError(f"tuning {name}={value} must be in [0, 1]")
        if self.vllm_cpu_decode_speedup is not None and not self.vllm_cpu_decode_speedup > 0:
            raise PlanError(f"tuning vllm_cpu_decode_speedup={self.vllm_cpu_decode_speedup} must be > 0")
        for name in ("param_bytes", "optimizer_bytes", "kv_bytes"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise PlanError(f"tuning {name}={value} must be > 0 (or None for the default)")
        for name in ("grad_bytes", "scorer_s_per_sample", "source_s_per_prompt"):
            if not getattr(self, name) >= 0:
                raise PlanError(f"tuning {name}={getattr(self, name)} must be >= 0")
        if self.vllm_group_bandwidth is not None and not self.vllm_group_bandwidth > 0:
            raise PlanError(f"tuning vllm_group_bandwidth={self.vllm_group_bandwidth} must be > 0")
        if not self.host_gloo_bandwidth > 0:
            raise PlanError(f"tuning host_gloo_bandwidth={self.host_gloo_bandwidth} must be > 0")
        if not self.file_bandwidth > 0:
            raise PlanError(f"tuning file_bandwidth={self.file_bandwidth} must be > 0")
        if self.ops_per_layer < 0:
            raise PlanError(f"tuning ops_per_layer={self.ops_per_layer} must be >= 0")
        if self.top_k < 0:
            raise PlanError(f"tuning top_k={self.top_k} must be >= 0")
        if not self.split_multipliers or any(m < 1 for m in self.split_multipliers):
            raise PlanError(f"tuning split_multipliers={self.split_multipliers} must be a non-empty tuple of integers >= 1")


def make_tuning(**overrides: Any) -> Tuning:
    """A ``Tuning`` with ``overrides`` applied; an unknown name is a ``PlanError`` listing the known ones."""
    known = Tuning.__struct_fields__
    unknown = sorted(set(overrides) - set(known))
    if unknown:
        raise PlanError(f"unknown tuning parameter(s) {', '.join(map(repr, unknown))}; known: {', '.join(known)}")
    try:
        return msgspec.convert(overrides, type=Tuning, strict=False)
    except msgspec.ValidationError as exc:
        raise PlanError(f"bad tuning value: {exc}") from None


def tuning_help() -> str:
    """``name=default`` for every tuning parameter, one per line (for ``flowrl plan --help``)."""
    defaults = Tuning()
    return "\n".join(f"  {name}={getattr(defaults, name)!r}" for name in Tuning.__struct_fields__)
