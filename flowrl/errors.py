"""The exceptions flowrl raises: one class per domain, each message naming what is wrong and the fix."""

from __future__ import annotations

__all__ = [
    "FlowrlError",
    "GraphError",
    "ConfigError",
    "PlanError",
    "NodeExecutionError",
    "NodeBuildError",
    "TransportError",
    "CheckpointError",
    "GraphWarning",
]


class FlowrlError(Exception):
    """Base class of every error flowrl raises on purpose.

    The CLI turns any ``FlowrlError`` into a one-paragraph message and exit status 2; anything else
    is a bug in flowrl and keeps its traceback.
    """


class GraphError(FlowrlError):
    """A graph breaks a rule: the message names the node(s), the rule and the fix."""


class ConfigError(FlowrlError):
    """A configuration value is out of range or inconsistent with another one."""


class PlanError(FlowrlError):
    """A placement cannot work: parallel dims that do not multiply out, memory that does not fit."""


class NodeExecutionError(FlowrlError):
    """An operator failed while the runtime executed it; ``__cause__`` holds the original error.

    Attributes:
        node: name of the node that failed.
        step: the trainer step (policy version) at which it failed, when known.
    """

    def __init__(self, message: str, *, node: str, step: int | None = None) -> None:
        super().__init__(message)
        self.node = node
        self.step = step


class NodeBuildError(NodeExecutionError):
    """A node's program could not be built (a user factory that raised, a model config torch
    rejects): a mistake in the graph or its user code, reported before any step runs.
    ``step`` is None; ``__cause__`` (local backend) holds the original error."""


class TransportError(FlowrlError):
    """A weight transport could not publish or fetch a state."""


class CheckpointError(FlowrlError):
    """A checkpoint is missing, incomplete or does not match the graph it is resumed into."""


class GraphWarning(UserWarning):
    """A graph that is valid but almost certainly not what its author meant (``flowrl.graph.advice``):
    the message names the node, the setting, its effect and the fix. Emitted when a graph is built
    and when a run starts."""
