"""Graphs that are valid but almost certainly not what their author meant: warnings, not errors.

``advice(graph)`` lists them, one message each naming the node, the setting, its effect and the
fix; ``warn_about(graph)`` emits each as a ``GraphWarning`` pointing at the caller's line.
``GraphBuilder.build`` and ``run_graph`` (so a graph file too) call it; ``flowrl run`` prints each
as a ``flowrl run: warning: ...`` line instead.

Example:
    >>> from flowrl.examples import build_example
    >>> advice(build_example("llamarl"))
    []
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable

from flowrl.errors import GraphWarning
from flowrl.graph.nodes import GeneratorNode, LossNode
from flowrl.graph.structure import GraphStructure as Graph

__all__ = ["advice", "warn_about"]


def _one_sample_per_prompt(g: Graph) -> Iterable[str]:
    """Every baseline flowrl has is the prompt's group (``LossConfig.baseline``): with one sample
    per prompt the advantage ``reward - baseline`` is 0 for every sample (``leave_one_out``: 0 by
    definition), so the policy gradient is 0 too."""
    for loss in g.nodes_of(LossNode):
        for gen in (p for p in g.producers(loss.name) if isinstance(p, GeneratorNode)):
            n = gen.sampling.n_samples
            if n == 1:
                yield (
                    f"loss {loss.name!r}: generator {gen.name!r} draws n_samples=1 completion per prompt, so the group "
                    f"baseline ({loss.loss.baseline}) leaves every advantage 0 and nothing is learned; "
                    f"set n_samples >= 2 on b.generator({gen.name!r}, ...)"
                )


RULES: tuple[Callable[[Graph], Iterable[str]], ...] = (_one_sample_per_prompt,)


def advice(g: Graph) -> list[str]:
    """What in ``g`` is legal but most likely a mistake, as messages; empty for none."""
    return [message for rule in RULES for message in rule(g)]


def warn_about(g: Graph, *, stacklevel: int = 3) -> None:
    """Emit each of ``advice(g)`` as a ``GraphWarning``; ``stacklevel`` 3 names the line that called
    the function calling this one (``b.build()``, ``run_graph(...)`` in the user's script)."""
    for message in advice(g):
        warnings.warn(message, GraphWarning, stacklevel=stacklevel)
