"""The critic node's program: values of each batch by the critic's current weights, then a training step on it.

Step ``seq`` runs once the policy has finished step ``seq - 1`` (``CriticNode.version_needed``; the
controller waits on the version clock outside the colocation group's runner, and writes a
checkpoint before it moves the clock on), so the critic is at version ``U_c * seq`` (``U_c``: its
``num_iterations``) when it computes batch ``seq``'s values, which it checks: its values carry that
version (``value_version``), and a checkpoint holds the critic and the policy at the same batch.

State (``_lock``: ``save`` may run while a step trains): the ``Critic`` operator's.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

import torch

from flowrl.errors import ConfigError, FlowrlError
from flowrl.graph.critic import CriticNode
from flowrl.graph.ir import Graph
from flowrl.graph.nodes import LossNode
from flowrl.runtime.programs.nodes import Batch, Info, ProgramBase

if TYPE_CHECKING:
    from flowrl.runtime.programs.nodes import ProgramEnv, SharedTransports

__all__ = ["CriticProgram", "build_critic"]


class CriticProgram(ProgramBase):
    """Writes ``values`` and ``value_version`` for each batch and trains on it (module docstring)."""

    def __init__(self, node: CriticNode, graph: Graph, *, device: str = "cpu") -> None:
        from flowrl.operators.critic import Critic

        losses = [u for u in graph.users(node.name) if isinstance(u, LossNode)]
        if len(losses) != 1:
            raise ConfigError(f"critic {node.name!r} feeds {len(losses)} losses; it serves exactly one (objective='ppo')")
        self.name = node.name
        self.critic = Critic(node, losses[0].loss, device=device)
        self._updates = node.optimizer.num_iterations
        self._lock = threading.Lock()

    def step(self, seq: int, inputs: Batch, min_version: int) -> tuple[Batch, Info]:
        start = time.perf_counter()
        with self._lock:
            version = self.critic.version
            if version != self._updates * seq:
                raise FlowrlError(
                    f"critic {self.name!r} at version {version} computes the values of batch {seq}, which needs version "
                    f"{self._updates * seq} ({self._updates} optimizer steps a batch): this is a flowrl bug; please report it"
                )
            values, metrics = self.critic.train_step(inputs)
        out = {"values": values, "value_version": torch.tensor(version, dtype=torch.int64)}
        return out, {**metrics, "critic_s": time.perf_counter() - start}

    def save(self, path: str) -> None:
        with self._lock:
            state = self.critic.state()
        torch.save(state, path)

    def load(self, path: str) -> None:
        state = torch.load(path, weights_only=True, map_location="cpu")
        with self._lock:
            self.critic.load_state(state)


def build_critic(node: CriticNode, graph: Graph, env: ProgramEnv, transports: SharedTransports) -> CriticProgram:
    """A critic's program, on its node's device."""
    return CriticProgram(node, graph, device=env.device_of(node.name))
