"""The planner prices a packing policy's packed tokens (``OptimizerConfig.packing``) on any device."""

from __future__ import annotations

import msgspec
import pytest

from flowrl.calibration.measure import Measurements, calibrated_cluster
from flowrl.examples.longtail import LONGTAIL_MODEL
from flowrl.graph.builder import GraphBuilder
from flowrl.planners.cluster import cpu_device
from flowrl.planners.lengths import LengthDistribution
from flowrl.planners.workload import Workload
from flowrl.planners.estimate.train import pick_fitting, train_options
from flowrl.planners.parallel import ParallelDims
from flowrl.planners.plan import plan_graph
from tests.planners.test_cpu_terms import F_TOK, LONG_WORK
from tests.planners.test_estimates import EXACT, TINY, ctx, device


def _fastest(context, **options):
    return pick_fitting(train_options(TINY, ParallelDims(), range(1), context, **options), context, 0.0, node="policy", what="test")


def test_a_packing_policy_costs_the_mean_length_on_a_cpu_device():
    # 4 sequences of 3 prompt tokens + 1 or 3 completion tokens, micro_batch_size 0 (one micro-batch of 4):
    # packed, 4 x (3 + 2 - 1) tokens (the last predicts nothing); padded (no packing: flowrl's trainer on a CPU), 4 x (3 + E[max of 4] - 1)
    cpu = cpu_device(cores=1, memory_bytes=10**9, peak_flops=1e12, memory_bandwidth=1e11, kernel_overhead_s=0.0)
    packed = _fastest(ctx(dev=cpu, work=LONG_WORK), packing=True)
    assert packed.notes[0] == "micro-batch 4 x 1"  # micro_batch_size 0: the whole batch in one pass, as the trainer runs it
    assert packed.breakdown["compute"] == pytest.approx(3 * 4 * 4 * F_TOK(2.0) / 1e12)
    s_pad = 3 + 1 + 2 * (1 - 0.5**4) - 1
    padded = _fastest(ctx(dev=cpu, work=LONG_WORK))
    assert padded.breakdown["compute"] == pytest.approx(3 * 4 * s_pad * F_TOK(s_pad / 2) / 1e12)
    forced = _fastest(ctx(dev=cpu, work=LONG_WORK, tuning=msgspec.structs.replace(EXACT, packed_sequences=False)), packing=True)
    assert forced.breakdown["compute"] == pytest.approx(padded.breakdown["compute"])  # Tuning.packed_sequences overrides


def _longtail(packing: bool | None):
    b = GraphBuilder("longtail", model=LONGTAIL_MODEL)
    prompts = b.source("prompts", task="longtail", batch_size=8)
    gen = b.generator("gen", prompts, n_samples=16, max_new_tokens=32)
    ref = b.reference("ref", gen, packing=packing)
    aipo = b.loss("aipo", gen, b.scorer("reward", gen, fn="flowrl.operators.tasks:longtail_reward"), ref, objective="aipo", kl_coef=0.1)
    b.weights(b.policy("policy", aipo, packing=packing), gen, max_staleness=0)
    return b.build()


@pytest.mark.parametrize("lengths, faster", [(((4, 9.0), (32, 1.0)), True), (((32, 1.0),), False)], ids=["long-tail", "equal"])
def test_the_plan_of_a_packing_policy_prices_its_packed_tokens(lengths, faster):
    # long-tail completions (4 tokens, 1 in 10 of 32: mean 6.8, the longest of 128 almost surely 32): packed, the
    # policy's time follows the mean; equal lengths: the same as padded (the trainer pads what packing cannot shorten)
    m = Measurements(matmul_flops=50e9, copy_bandwidth=5e9, op_overhead_s=3e-6, cores=2, memory_bytes=16 * 2**30)
    work = Workload(prompts_per_step=8, samples_per_prompt=16, prompt_len=6, gen_len=32, lengths=LengthDistribution(points=lengths))
    padded, packed = (plan_graph(_longtail(p), calibrated_cluster(m), strategy="colocated", max_staleness=0, workload=work) for p in (False, True))
    for node in ("policy", "ref"):  # a packing reference's forward too
        if faster:
            assert packed.placements[node].time_s < 0.5 * padded.placements[node].time_s, node
        else:
            assert packed.placements[node].time_s == pytest.approx(padded.placements[node].time_s), node
    assert packed.placements["gen"].time_s == pytest.approx(padded.placements["gen"].time_s)


def test_the_default_is_priced_as_the_runtime_packs_it():
    # packing=None packs where the family can (flowrl.operators.packing.packs); the planner, which cannot read the
    # family table (torch), prices it packed: true while every family flowrl trains takes packed rows
    from flowrl.models.families import FAMILIES

    assert all(f.packing for f in FAMILIES.values()), "a family that cannot pack: search._Evaluator._packing must price its default padded"
    m = Measurements(matmul_flops=50e9, copy_bandwidth=5e9, op_overhead_s=3e-6, cores=2, memory_bytes=16 * 2**30)
    work = Workload(prompts_per_step=8, samples_per_prompt=16, prompt_len=6, gen_len=32, lengths=LengthDistribution(points=((4, 9.0), (32, 1.0))))
    default, packed = (plan_graph(_longtail(p), calibrated_cluster(m), strategy="colocated", max_staleness=0, workload=work) for p in (None, True))
    for node in ("policy", "ref"):
        assert default.placements[node].time_s == packed.placements[node].time_s, node


def test_the_default_on_a_gpu_is_priced_as_the_runtime_runs_it():
    # flowrl's trainer runs packing=None packed and micro_batch_size 0 as the whole batch on any device: on the
    # test's GPU-kind device the default costs what packing=True costs, one micro-batch of the 4 sequences
    default, packed = _fastest(ctx(work=LONG_WORK), packing=None), _fastest(ctx(work=LONG_WORK), packing=True)
    assert default.notes == packed.notes == ("micro-batch 4 x 1",)
    assert default.breakdown["compute"] == pytest.approx(3 * 4 * 4 * F_TOK(2.0) / 1e12)  # 4 x (3 + 2 - 1) packed tokens
    assert default.time_s == packed.time_s


def test_where_the_whole_batch_does_not_fit_the_default_says_which_micro_batch_to_set():
    options = train_options(TINY, ParallelDims(), range(1), ctx(work=LONG_WORK), packing=None).options
    assert options[0].micro_batch == 4  # what the trainer runs comes first, whatever is faster
    room = min(o.memory_total for o in options if o.micro_batch == 4) - 1  # the whole batch does not fit, a smaller one does
    fits = _fastest(ctx(dev=device(memory_bytes=room), work=LONG_WORK), packing=None)
    assert fits.feasible and fits.notes[0] != "micro-batch 4 x 1"
    size = int(fits.notes[0].split()[1])
    assert fits.notes[1] == f"the whole batch does not fit: set the policy's micro_batch_size={size}"
    assert fits.memory.total <= room
