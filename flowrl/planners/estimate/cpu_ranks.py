"""Tensor- and pipeline-parallel training on CPU ranks: what one rank computes, holds and sends.

A policy (or critic, or reference) whose mesh has ``tp > 1`` or ``pp > 1`` runs on a CPU as a torchrun
job: one process per rank with one intra-op thread (``OMP_NUM_THREADS=1``), its collectives and sends
over gloo between the host's processes. ``estimate.train`` prices such a mesh with these terms instead
of the GPU ones (where a tp group all-reduces over NVLink at the link's rate and the head is split with
the rest); GPU meshes keep theirs.

Notation as ``estimate.train``'s: h the width, L layers, R the head's rows (``ModelSpec.output_rows``),
V the vocabulary, ``attn`` and ``mlp`` one block's attention and (active) MLP parameters. A rank of
stage ``i`` holds ``l_i`` layers (``stage_split``: the first ``L % pp`` stages ``ceil(L / pp)``, the
others ``floor(L / pp)``); on a micro-batch of T tokens (their mean, packed) attending to c keys on
average::

    matmul_i    = l_i * (attn + mlp) / tp + [last stage] R*h       # q k v gate up colwise, o down rowwise;
                                                                   # the head replicated on every tp rank
    flops/token = 2 * matmul_i + 4 * l_i * h * c / tp              # attention on the rank's heads
    params_i    = l_i * (attn + mlp) / tp + l_i * 2h               # sharded linears, replicated norms
                  + [first stage] V*h + [last stage] (h + R*h)     # embedding; final norm and head (a tied
                                                                   # head is a copy of its own when pp > 1)
    tp_comm     = l * (TP_FORWARD_ALL_REDUCES * forwards + TP_BACKWARD_ALL_REDUCES * backwards)
                  * all_reduce(T*h*act_bytes, tp)                  # at gloo's rate at that size
    pp_comm     = (sends forward + sends backward) * send(T*h*act_bytes)     # at gloo's rate at that size
    bubble      = (pp - 1) * t_mb                                  # 1F1B: m + pp - 1 slots of a micro-batch

gloo's rates at a size are measured by ``flowrl calibrate --gloo`` between two processes: an all-reduce's
(``CpuTerms.gloo_all_reduce_rate``) and a send's (``gloo_send_rate``) at activations' sizes, else the
all-gather / reduce-scatter rate (``gloo_rate``), else ``tuning.GLOO_BANDWIDTH``. The stage with the most FLOPs
sets the pipeline's pace (``RankShare``'s time figures), the one with the most parameters its memory
(``RankShare.params``). Not modelled: DTensor's own dispatch per sharded operator (measured at ~9% of
a 4-layer pass in ``benches/tp_pp_parts.py``), a sequence-parallel layout.

Example:
    >>> from flowrl.modelspec import ModelSpec
    >>> m = ModelSpec(name="toy", n_layers=5, dim=8, n_heads=2, n_kv_heads=2, ffn_dim=16, vocab_size=10, tie_embeddings=True)
    >>> stage_split(5, 2), stage_split(4, 1)
    ((3, 2), (4, 4))
    >>> s = rank_share(m, tp=2, pp=2)
    >>> s.layers, s.matmul, s.params  # stage 0: 3 x 640 / 2 = 960; stage 1: 2 x 640 / 2 + 80 = 720
    (3, 960.0, 1088.0)
"""

from __future__ import annotations

from typing import NamedTuple

from flowrl.modelspec import ModelSpec
from flowrl.planners.estimate.common import Context, Link, all_reduce_s, send_s
from flowrl.planners.tuning import GLOO_BANDWIDTH

__all__ = [
    "TP_FORWARD_ALL_REDUCES", "TP_BACKWARD_ALL_REDUCES", "RankShare", "stage_split", "rank_share", "gloo_link",
    "tp_comm_s", "pp_comm_s", "tp_parts", "pp_parts",
]

#: All-reduces of a block's ``[tokens, h]`` activations per forward pass on a tp rank: the outputs of
#: the attention's ``o`` and the MLP's ``down`` (rowwise).
TP_FORWARD_ALL_REDUCES = 2
#: All-reduces per backward pass: the input gradient of each colwise projection, as the runtime's plan
#: gives each its own input (``runtime.parallel.tp_train.tp_plan``: q, k, v, gate and up, 5 a layer;
#: ``benches/tp_pp_parts.py`` counts them). A plan that made the block's input one replicated DTensor
#: for q, k, v (and gate, up) together (``PrepareModuleInput(..., use_local_output=False)``) would
#: issue 2.
TP_BACKWARD_ALL_REDUCES = 5


class RankShare(NamedTuple):
    """One rank's share of a model on a tp x pp mesh (module docstring).

    Attributes:
        layers: decoder layers of the stage that sets the pace (the most FLOPs).
        matmul: weights a token multiplies through on that stage's rank (FLOPs/token = 2 x this + attention).
        attention: attention FLOPs per token per key attended to on that rank (``4 * l * h / tp``).
        params: parameters a rank of the stage with the most of them holds.
        trained: of those, the ones with gradients and AdamW states (a LoRA policy's adapters, their share).
    """

    layers: int
    matmul: float
    attention: float
    params: float
    trained: float

    def flops_per_token(self, context: float) -> float:
        """Forward FLOPs of one token on this rank when it attends to ``context`` keys."""
        return 2.0 * self.matmul + self.attention * context


def stage_split(n_layers: int, pp: int) -> tuple[int, int]:
    """Layers of the first and of the last pipeline stage (``parallel.stage_layers``' split: the first
    ``n_layers % pp`` stages hold one more); both ``n_layers`` when ``pp`` is 1."""
    if pp <= 1:
        return n_layers, n_layers
    return -(-n_layers // pp), n_layers // pp


def rank_share(model: ModelSpec, tp: int, pp: int) -> RankShare:
    """What one rank of a ``tp`` x ``pp`` mesh computes and holds (module docstring)."""
    h, L = model.dim, model.n_layers
    linear = model.attn_params + model.mlp_params / L  # held: every expert
    active = model.attn_params + model.active_mlp_params / L  # computed: the experts a token goes to
    head = model.output_rows * h
    first_l, last_l = stage_split(L, pp)
    if pp == 1:
        stages = [(L, model.params - L * linear + L * linear / tp, L * active / tp + head)]
    else:
        stages = [
            (first_l, first_l * (linear / tp + 2 * h) + model.vocab_size * h, first_l * active / tp),
            (last_l, last_l * (linear / tp + 2 * h) + h + head, last_l * active / tp + head),
        ]
    layers, _, matmul = max(stages, key=lambda s: (s[2], s[0]))
    params = max(s[1] for s in stages)
    trained = model.adapter_params * max(first_l, last_l) / L / tp if model.adapter_params else params
    return RankShare(layers=layers, matmul=matmul, attention=4.0 * layers * h / tp, params=params, trained=trained)


def gloo_link(ctx: Context, nbytes: float, op: str = "gather") -> Link:
    """The link a collective of ``nbytes`` (per tensor) crosses between CPU ranks: gloo between two
    processes of the host, at the rate calibrated at that size: ``op`` ``"gather"`` (an all-gather or
    reduce-scatter: ``CpuTerms.gloo_rate``), ``"all_reduce"`` (``gloo_all_reduce_rate``), ``"send"``
    (``gloo_send_rate``) or ``"all_to_all"`` (``gloo_all_to_all_rate``); the last three fall back to the
    first, and that to ``GLOO_BANDWIDTH``. A rate achieved: no ``link_efficiency``."""
    cpu = ctx.cluster.device.cpu
    rates = {"all_reduce": cpu.gloo_all_reduce_rate, "send": cpu.gloo_send_rate, "all_to_all": cpu.gloo_all_to_all_rate}
    rate = rates.get(op, cpu.gloo_rate)(nbytes)
    return Link(rate or cpu.gloo_rate(nbytes) or GLOO_BANDWIDTH, ctx.cluster.device.intra_host_latency_s)


def tp_comm_s(tokens: float, layers: int, tp: int, ctx: Context, *, forwards: int, backwards: int, act_bytes: int = 4, width: int) -> float:
    """Seconds of a tp rank's all-reduces on one micro-batch of ``tokens``: ``forwards`` forward passes
    (recomputes included) and ``backwards`` backward passes through ``layers`` layers of ``width``.

    Example:
        >>> from flowrl.planners.cluster import ClusterSpec, CpuTerms, cpu_device
        >>> from flowrl.planners.tuning import Tuning
        >>> from flowrl.planners.workload import Workload
        >>> dev = cpu_device(cores=2, memory_bytes=2**30, cpu=CpuTerms(gloo_by_bytes=((2**20, 1e9),)))
        >>> ctx = Context(cluster=ClusterSpec(name="c", hosts=1, devices_per_host=2, device=dev), workload=Workload(prompts_per_step=1, samples_per_prompt=1, prompt_len=1, gen_len=1), tuning=Tuning())
        >>> round(tp_comm_s(256, 4, 2, ctx, forwards=1, backwards=1, width=1024) * 1e3, 3)  # 4 layers x (2 + 5) of 1 MiB at 1 GB/s, + 2 x 1 us each
        29.416
    """
    if tp <= 1:
        return 0.0
    nbytes = tokens * width * act_bytes
    count = layers * (TP_FORWARD_ALL_REDUCES * forwards + TP_BACKWARD_ALL_REDUCES * backwards)
    return count * all_reduce_s(nbytes, tp, gloo_link(ctx, nbytes, "all_reduce"))


def pp_comm_s(tokens: float, pp: int, ctx: Context, *, forwards: int, backwards: int, act_bytes: int = 4, width: int) -> float:
    """Seconds of one micro-batch's sends between stages: its activations after each of ``forwards``
    forward passes, their gradient back after each of ``backwards`` backward passes."""
    if pp <= 1:
        return 0.0
    nbytes = tokens * width * act_bytes
    return (forwards + backwards) * send_s(nbytes, gloo_link(ctx, nbytes, "send"))


def _train_rate(model: ModelSpec, ctx: Context) -> float:
    dev = ctx.cluster.device
    return dev.measured_flops(model.dim, "train") or dev.peak_flops * ctx.tuning.mfu_train


def tp_parts(model: ModelSpec, ctx: Context, *, tp: int, tokens: float, context: float) -> dict[str, float]:
    """One training pass (forward + backward) of a tp rank on one micro-batch of ``tokens`` attending
    to ``context`` keys on average: ``compute`` and ``tp_comm`` (what ``estimate.train`` adds up for it;
    ``benches/tp_pp_parts.py`` measures the same)."""
    share = rank_share(model, tp, 1)
    return {
        "compute": 3 * tokens * share.flops_per_token(context) / _train_rate(model, ctx),
        "tp_comm": tp_comm_s(tokens, share.layers, tp, ctx, forwards=1, backwards=1, width=model.dim, act_bytes=ctx.cluster.device.dtype_bytes),
    }


def pp_parts(model: ModelSpec, ctx: Context, *, pp: int, microbatches: int, tokens: float, context: float) -> dict[str, float]:
    """One 1F1B training step of ``microbatches`` micro-batches of ``tokens`` each on ``pp`` stages, on
    the slowest stage's rank: ``compute``, ``pp_comm`` and ``bubble`` (``(pp - 1)`` micro-batch slots)."""
    share = rank_share(model, 1, pp)
    compute = 3 * tokens * share.flops_per_token(context) / _train_rate(model, ctx)
    p2p = pp_comm_s(tokens, pp, ctx, forwards=1, backwards=1, width=model.dim, act_bytes=ctx.cluster.device.dtype_bytes)
    return {"compute": microbatches * compute, "pp_comm": microbatches * p2p, "bubble": (pp - 1) * (compute + p2p)}
