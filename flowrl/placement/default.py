"""The placement of a run given none: the run strategy for its staleness bound, laid out on its devices.

Without a plan file or a JSON placement, a run places its device nodes by one of two fixed
strategies (``RUN_STRATEGIES``, chosen by ``run_strategy`` from the staleness bound k and laid out
by ``run_devices``; no estimates, no planner):

- ``all-colocated`` (k = 0, or one device): every device node on every device, the synchronous
  baseline;
- ``halves`` (k >= 1): generators on the first half of the devices, the trainer side (policies,
  references, reward models) on the second half, so the two overlap.

The devices are the backend's: this machine's cores (or its GPUs on CUDA) for the local and process
backends, the job's ranks under torchrun (which always colocates: ``all-colocated`` on every rank).

Example:
    >>> run_devices({"gen": "generator", "policy": "policy"}, "halves", 4)
    {'gen': (0, 1), 'policy': (2, 3)}
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flowrl.errors import PlanError
from flowrl.graph.kinds import KINDS
from flowrl.placement.layout import NodeMesh, Placement

if TYPE_CHECKING:
    from flowrl.graph.ir import Graph

__all__ = ["RUN_STRATEGIES", "run_strategy", "run_devices", "default_placement"]

#: The fixed strategies of a run without a placement (module docstring).
RUN_STRATEGIES: tuple[str, ...] = ("all-colocated", "halves")


def run_strategy(max_staleness: int, n_devices: int) -> str:
    """The strategy of a run without a placement: ``all-colocated`` for k = 0 or one device, else ``halves``."""
    return "all-colocated" if max_staleness == 0 or n_devices < 2 else "halves"


def run_devices(kinds: dict[str, str], strategy: str, n_devices: int) -> dict[str, tuple[int, ...]]:
    """Devices of each device node (name -> kind, in graph order) under a run strategy (``RUN_STRATEGIES``).

    ``halves`` puts the kinds whose table entry has ``side="trainer"`` on the second half, the others on the first.

    Raises:
        PlanError: for a strategy not in ``RUN_STRATEGIES``.
    """
    if strategy == "all-colocated":
        return {n: tuple(range(n_devices)) for n in kinds}
    if strategy != "halves":
        raise PlanError(f"unknown run strategy {strategy!r}; run strategies: {', '.join(RUN_STRATEGIES)}")
    half = n_devices // 2
    return {n: tuple(range(half, n_devices)) if KINDS[k].side == "trainer" else tuple(range(half)) for n, k in kinds.items()}


def default_placement(graph: Graph, max_staleness: int, n_devices: int, *, strategy: str | None = None) -> Placement:
    """The placement of a run of ``graph`` given none: ``strategy`` (default: ``run_strategy``'s for
    ``max_staleness``) on devices ``0 .. n_devices - 1``, every device node data-parallel.

    Raises:
        PlanError: ``n_devices`` < 1, or an unknown strategy.

    Example:
        >>> from flowrl.examples import build_example
        >>> str(default_placement(build_example("llamarl"), 1, 4))
        'gen:d2@0-1 | policy:d2@2-3'
    """
    if n_devices < 1:
        raise PlanError(f"a run needs at least one device to place its nodes on, not {n_devices}")
    strategy = strategy or run_strategy(max_staleness, n_devices)
    kinds = {n.name: n.kind for n in graph.nodes if KINDS[n.kind].runs_on == "devices"}
    nodes = {n: NodeMesh(devices=d) for n, d in run_devices(kinds, strategy, n_devices).items()}
    return Placement(nodes=nodes, strategy=strategy, source=f"default ({strategy})")
