"""The extension table's generator-engine row: a class with the ``GeneratorEngine`` interface and
its entries in ``graph.engines.ENGINE_CAPS`` (what it accepts: the node's setting checks) and ``operators.engines.ENGINES``
(class and machine check) is all the runtime needs. The third file of the row, the ``Engine``
literal's name (what graph files decode) and a planner branch when it costs differently, is not
exercised here: this run never writes the graph to JSON."""

from __future__ import annotations

import pytest

from flowrl.errors import ConfigError
from flowrl.examples import build_example
from flowrl.graph.nodes import GeneratorNode


def test_an_engine_in_the_two_tables_runs_a_graph(monkeypatch):
    import msgspec

    from flowrl.graph import engines as names
    from flowrl.operators import engines as table
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.run import run_graph
    from tests.operators import engine_module

    monkeypatch.setitem(names.ENGINE_CAPS, "counting", names.EngineCaps(builtin_models=True))
    monkeypatch.setitem(table.ENGINES, "counting", table.EngineSpec(
        generator="tests.operators.engine_module:CountingEngine", check="tests.operators.engine_module:check"))
    graph = build_example("llamarl")
    nodes = tuple(msgspec.structs.replace(n, engine="counting") if n.name == "gen" else n for n in graph.nodes)
    graph = type(graph)(msgspec.structs.replace(graph.spec, nodes=nodes))
    engine_module.CALLS.clear()
    rows = run_graph(graph, RunConfig(steps=3, progress=False)).rows
    assert [r["policy_version"] for r in rows] == [1, 2, 3]
    prompts = graph.node("prompts").source.batch_size
    assert len(engine_module.CALLS) >= 3 and set(engine_module.CALLS) == {prompts}  # every step's batch sampled by it
    assert all(r["reward_mean"] >= 0 for r in rows)
    with pytest.raises(ConfigError, match="the counting engine runs on the CPU only"):
        table.check_engine(graph.node("gen"), device="cuda")


def test_an_engine_in_no_table_is_refused_naming_the_engines():
    with pytest.raises(ConfigError, match=r"engine='counting' is not one of \['builtin', 'vllm'\]"):
        GeneratorNode(name="gen", engine="counting")
