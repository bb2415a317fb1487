"""run_graph refuses a graph that cannot fit in memory before allocating anything."""

from __future__ import annotations

import msgspec
import pytest

from flowrl.errors import ConfigError
from flowrl.examples.llamarl import build_llamarl
from flowrl.graph.ir import Graph
from flowrl.runtime.config import RunConfig
from flowrl.runtime.preflight import check_fits_in_memory
from flowrl.runtime.run import run_graph
from flowrl.runtime.synthetic import synthetic_programs


def _huge_vocab() -> Graph:
    g = build_llamarl()
    nodes = tuple(
        msgspec.structs.replace(n, model=msgspec.structs.replace(n.model, vocab_size=2**36)) if hasattr(n, "model") else n
        for n in g.nodes
    )
    return Graph(msgspec.structs.replace(g.spec, nodes=nodes))


def test_run_graph_refuses_a_graph_too_big_for_this_machine():
    with pytest.raises(ConfigError, match=r"node 'gen' \(generator\) needs at least .* GiB"):
        run_graph(_huge_vocab(), RunConfig(steps=1))


def test_the_default_example_fits_and_synthetic_programs_are_skipped():
    check_fits_in_memory(build_llamarl(), memory_bytes=2**30)
    g = _huge_vocab()
    check_fits_in_memory(g, memory_bytes=2**30, skip=frozenset(synthetic_programs(g)))
    with pytest.raises(ConfigError, match=r"node .* needs at least .* more than the 0.000977 GiB"):
        check_fits_in_memory(build_llamarl(), memory_bytes=2**20)
