"""Tensor- and pipeline-parallel training on CPU ranks (``planners/estimate/cpu_ranks.py``): each term on
a hand-computed case, and ``train_options`` adding them up as torchrun runs such a mesh on a CPU, while a
GPU mesh keeps its NVLink terms.

The model: 4 layers, width 64, 4 heads of 16, 2 KV heads, MLP 128, vocabulary 100, tied head:
attention 2*64*64 + 2*64*32 = 12288 and MLP 3*64*128 = 24576 parameters a layer (36864 in linears),
norms 2*64, embedding 6400, final norm 64: 154432 parameters.
"""

from __future__ import annotations

import pytest

from flowrl.modelspec import ModelSpec
from flowrl.planners.cluster import ClusterSpec, CpuTerms, cpu_device, parse_cluster
from flowrl.planners.estimate.common import Context
from flowrl.errors import PlanError
from flowrl.planners.estimate.cpu_ranks import gloo_link, pp_comm_s, rank_share, stage_split, tp_comm_s
from flowrl.planners.estimate.train import train_options
from flowrl.planners.parallel import ParallelDims
from flowrl.planners.tuning import Tuning
from flowrl.planners.workload import Workload

MODEL = ModelSpec(name="t", n_layers=4, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=100, tie_embeddings=True)
LINEAR = 12288 + 24576
#: 2 prompts x 4 samples of 8 + 24 tokens: packed, 8 sequences of 31 tokens (the last predicts nothing)
WORK = Workload(prompts_per_step=2, samples_per_prompt=4, prompt_len=8, gen_len=24)
TOKENS = 8 * 31
RATE, GLOO, LATENCY = 1e9, 0.5e9, 1e-6  # train FLOP/s at width 64, gloo bytes/s at every size, a hop's latency


def ctx(*, gloo: tuple[tuple[int, float], ...] = ((1, GLOO),), devices: int = 4, **tables) -> Context:
    terms = CpuTerms(flops_by_width=((64, 2 * RATE),), train_flops_by_width=((64, RATE),), gloo_by_bytes=gloo, host_cores=devices,
                     thread_speedup=1.6, **tables)  # as calibrated: a replicated CPU mesh would be one threaded process
    dev = cpu_device(cores=devices, memory_bytes=8 * 2**30, cpu=terms)
    assert dev.intra_host_latency_s == LATENCY
    cluster = ClusterSpec(name="cpu-test", hosts=1, devices_per_host=devices, device=dev)
    return Context(cluster=cluster, workload=WORK, tuning=Tuning(activation_checkpointing="off"))


def test_model_counts_match_the_docstring():
    assert MODEL.attn_params + MODEL.mlp_params // 4 == LINEAR and MODEL.params == 154432


# -- the terms ---------------------------------------------------------------------------------------
def test_stages_split_the_layers_with_the_first_stages_one_longer():
    assert stage_split(4, 1) == (4, 4)
    assert stage_split(4, 2) == (2, 2)
    assert stage_split(5, 2) == (3, 2)
    assert stage_split(7, 3) == (3, 2)


def test_a_tp_rank_holds_half_the_linears_and_the_whole_norms_embedding_and_head():
    s = rank_share(MODEL, tp=2, pp=1)
    assert s.params == 154432 - 4 * LINEAR / 2  # 80704: the linears halved, 4 x 128 + 64 norms and the 6400 embedding whole
    assert s.matmul == 4 * LINEAR / 2 + 6400  # the head's 100 x 64 on every tp rank
    assert s.attention == 4 * 4 * 64 / 2  # its 2 of the 4 heads
    assert (s.layers, s.trained) == (4, s.params)
    assert s.flops_per_token(15.5) == 2 * 80128 + 512 * 15.5


def test_a_pp_rank_holds_its_stage_the_first_the_embedding_the_last_the_head_copy():
    s = rank_share(MODEL, tp=1, pp=2)
    # stage 0: 2 x (36864 + 128) + 6400 = 80384; stage 1: 2 x 36992 + 64 + 6400 = 80448 (the tied head's copy)
    assert s.params == 80448
    assert s.matmul == 2 * LINEAR + 6400  # the last stage computes the head: it sets the pace
    assert (s.layers, s.attention) == (2, 4 * 2 * 64)
    both = rank_share(MODEL, tp=2, pp=2)
    assert (both.params, both.matmul, both.attention) == (2 * (LINEAR / 2 + 128) + 64 + 6400, 2 * LINEAR / 2 + 6400, 4 * 2 * 64 / 2)


def test_uneven_stages_the_longer_first_stage_sets_the_pace_when_the_head_is_small():
    five = ModelSpec(name="t5", n_layers=5, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=100, tie_embeddings=True)
    s = rank_share(five, tp=1, pp=2)
    assert (s.layers, s.matmul) == (3, 3 * LINEAR)  # 3 layers (110592) against 2 + head (80128)
    assert s.params == 3 * (LINEAR + 128) + 6400


def test_a_lora_rank_trains_its_share_of_the_adapters():
    lora = ModelSpec(name="l", n_layers=4, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=100, tie_embeddings=True, adapter_params=800)
    assert rank_share(lora, tp=2, pp=2).trained == 800 * 2 / 4 / 2


def test_tp_all_reduces_are_two_a_layer_forward_and_five_backward_of_tokens_x_width_at_glooes_rate_at_that_size():
    # forward: the rowwise o and down outputs; backward: the input gradient of each colwise q, k, v, gate, up (tp_train.tp_plan)
    nbytes = TOKENS * 64 * 4  # 63488
    one = 2 * (2 - 1) / 2 * nbytes / GLOO + 2 * LATENCY  # a ring all-reduce over 2 ranks
    assert tp_comm_s(TOKENS, 4, 2, ctx(), forwards=1, backwards=1, width=64) == pytest.approx(4 * 7 * one, rel=1e-12)
    # a recompute adds a forward's 2 a layer; a second iteration a forward's and a backward's
    assert tp_comm_s(TOKENS, 4, 2, ctx(), forwards=3, backwards=2, width=64) == pytest.approx(4 * (3 * 2 + 2 * 5) * one, rel=1e-12)
    assert tp_comm_s(TOKENS, 4, 1, ctx(), forwards=1, backwards=1, width=64) == 0.0
    # the rate is the one measured at the message's size: 0.1 GB/s at 62 KiB, 1 GB/s at 64 MiB
    sized = ctx(gloo=((nbytes, 0.1e9), (2**26, 1e9)))
    assert tp_comm_s(TOKENS, 4, 2, sized, forwards=1, backwards=1, width=64) == pytest.approx(28 * (nbytes / 0.1e9 + 2 * LATENCY), rel=1e-12)


def test_pp_sends_a_micro_batchs_activations_forward_and_their_gradient_back():
    nbytes = TOKENS * 64 * 4
    assert pp_comm_s(TOKENS, 2, ctx(), forwards=1, backwards=1, width=64) == pytest.approx(2 * (nbytes / GLOO + LATENCY), rel=1e-12)
    assert pp_comm_s(TOKENS, 1, ctx(), forwards=1, backwards=1, width=64) == 0.0


# -- train_options on CPU ranks ------------------------------------------------------------------------
def option(dims: ParallelDims, c: Context | None = None, **kw):
    c = c or ctx()
    opts = train_options(MODEL, dims, range(dims.size), c, packing=None, **kw)
    return opts.estimate(opts.options[0])


def test_a_tp2_policy_on_cpu_ranks_computes_its_share_and_all_reduces_over_gloo():
    est = option(ParallelDims(tp=2))
    assert est.notes[0] == "micro-batch 8 x 1"
    compute = 3 * TOKENS * (2 * (4 * LINEAR / 2 + 6400) + 4 * 4 * 64 / 2 * 15.5) / RATE  # forward + backward at the one-core rate
    assert est.breakdown["compute"] == pytest.approx(compute, rel=1e-12)
    assert est.breakdown["tp_comm"] == pytest.approx(28 * (TOKENS * 64 * 4 / GLOO + 2 * LATENCY), rel=1e-12)
    assert est.breakdown["pp_comm"] == est.breakdown["bubble"] == est.breakdown["dp_comm"] == 0.0
    # memory: 1/2 of the linears' weights, gradients and AdamW's two moments, the rest whole; logits whole
    params = 154432 - 4 * LINEAR / 2
    assert (est.memory.weights, est.memory.grads, est.memory.optimizer) == (int(params * 4), int(params * 4), int(params * 8))
    assert est.memory.workspace == TOKENS // 31 * 32 * 100 * 8  # the padded tokens' fp32 logits and their gradient, on each rank


def test_a_tp2_reference_forward_all_reduces_twice_a_layer_at_the_forward_rate():
    est = option(ParallelDims(tp=2), forward_only=True)
    compute = TOKENS * (2 * (4 * LINEAR / 2 + 6400) + 4 * 4 * 64 / 2 * 15.5) / (2 * RATE)  # the forward's calibrated rate
    assert est.breakdown["compute"] == pytest.approx(compute, rel=1e-12)
    assert est.breakdown["tp_comm"] == pytest.approx(4 * 2 * (TOKENS * 64 * 4 / GLOO + 2 * LATENCY), rel=1e-12)
    assert (est.memory.grads, est.memory.optimizer) == (0, 0)


def test_a_pp2_policy_on_cpu_ranks_pays_one_bubble_slot_and_its_sends():
    est = option(ParallelDims(pp=2), micro_batch=2)  # 4 micro-batches of 2 sequences (62 tokens)
    tokens = 2 * 31
    compute = 3 * tokens * (2 * (2 * LINEAR + 6400) + 4 * 2 * 64 * 15.5) / RATE  # the last stage: 2 layers and the head
    p2p = 2 * (tokens * 64 * 4 / GLOO + LATENCY)
    assert est.breakdown["compute"] == pytest.approx(4 * compute, rel=1e-12)
    assert est.breakdown["pp_comm"] == pytest.approx(4 * p2p, rel=1e-12)
    assert est.breakdown["bubble"] == pytest.approx(compute + p2p, rel=1e-12)  # (pp - 1) slots of (m + pp - 1)
    assert est.time_s == pytest.approx(5 * (compute + p2p) + est.breakdown["optimizer"], rel=1e-12)
    assert est.memory.weights == int(80448 * 4)


def test_dp_tp_on_cpu_ranks_splits_the_batch_and_gathers_the_tp_shards_blocks_over_gloo():
    """dp=2 x tp=2 (FSDP2 over dp): each dp rank computes half the batch; FSDP gathers its block
    of the tp shard (half the linears, the norms whole) for the forward and backward and
    reduce-scatters the gradients: three all-gathers of the shard's parameters over 2 ranks, none
    hidden behind the compute on a crowded host."""
    tp_only, both = option(ParallelDims(tp=2)), option(ParallelDims(dp=2, tp=2), sharding="fsdp", crowded=True)
    assert both.breakdown["compute"] == pytest.approx(tp_only.breakdown["compute"] / 2, rel=1e-12)
    params = 154432 - 4 * LINEAR / 2
    gather = (2 - 1) / 2 * params * 4 / GLOO + LATENCY
    assert both.breakdown["dp_comm"] == pytest.approx(3 * gather, rel=1e-12)
    assert both.memory.weights == int(params * 4 / 2)


def test_the_same_tp_mesh_on_gpus_keeps_its_nvlink_terms():
    """A GPU mesh is not priced as CPU ranks: all-reduces over the link at 2 a layer per pass, the head split."""
    c = parse_cluster("2xH100")
    gpu = Context(cluster=c, workload=WORK, tuning=Tuning(activation_checkpointing="off"))
    est = option(ParallelDims(tp=2), gpu)
    link = c.device.intra_host_bandwidth * Tuning().link_efficiency
    nbytes = TOKENS * 64 * c.device.dtype_bytes
    one = nbytes / link + 2 * c.device.intra_host_latency_s
    assert est.breakdown["tp_comm"] == pytest.approx(3 * 4 * 2 * one, rel=1e-12)
    assert est.memory.weights == int(MODEL.params / 2 * c.device.dtype_bytes)


def test_all_reduces_and_sends_run_at_their_own_calibrated_rates_else_the_gather_rate():
    """``flowrl calibrate --gloo`` times gloo's all-reduce and send at activations' sizes: a tp rank's
    all-reduces are priced at the first, a stage's sends at the second; a cluster file without them
    (or an uncalibrated CPU) falls back to the all-gather / reduce-scatter rate, then ``GLOO_BANDWIDTH``."""
    nbytes = TOKENS * 64 * 4
    measured = ctx(gloo_all_reduce_by_bytes=((nbytes, 2e9),), gloo_send_by_bytes=((nbytes, 4e9),))
    assert tp_comm_s(TOKENS, 4, 2, measured, forwards=1, backwards=1, width=64) == pytest.approx(28 * (nbytes / 2e9 + 2 * LATENCY), rel=1e-12)
    assert pp_comm_s(TOKENS, 2, measured, forwards=1, backwards=1, width=64) == pytest.approx(2 * (nbytes / 4e9 + LATENCY), rel=1e-12)
    assert gloo_link(measured, nbytes).bandwidth == GLOO  # FSDP's gathers keep the gather rate
    assert [gloo_link(ctx(), nbytes, op).bandwidth for op in ("gather", "all_reduce", "send")] == [GLOO] * 3
    from flowrl.planners.tuning import GLOO_BANDWIDTH

    assert gloo_link(ctx(gloo=()), nbytes, "all_reduce").bandwidth == GLOO_BANDWIDTH
    for field in ("gloo_all_reduce_by_bytes", "gloo_send_by_bytes"):
        with pytest.raises(PlanError, match=rf"{field}=.* must be \(bytes >= 1, bytes/s > 0\) pairs, sizes strictly ascending"):
            CpuTerms(**{field: ((2**20, 1e9), (2**18, 1e9))})


@pytest.mark.parametrize("dims, field", [(ParallelDims(tp=2), "tp_train_efficiency"), (ParallelDims(pp=2), "pp_train_efficiency")])
def test_a_split_ranks_compute_runs_at_its_measured_efficiency_and_its_collectives_as_priced(dims, field):
    """``CpuTerms.tp_train_efficiency`` / ``pp_train_efficiency`` (``flowrl calibrate --gloo``: the runtime's
    split passes against these terms) divide a rank's compute; its all-reduces and sends keep their
    gloo-rate terms; the other axis' efficiency does not apply."""
    micro = {"micro_batch": 2} if dims.pp > 1 else {}
    plain = option(dims, **micro)
    slow = option(dims, c=ctx(**{field: 0.5}), **micro)
    other = option(dims, c=ctx(**{("pp_train_efficiency" if field.startswith("tp") else "tp_train_efficiency"): 0.5}), **micro)
    assert slow.breakdown["compute"] == pytest.approx(2 * plain.breakdown["compute"], rel=1e-12)
    for part in ("tp_comm", "pp_comm"):
        assert slow.breakdown[part] == pytest.approx(plain.breakdown[part], rel=1e-12)
    assert other.breakdown["compute"] == pytest.approx(plain.breakdown["compute"], rel=1e-12)


def test_an_efficiency_out_of_range_is_refused():
    with pytest.raises(PlanError, match=r"tp_train_efficiency=-0.5 must be in \[0, 4\]"):
        CpuTerms(tp_train_efficiency=-0.5)
