"""vLLM's figures measured at a tiny shape: a decode speed-up and a weight-sync rate that the planner reads.

Starting vLLM takes a minute on a shared 2-core machine, so the measurement runs with --runslow;
``with_vllm`` (pure) and the refusal of bad counts run by default."""

from __future__ import annotations

import pytest

from flowrl.calibration.measure import Measurements, calibrated_cluster
from flowrl.calibration.vllm_rates import VllmFigures, measure_vllm, with_vllm
from flowrl.errors import PlanError
from flowrl.modelspec import ModelSpec

#: Heads of 32 (a head size vLLM's CPU kernels take), 2 blocks.
SHAPE = ModelSpec(name="t", n_layers=2, dim=64, n_heads=2, n_kv_heads=1, ffn_dim=128, vocab_size=64, tie_embeddings=True)


def test_with_vllm_puts_the_figures_where_the_planner_reads_them():
    m = Measurements(matmul_flops=40e9, copy_bandwidth=6e9, op_overhead_s=4e-6, cores=2, memory_bytes=2**30)
    cpu = calibrated_cluster(with_vllm(m, VllmFigures(decode_speedup=1.7, sync_bandwidth=0.9e9, width=64, sync_bytes=1))).device.cpu
    assert (cpu.vllm_decode_speedup, cpu.vllm_sync_bandwidth) == (1.7, 0.9e9)


@pytest.mark.parametrize("over, message", [({"rows": 0}, "rows=0"), ({"statistic": "mean"}, "statistic 'mean'")])
def test_measure_vllm_refuses_bad_counts_before_starting_vllm(over, message):
    with pytest.raises(PlanError, match=message):
        measure_vllm(SHAPE, **over)


@pytest.mark.slow  # starts vLLM (about a minute on 2 shared cores)
def test_measure_vllm_at_a_tiny_shape():
    pytest.importorskip("vllm")
    figures = measure_vllm(SHAPE, rows=4, new_tokens=4, repeats=1)
    assert figures.decode_speedup > 0 and figures.sync_bandwidth > 0 and figures.width == 64
    assert figures.sync_bytes > 0 and figures.sync_bandwidth < float("inf")
