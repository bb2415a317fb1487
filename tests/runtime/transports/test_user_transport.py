"""A transport registered by the user works on every backend: its traits decide how it is opened,
and a worker process imports its factory by reference (issue 12.3)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flowrl.errors import TransportError
from flowrl.examples.llamarl import build_llamarl
from flowrl.runtime.run import run_graph
from flowrl.runtime.weights.edges import transport_specs
from flowrl.runtime.transports.file import FileTransport
from flowrl.runtime.transports.registry import register_transport, transport_reference, transport_traits
from tests.runtime.helpers import synthetic_config

NAME = "test-logged-file"


class LoggedFileTransport(FileTransport):
    """The file transport, noting each publish and fetch (version, pid) in ``$FLOWRL_TEST_TRANSPORT_LOG``."""

    name = NAME

    def _note(self, what: str, version: int | None) -> None:
        with open(os.environ["FLOWRL_TEST_TRANSPORT_LOG"], "a") as f:
            f.write(f"{what} {version} {os.getpid()}\n")

    def publish(self, state, version):
        super().publish(state, version)
        self._note("publish", version)

    def fetch_into(self, target, *, newer_than=-1):
        got = super().fetch_into(target, newer_than=newer_than)
        if got is not None:
            self._note("fetch", got)
        return got


@pytest.fixture
def logged(tmp_path, monkeypatch) -> Path:
    log = tmp_path / "transport.log"
    monkeypatch.setenv("FLOWRL_TEST_TRANSPORT_LOG", str(log))  # workers inherit the environment
    register_transport(NAME, LoggedFileTransport, replace=True)
    return log


@pytest.mark.parametrize("backend", ["local", "process"])
def test_registered_transport_runs_on_every_backend(backend, logged):
    g = build_llamarl(max_staleness=1, transport=NAME)
    result = run_graph(g, synthetic_config(g, steps=3, backend=backend))
    assert [r["step"] for r in result.rows] == [1, 2, 3]
    lines = [line.split() for line in logged.read_text().splitlines()]
    published = [int(v) for what, v, _ in lines if what == "publish"]
    fetched = [int(v) for what, v, _ in lines if what == "fetch"]
    assert published and published == sorted(published) and fetched
    pids = {int(pid) for *_, pid in lines}
    # local: both ends in this process; process: both ends in workers, none here
    assert pids == {os.getpid()} if backend == "local" else os.getpid() not in pids


def test_traits_come_from_the_class_and_decide_the_options(logged, tmp_path):
    assert transport_traits(NAME).needs_directory and transport_traits(NAME).crosses_processes
    (spec,) = transport_specs(build_llamarl(transport=NAME), str(tmp_path), crosses_processes=True)
    assert spec.name == NAME and spec.writer_options == {"directory": str(tmp_path / "weights-policy-gen")}
    assert spec.factory == f"{__name__}:LoggedFileTransport"


def test_an_unregistered_transport_fails_where_the_run_starts():
    g = build_llamarl(max_staleness=1, transport="carrier-pigeon")  # a valid graph: the name has the right form
    with pytest.raises(TransportError, match=r"unknown transport 'carrier-pigeon'; known transports: \[.*'inprocess'.*register yours"):
        run_graph(g, synthetic_config(g, steps=1))


def test_a_factory_other_processes_cannot_import_is_named():
    register_transport("test-nested", lambda **options: None, replace=True)
    with pytest.raises(TransportError, match=r"transport 'test-nested' is registered with .*lambda.*define its factory at module level"):
        transport_reference("test-nested")
