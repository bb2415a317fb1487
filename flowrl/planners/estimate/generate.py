"""Generation time and memory: compute-bound prefill, memory-bound decode, KV cache, tensor-parallel traffic.

Notation as in ``train``; each of the dp replicas (tp * pp devices) generates ``ceil(S / dp)``
completions, batched; ``wb`` is bytes per weight in the generator's precision (LlamaRL samples with
FP8 weights), ``kvb`` bytes per KV element. Per device::

    weights    = P * wb / (tp * pp)
    kv_token   = 2 * (L/pp) * ceil(kv_heads / tp) * head_dim * kvb     # KV heads replicate when tp > kv_heads
                                                                     # (an MLA latent: (L/pp) * kv_dim * kvb)
    batch      = min(ceil(S/dp), (budget - reserved - weights - workspace) // (s * kv_token))
    waves      = ceil(ceil(S/dp) / batch)                 # rounds when the KV cache cannot hold them all

An engine that claims a share of each GPU when it starts (``EngineCaps.cuda_memory_fraction``:
vLLM's ``gpu_memory_utilization``, 0.45) holds ``claim = fraction * device memory`` for the whole
run: its KV cache is what the claim leaves, ``batch = min(ceil(S/dp), (claim - weights - workspace)
// (s * kv_token))``, the claim must fit beside what colocated nodes hold (``claim + reserved <=
budget``), and its memory is all resident (``MemoryBreakdown.held``), which a colocated trainer's
step must fit beside.

Time of one wave of ``b`` completions::

    prefill    = b * prompt_len * F_tok(prompt_len / 2) / (tp * pp * peak * mfu_prefill)
                 + L * 2 * all_reduce(b * prompt_len * h * 2, tp) + L * ops_per_layer * kernel_overhead
    stage      = max( (weights_read + b * ctx * kv_token + b * V * 4 / (tp*pp)) / (mem_bw * mem_eff),   # read
                      b * F_tok(ctx) / (tp * pp * peak * mfu_decode) )                              # compute
    token      = pp * (stage + (L/pp) * 2 * all_reduce(b * h * 2, tp) + (L/pp) * ops_per_layer * kernel_overhead)
    (with uneven stages memory is the largest stage's, ``ceil(L/pp)`` layers, and a token still
    passes every layer once, so its time is the sum over stages, ``pp * (L/pp) = L`` layers)
                 + (pp - 1) * send(b * h * 2)
    decode     = steps * token,          ctx = prompt_len + l / 2 (mean keys attended)
    weights_read = weights, less a mixture of experts' routed experts that none of the b tokens
                 goes to: weights * (1 - routed/P * (1 - ModelSpec.expert_read_fraction(b)))
    G          = waves * prefill + decode

``steps`` and ``l`` come from the completion lengths and the batching mode
(``flowrl.planners.lengths``): lock-step, ``steps = waves * E[max of b]`` and ``l = E[max of b]``
(finished slots idle until the longest is done); continuous, ``steps = E[max of b] + (n/b - 1)^+ *
mean`` and ``l = mean``. A continuous generator in an asynchronous run keeps its slots full across
steps (the next step's prompts fill what the tail frees), so its steady-state time per step,
``NodeEstimate.steady_s``, is ``waves * prefill + n * mean / b * token`` (``Tuning.cross_step_slots``;
off by default on a CPU device, where the planner predicts flowrl's own slot batcher: with its
default slots, one step's samples, and its deadline admission it holds about one step's groups at
a time, so each step still waits for its longest group and ``steady_s`` is the synchronous time).
A continuous generator also pays ``DeviceSpec.cpu.slot_row_overhead_s`` per busy row per decode step,
``n * mean`` of them per step (``slot_overhead``). Every completion running
to ``gen_len`` (the default lengths) gives ``steps = waves * gen_len`` in every mode.

``peak * mfu`` is, on a calibrated CPU device (``DeviceSpec.cpu.flops_by_width``), the measured rate of
the built-in model's forward at the model's width instead (``decode_flops_by_width`` for decode,
times ``DeviceSpec.decode_rows_factor(b)``: the rate measured on few rows over the table's, since a
CPU core decoding a few rows streams every weight without hiding it behind the arithmetic):
what the machine achieves on the whole pass, so no MFU factor, and its launches are in it (the
``ops_per_layer * kernel_overhead`` terms are 0 there). A tp generator on a CPU runs as torchrun
ranks, one process each: its all-reduces go over gloo at the rate ``flowrl calibrate --gloo``
measured at their size (``cpu_ranks.gloo_link``; a decode step's ``[b, h]`` is a few KiB, where
gloo's latency dominates), never the CPU device's memory copy rate.

The engine (``GeneratorNode.engine``, the first note of every generator estimate) is costed by its
row in ``graph.engines.ENGINE_CAPS``: ``"builtin"``'s is the model above as it stands. ``"vllm"``'s
differs in three ways (``refills_rows``, ``python_loop``, ``cpu_kernels``): rows leave the batch as they finish
and waiting ones take their place inside one generate call (vLLM's scheduler), so its steps and
context follow the continuous formulas above, but with ``batching="lockstep"`` (a call per batch)
without cross-step slots (weights change between calls, so a call waits for its longest
completion), and without flowrl's slot bookkeeping; it pays no ``DeviceSpec.cpu.decode_step_overhead_s`` (flowrl's Python sampling loop); and on a CPU device its
decode runs ``vllm_decode_speedup`` times the built-in engine's measured rate (its own fused CPU
kernels): ``Tuning.vllm_cpu_decode_speedup`` when set, else the cluster's calibrated
``CpuTerms.vllm_decode_speedup`` (``flowrl calibrate --vllm``), else 1.3 (``benches/engines.py``). On a GPU the roofline terms are
what vLLM reaches; flowrl's built-in engine is priced with the same terms there, which flatters it.

A vLLM generator with ``batching="continuous"`` (``flowrl.operators.engines.vllm_stream``: samples
streamed into vLLM's engine across steps) keeps its slots full across steps like the built-in
continuous generator (the same ``steady_s``, under the same ``Tuning.cross_step_slots`` rule), and
pays a re-prefill for each weight update while it decodes: the update aborts the running requests
and re-submits each with its kept tokens as its prompt, so their KV is recomputed by the new weights::

    kept       = prompt_len + E[l^2] / (2 E[l])      # a running request's prompt and tokens so far
    reprefill  = b * kept * F_tok(kept / 2) / (tp * pp * peak * mfu_prefill)
                 + L * 2 * all_reduce(b * kept * h * 2, tp) + L * ops_per_layer * kernel_overhead

added once per step (``breakdown["reprefill"]``) to ``time_s`` and ``steady_s``. Assumed: one weight
update per step (the policy publishes once per trainer step), arriving while all ``b`` slots are
busy; a running request is met at a uniformly random point of a length-biased completion (a longer
one spends longer in a slot), hence ``E[l^2] / (2 E[l])`` tokens kept; the prefix cache holds
nothing across the update (it is reset with the weights); and the stream's per-row bookkeeping in
flowrl's process overlaps vLLM's engine core, so it pays no ``slot_row_overhead_s``.

The decode step reads every weight once per generated token, so it is bound by memory bandwidth:
tp splits those reads over tp devices (and pays two all-reduces per layer per token); pp splits
memory but not the time of one token, since the stages of one token run one after another.
Prefill is counted per completion (no prefix sharing between the samples of one prompt).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from flowrl.planners.estimate.common import (
    GiB,
    Context,
    MemoryBreakdown,
    NodeEstimate,
    all_reduce_s,
    axis_link,
    precision_bytes,
    send_s,
)
from flowrl.planners.cluster import DEVICE_TRAITS
from flowrl.planners.estimate.cpu_ranks import gloo_link
from flowrl.graph.engines import DEFAULT_ENGINE, ENGINE_CAPS
from flowrl.planners.estimate.train import memory_budget
from flowrl.planners.lengths import LengthDistribution, decode_steps, steady_decode_steps
from flowrl.modelspec import ModelSpec
from flowrl.planners.parallel import ParallelDims, stage_layers
from flowrl.planners.tuning import VLLM_CPU_DECODE_SPEEDUP
from flowrl.planners.units import format_excess, format_gib_pair

__all__ = ["estimate_generate", "generator_dtype", "vllm_decode_speedup", "engine_claim", "claim_fraction"]


def generator_dtype(node_precision: str, ctx: Context) -> str:
    """The generator's weight dtype: the ``gen_precision`` tuning override, else the node's own."""
    return ctx.tuning.gen_precision or node_precision


def vllm_decode_speedup(ctx: Context) -> float:
    """How many times the built-in engine's decode rate vLLM's CPU build decodes at: the tuning's
    figure, else the cluster's calibrated one, else ``VLLM_CPU_DECODE_SPEEDUP``."""
    return ctx.tuning.vllm_cpu_decode_speedup or ctx.cluster.device.cpu.vllm_decode_speedup or VLLM_CPU_DECODE_SPEEDUP


def claim_fraction(engine: str, memory_fraction: float = 0.0) -> float:
    """The share of each CUDA GPU ``engine`` claims at start: the node's own ``memory_fraction`` (vLLM's
    ``gpu_memory_utilization`` set on the generator) where its engine claims one, else
    ``EngineCaps.cuda_memory_fraction``; 0 for an engine that allocates as it runs."""
    default = ENGINE_CAPS[engine].cuda_memory_fraction
    return (memory_fraction or default) if default > 0 else 0.0


def engine_claim(engine: str, ctx: Context, memory_fraction: float = 0.0) -> int:
    """Bytes per device ``engine`` claims when it starts and holds for the run on this cluster's
    devices (``claim_fraction`` of a CUDA GPU's memory: vLLM's ``gpu_memory_utilization``, the node's
    ``memory_fraction`` when set); 0 where it allocates as it runs (a CPU, the built-in engine)."""
    dev = ctx.cluster.device
    fraction = claim_fraction(engine, memory_fraction)
    return int(fraction * dev.memory_bytes) if fraction > 0 and DEVICE_TRAITS[dev.kind].cuda else 0


def _rate(dtype: str, ctx: Context, width: int, pass_kind: str, mfu: float) -> tuple[float, bool]:
    """FLOP/s of a generator pass and whether it was measured: a calibrated table's rate (the
    whole pass as this machine runs it: no MFU, launches included), else the peak for ``dtype`` x ``mfu``."""
    dev = ctx.cluster.device
    measured = dev.measured_flops(width, pass_kind)
    if measured is not None:
        return measured, True
    if dtype == "float8" and dev.peak_flops_8bit > 0:
        return dev.peak_flops_8bit * mfu, False
    if dtype == "float32" and DEVICE_TRAITS[dev.kind].tensor_cores:
        return dev.peak_flops / 2 * mfu, False  # TF32 tensor cores run at half the bf16 rate
    return dev.peak_flops * mfu, False


def estimate_generate(
    model: ModelSpec,
    dims: ParallelDims,
    devices: Sequence[int],
    ctx: Context,
    *,
    precision: str = "bfloat16",
    reserved_bytes: float = 0.0,
    node: str = "gen",
    engine: str = DEFAULT_ENGINE,
    memory_fraction: float = 0.0,
) -> NodeEstimate:
    """Seconds to generate one step's completions on this mesh, and bytes per device.

    Args:
        precision: the generator's weight dtype (``generator_dtype`` resolves the tuning override).
        reserved_bytes: bytes per device held by colocated nodes (their weights and optimizer states);
            the KV cache gets what is left.
        engine: the generator's engine, ``"builtin"`` or ``"vllm"`` (see the module docstring).
        memory_fraction: the node's own share of each GPU its engine claims (``VLLMConfig.gpu_memory_utilization``);
            0: the engine's (``EngineCaps.cuda_memory_fraction``).

    Example:
        >>> from flowrl.planners.cluster import parse_cluster
        >>> from flowrl.modelspec import model_preset
        >>> from flowrl.planners.tuning import Tuning
        >>> from flowrl.planners.workload import Workload
        >>> ctx = Context(cluster=parse_cluster("8xH100"), tuning=Tuning(),
        ...               workload=Workload(prompts_per_step=64, samples_per_prompt=4, prompt_len=256, gen_len=256))
        >>> est = estimate_generate(model_preset("llama3-8b"), ParallelDims(dp=8), range(8), ctx)
        >>> est.feasible, est.notes
        (True, ('builtin engine', 'batch 32 x 1 wave', 'bfloat16 weights', 'lock-step, 256 decode steps'))
        >>> estimate_generate(model_preset("llama3-8b"), ParallelDims(dp=8), range(8), ctx, engine="vllm").notes[0]
        'vllm engine'
    """
    c, t, w = ctx.cluster, ctx.tuning, ctx.workload
    dev = c.device
    dp, tp, pp = dims.dp, dims.tp, dims.pp
    wb = precision_bytes(precision)
    kvb = t.kv_bytes or (2 if DEVICE_TRAITS[dev.kind].tensor_cores else wb)
    ab = 2 if DEVICE_TRAITS[dev.kind].tensor_cores else dev.dtype_bytes
    h, L, V = model.dim, model.n_layers, model.vocab_size
    layers = stage_layers(L, pp)  # the largest stage: its memory must fit (stages may be uneven)
    replicas = 1 if dev.cpu.thread_speedup > 0 else dp  # a CPU mesh is one process with dp intra-op threads
    speedup = dev.mesh_speedup(dp, c.devices_per_host, generator=True) / replicas
    per_replica = math.ceil(w.sequences / replicas)
    weights = int(model.params * wb * layers / (L * tp))
    kv_token = layers * model.kv_elems_per_layer(tp) * kvb
    kv_seq = w.seq_len * kv_token
    prefill_chunk = min(per_replica * w.prompt_len, 8192)
    workspace = int(prefill_chunk * (8 * h + 3 * model.active_ffn_dim) * ab / tp + min(per_replica, 1024) * V * 4 / tp)

    budget = memory_budget(ctx)
    claim = engine_claim(engine, ctx, memory_fraction)
    room: float
    if claim:  # the engine takes its share of each GPU at start, whatever it needs: its KV pool is the rest
        room = claim - weights - workspace if claim + reserved_bytes <= budget else 0
    else:
        room = budget - reserved_bytes - weights - workspace
    max_batch = int(room // kv_seq) if room > 0 else 0
    if max_batch < 1 and claim:
        fraction = claim_fraction(engine, memory_fraction)
        source = "the generator's gpu_memory_utilization" if memory_fraction else "EngineCaps.cuda_memory_fraction"
        inside = weights + workspace + kv_seq
        need_s, budget_s = format_gib_pair(claim + reserved_bytes, budget)
        share = (
            f"node {node!r} ({model.name} generation on {dims.short()}, {precision} weights): {engine} claims {fraction:g} of each "
            f"{dev.name}'s {dev.memory_bytes / GiB:.1f} GiB ({claim / GiB:.1f} GiB, {source}) for the run"
        )
        if inside > claim:
            problem = (
                f"{share}, too little for its weights ({weights / GiB:.1f}), activations ({workspace / GiB:.2f}) and one sequence of KV "
                f"cache ({kv_seq / GiB:.2f}): {format_excess(inside - claim)} over"
            )
        else:
            problem = (
                f"{share}; beside {reserved_bytes / GiB:.1f} GiB held by colocated nodes that needs {need_s} per device of a "
                f"{dev.name}'s {dev.memory_bytes / GiB:.1f} GiB x memory_util {t.memory_util:g} = {budget_s}, {format_excess(claim + reserved_bytes - budget)} over"
            )
        memory = MemoryBreakdown(weights=weights, held=max(0, claim - weights))
        return NodeEstimate(time_s=math.inf, memory=memory, feasible=False, problem=problem)
    if max_batch < 1:
        need = reserved_bytes + weights + workspace + kv_seq
        memory = MemoryBreakdown(weights=weights, kv_cache=int(kv_seq), workspace=workspace)
        need_s, budget_s = format_gib_pair(need, budget)
        problem = (
            f"node {node!r} ({model.name} generation on {dims.short()}, {precision} weights) needs {need_s} per device "
            f"for its weights ({weights / GiB:.1f}) and one sequence of KV cache ({kv_seq / GiB:.2f})"
            + (f" beside {reserved_bytes / GiB:.1f} GiB held by colocated nodes" if reserved_bytes else "")
            + f"; a {dev.name} has {dev.memory_bytes / GiB:.1f} GiB x memory_util {t.memory_util:g} = {budget_s}, "
            f"{format_excess(need - budget)} over"
        )
        return NodeEstimate(time_s=math.inf, memory=memory, feasible=False, problem=problem)
    waves = math.ceil(per_replica / min(max_batch, per_replica))
    b = math.ceil(per_replica / waves)

    tp_link = axis_link(c, t, devices, dims, "tp") if tp > 1 else None

    def tp_all_reduce_s(nbytes: float) -> float:
        """One all-reduce of ``nbytes`` over the tp group: over the cluster's link on GPUs; on CPU ranks
        (a tp generator runs under torchrun, one process a rank) at gloo's calibrated rate at that size."""
        if tp_link is None:
            return 0.0
        cuda = DEVICE_TRAITS[dev.kind].cuda
        return all_reduce_s(nbytes, tp, tp_link if cuda else gloo_link(ctx, nbytes, "all_reduce"))

    pp_link = axis_link(c, t, devices, dims, "pp") if pp > 1 else None
    prefill_rate, measured = _rate(precision, ctx, h, "forward", t.mfu_prefill)
    decode_rate, _ = _rate(precision, ctx, h, "decode", t.mfu_decode)
    mem_bw = dev.memory_bandwidth * t.memory_bandwidth_efficiency
    launch_layer = 0.0 if measured else t.ops_per_layer * dev.kernel_overhead_s  # a measured rate has its launches

    p_tok = b * w.prompt_len
    prefill_compute = p_tok * model.forward_flops_per_token(w.prompt_len / 2) / (tp * pp * prefill_rate)
    prefill_comm = L * 2 * tp_all_reduce_s(p_tok * h * ab)
    prefill = prefill_compute + prefill_comm + L * launch_layer

    dist = w.length_dist
    caps = ENGINE_CAPS[engine]  # its cost model: the row's refills_rows, python_loop, cpu_kernels
    stream = caps.refills_rows and w.batching == "continuous"  # fed across steps, weights updated in flight
    batching = "continuous" if caps.refills_rows else w.batching  # its scheduler refills finished rows within a call
    steps = decode_steps(dist, completions=per_replica, batch=b, batching=batching)
    continuous = batching == "continuous"
    ctx_len = w.prompt_len + (dist.mean if continuous else dist.expected_max(b)) / 2
    # a mixture of experts reads the routed experts its b tokens go to (ModelSpec.expert_read_fraction)
    read_weights = weights * (1 - model.routed_expert_params / model.params * (1 - model.expert_read_fraction(b)))
    read = read_weights * L / (layers * pp) + b * ctx_len * kv_token * L / (layers * pp) + b * V * 4 / (tp * pp)  # a mean stage
    t_read = read / mem_bw
    # on a calibrated CPU, the rate at b rows (a few rows stream every weight for little arithmetic)
    t_compute = b * model.forward_flops_per_token(ctx_len) / (tp * pp * decode_rate * dev.decode_rows_factor(b))
    stage = max(t_read, t_compute)
    if tp > 1 and caps.python_loop and not DEVICE_TRAITS[dev.kind].cuda:  # the built-in engine's tp ranks on a CPU
        stage /= dev.rank_efficiency("decode", tp=tp)  # as measured against these terms (CpuTerms.tp_decode_efficiency)
    tp_tok = L / pp * 2 * tp_all_reduce_s(b * h * ab)
    token = pp * (stage + tp_tok + L / pp * launch_layer) + ((pp - 1) * send_s(b * h * ab, pp_link) if pp_link else 0.0)
    step_overhead = dev.cpu.decode_step_overhead_s if caps.python_loop else 0.0  # flowrl's Python sampling loop
    token += step_overhead
    if caps.cpu_kernels and not DEVICE_TRAITS[dev.kind].cuda:  # its own CPU kernels
        token /= vllm_decode_speedup(ctx)
    prefill /= speedup
    token /= speedup
    decode = steps * token
    reprefill = _reprefill(model, w.prompt_len + _kept(dist), b, tp, pp, prefill_rate, L, h, ab, tp_all_reduce_s, launch_layer) / speedup if stream else 0.0
    # flowrl's slot batcher: Python bookkeeping per busy row per decode step, one per completion token
    slot_rows = per_replica * dist.mean * dev.cpu.slot_row_overhead_s / speedup if continuous and caps.python_loop else 0.0

    memory = MemoryBreakdown(weights=weights, kv_cache=int(b * kv_seq), workspace=workspace)
    if claim:  # held from start to end: its KV pool and activations are all of the claim past the weights
        memory = MemoryBreakdown(weights=weights, held=claim - weights)
    breakdown = {
        "prefill": waves * prefill,
        "decode_memory" if t_read >= t_compute else "decode_compute": steps * pp * stage / speedup,
        "tp_comm": steps * pp * tp_tok / speedup + waves * prefill_comm / speedup,
        "launch": steps * L * launch_layer / speedup + waves * L * launch_layer / speedup,
        "pp_comm": steps * ((pp - 1) * send_s(b * h * ab, pp_link) if pp_link else 0.0) / speedup,
        "step_overhead": steps * step_overhead / speedup,
        "slot_overhead": slot_rows,
    }
    if stream:
        breakdown["reprefill"] = reprefill
    if w.env_s:
        breakdown["env"] = w.env_s  # waiting on environments (multi-turn rollouts): a generator-side delay
    mode = "continuous stream, a re-prefill per update" if stream else "continuous within a call" if caps.refills_rows else "continuous" if continuous else "lock-step"
    held = (f"holds {claim_fraction(engine, memory_fraction):g} of each {dev.name} for the run ({claim / GiB:.1f} GiB: weights, KV cache pool, activations)",) if claim else ()
    notes = (f"{engine} engine", *held, f"batch {b} x {waves} wave{'s' if waves > 1 else ''}", f"{precision} weights", f"{mode}, {steps:.0f} decode steps")
    cross_step = t.cross_step_slots if t.cross_step_slots is not None else DEVICE_TRAITS[dev.kind].cross_step_slots
    cross_step = cross_step and (stream or not caps.refills_rows)  # called per batch: weights change between calls, each waits for its longest
    steady = waves * prefill + steady_decode_steps(dist, completions=per_replica, batch=b) * token + slot_rows if continuous and cross_step else None
    if steady is not None:
        steady += reprefill + w.env_s
    return NodeEstimate(time_s=waves * prefill + decode + slot_rows + reprefill + w.env_s, memory=memory, breakdown=breakdown, notes=notes, steady_s=steady)


def _kept(dist: LengthDistribution) -> float:
    """Tokens a running request has drawn when a weight update meets it: ``E[l^2] / (2 E[l])`` (module docstring)."""
    total = sum(wt for _, wt in dist.points)
    return sum(n * n * wt for n, wt in dist.points) / total / (2 * dist.mean)


def _reprefill(
    model: ModelSpec, kept: float, b: int, tp: int, pp: int, rate: float, L: int, h: int, ab: int, tp_all_reduce_s: Callable[[float], float], launch_layer: float
) -> float:
    """One replica's prefill of ``b`` running requests' ``kept`` tokens again, after a weight update (module docstring)."""
    tokens = b * kept
    compute = tokens * model.forward_flops_per_token(kept / 2) / (tp * pp * rate)
    comm = L * 2 * tp_all_reduce_s(tokens * h * ab)
    return compute + comm + L * launch_layer
