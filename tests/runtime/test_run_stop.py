"""The run's end alone (``RunStop``): the first failure kept, a stall detected, done ends the wait."""

from __future__ import annotations

import threading
import time

import pytest

from flowrl.errors import NodeExecutionError
from flowrl.examples import build_example
from flowrl.runtime.control.run_stop import RunStop


def test_the_first_failure_is_kept_and_raised_naming_its_node_kind_and_step():
    stop = RunStop(stall_timeout_s=60.0)
    stop.raise_failure(build_example("llamarl"))  # none yet: nothing raised
    first = ValueError("boom")
    results = []
    threads = [threading.Thread(target=lambda i=i: results.append(stop.fail("gen", i, first if i == 0 else RuntimeError("closed")))) for i in range(8)]
    threads[0].start()
    threads[0].join()
    for t in threads[1:]:
        t.start()
    for t in threads[1:]:
        t.join()
    assert results == [True] + [False] * 7 and stop.stopped() and stop.failure == ("gen", 0, first)
    with pytest.raises(NodeExecutionError, match=r"node 'gen' \(generator\) failed at step 0: ValueError: boom") as info:
        stop.raise_failure(build_example("llamarl"))
    assert info.value.__cause__ is first


def test_a_node_execution_error_is_raised_as_it_is():
    stop = RunStop(stall_timeout_s=60.0)
    error = NodeExecutionError("node 'policy' (policy) failed at step 2: already said", node="policy", step=2)
    stop.fail("policy", 2, error)
    with pytest.raises(NodeExecutionError) as info:
        stop.raise_failure(build_example("llamarl"))
    assert info.value is error


def test_a_stall_fails_the_run_as_the_controller():
    stop, failed = RunStop(stall_timeout_s=0.05), []

    def fail(node, step, exc):
        failed.append((node, step, exc))
        stop.fail(node, step, exc)

    t0 = time.monotonic()
    stop.supervise(lambda: "gen->reward: 0/2", fail, poll_s=0.01)
    assert time.monotonic() - t0 < 5.0
    ((node, step, exc),) = failed
    assert (node, step) == ("controller", None) and isinstance(exc, TimeoutError) and "gen->reward: 0/2" in str(exc)
    with pytest.raises(NodeExecutionError, match=r"^the controller failed: TimeoutError: no executor finished a step in 0 s"):
        stop.raise_failure(build_example("llamarl"))


def test_progress_keeps_a_slow_run_alive_and_done_ends_the_wait():
    stop, failed = RunStop(stall_timeout_s=0.2), []

    def steps() -> None:
        for _ in range(10):
            time.sleep(0.05)
            stop.progress()
        stop.done()

    worker = threading.Thread(target=steps)
    worker.start()
    stop.supervise(lambda: "", lambda *a: failed.append(a), poll_s=0.01)
    worker.join()
    assert failed == [] and not stop.stopped() and stop.failure is None
