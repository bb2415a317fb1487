"""Where a run's nodes run: the ``Placement`` the runtime executes, between the planner and the runtime.

Pure data (no torch, no planner): ``data`` (the ``Placement`` struct: each device node's devices
and mesh axes, the run strategy, colocation groups), ``forms`` (its JSON form, what a user writes
for ``--plan``), ``default`` (the run strategies of a run given no placement), ``resharding`` (a
weight's layout over ranks and the transfers between two layouts, which the collective transport
moves and the planner prices; not imported here), ``weight_routes`` (which weight edges of a
torchrun job take the direct route into vLLM's workers: the runtime opens them, the planner prices
them; not imported here). The planner makes
placements (``Plan.placement()``), the runtime reads them (``run_graph(graph, placement, config)``),
and neither imports the other.

Example:
    >>> from flowrl.examples import build_example
    >>> str(default_placement(build_example("llamarl"), max_staleness=0, n_devices=2))
    'gen:d2@0-1 | policy:d2@0-1'
"""

from flowrl.placement.layout import AXES, NodeMesh, Placement, colocation_groups, device_ranges
from flowrl.placement.default import RUN_STRATEGIES, default_placement, run_devices, run_strategy
from flowrl.placement.forms import decode_placement, load_placement, placement_to_json

__all__ = [
    "AXES",
    "NodeMesh",
    "Placement",
    "colocation_groups",
    "device_ranges",
    "RUN_STRATEGIES",
    "default_placement",
    "run_devices",
    "run_strategy",
    "decode_placement",
    "load_placement",
    "placement_to_json",
]
