"""vLLM's processes against the ends of the run, without vLLM: the engine watch and the process group they start in.

``EngineWatch`` watches ``sleep`` processes standing for vLLM's (``end_process`` recorded: the real one
ends this process); ``_own_process_group`` is checked on a process spawned as vLLM spawns its engine
core (multiprocessing's ``spawn``). The runs with vLLM itself are ``tests/reliability/test_vllm_faults.py``.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import threading
import time

import pytest

from flowrl import fatal
from flowrl.operators.engines import vllm_watch
from flowrl.operators.engines.vllm_engine import _own_process_group

SLACK_S = 5.0


class Holder:
    """What the watch holds a weak reference to (the generator)."""


@pytest.fixture
def ended(monkeypatch):
    said: list[str] = []
    first = threading.Event()

    def record(message: str, **_: object) -> None:
        said.append(message)
        first.set()

    monkeypatch.setattr(vllm_watch, "end_process", record)
    return said, first


def test_a_dead_engine_process_ends_the_run_naming_it(ended) -> None:
    said, first = ended
    holder, procs = Holder(), [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    watch = vllm_watch.EngineWatch("generator 'gen'", [p.pid for p in procs], holder)
    try:
        t0 = time.monotonic()
        procs[1].kill()
        procs[1].wait()
        assert first.wait(vllm_watch.POLL_S + SLACK_S), "the watch did not notice the dead process"
        assert time.monotonic() - t0 <= vllm_watch.POLL_S + SLACK_S
        assert said[0].startswith(f"generator 'gen': vLLM's engine process {procs[1].pid} (sleep) died under the run"), said
    finally:
        watch.close()
        procs[0].kill()
        procs[0].wait()
        watch._thread.join(timeout=SLACK_S)
    assert not watch._thread.is_alive()


@pytest.mark.parametrize("how", ["closed", "interrupted", "collected"])
def test_an_engine_ended_by_design_is_not_a_failure(ended, monkeypatch, how: str) -> None:
    said, first = ended
    holder, proc = Holder(), subprocess.Popen(["sleep", "60"])
    watch = vllm_watch.EngineWatch("generator 'gen'", [proc.pid], holder)
    if how == "closed":
        watch.close()  # the generator's close, before it shuts vLLM down
    elif how == "interrupted":
        monkeypatch.setattr(vllm_watch, "interrupted", lambda: True)  # Ctrl-C reached vLLM's processes too
    else:
        del holder  # the generator was garbage-collected (vLLM's finalizer stops its processes)
    proc.kill()
    proc.wait()
    assert not first.wait(vllm_watch.POLL_S * 2.5), said
    watch.close()
    watch._thread.join(timeout=SLACK_S)
    assert not watch._thread.is_alive()


def test_vllms_processes_start_in_a_process_group_of_their_own() -> None:
    ctx = multiprocessing.get_context("spawn")  # as vLLM starts its engine core (VLLM_WORKER_MULTIPROC_METHOD=spawn)
    groups = {}
    for inside in (True, False):
        proc = ctx.Process(target=time.sleep, args=(30,))  # a stdlib target: the child imports nothing of ours
        if inside:
            with _own_process_group():
                proc.start()
        else:
            proc.start()
        groups[inside] = (proc.pid, os.getpgid(proc.pid))
        proc.kill()
        proc.join(timeout=30)
    pid, group = groups[True]
    assert group == pid, "a process vLLM starts leads its own group: Ctrl-C to the terminal's group does not reach it"
    assert groups[False][1] == os.getpgid(0), "outside vLLM's start, processes stay in this process's group"
    assert not fatal.ending()
