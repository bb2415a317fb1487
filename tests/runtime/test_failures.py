"""An operator that raises stops every executor promptly and surfaces as one error naming node and step."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from flowrl.errors import NodeExecutionError
from flowrl.runtime.run import run_graph
from tests.runtime.helpers import synthetic_config

BACKENDS = ["local", "process"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("node", ["prompts", "gen", "reward", "policy"])
def test_failure_in_each_node_kind(graph_k, backend, node):
    g = graph_k(1)
    config = synthetic_config(g, steps=20, backend=backend, options={"fail_node": node, "fail_step": 3})
    start = time.monotonic()
    with pytest.raises(NodeExecutionError, match=rf"node '{node}' \(\w+\) failed at step 3") as info:
        run_graph(g, config)
    assert time.monotonic() - start < 30
    assert info.value.node == node and info.value.step == 3
    assert "injected failure" in str(info.value) + str(info.value.__cause__)


def test_worker_killed_is_reported(graph_k):
    """SIGKILL of a worker process: the run stops with an error naming the node; no worker is left."""
    g = graph_k(1)
    config = synthetic_config(g, steps=400, backend="process", options={"gen_s": 0.01, "train_s": 0.01})
    from flowrl.runtime.backends.process import backend as process_backend

    spawned = []
    original = process_backend.ProcessWorkers._spawn

    def spy(self, *args):
        host = original(self, *args)
        spawned.append(host)
        return host

    process_backend.ProcessWorkers._spawn = spy
    try:
        steps_seen = threading.Event()

        def killer():
            steps_seen.wait(120)  # the run is under way: every worker is up
            victim = next(h for h in spawned if h.node == "gen")
            os.kill(victim.link.proc.pid, signal.SIGKILL)

        t = threading.Thread(target=killer)
        t.start()
        with pytest.raises(NodeExecutionError, match=r"'gen'.*SIGKILL"):
            run_graph(g, config, on_step=lambda row: row["step"] >= 3 and steps_seen.set())
        t.join()
    finally:
        process_backend.ProcessWorkers._spawn = original
    for host in spawned:
        assert host.link.proc.poll() is not None, f"worker of {host.node} still running"
