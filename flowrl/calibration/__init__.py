"""Calibration: this machine's figures as the local runtime meets them, measured, as the planner's ``cpu`` cluster.

A layer above the planner and the runtime: it runs the built-in model's passes, the generators
and the runtime's compute threads (torch), and turns what it measured into the planner's data
(``planners.cluster.ClusterSpec`` with ``CpuTerms``). The planner stays pure: it reads the
result, ``flowrl calibrate -o cpu.json`` then ``flowrl plan --cluster cpu.json``. ``measure``:
``flowrl.calibration.measure``.
"""

from flowrl.calibration.measure import PASSES, WIDTHS, Measurements, calibrated_cluster, measure, pass_flops

__all__ = ["Measurements", "measure", "calibrated_cluster", "pass_flops", "PASSES", "WIDTHS"]
