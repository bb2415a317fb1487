"""The estimate formulas, checked against values computed by hand from their docstrings.

The device below has round figures and no overheads (no latency, no launch cost, efficiencies 1),
so each case reduces to the formula it checks.
"""

from __future__ import annotations

import math

import pytest

from flowrl.planners.cluster import ClusterSpec, CpuTerms, DeviceSpec
from flowrl.planners.estimate.common import Context, Link, all_gather_s, all_reduce_s, send_s
from flowrl.planners.estimate.generate import estimate_generate
from flowrl.planners.estimate.cpu import estimate_in_policy, estimate_scorer, estimate_source
from flowrl.planners.estimate.sync import add_engine_load, estimate_sync
from flowrl.planners.estimate.train import estimate_train, pick_fitting, train_options
from flowrl.modelspec import ModelSpec
from flowrl.planners.parallel import ParallelDims
from flowrl.planners.tuning import Tuning
from flowrl.planners.workload import Workload

TINY = ModelSpec(name="tiny", n_layers=2, dim=8, n_heads=2, n_kv_heads=1, ffn_dim=16, vocab_size=10)  # 1352 params
WORK = Workload(prompts_per_step=2, samples_per_prompt=2, prompt_len=3, gen_len=1)  # 4 sequences of 4 tokens
EXACT = Tuning(
    mfu_train=1, mfu_prefill=1, mfu_decode=1, memory_bandwidth_efficiency=1, link_efficiency=1,
    ops_per_layer=0, memory_util=1, dp_overlap=0, activation_checkpointing="off",
)


def device(**over) -> DeviceSpec:
    """The test device; ``over`` may name ``DeviceSpec`` fields and ``CpuTerms`` fields (put in ``cpu``)."""
    terms = {k: over.pop(k) for k in list(over) if k in CpuTerms.__struct_fields__}
    base = dict(
        name="X", memory_bytes=10**9, peak_flops=1e12, memory_bandwidth=1e11, intra_host_bandwidth=1e10,
        inter_host_bandwidth=1e9, intra_host_latency_s=0.0, inter_host_latency_s=0.0, kernel_overhead_s=0.0,
    )
    base.update(over)
    return DeviceSpec(**base, cpu=CpuTerms(**terms))


def ctx(dev: DeviceSpec | None = None, per_host: int = 8, hosts: int = 1, tuning: Tuning = EXACT, work: Workload = WORK) -> Context:
    return Context(cluster=ClusterSpec(name="c", hosts=hosts, devices_per_host=per_host, device=dev or device()), workload=work, tuning=tuning)


# -- collectives -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fn, args, expected",
    [
        (all_reduce_s, (1e9, 4, Link(1e9, 1e-6)), 2 * 3 / 4 + 2 * 2 * 1e-6),
        (all_reduce_s, (1e9, 1, Link(1e9, 1e-6)), 0.0),
        (all_gather_s, (1e9, 8, Link(1e9, 1e-6)), 7 / 8 + 3 * 1e-6),
        (send_s, (5e8, Link(1e9, 1e-6)), 0.5 + 1e-6),
    ],
    ids=["all-reduce", "all-reduce-1", "all-gather", "send"],
)
def test_collectives(fn, args, expected):
    assert fn(*args) == pytest.approx(expected)


# -- training ----------------------------------------------------------------------------------------
def test_train_single_device_by_hand():
    est = estimate_train(TINY, ParallelDims(), range(1), ctx())
    f_tok = 2 * 1232 + 4 * 2 * 8 * (4 / 2)  # forward FLOPs per token, causal ctx s/2 = 2
    assert est.breakdown["compute"] == pytest.approx(3 * 16 * f_tok / 1e12)
    # bf16 params (2) + fp32 grads (4) + 2 * 12 optimizer bytes, streamed once, per parameter
    assert est.breakdown["optimizer"] == pytest.approx(1352 * (2 + 4 + 24) / 1e11)
    assert est.time_s == pytest.approx(est.breakdown["compute"] + est.breakdown["optimizer"])
    m = est.memory
    assert (m.weights, m.grads, m.optimizer) == (1352 * 2, 1352 * 4, 1352 * 12)
    # equal times for every micro-batch (no overheads): the least memory wins, micro-batch 1
    assert est.notes == ("micro-batch 1 x 4",)
    assert m.activations == 2 * 4 * (8 * 8 + 3 * 16) * 2  # layers * tokens * (8h + 3f) * 2 bytes
    assert m.workspace == 4 * 10 * 8  # fp32 logits and their gradient


def test_train_tensor_parallel_traffic_by_hand():
    est = estimate_train(TINY, ParallelDims(tp=2), range(2), ctx())
    # per micro-batch of t tokens: 3 passes x 2 layers x 2 all-reduces of t*h*2 bytes over 2 devices
    # ring all-reduce on 2 devices moves bytes once: 16 tokens in total -> 3*2*2*16*8*2 bytes / 1e10
    assert est.breakdown["tp_comm"] == pytest.approx(3 * 2 * 2 * 16 * 8 * 2 / 1e10)
    assert est.memory.weights == 1352 * 2 // 2


def test_train_data_parallel_gradient_sync_and_sharded_optimizer():
    dims = ParallelDims(dp=2)
    est = estimate_train(TINY, dims, range(2), ctx())
    grad_bytes = 1352 * 4
    assert est.breakdown["dp_comm"] == pytest.approx(all_reduce_s(grad_bytes, 2, Link(1e10, 0.0)))
    assert est.memory.optimizer == 1352 * 12 // 2
    across_hosts = estimate_train(TINY, dims, range(2), ctx(per_host=1, hosts=2))
    assert across_hosts.breakdown["dp_comm"] == pytest.approx(10 * est.breakdown["dp_comm"])  # NIC is 10x slower


def test_pipeline_bubble_is_pp_minus_one_slots():
    est = estimate_train(TINY, ParallelDims(pp=2), range(2), ctx(tuning=Tuning(**{**_fields(EXACT), "activation_checkpointing": "off"})))
    m = int(est.notes[0].split(" x ")[1])
    per_slot = est.breakdown["bubble"] / (2 - 1)
    assert est.breakdown["compute"] + est.breakdown["pp_comm"] == pytest.approx(m * per_slot)


def test_checkpointing_is_chosen_only_when_needed():
    roomy = estimate_train(TINY, ParallelDims(), range(1), ctx(tuning=Tuning(**{**_fields(EXACT), "activation_checkpointing": "auto"})))
    assert "activation checkpointing" not in roomy.notes
    resident = 1352 * 18
    # micro-batch 1 (4 tokens): stored activations 2*4*112*2 = 1792 B, checkpointed 2*4*8*2 + 4*112*2 = 1024 B,
    # plus 320 B of logits: only the checkpointed option fits in 1400 B
    tight_dev = device(memory_bytes=resident + 1400)
    tight = estimate_train(TINY, ParallelDims(), range(1), ctx(dev=tight_dev, tuning=Tuning(**{**_fields(EXACT), "activation_checkpointing": "auto"})))
    assert tight.feasible and tight.notes == ("micro-batch 1 x 4", "activation checkpointing")
    assert tight.memory.activations == 1024
    assert tight.breakdown["compute"] == pytest.approx(roomy.breakdown["compute"] * 4 / 3)  # one more forward


def test_train_infeasible_names_node_memory_and_excess():
    est = estimate_train(TINY, ParallelDims(), range(1), ctx(dev=device(memory_bytes=1000)), node="policy")
    assert not est.feasible
    assert "node 'policy'" in est.problem and "a X has 0.0 GiB x memory_util 1" in est.problem and "bytes over" in est.problem


GiB = 1024**3


def _just_over(kind: str, excess: int) -> str:
    """The problem of a node that needs ``excess`` bytes more than a 72 GiB device (memory_util 1) has."""
    c = ctx(dev=device(memory_bytes=72 * GiB))
    if kind == "train":
        options = train_options(TINY, ParallelDims(), range(1), c)
        smallest = min(o.memory_total for o in options.options)
        return pick_fitting(options, c, 72 * GiB - smallest + excess, node="policy", what="tiny training").problem
    fits = estimate_generate(TINY, ParallelDims(), range(1), c, precision="bfloat16")
    kv_seq = fits.memory.kv_cache // WORK.sequences
    reserved = 72 * GiB - fits.memory.weights - fits.memory.workspace - kv_seq + excess
    return estimate_generate(TINY, ParallelDims(), range(1), c, precision="bfloat16", reserved_bytes=reserved, node="gen").problem


@pytest.mark.parametrize(
    "kind, excess, shown",
    [
        ("train", 5 * 1024**2, "needs 72.005 GiB per device (0.0 resident"),
        ("train", 5 * 1024**2, "= 72.000 GiB, 5 MiB over"),
        ("train", 300, "= 72.0000 GiB, 300 bytes over"),
        ("train", int(1.5 * GiB), "needs 73.5 GiB per device"),
        ("train", int(1.5 * GiB), "= 72.0 GiB, 1.5 GiB over"),
        ("generate", 12 * 1024**2, "needs 72.01 GiB per device"),
        ("generate", 12 * 1024**2, "= 72.00 GiB, 12 MiB over"),
    ],
    ids=["train-need", "train-mib", "train-bytes", "train-gib-need", "train-gib", "gen-need", "gen-mib"],
)
def test_memory_excess_is_never_rounded_away(kind, excess, shown):
    problem = _just_over(kind, excess)
    assert shown in problem, problem
    assert "0.0 GiB over" not in problem


def test_reference_forward_only_has_no_optimizer():
    est = estimate_train(TINY, ParallelDims(), range(1), ctx(), forward_only=True)
    assert (est.memory.grads, est.memory.optimizer, est.breakdown["optimizer"]) == (0, 0, 0.0)
    train = estimate_train(TINY, ParallelDims(), range(1), ctx())
    assert est.breakdown["compute"] == pytest.approx(train.breakdown["compute"] / 3)


def test_recomputed_logprobs_add_a_forward():
    base = estimate_train(TINY, ParallelDims(), range(1), ctx())
    more = estimate_train(TINY, ParallelDims(), range(1), ctx(), recompute_logprobs=True)
    assert more.breakdown["compute"] == pytest.approx(base.breakdown["compute"] * 4 / 3)


# -- generation --------------------------------------------------------------------------------------
def test_decode_is_memory_bound_by_hand():
    dev = device(peak_flops=1e18)  # compute is free: every decode step costs its bytes read
    est = estimate_generate(TINY, ParallelDims(), range(1), ctx(dev=dev), precision="bfloat16")
    weights = 1352 * 2
    kv_token = 2 * 2 * 1 * 4 * 2  # k,v x layers x kv heads x head_dim x 2 bytes
    read = weights + 4 * (3 + 1 / 2) * kv_token + 4 * 10 * 4  # weights + KV at mean ctx + fp32 logits
    assert est.time_s == pytest.approx(1 * read / 1e11, rel=1e-6)
    assert est.notes == ("builtin engine", "batch 4 x 1 wave", "bfloat16 weights", "lock-step, 1 decode steps")
    assert (est.memory.weights, est.memory.kv_cache) == (weights, 4 * 4 * kv_token)


def test_eight_bit_weights_halve_the_bytes_read():
    dev = device(peak_flops=1e18, peak_flops_8bit=2e18)
    bf16 = estimate_generate(TINY, ParallelDims(), range(1), ctx(dev=dev), precision="bfloat16")
    fp8 = estimate_generate(TINY, ParallelDims(), range(1), ctx(dev=dev), precision="float8")
    assert fp8.memory.weights == bf16.memory.weights // 2 and fp8.time_s < bf16.time_s
    int8 = estimate_generate(TINY, ParallelDims(), range(1), ctx(dev=dev), precision="int8")  # weight-only: bf16 peak
    assert int8.memory.weights == fp8.memory.weights and bf16.time_s > int8.time_s >= fp8.time_s


def test_kv_cache_limit_forces_waves():
    weights, workspace, kv_seq = 1352 * 2, 12 * (64 + 48) * 2 + 4 * 10 * 4, 4 * 32
    dev = device(memory_bytes=weights + workspace + 2 * kv_seq + 50)  # two sequences of KV fit
    est = estimate_generate(TINY, ParallelDims(), range(1), ctx(dev=dev), precision="bfloat16")
    assert est.notes[1] == "batch 2 x 2 waves"
    roomy = estimate_generate(TINY, ParallelDims(), range(1), ctx(), precision="bfloat16")
    assert est.time_s > roomy.time_s


def test_generation_infeasible_message():
    est = estimate_generate(TINY, ParallelDims(), range(1), ctx(dev=device(memory_bytes=2000)), precision="bfloat16", node="gen")
    assert not est.feasible and math.isinf(est.time_s)
    assert "node 'gen' (tiny generation on d1, bfloat16 weights)" in est.problem and "bytes over" in est.problem


def test_tensor_parallel_splits_weight_reads():
    dev = device(peak_flops=1e18)
    one = estimate_generate(TINY, ParallelDims(), range(1), ctx(dev=dev), precision="bfloat16")
    two = estimate_generate(TINY, ParallelDims(tp=2), range(2), ctx(dev=dev), precision="bfloat16")
    assert two.memory.weights == one.memory.weights // 2
    assert two.breakdown["decode_memory"] < one.breakdown["decode_memory"]
    assert two.breakdown["tp_comm"] > 0


# -- weight sync -------------------------------------------------------------------------------------
def _sync(transport: str, c: Context, src=(range(0, 2), ParallelDims(dp=2)), dst=(range(2, 4), ParallelDims(dp=2)), dst_bytes=2.0):
    return estimate_sync(
        TINY, src="policy", dst="gen", transport=transport, src_devices=src[0], src_dims=src[1],
        dst_devices=dst[0], dst_dims=dst[1], dst_bytes_per_param=dst_bytes, src_bytes_per_param=2.0, ctx=c,
    )


def test_a_vllm_generator_adds_the_hop_into_its_workers_by_hand():
    """On CPU ranks (GPUs: tests/planners/test_sync_rates.py)."""
    c = ctx(dev=device(kind="cpu"), tuning=Tuning(**{**_fields(EXACT), "file_bandwidth": 1e9, "vllm_group_bandwidth": 0.5e9}))
    total = 1352 * 2  # P * the generator's bytes per parameter: each replica sends its own copy on, in parallel
    group = "weight-sync group (gloo; its broadcast and vLLM's reload overlapped), 0.5 GB/s (--set vllm_group_bandwidth)"
    for transport, extra, hop in [("collective", total / 0.5e9, group), ("file", 2 * total / 1e9, "file vLLM's worker reads")]:
        base = _sync(transport, c)
        est = add_engine_load(base, TINY, engine="vllm", transport=transport, dst_bytes_per_param=2.0, ctx=c)
        assert est.time_s == pytest.approx(base.time_s + extra) and hop in est.note and est.note.startswith(base.note)
        assert est.dst_only_s == pytest.approx(extra)  # the generator side's alone: the trainer has published
        assert add_engine_load(base, TINY, engine="builtin", transport=transport, dst_bytes_per_param=2.0, ctx=c) == base


def test_sync_per_transport_by_hand():
    c = ctx(tuning=Tuning(**{**_fields(EXACT), "file_bandwidth": 1e9}))
    total = 1352 * 2
    assert _sync("file", c).time_s == pytest.approx(total * (1 + 2) / 1e9)
    # rank to rank: each generator device receives a full copy (tp=pp=1); senders split dp copies; every
    # block is under 64 KiB, so packed by its sender and unpacked by its receiver: each rank copies ``total``,
    # overlapped with the wire (the copies win only where memory is slower than the link)
    assert _sync("collective", c).time_s == pytest.approx(max(total, total * 2 / 2) / 1e10)
    slow_memory = ctx(dev=device(memory_bandwidth=1e9), tuning=c.tuning)
    assert _sync("collective", slow_memory).time_s == pytest.approx(total / 1e9)
    same = _sync("collective", c, src=(range(4), ParallelDims(dp=4)), dst=(range(4), ParallelDims(dp=4)))
    assert same.time_s == pytest.approx(total / 1e11) and same.note == "same layout: local copy"
    assert _sync("collective", c).bytes == _sync("collective", c).wire_bytes == total * 2
    assert _sync("collective", c).copied_bytes == 2 * total * 2


#: blocks of 64 KiB and more in float32 (wq is 128 x 128): sent and received without staging where contiguous
WIDE = ModelSpec(name="wide", n_layers=2, dim=128, n_heads=4, n_kv_heads=2, ffn_dim=256, vocab_size=64)


@pytest.mark.parametrize(
    ("dst_dims", "wire", "copied"),
    [
        # dp replicas: every block whole on both sides; only the small ones (k, v, norms, embeddings) are staged
        (ParallelDims(dp=2), 2 * WIDE.params * 4, 2 * 2 * 4 * (2 * (2 * 128 * 64 + 2 * 128) + 2 * 64 * 128 + 128)),
        # tp2: each rank also receives the replicated embeddings, head and norms; row splits are strided on the sender
        (ParallelDims(tp=2), 4 * (WIDE.params + 2 * 64 * 128 + 128 + 2 * 2 * 128), None),
    ],
    ids=["dp2", "tp2"],
)
def test_collective_sync_volume_is_the_transports(dst_dims, wire, copied):
    """The planner's bytes come from ``resharding.transfer_volume`` over the runtime's layouts (``sync_params``)."""
    from flowrl.placement.resharding import transfer_volume

    from flowrl.planners.estimate.sync import sync_params

    est = estimate_sync(WIDE, src="policy", dst="gen", transport="collective", src_devices=range(2), src_dims=ParallelDims(dp=2),
                        dst_devices=range(2, 4), dst_dims=dst_dims, dst_bytes_per_param=4.0, src_bytes_per_param=4.0, ctx=ctx())
    full = transfer_volume(*sync_params(WIDE, range(2), range(2, 4), dst_dims, layers=WIDE.n_layers, wb=4))
    assert (est.wire_bytes, est.copied_bytes) == (full.wire_bytes, full.copied_bytes)
    assert est.wire_bytes == wire
    if copied is not None:
        assert est.copied_bytes == copied
    else:  # wo and w2 (row splits) are strided on the sending side; everything small is staged on both
        assert 0 < est.copied_bytes < 2 * est.wire_bytes


def test_sync_on_cpu_is_memory_copies():
    cpu = device(name="cpu", kind="cpu", compute_dtype="float32")
    c = ctx(dev=cpu)
    one = _sync("inprocess", c, dst_bytes=4.0)
    assert one.time_s == pytest.approx(1352 * 4 / 1e11) and one.replicas == 1
    assert _sync("shm", c, dst_bytes=4.0).time_s == pytest.approx(2 * one.time_s)


def test_unknown_transport_is_costed_as_collective():
    c = ctx()
    assert _sync("my_rdma", c).time_s == _sync("collective", c).time_s
    assert "user transport 'my_rdma'" in _sync("my_rdma", c).note


# -- cpu ---------------------------------------------------------------------------------------------
def test_host_nodes():
    c = ctx(tuning=Tuning(scorer_s_per_sample=1e-3, source_s_per_prompt=1e-4))
    assert estimate_scorer("scorer", c).time_s == pytest.approx(4 * 1e-3)
    assert estimate_source("source", c).time_s == pytest.approx(2 * 1e-4)
    assert estimate_in_policy("loss", c).time_s == 0.0


def _fields(t: Tuning) -> dict:
    return {f: getattr(t, f) for f in t.__struct_fields__}


# -- the generator's engine ------------------------------------------------------------------------
def test_the_vllm_engine_on_a_cpu_drops_flowrls_loop_overhead_and_decodes_at_its_measured_factor():
    dev = device(kind="cpu", decode_step_overhead_s=1e-3)
    tuning = Tuning(**{**_fields(EXACT), "vllm_cpu_decode_speedup": 2.0})
    builtin = estimate_generate(TINY, ParallelDims(), range(1), ctx(dev=dev, tuning=tuning), precision="float32")
    vllm = estimate_generate(TINY, ParallelDims(), range(1), ctx(dev=dev, tuning=tuning), precision="float32", engine="vllm")
    assert builtin.notes[0] == "builtin engine" and vllm.notes[0] == "vllm engine"
    assert builtin.breakdown["step_overhead"] == pytest.approx(1e-3) and vllm.breakdown["step_overhead"] == 0.0  # 1 decode step
    prefill = builtin.breakdown["prefill"]
    assert vllm.breakdown["prefill"] == pytest.approx(prefill)
    assert vllm.time_s == pytest.approx(prefill + (builtin.time_s - prefill - 1e-3) / 2.0)  # the blocks' pass at 2x


def test_the_vllm_engine_frees_finished_rows_within_a_call_but_keeps_no_slots_across_steps():
    from flowrl.planners.lengths import LengthDistribution

    work = Workload(prompts_per_step=8, samples_per_prompt=4, prompt_len=3, gen_len=10,
                    lengths=LengthDistribution(points=((2, 1.0), (10, 1.0))))  # fmt: skip
    dev = device(peak_flops=1e18)  # memory-bound: context length is what differs
    builtin = estimate_generate(TINY, ParallelDims(), range(1), ctx(dev=dev, work=work), precision="bfloat16")
    vllm = estimate_generate(TINY, ParallelDims(), range(1), ctx(dev=dev, work=work), precision="bfloat16", engine="vllm")
    assert builtin.notes[-1].startswith("lock-step") and vllm.notes[-1].startswith("continuous within a call")
    assert vllm.time_s < builtin.time_s  # rows leave as they finish: the mean length, not the longest
    assert vllm.steady_s is None  # on a GPU too: weights change between calls, so no cross-step slots


def test_a_vllm_stream_keeps_its_slots_full_across_steps_and_pays_a_re_prefill_per_update():
    """``batching="continuous"`` on vLLM (the stream): priced like the built-in continuous generator
    (cross-step slots), plus one re-prefill a step of the running requests' kept tokens, whose count is
    ``E[l^2] / (2 E[l])`` of a long-tail distribution; still below the per-call (lock-step batches) price."""
    from flowrl.planners.lengths import mean_and_tail

    dist = mean_and_tail(mean=20, max_len=200, tail_frac=0.05)  # 95% at 200/19 ~ 10.5 tokens, 5% at 200
    work = dict(prompts_per_step=8, samples_per_prompt=4, prompt_len=3, gen_len=200, lengths=dist)
    dev = device(peak_flops=1e9)  # prefill is compute-bound: the re-prefill is visible
    per_call = estimate_generate(TINY, ParallelDims(), range(1), ctx(dev=dev, work=Workload(**work)), precision="bfloat16", engine="vllm")
    stream = estimate_generate(TINY, ParallelDims(), range(1), ctx(dev=dev, work=Workload(**work, batching="continuous")), precision="bfloat16", engine="vllm")
    builtin = estimate_generate(TINY, ParallelDims(), range(1), ctx(dev=dev, work=Workload(**work, batching="continuous")), precision="bfloat16")
    assert stream.notes[-1].startswith("continuous stream") and "reprefill" not in per_call.breakdown

    b = 32  # every sequence in one batch (the KV cache holds them)
    mean = sum(n * w for n, w in dist.points) / sum(w for _, w in dist.points)
    kept = 3 + sum(n * n * w for n, w in dist.points) / sum(w for _, w in dist.points) / (2 * mean)
    assert kept > 3 + mean / 2  # length-biased: the long tail holds the slots
    reprefill = b * kept * TINY.forward_flops_per_token(kept / 2) / 1e9
    assert stream.breakdown["reprefill"] == pytest.approx(reprefill, rel=1e-9)
    assert stream.time_s == pytest.approx(per_call.time_s + reprefill, rel=1e-9)  # one step from empty: the per-call decode
    # the built-in continuous generator's cross-step price, vLLM's decode (no Python loop), plus the re-prefill
    assert builtin.steady_s is not None and stream.steady_s is not None
    assert stream.steady_s == pytest.approx(builtin.steady_s - builtin.breakdown["slot_overhead"] + reprefill, rel=1e-9)
    assert stream.steady_s < per_call.time_s  # slots kept full beat each call waiting for its longest
