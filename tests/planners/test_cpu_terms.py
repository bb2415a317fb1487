"""The measured CPU terms of the model, each checked against a hand-computed value.

``DeviceSpec``: the pass rates by width (``flops_by_width``, ``decode_flops_by_width``,
``train_flops_by_width``: applied without an MFU factor or a launch term), ``thread_speedup``
(a CPU mesh is one process: dp-only, sped up by threads), ``shared_slowdown`` (overlapped meshes
of one host, ``schedule.shared_step_s``), ``decode_step_overhead_s``, ``slot_row_overhead_s``,
``train_step_overhead_s``; ``Tuning.packed_sequences`` and ``Tuning.cross_step_slots`` (padded
trainer and one step's groups in flight on CPU, as flowrl's runtime runs).
"""

from __future__ import annotations

import msgspec
import pytest

from flowrl.errors import PlanError
from flowrl.examples import build_example
from flowrl.calibration.measure import Measurements, calibrated_cluster
from flowrl.planners.cluster import ClusterSpec, CpuTerms, cpu_device
from flowrl.planners.estimate.generate import estimate_generate
from flowrl.planners.estimate.train import estimate_train
from flowrl.planners.lengths import LengthDistribution
from flowrl.planners.parallel import ParallelDims
from flowrl.planners.plan import plan_graph
from flowrl.planners.schedule import shared_step_s
from tests.planners.test_estimates import EXACT, TINY, WORK, ctx, device

#: TINY's forward FLOPs per token at a causal context of c: 2 * 1232 matmul params + 4 * L * h * c.
F_TOK = lambda c: 2 * 1232 + 4 * 2 * 8 * c  # noqa: E731
#: Two completion lengths, 1 and 3 tokens, equally likely: mean 2, E[max of 4] = 1 + 2 * (1 - 0.5**4).
TWO_LENGTHS = LengthDistribution(points=((1, 1.0), (3, 1.0)))
LONG_WORK = msgspec.structs.replace(WORK, gen_len=3, lengths=TWO_LENGTHS)
GPU_LIKE = msgspec.structs.replace(EXACT, packed_sequences=True)  # the packed model, on the test device


@pytest.mark.parametrize(
    "tables, width, pass_kind, expected",
    [
        ({"flops_by_width": ((4, 1e9), (16, 3e9))}, 8, "forward", 2e9),  # halfway in log(width)
        ({"flops_by_width": ((4, 1e9), (16, 3e9))}, 2, "forward", 1e9),  # below the table: its first rate
        ({"flops_by_width": ((4, 1e9), (16, 3e9))}, 64, "forward", 3e9),  # above: its last rate
        ({"flops_by_width": ((4, 1e9), (16, 3e12))}, 64, "forward", 3e12),  # measured, so not capped by peak_flops
        ({"flops_by_width": ((8, 1e9),), "train_flops_by_width": ((8, 2e9),)}, 8, "train", 2e9),  # the pass's own table
        ({"flops_by_width": ((8, 1e9),), "train_flops_by_width": ((8, 2e9),)}, 8, "decode", 1e9),  # else the forward's
        ({}, 8, "train", 1e12),  # no table: peak_flops
    ],
    ids=["interpolated", "below", "above", "not-capped", "own-table", "forward-fallback", "no-table"],
)
def test_flops_at(tables, width, pass_kind, expected):
    assert device(**tables).flops_at(width, pass_kind) == pytest.approx(expected)


@pytest.mark.parametrize("field", ["flops_by_width", "decode_flops_by_width", "train_flops_by_width"])
@pytest.mark.parametrize("table", [((16, 1e9), (4, 1e9)), ((4, 0.0),), ((4, 1e9), (4, 2e9))], ids=["descending", "zero-rate", "repeated"])
def test_bad_flops_table_is_refused(field, table):
    with pytest.raises(PlanError, match=field):
        device(**{field: table})


def test_bad_pass_kind_and_slowdown_are_refused():
    with pytest.raises(PlanError, match="pass kind 'backward' is not one of forward, decode, train"):
        device().flops_at(8, "backward")
    with pytest.raises(PlanError, match="shared_slowdown=0.5 must be a finite number >= 1"):
        device(shared_slowdown=0.5)


def test_measured_train_rate_takes_no_mfu_and_no_launches():
    # WORK: 4 sequences of 3 + 1 tokens, packed (16 tokens), causal context 2; mfu_train 0.5 and 16
    # launches of 1 ms per layer would double the compute and add 3 * 2 * 16 ms with a preset's peak
    tuning = msgspec.structs.replace(GPU_LIKE, mfu_train=0.5, ops_per_layer=16)
    dev = device(kernel_overhead_s=1e-3, train_flops_by_width=((8, 2.5e11),))
    est = estimate_train(TINY, ParallelDims(), range(1), ctx(dev=dev, tuning=tuning))
    assert est.breakdown["compute"] == pytest.approx(3 * 16 * F_TOK(2) / 2.5e11)
    assert est.breakdown["launch"] == 0.0
    preset = estimate_train(TINY, ParallelDims(), range(1), ctx(dev=device(kernel_overhead_s=1e-3), tuning=tuning))
    assert preset.breakdown["compute"] == pytest.approx(3 * 16 * F_TOK(2) / (1e12 * 0.5))
    assert preset.breakdown["launch"] == pytest.approx(3 * 2 * 16 * 1e-3)


def test_measured_generate_rates_take_no_mfu_and_no_launches():
    # lock step, 4 completions of 1 token: prefill 4 x 3 tokens at context 1.5, no decode step
    # after the first token's forward (decode_steps = 1 token: one decode step of 4 rows at context 3.5)
    tuning = msgspec.structs.replace(EXACT, mfu_prefill=0.5, mfu_decode=0.5, ops_per_layer=16)
    dev = device(kernel_overhead_s=1e-3, flops_by_width=((8, 1e11),), decode_flops_by_width=((8, 5e10),))
    est = estimate_generate(TINY, ParallelDims(), range(1), ctx(dev=dev, tuning=tuning))
    assert est.breakdown["prefill"] == pytest.approx(12 * F_TOK(1.5) / 1e11)
    assert est.breakdown["decode_compute"] == pytest.approx(4 * F_TOK(3.5) / 5e10)
    assert est.breakdown["launch"] == 0.0


def test_a_few_rows_decode_at_the_rate_measured_on_few_rows():
    """``decode_rows_fraction`` scales the decode rate at the generator's rows: 4 rows between the
    table's 1 (0.25) and 16 (1.0) rows, halfway in log(rows), decode at 0.625 of the table's rate."""
    dev = device(kind="cpu", flops_by_width=((8, 1e11),), decode_flops_by_width=((8, 5e10),), decode_rows_fraction=((1, 0.25), (16, 1.0)))
    est = estimate_generate(TINY, ParallelDims(), range(1), ctx(dev=dev))
    assert dev.decode_rows_factor(4) == pytest.approx(0.625)
    assert est.breakdown["decode_compute"] == pytest.approx(4 * F_TOK(3.5) / (5e10 * 0.625))
    plain = estimate_generate(TINY, ParallelDims(), range(1), ctx(dev=msgspec.structs.replace(dev, cpu=msgspec.structs.replace(dev.cpu, decode_rows_fraction=()))))
    assert plain.breakdown["decode_compute"] == pytest.approx(4 * F_TOK(3.5) / 5e10)


def test_a_cpu_tp_generators_all_reduces_run_at_gloos_rate_at_their_size():
    """A tp generator on CPU ranks all-reduces its ``[rows, h]`` activations over gloo at the rate
    calibrated at that size, not at the device's memory copy rate (``intra_host_bandwidth``); on a GPU
    the cluster's link."""
    from flowrl.planners.estimate.common import Link, all_reduce_s

    gloo = ((16, 1e6), (2**20, 1e6))  # 1 MB/s at every size: far below the 1e10 intra-host figure
    dev = device(kind="cpu", flops_by_width=((8, 1e11),), gloo_all_reduce_by_bytes=gloo)
    est = estimate_generate(TINY, ParallelDims(tp=2), range(2), ctx(dev=dev))
    act = dev.dtype_bytes  # the test device computes in bfloat16
    one_token = 2 * 2 * all_reduce_s(4 * 8 * act, 2, Link(1e6, 0.0))  # L=2 layers x 2 all-reduces of [4 rows, h=8]
    prefill = 2 * 2 * all_reduce_s(12 * 8 * act, 2, Link(1e6, 0.0))  # 4 prompts x 3 tokens
    assert est.breakdown["tp_comm"] == pytest.approx(one_token + prefill)
    gpu = estimate_generate(TINY, ParallelDims(tp=2), range(2), ctx(dev=device(gloo_all_reduce_by_bytes=gloo)))
    assert gpu.breakdown["tp_comm"] < est.breakdown["tp_comm"] / 100  # 1e10 B/s NVLink-like link, bf16


def test_a_cpu_tp_generators_decode_runs_at_its_measured_efficiency():
    """``CpuTerms.tp_decode_efficiency`` (the built-in generator's split decode step against these
    terms) divides a CPU tp generator's decode step, not its all-reduces; a GPU's and a tp=1's ignore it."""
    base = dict(kind="cpu", flops_by_width=((8, 1e11),), gloo_all_reduce_by_bytes=((16, 1e6),))
    plain = estimate_generate(TINY, ParallelDims(tp=2), range(2), ctx(dev=device(**base)))
    slow = estimate_generate(TINY, ParallelDims(tp=2), range(2), ctx(dev=device(**base, tp_decode_efficiency=0.5)))
    key = next(k for k in plain.breakdown if k.startswith("decode_"))
    assert slow.breakdown[key] == pytest.approx(2 * plain.breakdown[key], rel=1e-12)
    assert slow.breakdown["tp_comm"] == plain.breakdown["tp_comm"]
    one = [estimate_generate(TINY, ParallelDims(), range(1), ctx(dev=device(**base, **e))).time_s for e in ({}, {"tp_decode_efficiency": 0.5})]
    assert one[0] == one[1]
    gpu = [estimate_generate(TINY, ParallelDims(tp=2), range(2), ctx(dev=device(**e))).time_s for e in ({}, {"tp_decode_efficiency": 0.5})]
    assert gpu[0] == gpu[1]


@pytest.mark.parametrize(
    "speedups, generator, expected",
    [
        ((0.0, 0.0), False, 4.0),
        ((1.6, 0.0), False, 1 + 0.6 * 3 / 7),
        ((1.6, 0.0), True, 1 + 0.6 * 3 / 7),  # no generator figure: the trainer's
        ((1.6, 1.2), True, 1 + 0.2 * 3 / 7),
        ((1.0, 1.2), False, 1.0),
    ],
    ids=["gpu-replicas", "measured", "generator-falls-back", "generator-own", "no-gain"],
)
def test_mesh_speedup(speedups, generator, expected):
    dev = device(thread_speedup=speedups[0], gen_thread_speedup=speedups[1])
    assert dev.mesh_speedup(4, 8, generator=generator) == pytest.approx(expected)


def test_a_cpu_generator_mesh_uses_its_own_thread_speedup():
    one = estimate_generate(TINY, ParallelDims(), range(1), ctx(dev=device(thread_speedup=1.5, gen_thread_speedup=1.25), per_host=2))
    mesh = estimate_generate(TINY, ParallelDims(dp=2), range(2), ctx(dev=device(thread_speedup=1.5, gen_thread_speedup=1.25), per_host=2))
    assert mesh.time_s == pytest.approx(one.time_s / 1.25)


def test_cpu_mesh_is_one_replica_sped_up_by_threads():
    # thread_speedup 1.5 on a host of 2: a dp=2 mesh runs all 4 sequences in one replica, 1.5x faster
    # than one device; without it (GPU) each of 2 replicas runs 2 sequences
    one = estimate_train(TINY, ParallelDims(), range(1), ctx(dev=device(thread_speedup=1.5), per_host=2))
    mesh = estimate_train(TINY, ParallelDims(dp=2), range(2), ctx(dev=device(thread_speedup=1.5), per_host=2))
    assert mesh.time_s == pytest.approx(one.time_s / 1.5)
    assert mesh.breakdown["dp_comm"] == 0.0  # one replica: no gradient all-reduce
    gen_one = estimate_generate(TINY, ParallelDims(), range(1), ctx(dev=device(thread_speedup=1.5), per_host=2))
    gen_mesh = estimate_generate(TINY, ParallelDims(dp=2), range(2), ctx(dev=device(thread_speedup=1.5), per_host=2))
    assert gen_mesh.time_s == pytest.approx(gen_one.time_s / 1.5)
    assert gen_mesh.notes[1] == "batch 4 x 1 wave"


def test_a_cpu_mesh_is_searched_without_tensor_or_pipeline_splits():
    # a calibrated CPU runs a mesh as one process with intra-op threads: there is no tp or pp to run
    m = Measurements(matmul_flops=50e9, copy_bandwidth=5e9, op_overhead_s=3e-6, cores=2, memory_bytes=16 * 2**30, cpu=CpuTerms(thread_speedup=1.3))
    plan = plan_graph(build_example("llamarl"), calibrated_cluster(m), strategy="colocated", max_staleness=0)
    assert str(plan) == "gen:d2@0-1 | policy:d2@0-1"


def test_decode_step_overhead_is_paid_per_decode_step():
    # WORK: 1 completion token, lock-step: 1 decode step
    base = estimate_generate(TINY, ParallelDims(), range(1), ctx())
    over = estimate_generate(TINY, ParallelDims(), range(1), ctx(dev=device(decode_step_overhead_s=1e-3)))
    assert over.time_s - base.time_s == pytest.approx(1e-3)
    assert over.breakdown["step_overhead"] == pytest.approx(1e-3)


def test_train_step_overhead_is_paid_once_per_optimizer_step():
    base = estimate_train(TINY, ParallelDims(), range(1), ctx())
    over = estimate_train(TINY, ParallelDims(), range(1), ctx(dev=device(train_step_overhead_s=2e-3)))
    assert over.time_s - base.time_s == pytest.approx(2e-3)
    assert over.breakdown["optimizer"] - base.breakdown["optimizer"] == pytest.approx(2e-3)


def test_a_measured_adamw_step_prices_the_optimizer_per_parameter():
    """``adamw_s_per_param`` (``flowrl calibrate``'s AdamW step) replaces the bandwidth term: TINY's
    1352 parameters x 1 us, plus the step overhead."""
    est = estimate_train(TINY, ParallelDims(), range(1), ctx(dev=device(adamw_s_per_param=1e-6, train_step_overhead_s=2e-3)))
    assert est.breakdown["optimizer"] == pytest.approx(1352 * 1e-6 + 2e-3, rel=1e-12)


# -- flowrl's own trainer and slot batcher on a CPU device ------------------------------------------------
def test_cpu_trainer_pads_the_whole_batch_to_its_longest_sequence():
    # 4 sequences of 3 prompt tokens + 1 or 3 completion tokens: padded, one micro-batch of 4 (the
    # trainer's micro_batch_size 0) costs 4 x (3 + E[max of 4] - 1) tokens (the last token predicts
    # nothing); packed, 4 x (3 + 2) tokens
    cpu = cpu_device(cores=1, memory_bytes=10**9, peak_flops=1e12, memory_bandwidth=1e11, kernel_overhead_s=0.0)
    s_pad = 3 + 1 + 2 * (1 - 0.5**4) - 1
    padded = estimate_train(TINY, ParallelDims(), range(1), ctx(dev=cpu, work=LONG_WORK))
    assert padded.notes[0] == "micro-batch 4 x 1"
    assert padded.breakdown["compute"] == pytest.approx(3 * 4 * s_pad * F_TOK(s_pad / 2) / 1e12)
    packed = estimate_train(TINY, ParallelDims(), range(1), ctx(dev=cpu, work=LONG_WORK, tuning=msgspec.structs.replace(EXACT, packed_sequences=True)))
    assert packed.breakdown["compute"] == pytest.approx(3 * 4 * 5 * F_TOK(2.5) / 1e12)


def test_slot_rows_are_paid_per_completion_token():
    # continuous: 4 completions of mean length 2 are 8 busy row-steps of 1 ms each
    work = msgspec.structs.replace(LONG_WORK, batching="continuous")
    base = estimate_generate(TINY, ParallelDims(), range(1), ctx(work=work))
    over = estimate_generate(TINY, ParallelDims(), range(1), ctx(dev=device(slot_row_overhead_s=1e-3), work=work))
    assert over.breakdown["slot_overhead"] == pytest.approx(8e-3)
    assert over.time_s - base.time_s == pytest.approx(8e-3)
    lockstep = estimate_generate(TINY, ParallelDims(), range(1), ctx(dev=device(slot_row_overhead_s=1e-3), work=LONG_WORK))
    assert lockstep.breakdown["slot_overhead"] == 0.0


@pytest.mark.parametrize("cross_step, steady", [(None, False), (False, False), (True, True)], ids=["cpu-default", "off", "on"])
def test_cpu_continuous_generator_keeps_one_steps_groups(cross_step, steady):
    # on a CPU device the async steady state is the sync time unless slots are filled across steps
    cpu = cpu_device(cores=1, memory_bytes=10**9, peak_flops=1e12, memory_bandwidth=1e11, kernel_overhead_s=0.0)
    tuning = msgspec.structs.replace(EXACT, cross_step_slots=cross_step)
    est = estimate_generate(TINY, ParallelDims(), range(1), ctx(dev=cpu, tuning=tuning, work=msgspec.structs.replace(LONG_WORK, batching="continuous")))
    assert (est.steady_s is not None) == steady


@pytest.mark.parametrize(
    "busy, slowdown, expected",
    [
        ([2.0, 5.0], 1.5, 2 * 1.5 + 3),  # overlap 2 s of work at 1.5x, then 3 s alone
        ([2.0, 5.0], 1.0, 5.0),  # separate devices: the busiest
        ([1.0, 2.0, 4.0], 2.0, 1 * 2 + 1 * 2 + 2),  # three, then two, then one busy
        ([3.0, 0.0], 2.0, 3.0),  # an idle group slows nothing
    ],
    ids=["two", "no-slowdown", "three", "one-busy"],
)
def test_shared_step(busy, slowdown, expected):
    assert shared_step_s(busy, slowdown) == pytest.approx(expected)


def test_async_step_of_meshes_sharing_a_host():
    # disaggregated on one host of 2 cores: the trainer's and the generator's busy times overlap,
    # slowed 1.5x while both run; the same plan with shared_slowdown 1 is their maximum
    def plan(shared: float):
        m = Measurements(matmul_flops=50e9, copy_bandwidth=5e9, op_overhead_s=3e-6, cores=2, memory_bytes=16 * 2**30, cpu=CpuTerms(shared_slowdown=shared))
        return plan_graph(build_example("llamarl"), calibrated_cluster(m), strategy="disaggregated", max_staleness=1)

    alone, shared = plan(1.0), plan(1.5)
    sync = sum(s.time_s for s in alone.weight_syncs)  # both sides take part in the weight sync
    gen_t, train_t = sorted(p.time_s + sync for p in alone.placements.values() if p.kind in ("generator", "policy"))
    assert alone.async_step_s == pytest.approx(train_t)
    assert shared.async_step_s == pytest.approx(train_t + 0.5 * gen_t)


def test_more_ranks_than_cores_time_share_them():
    # the cluster bench's layout: a generator rank and a 2-rank policy, 3 devices on a 2-core host
    # (calibrated_cluster(m, cores=3): CpuTerms.host_cores 2); while both run, 3 ranks on 2 cores go 1.5x
    # slower (above shared_slowdown 1.2); the same plan on 3 cores is shared_slowdown's alone
    m = Measurements(matmul_flops=50e9, copy_bandwidth=5e9, op_overhead_s=3e-6, cores=2, memory_bytes=16 * 2**30, cpu=CpuTerms(shared_slowdown=1.2))
    on_two = calibrated_cluster(m, cores=3)
    assert on_two.device.cpu.host_cores == 2 and calibrated_cluster(m).device.cpu.host_cores == 2
    on_three = msgspec.structs.replace(on_two, device=msgspec.structs.replace(on_two.device, cpu=msgspec.structs.replace(m.cpu, host_cores=3)))
    plan = lambda cluster: plan_graph(build_example("llamarl"), cluster, strategy="gen:d1@0 | policy:d2@1-2", max_staleness=1)  # noqa: E731
    shared, alone = plan(on_two), plan(on_three)

    def busy(p):  # each side's busy seconds, shortest first (on 2 cores no collective overlaps: train.host_crowded)
        sync = sum(s.time_s for s in p.weight_syncs)
        return sorted(p.placements[n].time_s + sync for n in ("gen", "policy"))

    short, long = busy(alone)
    assert alone.async_step_s == pytest.approx(long + 0.2 * short)
    short, long = busy(shared)
    assert shared.async_step_s == pytest.approx(long + 0.5 * short)
    with pytest.raises(PlanError, match=r"host_cores=-1 must be an integer >= 0"):
        CpuTerms(host_cores=-1)


def test_calibrated_cluster_carries_every_measured_term():
    m = Measurements(
        matmul_flops=50e9, copy_bandwidth=5e9, op_overhead_s=3e-6, cores=2, memory_bytes=16 * 2**30,
        cpu=CpuTerms(
            flops_by_width=((64, 3e10),), decode_flops_by_width=((64, 2e10),), train_flops_by_width=((64, 2.5e10),),
            thread_speedup=1.3, gen_thread_speedup=1.1, shared_slowdown=1.2, decode_step_overhead_s=2e-4, slot_row_overhead_s=5e-6,
        ),
    )
    dev = calibrated_cluster(m).device
    got = (dev.flops_at(64), dev.flops_at(64, "decode"), dev.flops_at(64, "train"), dev.cpu.thread_speedup, dev.cpu.gen_thread_speedup,
           dev.cpu.shared_slowdown, dev.cpu.decode_step_overhead_s, dev.cpu.slot_row_overhead_s)
    assert got == (3e10, 2e10, 2.5e10, 1.3, 1.1, 1.2, 2e-4, 5e-6)
    assert isinstance(calibrated_cluster(m), ClusterSpec)
