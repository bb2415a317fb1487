"""The extension table's generator-engine row: a class with the ``GeneratorEngine`` interface and
its entries in ``graph.engines.ENGINE_CAPS`` (what it accepts: the node's setting checks; how the
planner costs it) and ``operators.engines.ENGINES`` (class and machine check) is all the runtime and
the planner need. The ``Engine`` literal's name (what graph files decode) is not exercised here:
these runs never write the graph to JSON."""

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


def test_the_planner_prices_an_engine_by_its_row_alone(monkeypatch):
    """No planner branch names an engine: a row with vLLM's cost facts (``refills_rows``,
    ``python_loop``, ``cpu_kernels``) is priced as vLLM is, a row with the built-in's as the
    built-in engine, and a row that only leaves flowrl's Python loop drops that loop's overhead."""
    import msgspec

    from flowrl.graph import engines
    from flowrl.planners.estimate.generate import estimate_generate
    from flowrl.planners.parallel import ParallelDims
    from flowrl.planners.plan import plan_graph
    from tests.planners.test_estimates import TINY, ctx, device

    vllm_facts = msgspec.structs.replace(engines.ENGINE_CAPS["vllm"], builtin_models=True, precisions=(), kv_cache_optional=True)
    monkeypatch.setitem(engines.ENGINE_CAPS, "like_vllm", vllm_facts)
    monkeypatch.setitem(engines.ENGINE_CAPS, "like_builtin", engines.EngineCaps(builtin_models=True))
    monkeypatch.setitem(engines.ENGINE_CAPS, "no_loop", engines.EngineCaps(builtin_models=True, python_loop=False))
    dev = device(kind="cpu", decode_step_overhead_s=1e-3)

    def price(engine):
        return estimate_generate(TINY, ParallelDims(), range(1), ctx(dev=dev), precision="float32", engine=engine)

    builtin, vllm = price("builtin"), price("vllm")
    assert builtin.time_s != vllm.time_s
    assert price("like_builtin").time_s == builtin.time_s
    assert price("like_vllm").time_s == vllm.time_s and price("like_vllm").notes[1:] == vllm.notes[1:]
    no_loop = price("no_loop")
    assert builtin.breakdown["step_overhead"] > 0 and no_loop.breakdown["step_overhead"] == 0.0
    assert no_loop.time_s == pytest.approx(builtin.time_s - builtin.breakdown["step_overhead"])

    def planned(engine):  # the whole planner, from a graph whose generator names the engine
        graph = build_example("llamarl")
        nodes = tuple(msgspec.structs.replace(n, engine=engine) if n.name == "gen" else n for n in graph.nodes)
        return plan_graph(type(graph)(msgspec.structs.replace(graph.spec, nodes=nodes)), "cpu").placements["gen"]

    plain, fast = planned("like_builtin"), planned("like_vllm")
    assert plain.notes[0] == "like_builtin engine" and fast.notes[0] == "like_vllm engine"
    assert fast.time_s < plain.time_s  # no Python loop overhead, rows refilled within a call, vLLM's CPU speed-up
