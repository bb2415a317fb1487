"""``flowrl.calibration.rank_passes``: the split passes' efficiencies from their seconds (a hand
computation with gloo's rates), and the two processes measuring them through the runtime's own
tensor and pipeline parallelism."""

from __future__ import annotations

import msgspec
import pytest

from flowrl.calibration.measure import Measurements
from flowrl.calibration.rank_passes import MICRO_BATCHES, RankPassSeconds, efficiencies, measure_rank_passes, with_rank_passes
from flowrl.errors import PlanError
from flowrl.planners.cluster import CpuTerms

M = Measurements(
    matmul_flops=1e9, copy_bandwidth=1e9, op_overhead_s=1e-6, cores=2, memory_bytes=2**30,
    cpu=CpuTerms(gloo_all_reduce_by_bytes=((1, 1e8),), gloo_send_by_bytes=((1, 2e8),)),
)


def test_each_efficiency_is_the_compute_term_over_what_the_pass_leaves_after_its_collectives():
    s = RankPassSeconds(width=64, rows=8, whole_train=1.0, tp_train=0.8, pp_train=0.9, whole_decode=0.01, tp_decode=0.012)
    act = 8 * 8 * 64 * 4  # [rows x 8 tokens, width] float32
    tp_comm = 2 * 7 * act / 1e8  # 2 layers x (2 forward + 5 backward) all-reduces at 1e8 B/s
    dec_comm = 2 * 2 * 8 * 64 * 4 / 1e8  # 2 layers x 2 all-reduces of [8 rows, width]
    sends = (MICRO_BATCHES + 1) * 2 * (act / MICRO_BATCHES) / 2e8
    got = efficiencies(s, M)
    assert got["tp_train_efficiency"] == pytest.approx(0.5 / (0.8 - tp_comm), rel=1e-12)
    assert got["tp_decode_efficiency"] == pytest.approx(0.005 / (0.012 - dec_comm), rel=1e-12)
    assert got["pp_train_efficiency"] == pytest.approx((MICRO_BATCHES + 1) * 0.5 / MICRO_BATCHES / (0.9 - sends), rel=1e-12)
    terms = with_rank_passes(M, s).cpu
    assert (terms.tp_train_efficiency, terms.tp_decode_efficiency, terms.pp_train_efficiency) == tuple(got.values())
    assert terms.gloo_all_reduce_by_bytes == M.cpu.gloo_all_reduce_by_bytes  # the rest kept


def test_an_efficiency_is_clamped_where_the_collectives_take_the_whole_pass():
    s = RankPassSeconds(width=64, rows=8, whole_train=1.0, tp_train=1e-6, pp_train=1e-6, whole_decode=1.0, tp_decode=1e-6)
    assert set(efficiencies(s, M).values()) == {1.5}


@pytest.mark.slow  # two processes importing torch.distributed: ~8 s at rest, 30 under load (--runslow)
def test_the_two_ranks_time_every_split_pass():
    """Two processes over gloo: the trainer's DTensor split, the generator's split and a 1F1B pipeline
    of the calibration model at width 32."""
    s = measure_rank_passes(32, repeats=1)
    assert s.width == 32 and s.rows == 256
    assert all(v > 0 for v in msgspec.structs.asdict(s).values())
    assert all(0.05 <= e <= 1.5 for e in efficiencies(s, M).values())


def test_a_width_that_does_not_split_is_refused():
    with pytest.raises(PlanError, match="width=48 must be a multiple of 32"):
        measure_rank_passes(48)
