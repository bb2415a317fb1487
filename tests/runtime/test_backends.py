"""The backend registry: run_graph dispatches through it; every built-in implements the protocol."""

from __future__ import annotations

import importlib

import pytest

from flowrl.errors import ConfigError, PlanError
from flowrl.examples.llamarl import build_llamarl
from flowrl.placement import NodeMesh, Placement
from flowrl.runtime.backends.backend import BUILTIN_BACKENDS, Backend, backend_names, create_backend, register_backend
from flowrl.runtime.backends.local import LocalBackend
from flowrl.runtime.config import RunConfig
from flowrl.runtime.run import run_graph
from tests.runtime.helpers import synthetic_config


class CountingBackend(LocalBackend):
    """The local backend, counting its runs."""

    name = "test-counting"
    runs = 0
    placements: list = []

    def run(self, graph, placement, config, *, on_step=None):
        type(self).runs += 1
        type(self).placements.append(placement)
        return super().run(graph, placement, config, on_step=on_step)


@pytest.mark.parametrize("name", sorted(BUILTIN_BACKENDS))
def test_builtins_implement_the_protocol(name):
    backend = create_backend(name)
    assert isinstance(backend, Backend) and backend.name == name and isinstance(backend.crosses_processes, bool)


def test_every_builtin_has_its_traits_row():
    """The runtime's table (name -> class) and the traits table (``flowrl.backend_traits.BACKENDS``) list the same
    names, and a class's ``crosses_processes`` is its row's."""
    from flowrl.backend_traits import BACKENDS

    assert set(BUILTIN_BACKENDS) == set(BACKENDS)
    for name in BUILTIN_BACKENDS:
        assert create_backend(name).crosses_processes == BACKENDS[name].crosses_processes


def test_what_a_backend_allows_comes_from_its_traits(monkeypatch):
    """FSDP and offloading are refused by a backend's traits, not its name: a user backend declaring ``shards`` takes FSDP."""
    from flowrl import backend_traits
    from flowrl.runtime.parallel.fsdp import check_backend
    from flowrl.runtime.programs.offload import offload_roles
    from tests.runtime.test_fsdp import fsdp_graph

    graph = fsdp_graph()
    with pytest.raises(ConfigError, match=r"sharding='fsdp'.*'mine' backend runs it in one process"):
        check_backend(graph, "mine")
    monkeypatch.setitem(backend_traits._DECLARED, "mine", backend_traits.BackendTraits(crosses_processes=True, shards=True))
    check_backend(graph, "mine")
    with pytest.raises(ConfigError, match=r"offload='on' runs on the local and process backends; under torchrun run with --offload off"):
        offload_roles(graph, Placement(nodes={}), "on", backend="torchrun")


def test_run_graph_dispatches_through_the_registry(monkeypatch):
    from flowrl.runtime.backends import backend as base

    monkeypatch.setattr(base, "_USER_BACKENDS", {})  # the registration ends with the test (doctests list the built-ins)
    register_backend("test-counting", CountingBackend, replace=True)
    g = build_llamarl(max_staleness=1)
    result = run_graph(g, synthetic_config(g, steps=2, backend="test-counting"))
    assert CountingBackend.runs == 1 and [r["step"] for r in result.rows] == [1, 2]
    with pytest.raises(ConfigError, match=r"'test-counting' is already registered; pass replace=True"):
        register_backend("test-counting", CountingBackend)


def test_run_graph_hands_the_placement_to_the_backend_and_none_without_one(monkeypatch):
    from flowrl.runtime.backends import backend as base

    monkeypatch.setattr(base, "_USER_BACKENDS", {})
    register_backend("test-counting", CountingBackend, replace=True)
    g = build_llamarl(max_staleness=1)
    together = Placement(nodes={"gen": NodeMesh(devices=(0,)), "policy": NodeMesh(devices=(0,))}, source="test")
    run_graph(g, together, synthetic_config(g, steps=1, backend="test-counting"))
    run_graph(g, synthetic_config(g, steps=1, backend="test-counting"))  # the two-argument form
    run_graph(g, None, synthetic_config(g, steps=1, backend="test-counting"))
    assert CountingBackend.placements[-3:] == [together, None, None]


def test_run_graph_refuses_a_placement_that_is_not_one_or_not_the_graphs():
    g = build_llamarl(max_staleness=1)
    with pytest.raises(ConfigError, match=r"placement must be a flowrl.placement.Placement or None, not str .*read_placement\(path, graph\)"):
        run_graph(g, "place.json", RunConfig(steps=1))
    misspelt = Placement(nodes={"gen": NodeMesh(devices=(0,)), "polcy": NodeMesh(devices=(1,))})
    with pytest.raises(PlanError, match=r"places \['polcy'\], which are not device nodes of graph 'llamarl'.*did you mean 'policy'"):
        run_graph(g, misspelt, synthetic_config(g, steps=1))


def test_unknown_backend_names_the_known_ones():
    g = build_llamarl(max_staleness=1)
    with pytest.raises(ConfigError, match=r"unknown backend 'mpi'; choose one of \['local', 'process', .*'torchrun'"):
        run_graph(g, RunConfig(backend="mpi", steps=1))  # refused at run start, before any work
    with pytest.raises(ConfigError, match=r"unknown backend 'mpi'"):
        create_backend("mpi")
    assert {"local", "process", "torchrun"} <= set(backend_names())


@pytest.mark.parametrize("module", ["backends.local", "backends.process.backend", "backends.torchrun.backend", "backends.drive", "weights.torchrun_edges", "backends.torchrun.rank_programs"])
def test_no_backend_imports_run_py(module):
    """``run.py`` dispatches to the backends; a backend importing it back would close an import circle."""
    source = importlib.import_module(f"flowrl.runtime.{module}").__file__
    with open(source) as f:
        text = f.read()
    assert "flowrl.runtime.run import" not in text and "from flowrl.runtime import run" not in text
