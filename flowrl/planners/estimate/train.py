"""Training-step time and memory of a policy (and forward-only passes of a reference model).

Notation: S sequences per step of at most s tokens and ``s_bar`` on average (``Workload``: prompt +
mean completion; sequences are packed, so time follows the mean and memory the longest; a policy
whose ``OptimizerConfig.packing`` packs (its default, None, or True) counts its packed tokens, the
mean - 1, on any device; with ``packing=False`` on a CPU device, or ``Tuning.packed_sequences`` off,
each micro-batch is padded to its longest sequence as flowrl's trainer then does, so ``s_bar`` is
prompt + the expected longest of ``mb`` completions - 1, the last token predicting nothing), model of L layers, width h, MLP width f,
vocabulary V, P parameters; mesh dp x tp x pp; micro-batches of ``mb`` sequences, so each
data-parallel rank runs ``m = ceil(ceil(S / dp) / mb)`` micro-batches.

Time of one optimizer step::

    F_tok       = 2 * matmul_params + 4 * L * h * (s_bar / 2)        # forward FLOPs/token, causal
    passes      = 3 (forward + backward) + 1 if activation checkpointing + 1 if log-probs are recomputed
    t_mb        = passes * [ mb*s_bar * F_tok / pp / (tp * peak * mfu_train)      # compute of one stage
                             + (L/pp) * 2 * all_reduce(mb*s_bar*h*act_bytes, tp)  # tp: 2 per layer
                             + (L/pp) * ops_per_layer * kernel_overhead ]         # launches
                  + 2 * send(mb*s_bar*h*act_bytes) if pp > 1                      # stage-to-stage
    pipeline    = (m + pp - 1) * t_mb                                  # 1F1B: pp - 1 bubble slots
    grad_sync   = (1 - overlap) * all_reduce(P/(tp*pp) * grad_bytes, dp)         # reduce-scatter (all_gather) at zero >= 2
    optimizer   = P/(tp*pp) * (param_bytes + grad_bytes + 2 * optimizer_bytes / shard) / mem_bw
                  + param_tensors * 10 * kernel_overhead  (+ all_gather of the params if sharded)
                  (a calibrated CPU: P/(tp*pp) * ``CpuTerms.adamw_s_per_param``, AdamW's step measured)
                  (ZeRO-3: a rank steps its shards, param_bytes + grad_bytes / dp too)
    T           = pipeline + grad_sync + optimizer
    zero = 3    :  t_mb += (1 - overlap) * gathers * all_gather(P/(tp*pp) * param_bytes, dp)
                   gathers = iterations * (2 + ckpt) + 1 if log-probs are recomputed
                   (FSDP gathers each stage's parameters for every forward and backward pass)
    overlap     = dp_overlap, or 0 where the host's processes outnumber its cores (``host_crowded``)

On a calibrated CPU device ``peak * mfu_train`` is the measured rate of the built-in model's
forward + backward at width h (``DeviceSpec.cpu.train_flops_by_width``; a reference's forward:
``flops_by_width``): the whole pass as this machine runs it, so no MFU, and ``ops_per_layer`` is 0
(its launches are in it). A CPU mesh is one process with an intra-op thread per core (the local and
process backends), sped up ``DeviceSpec.mesh_speedup`` times, except an FSDP2 policy's
(``sharding="fsdp"``), which runs under torchrun: each of its dp ranks is a process with one
intra-op thread (torchrun's ``OMP_NUM_THREADS=1``) that computes its ``S / dp`` sequences at the
one-core rate, gathers and reduce-scatters over gloo between the ranks' processes, a block at a time
(``gloo_link``: ``CpuTerms.gloo_rate`` at a block's bytes, measured by ``flowrl calibrate``, else
``tuning.GLOO_BANDWIDTH``),
with no overlap where the job's ranks and vLLM's workers outnumber the host's cores (``crowded``:
``host_crowded``; on two cores beside vLLM nothing runs a gather while the rank computes); ranks
that outnumber the cores time-share them in the step (``schedule.shared_step_s``). A mesh with
``tp > 1`` or ``pp > 1`` on a CPU runs as such ranks too, priced by ``estimate.cpu_ranks``: each rank
computes its share (1/tp of the linears and heads, its stage's layers, the replicated head whole) at
the one-core rate, all-reduces its activations over the tp ranks (2 a layer per forward pass, 2 per
backward) and sends them between stages at gloo's rate at their size, and holds its stage's
replicated norms, embedding and head whole; a GPU mesh keeps the terms above.

Memory per device::

    ZeRO stage ``zero`` (``Tuning.zero_stage``) shards over dp: 1 the optimizer states, 2 also the
    gradients, 3 (FSDP) also the parameters:
    weights = P/(tp*pp) * param_bytes / (dp if zero >= 3 else 1)
    grads = P/(tp*pp) * grad_bytes / (dp if zero >= 2 else 1)
    optimizer = P/(tp*pp) * optimizer_bytes / (dp if zero >= 1 else 1)
    per_layer  = mb*s * (8h + 3f) * act_bytes / tp          # stored activations of one layer
    activations = min(pp, m) * (L/pp) * per_layer            # 1F1B keeps up to pp micro-batches
                = min(pp, m) * (L/pp) * mb*s*h*act_bytes/tp + per_layer   with checkpointing
    workspace   = mb*s * V * 8 / tp                          # fp32 logits and their gradient
                                                             # (forward only: 4 bytes; a classifier's
                                                             # head_rows, not V; last_logits: mb * V * 4)

A mixture of experts (``ModelSpec.n_experts`` = E) on a mesh with ``ParallelDims.ep`` > 1 trains with
expert parallelism, as the torchrun runtime runs it (``flowrl.runtime.parallel.expert_parallel``) and
Megatron and its peers do: the routed experts' X parameters are split over groups of ``ep`` of the dp
ranks, each rank holding ``E / ep`` whole experts, so ZeRO shards and gathers them, and reduces their
gradients, over the ``dp / ep`` ranks holding the same experts only (ZeRO-3 gathers no expert when
ep = dp); the other ``P - X`` parameters as above. The search tries every ep the node's program runs
(``parallel.expert_splits``: the divisors of dp dividing E, of which the runtime builds ep = dp only,
``runnable.expert_split_runs``) and the plan carries the one it picked (``NodeMesh.ep``). Each MoE layer's tokens go to their experts' ranks and back, an all-to-all each way
per pass (the backward's gradients too)::

    a2a   = moe_layers/pp * [ (2 * forward passes + 2 * backward passes) * all_to_all(mb*s_bar * k * h * act_bytes / tp, ep)
                              + forward passes * all_to_all(E * 8, ep) ]      # each forward's per-expert token counts

added to ``t_mb`` (``breakdown["ep_comm"]``), at ``estimate.experts.all_to_all_rate``: gloo's
all-to-all rate ``flowrl calibrate --gloo`` measured at that size on CPU ranks, the cluster spec's
link on GPUs (the policy's note names it). Not modelled: routing imbalance, expert tensor
parallelism of its own.

A LoRA policy (``ModelSpec.adapter_params`` = A > 0) trains its adapters only: ``grads``,
``optimizer``, ``grad_sync`` and the optimizer step count A instead of P (the weights stay P), and
its backward costs one forward instead of two (the frozen weights need only the input gradient), so
``passes`` is 2 (+ 1 with checkpointing, + 1 for a log-prob recompute).

With uneven stages (pp need not divide L) every per-stage figure is the largest stage's:
``L/pp`` above is ``ceil(L/pp)``, ``P/(tp*pp)`` is ``P * ceil(L/pp) / (L * tp)``, and ``F_tok / pp``
is ``F_tok * ceil(L/pp) / L``. Parameters are assumed evenly spread over layers (the first and last stages also hold the
embedding and output head; for Llama-3 405B at tp=8 that is about 2 GiB more on those two).
The estimate tries every power-of-two micro-batch (or the one the optimizer config fixes) with
and without checkpointing and keeps the fastest that fits; for a policy with the default packing
and ``micro_batch_size`` 0 (the whole batch, as flowrl's trainer runs it on any device) it keeps the
whole batch where that fits, else the fastest that fits, noting the ``micro_batch_size`` to set.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

from flowrl.planners.estimate.common import (
    GiB,
    Context,
    Link,
    MemoryBreakdown,
    NodeEstimate,
    all_gather_s,
    all_reduce_s,
    all_to_all_s,
    axis_link,
    send_s,
)
from flowrl.planners.estimate.cpu_ranks import gloo_link, pp_comm_s, rank_share, tp_comm_s
from flowrl.planners.estimate.experts import all_to_all_rate, as_link, smallest_priced
from flowrl.modelspec import ModelSpec
from flowrl.planners.cluster import DEVICE_TRAITS, ClusterSpec
from flowrl.planners.parallel import ParallelDims, stage_layers
from flowrl.planners.tuning import GLOO_BANDWIDTH, Tuning
from flowrl.planners.units import format_excess, format_gib_pair

__all__ = [
    "TrainOption", "TrainOptions", "train_options", "estimate_train", "pick_fitting", "memory_budget", "zero_stage",
    "gloo_link", "host_crowded",
]


def host_crowded(cluster: ClusterSpec, vllm_workers: int) -> bool:
    """Whether a host's processes outnumber its cores, leaving none free to run a collective beside
    the compute: on a CPU cluster (a device is a core), the job's ranks (one per device) and
    ``vllm_workers`` (vLLM's worker processes: at least one per vLLM generator) against the host's
    cores (``CpuTerms.host_cores``, else one per device). Never on GPUs, whose collectives run on
    engines of their own.

    Example:
        >>> from flowrl.planners.cluster import parse_cluster
        >>> host_crowded(parse_cluster("cpu:2"), 0), host_crowded(parse_cluster("cpu:2"), 1), host_crowded(parse_cluster("8xH100"), 1)
        (False, True, False)
    """
    dev = cluster.device
    if not DEVICE_TRAITS[dev.kind].pinned:
        return False
    return cluster.devices_per_host + vllm_workers > (dev.cpu.host_cores or cluster.devices_per_host)


def zero_stage(tuning: Tuning, sharding: str = "replicate") -> int:
    """The ZeRO stage in effect: 3 for a policy whose optimizer says ``sharding="fsdp"`` (what the
    torchrun runtime runs: FSDP2, ``flowrl.runtime.parallel.fsdp``), else ``tuning.zero_stage``, else 1 with
    ``shard_optimizer`` and 0 without."""
    if sharding == "fsdp":
        return 3
    if tuning.zero_stage is not None:
        return tuning.zero_stage
    return 1 if tuning.shard_optimizer else 0


def memory_budget(ctx: Context) -> float:
    """Bytes per device the planner may fill: device memory x ``memory_util``."""
    return ctx.cluster.device.memory_bytes * ctx.tuning.memory_util


def _micro_batches(per_rank: int, fixed: int) -> list[int]:
    if fixed > 0:
        return [min(fixed, per_rank)]
    sizes, mb = [], 1
    while mb < per_rank:
        sizes.append(mb)
        mb *= 2
    sizes.append(per_rank)
    return sizes


class TrainOption(NamedTuple):
    """One (micro-batch, checkpointing) choice: its step time and bytes per device."""

    time_s: float
    memory_total: int
    micro_batch: int
    checkpointing: bool


class TrainOptions:
    """Every option of one node on one mesh, fastest first; ``estimate(option)`` details one.

    Computing a full ``NodeEstimate`` for each of the ~24 options of each of the thousands of
    meshes a search visits would dominate its run time, so options stay tuples until chosen.
    """

    def __init__(self, options: list[TrainOption], detail: Callable[[TrainOption], NodeEstimate]) -> None:
        self.options = options
        self._detail = detail

    def estimate(self, option: TrainOption) -> NodeEstimate:
        return self._detail(option)


def train_options(
    model: ModelSpec,
    dims: ParallelDims,
    devices: Sequence[int],
    ctx: Context,
    *,
    forward_only: bool = False,
    recompute_logprobs: bool = False,
    micro_batch: int = 0,
    sharding: str = "replicate",
    last_logits: bool = False,
    iterations: int = 1,
    updates: int = 1,
    packing: bool | None = False,
    crowded: bool = False,
) -> TrainOptions:
    """Every (micro-batch, checkpointing) option for this mesh, fastest first, feasible or not.

    Args:
        forward_only: a reference model: one forward pass, no gradients or optimizer.
        recompute_logprobs: add a forward pass for old-policy log-probs (PPO/GRPO).
        micro_batch: sequences per micro-batch; 0 lets the estimate choose.
        sharding: the policy's ``OptimizerConfig.sharding`` (``"fsdp"``: ZeRO stage 3, ``zero_stage``).
        last_logits: a forward pass that computes the logits of each sequence's last position only
            (a generative judge's verdict, ``flowrl.operators.reward_models``).
        iterations: forward/backward passes over the batch (``OptimizerConfig.num_iterations``); the
            log-prob recompute is once per batch.
        updates: optimizer steps per batch (``updates_per_batch``): each syncs gradients and steps AdamW.
        packing: the policy's ``OptimizerConfig.packing``: flowrl's trainer packs its micro-batches, so
            their tokens are the mean length's (``Tuning.packed_sequences``, when set, overrides it).
            None, the default, packs (where the family can, on any device): priced packed, and with
            ``micro_batch`` 0 as the trainer runs ``micro_batch_size`` 0, the whole batch in one
            micro-batch, where that fits; where it does not, the fastest micro-batch that fits, with
            a note naming the ``micro_batch_size`` to set (the trainer would run the whole batch).
        crowded: the host's processes outnumber its cores (:func:`host_crowded`): no data-parallel
            collective overlaps the compute (``Tuning.dp_overlap`` is taken as 0).
    """
    c, t, w = ctx.cluster, ctx.tuning, ctx.workload
    dev = c.device
    whole_first = False
    if packing is None:  # flowrl's trainer packs where the family can, on any device
        packing, whole_first = True, micro_batch == 0
    dp, tp, pp = dims.dp, dims.tp, dims.pp
    pb = t.param_bytes or dev.dtype_bytes
    ob = t.optimizer_bytes or (12 if pb <= 2 else 8)
    gb = t.grad_bytes
    ab = dev.dtype_bytes
    h, f, L, V = model.dim, model.active_ffn_dim, model.n_layers, model.output_rows  # a token's activations span the experts it goes to
    layers = stage_layers(L, pp)  # the largest stage sets the pace (stages may be uneven)
    frac = layers / L
    s = w.seq_len
    packed = t.packed_sequences if t.packed_sequences is not None else packing or DEVICE_TRAITS[dev.kind].packs_sequences
    dist = w.length_dist

    def mean_len(mb: int) -> float:
        """Tokens per sequence a micro-batch of ``mb`` costs: the mean packed, its longest padded."""
        if packed:  # flowrl's packing drops each sequence's last token, which predicts nothing, as padding does
            return w.mean_seq_len - 1 if packing else w.mean_seq_len
        return w.prompt_len + dist.expected_max(mb) - 1  # the last token predicts nothing

    # FSDP2 runs under torchrun: on a CPU each rank is a process of its own with one intra-op thread
    # (torchrun's OMP_NUM_THREADS=1), at the calibrated one-core rate, its collectives over gloo
    # a tp or pp mesh runs under torchrun on any device: on a CPU as ranks too, priced by ``cpu_ranks``'
    # terms (each rank's share of the layers and linears, its all-reduces and sends at gloo's rate)
    split = tp > 1 or pp > 1
    # (and under torchrun, ``Tuning.backend``, every mesh on a CPU is ranks: replicas are one-thread processes too)
    ranks_backend = t.backend == "torchrun" and not forward_only
    cpu_ranks = ((sharding == "fsdp" and not forward_only) or split or ranks_backend) and DEVICE_TRAITS[dev.kind].pinned
    share = rank_share(model, tp, pp) if cpu_ranks and split else None
    if cpu_ranks:
        replicas, speedup = dp, 1.0
    else:
        replicas = 1 if dev.cpu.thread_speedup > 0 else dp  # a CPU mesh is one process with dp intra-op threads
        speedup = dev.mesh_speedup(dp, c.devices_per_host) / replicas
    per_rank = math.ceil(w.sequences / replicas)
    if (packing or not packed) and micro_batch == 0 and not whole_first:  # flowrl's trainer runs micro_batch_size 0 as one pass over the batch
        micro_batch = per_rank
    measured = dev.measured_flops(h, "forward" if forward_only else "train")
    rate = measured if measured is not None else dev.peak_flops * t.mfu_train  # a measured rate is achieved, launches in it
    ops_per_layer = 0 if measured is not None else t.ops_per_layer
    p_dev = model.params * frac / tp
    # what has gradients and AdamW state: a LoRA policy's adapters (its base is frozen), else every weight;
    # a frozen weight's backward computes the input gradient only: one forward's FLOPs instead of two
    p_train = model.trained_params * frac / tp
    if share is not None:  # a CPU rank holds its stage's replicated norms, embedding and head whole
        p_dev, p_train = share.params, share.trained
    backward = 1 if model.adapter_params else 2

    tp_link = axis_link(c, t, devices, dims, "tp") if tp > 1 and share is None else None
    pp_link = axis_link(c, t, devices, dims, "pp") if pp > 1 and share is None else None
    # on CPU ranks FSDP2 gathers (and reduce-scatters) one block's tensors at a time: gloo's rate at that size
    block = model.params * pb / L if share is None else share.params * pb / share.layers
    dp_link = (gloo_link(ctx, block) if cpu_ranks else axis_link(c, t, devices, dims, "dp")) if replicas > 1 else None
    overlap = 0.0 if crowded else t.dp_overlap  # no free core runs a collective beside the compute

    zero = 0 if forward_only else zero_stage(t, sharding)
    # expert parallelism (module docstring): the routed experts, x per device of ep, shard over dp / ep
    ep = dims.ep if replicas > 1 and model.n_experts else 1
    x_full = model.routed_expert_params * frac / tp if ep > 1 else 0.0
    x_dev, dp_x = x_full / ep, dp // ep
    p_dev -= x_full - x_dev
    dense = p_dev - x_dev  # what ZeRO shards over all of dp
    if ep > 1:
        p_train = dense + x_dev  # every weight trains (LoRA policies take no expert parallelism)

    def over(dense_part: float, expert_part: float, n: int) -> float:
        """Bytes per device of a dense and an expert part, ZeRO-sharded (n > 1) over dp and dp / ep."""
        return dense_part / (dp if n > 1 else 1) + expert_part / (dp_x if n > 1 else 1)

    weights = int(over(dense * pb, x_dev * pb, dp if zero >= 3 else 1))

    def experts_too(collective: Callable[[float, int, Link], float], link: Link, dense_bytes: float, expert_bytes: float) -> float:
        """A collective over dp (on ``link``) of the dense part, and with expert parallelism over dp / ep of the experts'."""
        return collective(dense_bytes, dp, link) + (collective(expert_bytes, dp_x, link) if ep > 1 else 0.0)

    fsdp_gather = (1 - overlap) * experts_too(all_gather_s, dp_link, dense * pb, x_dev * pb) if zero >= 3 and dp_link else 0.0
    if forward_only:
        grads = optim = 0
        grad_sync = optimizer_s = 0.0
    else:
        d_train = p_train - x_dev
        grads = int(over(d_train * gb, x_dev * gb, dp if zero >= 2 else 1))
        shard = dp if zero >= 1 else 1
        optim = int(over(d_train * ob, x_dev * ob, shard))
        if dp_link:
            reduce = all_gather_s if zero >= 2 else all_reduce_s  # reduce-scatter moves what an all-gather does
            grad_sync = (1 - overlap) * experts_too(reduce, dp_link, d_train * gb, x_dev * gb)
        else:
            grad_sync = 0.0
        tensors = 9 * L + 3
        states = over(d_train * ob, x_dev * ob, shard if replicas > 1 else 1)  # a CPU mesh's one process steps all of them
        stepped = over(d_train * (pb + gb), x_dev * (pb + gb), dp if zero >= 3 and replicas > 1 else 1)  # ZeRO-3: a rank steps its shards
        if dev.cpu.adamw_s_per_param > 0:  # a calibrated CPU: AdamW's measured per-parameter loop
            optimizer_s = stepped / (pb + gb) * dev.cpu.adamw_s_per_param + dev.cpu.train_step_overhead_s
        else:
            optimizer_s = (stepped + 2 * states) / (dev.memory_bandwidth * t.memory_bandwidth_efficiency)
            optimizer_s += tensors * 10 * dev.kernel_overhead_s + dev.cpu.train_step_overhead_s
        if zero in (1, 2) and dp_link:  # the updated shards are gathered back into every replica's parameters
            optimizer_s += experts_too(all_gather_s, dp_link, d_train * pb, x_dev * pb)
    resident = weights + grads + optim
    moe_layers = model.moe_layers * frac if ep > 1 else 0.0

    def a2a(tok_bar: float, fwd: int, bwd: int) -> float:
        """The MoE layers' all-to-alls of one micro-batch: each way, every forward and backward pass."""
        if not moe_layers:
            return 0.0
        floor = smallest_priced(ctx)  # a message below the smallest size measured takes its time: gloo's latency
        nbytes, counts = max(tok_bar * model.experts_per_token * h * ab / tp, floor), max(model.n_experts * 8, floor)
        tokens = all_to_all_s(nbytes, ep, as_link(all_to_all_rate(ctx, devices, dims, nbytes)))
        return moe_layers * (2 * (fwd + bwd) * tokens + fwd * all_to_all_s(counts, ep, as_link(all_to_all_rate(ctx, devices, dims, counts))))

    ckpt_choices: tuple[bool, ...]
    if forward_only:
        ckpt_choices = (False,)
    elif t.activation_checkpointing == "auto":
        ckpt_choices = (False, True)
    else:
        ckpt_choices = (t.activation_checkpointing == "on",)

    # a CPU rank's logits are whole: the head is replicated over tp (``cpu_ranks``)
    logits_split = tp if share is None else 1

    def rank_terms(tok_bar: float, s_bar: float, passes: int, ckpt: bool) -> tuple[float, float, float, float]:
        """Compute, all-reduces, launches and sends of one micro-batch on a CPU rank of a tp/pp mesh (``cpu_ranks``)."""
        assert share is not None
        forwards = 1 if forward_only else iterations * (1 + int(ckpt)) + int(recompute_logprobs)
        backwards = 0 if forward_only else iterations
        sent = 1 if forward_only else iterations + int(recompute_logprobs)  # a checkpoint's recompute stays on its stage
        # the rank's compute at its measured efficiency (CpuTerms.tp/pp_train_efficiency: DTensor, narrow matmuls, the
        # schedule); a reference's forward-only pass takes the training pass's figure, the only one measured
        return (
            passes * tok_bar * share.flops_per_token(s_bar / 2) / (rate * dev.rank_efficiency("train", tp=tp, pp=pp)),
            tp_comm_s(tok_bar, share.layers, tp, ctx, forwards=forwards, backwards=backwards, act_bytes=ab, width=h),
            passes * share.layers * ops_per_layer * dev.kernel_overhead_s,
            pp_comm_s(tok_bar, pp, ctx, forwards=sent, backwards=backwards, act_bytes=ab, width=h),
        )

    def parts(mb: int, ckpt: bool) -> tuple[float, dict[str, float], MemoryBreakdown]:
        m = math.ceil(per_rank / mb)
        s_bar = mean_len(mb)
        f_tok = model.forward_flops_per_token(s_bar / 2)
        tok, tok_bar = mb * s, mb * s_bar
        per_layer = tok * (8 * h + 3 * f) * ab / tp
        workspace = int((mb if last_logits else tok) * V * (4 if forward_only else 8) / logits_split)
        passes = 1 if forward_only else iterations * (1 + backward + int(ckpt)) + int(recompute_logprobs)
        if share is None:
            compute = passes * tok_bar * f_tok * frac / (tp * rate)
            tp_comm = passes * layers * 2 * all_reduce_s(tok_bar * h * ab, tp, tp_link) if tp_link else 0.0
            launches = passes * layers * ops_per_layer * dev.kernel_overhead_s
            p2p = (1 if forward_only else 2 * iterations) * send_s(tok_bar * h * ab, pp_link) if pp_link else 0.0
        else:
            compute, tp_comm, launches, p2p = rank_terms(tok_bar, s_bar, passes, ckpt)
        ep_comm = a2a(tok_bar, 1, 0) if forward_only else a2a(tok_bar, iterations * (1 + int(ckpt)) + int(recompute_logprobs), iterations)
        gathers = iterations * (2 + int(ckpt)) + int(recompute_logprobs)  # FSDP gathers for every forward and backward
        t_mb = compute + tp_comm + launches + p2p + ep_comm + gathers * fsdp_gather
        if forward_only:
            acts = int(per_layer)
        elif ckpt:
            acts = int(min(pp, m) * layers * tok * h * ab / tp + per_layer)
        else:
            acts = int(min(pp, m) * layers * per_layer)
        memory = MemoryBreakdown(weights=weights, grads=grads, optimizer=optim, activations=acts, workspace=workspace)
        breakdown = {
            "compute": m * compute,
            "tp_comm": m * tp_comm,
            "launch": m * launches,
            "pp_comm": m * p2p,
            **({"ep_comm": m * ep_comm} if moe_layers else {}),
            "bubble": (pp - 1) * t_mb,
            "dp_comm": updates * grad_sync + m * gathers * fsdp_gather,
            "optimizer": updates * optimizer_s,
        }
        breakdown = {name: part / speedup for name, part in breakdown.items()}
        return ((m + pp - 1) * t_mb + updates * (grad_sync + optimizer_s)) / speedup, breakdown, memory

    # the hot loop: the same formulas as ``parts``, without building structs
    options: list[TrainOption] = []
    tp_ar = (lambda nbytes: all_reduce_s(nbytes, tp, tp_link)) if tp_link else (lambda nbytes: 0.0)
    for mb in _micro_batches(per_rank, micro_batch):
        m = -(-per_rank // mb)
        s_bar = mean_len(mb)
        f_tok = model.forward_flops_per_token(s_bar / 2)
        tok, tok_bar = mb * s, mb * s_bar
        per_layer = tok * (8 * h + 3 * f) * ab / tp
        workspace = int((mb if last_logits else tok) * V * (4 if forward_only else 8) / logits_split)
        layer_comm = layers * 2 * tp_ar(tok_bar * h * ab)
        p2p = (1 if forward_only else 2 * iterations) * send_s(tok_bar * h * ab, pp_link) if pp_link else 0.0
        for ckpt in ckpt_choices:
            passes = 1 if forward_only else iterations * (1 + backward + ckpt) + recompute_logprobs
            if share is None:
                t_mb = passes * (tok_bar * f_tok * frac / (tp * rate) + layer_comm + layers * ops_per_layer * dev.kernel_overhead_s) + p2p
            else:
                t_mb = sum(rank_terms(tok_bar, s_bar, passes, ckpt))
            t_mb += (iterations * (2 + ckpt) + recompute_logprobs) * fsdp_gather
            if moe_layers:
                t_mb += a2a(tok_bar, 1, 0) if forward_only else a2a(tok_bar, iterations * (1 + ckpt) + recompute_logprobs, iterations)
            if forward_only:
                acts = int(per_layer)
            elif ckpt:
                acts = int(min(pp, m) * layers * tok * h * ab / tp + per_layer)
            else:
                acts = int(min(pp, m) * layers * per_layer)
            options.append(TrainOption(((m + pp - 1) * t_mb + updates * (grad_sync + optimizer_s)) / speedup, resident + acts + workspace, mb, ckpt))
    options.sort()
    if whole_first:  # what the trainer runs (micro_batch_size 0: the whole batch) first; a smaller one only where it does not fit
        options.sort(key=lambda o: o.micro_batch != per_rank)

    def detail(option: TrainOption) -> NodeEstimate:
        time, breakdown, memory = parts(option.micro_batch, option.checkpointing)
        m = math.ceil(per_rank / option.micro_batch)
        notes = [f"micro-batch {option.micro_batch} x {m}"]
        if whole_first and option.micro_batch != per_rank:
            notes.append(f"the whole batch does not fit: set the policy's micro_batch_size={option.micro_batch}")
        if option.checkpointing:
            notes.append("activation checkpointing")
        if moe_layers:
            tokens = option.micro_batch * mean_len(option.micro_batch) * model.experts_per_token * h * ab / tp
            notes.append(f"experts split over ep={ep}: all-to-all at {all_to_all_rate(ctx, devices, dims, tokens).describe()}")
        if recompute_logprobs:
            notes.append("log-prob recompute")
        if updates > 1:
            notes.append(f"{iterations} passes, {updates} optimizer steps a batch")
        return NodeEstimate(time_s=time, memory=memory, breakdown=breakdown, notes=tuple(notes))

    return TrainOptions(options, detail)


def pick_fitting(options: TrainOptions, ctx: Context, reserved_bytes: float, *, node: str, what: str) -> NodeEstimate:
    """The first option (fastest) whose memory plus ``reserved_bytes`` fits; else the smallest, marked infeasible."""
    budget = memory_budget(ctx)
    for option in options.options:
        if option.memory_total + reserved_bytes <= budget:
            return options.estimate(option)
    smallest = options.estimate(min(options.options, key=lambda o: o.memory_total))
    need = smallest.memory.total + reserved_bytes
    dev = ctx.cluster.device
    need_s, budget_s = format_gib_pair(need, budget)
    problem = (
        f"node {node!r} ({what}) needs {need_s} per device "
        f"({smallest.memory.resident / GiB:.1f} resident + {smallest.memory.transient / GiB:.1f} transient"
        + (f" + {reserved_bytes / GiB:.1f} held by colocated nodes" if reserved_bytes else "")
        + f"); a {dev.name} has {dev.memory_bytes / GiB:.1f} GiB x memory_util {ctx.tuning.memory_util:g} = "
        f"{budget_s}, {format_excess(need - budget)} over"
    )
    return NodeEstimate(time_s=smallest.time_s, memory=smallest.memory, breakdown=smallest.breakdown, notes=smallest.notes, feasible=False, problem=problem)


def estimate_train(
    model: ModelSpec,
    dims: ParallelDims,
    devices: Sequence[int],
    ctx: Context,
    *,
    reserved_bytes: float = 0.0,
    node: str = "policy",
    forward_only: bool = False,
    recompute_logprobs: bool = False,
    micro_batch: int = 0,
) -> NodeEstimate:
    """The fastest option of ``train_options`` that fits beside ``reserved_bytes`` of colocated state.

    Example:
        >>> from flowrl.planners.cluster import parse_cluster
        >>> from flowrl.modelspec import model_preset
        >>> from flowrl.planners.tuning import Tuning
        >>> from flowrl.planners.workload import Workload
        >>> ctx = Context(cluster=parse_cluster("8xH100"), tuning=Tuning(),
        ...               workload=Workload(prompts_per_step=64, samples_per_prompt=4, prompt_len=256, gen_len=256))
        >>> est = estimate_train(model_preset("llama3-8b"), ParallelDims(dp=2, tp=4), range(8), ctx)
        >>> est.feasible, round(est.time_s, 1)
        (True, 2.1)
    """
    options = train_options(
        model, dims, devices, ctx, forward_only=forward_only, recompute_logprobs=recompute_logprobs, micro_batch=micro_batch
    )
    what = f"{model.name} {'forward' if forward_only else 'training'} on {dims.short()}"
    return pick_fitting(options, ctx, reserved_bytes, node=node, what=what)
