"""``flowrl.calibration.gloo_rate``: gloo's all-gather and reduce-scatter timed between two real processes,
what a graph with an FSDP2 policy asks ``flowrl calibrate --graph`` for, and bad input."""

from __future__ import annotations

import math
import subprocess

import pytest

from flowrl.calibration.gloo_rate import measure_gloo
from flowrl.calibration.needs import calibration_needs
from flowrl.errors import PlanError
from tests.planners.test_cpu_ranks_plan import graph


@pytest.mark.slow  # two processes importing torch: 15-25 s on the shared 2-core machine (--runslow)
def test_two_processes_time_gloos_collectives_and_leave_nothing_running():
    figures = measure_gloo(sizes=(2**16, 2**20), activation_sizes=(2**18,), repeats=1)
    rates = (*figures.gather_bandwidth, *figures.reduce_scatter_bandwidth, *figures.all_reduce_bandwidth, *figures.send_bandwidth, *figures.all_to_all_bandwidth)
    for rate in rates:
        assert rate > 0 and math.isfinite(rate)
    assert figures.sizes == (2**16, 2**20) and len(figures.gather_bandwidth) == len(figures.reduce_scatter_bandwidth) == 2
    assert figures.activation_sizes == (2**18,) and len(figures.all_reduce_bandwidth) == len(figures.send_bandwidth) == len(figures.all_to_all_bandwidth) == 1
    leftover = subprocess.run(["pgrep", "-f", "flowrl.calibration.gloo_rate --port"], capture_output=True, text=True)
    assert leftover.stdout.strip() == ""


@pytest.mark.parametrize(
    "kw, message",
    [({"sizes": (4,)}, r"sizes=\[4\] must be ascending byte counts >= 8"), ({"sizes": (2**20, 2**16)}, "must be ascending"),
     ({"repeats": 0}, "repeats=0 >= 1"), ({"statistic": "mean"}, "statistic 'mean' is not one of median, best"),
     ({"activation_sizes": (2**20, 2**18)}, r"activation_sizes=\[1048576, 262144\] must be ascending")],
    ids=["bytes", "order", "repeats", "statistic", "activation-order"],
)
def test_bad_arguments_are_refused_before_any_process_starts(kw, message):
    with pytest.raises(PlanError, match=message):
        measure_gloo(**kw)


def test_a_graph_with_an_fsdp2_policy_asks_for_gloos_rate():
    assert calibration_needs(graph()).gloo
    assert not calibration_needs(graph(sharding="replicate")).gloo
