"""The staleness gate: the one owner of the bound k, the updates per batch and the check.

Every number the staleness invariant is made of is derived here. ``run_graph`` builds the run's one
gate (``StalenessGate.of(graph, config.max_staleness)``, the override included) where the run starts
and hands it down: to the backend (``Backend.run(..., gate=)``), which hands it to the controller (its
executors' waits, the channels' capacity, the check of every batch), to the run strategy's placement
(``executor_placement.run_placement``) and, as plain data (``ProgramEnv.staleness``), to the generator
programs (continuous batching's group deadlines) in whatever process they run. Only a part built
outside a run (a unit test, a notebook) builds a gate of its own, from the graph alone.

- ``k`` counts trainer steps (batches), per gated weight edge (the edge into a node that waits for
  weights: a generator), the run's ``max_staleness`` when given, else the edge's.
- ``updates`` U: policy versions per trainer step (``Graph.updates_per_batch``); the version at the
  start of step ``seq`` is ``U * seq`` and only versions ``U * seq`` are ever published.
- A gated node samples batch ``seq`` only with weights of version ``>= U * (seq - k)``
  (``min_version``), so for every consumed batch ``U * seq - rollout_version <= U * k``
  (``check``: a violation is a flowrl bug and fails the run).
- Continuous batching: a group whose first token has version ``v`` must be consumed by step
  ``v // U + k`` (``deadline``).

Example:
    >>> gate = StalenessGate(bounds={"gen": EdgeBound(k=1, updates=2, policy="policy")}, updates=2)
    >>> gate.min_version("gen", 3), gate.bound("gen").deadline(4), gate.policy_k("policy")
    (4, 3, 1)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from flowrl.errors import FlowrlError

if TYPE_CHECKING:
    from flowrl.graph.ir import Graph

__all__ = ["EdgeBound", "StalenessGate", "StalenessViolation"]


class StalenessViolation(FlowrlError):
    """A consumed batch was staler than its weight edge allows: a flowrl bug, never user error."""


class EdgeBound(msgspec.Struct, frozen=True, kw_only=True):
    """The bound of one gated weight edge.

    Attributes:
        k: trainer steps a rollout may lag behind the step that consumes it (0: synchronous).
        updates: U, policy versions per trainer step.
        policy: the node that publishes the edge's weights.
    """

    k: int
    updates: int = 1
    policy: str = ""

    def min_version(self, seq: int) -> int:
        """The oldest weights step ``seq`` may sample with: ``U * (seq - k)``."""
        return self.updates * (seq - self.k)

    def deadline(self, version: int) -> int:
        """The last trainer step that may consume a group whose first token has ``version``: ``version // U + k``."""
        return version // self.updates + self.k


class StalenessGate(msgspec.Struct, frozen=True, kw_only=True):
    """The run's staleness bounds (see the module docstring).

    Attributes:
        bounds: gated node -> its weight edge's bound.
        updates: U, policy versions per trainer step.
    """

    bounds: dict[str, EdgeBound] = {}
    updates: int = 1

    @classmethod
    def of(cls, graph: Graph, max_staleness: int | None = None) -> StalenessGate:
        """The gate of ``graph``: each gated edge's k, or ``max_staleness`` for all of them when given."""
        updates = graph.updates_per_batch()
        bounds = {
            e.dst: EdgeBound(k=e.max_staleness if max_staleness is None else max_staleness, updates=updates, policy=e.src)
            for e in graph.gated_weight_edges()
        }
        return cls(bounds=bounds, updates=updates)

    def gates(self, node: str) -> bool:
        """Whether ``node`` waits for weights on the version clock."""
        return node in self.bounds

    def bound(self, node: str) -> EdgeBound:
        """The bound of the weight edge into ``node``."""
        try:
            return self.bounds[node]
        except KeyError:
            raise FlowrlError(f"node {node!r} has no gated weight edge (gated: {sorted(self.bounds)}); this is a flowrl bug") from None

    def min_version(self, node: str, seq: int) -> int:
        """The oldest weights ``node`` may sample step ``seq`` with."""
        return self.bound(node).min_version(seq)

    def version_at(self, seq: int) -> int:
        """The policy version at the start of step ``seq``: ``U * seq``."""
        return self.updates * seq

    def step_of(self, version: int) -> int:
        """The trainer step whose start ``version`` is (``version // U``)."""
        return version // self.updates

    def tightest(self) -> int:
        """The smallest k (0 with no gated edge): the bound the run strategy lays its placement out for."""
        return min((b.k for b in self.bounds.values()), default=0)

    def widest(self) -> int:
        """The largest k: how many batches may be in flight on a data edge (0 with no gated edge)."""
        return max((b.k for b in self.bounds.values()), default=0)

    def gated_by(self, policy: str) -> list[str]:
        """The gated nodes ``policy`` feeds with weights."""
        return [node for node, b in self.bounds.items() if b.policy == policy]

    def policy_k(self, policy: str) -> int:
        """The k a batch consumed by ``policy`` is checked against: the smallest of the edges it feeds."""
        return min((self.bounds[g].k for g in self.gated_by(policy)), default=0)

    def check(self, policy: str, seq: int, rollout_version: int, token_versions: tuple[int, int] | None = None) -> int:
        """Check the batch ``policy`` consumes at step ``seq``; return its version (its oldest token's).

        Args:
            policy: the consuming policy.
            seq: the step consuming it (at version ``U * seq``).
            rollout_version: the version the batch's rollouts were sampled with.
            token_versions: (oldest, newest) version of its tokens, when weights change in flight.

        Raises:
            StalenessViolation: a token from the policy's future, or a batch staler than ``U * k``.
        """
        now = self.version_at(seq)
        if token_versions is not None:  # the oldest token decides
            oldest, newest = token_versions
            rollout_version = min(rollout_version, oldest)
            if newest > now:
                raise StalenessViolation(f"policy {policy!r} at version {now} consumed tokens of version {newest}, from its future; this is a flowrl bug")
        staleness = now - rollout_version
        k = self.policy_k(policy)
        if staleness > self.updates * k or staleness < 0:
            raise StalenessViolation(
                f"policy {policy!r} consumed a batch of version {rollout_version} at version {now}: staleness {staleness} "
                f"breaks max_staleness={k} steps of {self.updates} versions. This is a flowrl bug; please report it"
            )
        return rollout_version
