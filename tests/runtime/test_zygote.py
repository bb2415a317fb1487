"""The process backend's start-up path: workers forked by the zygote, failures at start, and import costs."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flowrl.errors import NodeBuildError
from flowrl.runtime.backends.process.zygote import Zygote, ZygoteError
from flowrl.runtime.config import RunConfig
from flowrl.runtime.run import run_graph
from flowrl.runtime.programs.synthetic import synthetic_programs
from tests.reliability.killresume import alive, descendants
from tests.reliability.test_build_errors import _graph

REPO = Path(__file__).resolve().parents[2]


def _fork(zygote: Zygote) -> tuple[int, socket.socket, object]:
    ours, theirs = socket.socketpair()
    worker = zygote.fork(theirs)
    theirs.close()
    return worker.pid, ours, worker


def test_a_forked_worker_is_a_child_of_the_zygote_and_exits_when_its_socket_closes() -> None:
    zygote = Zygote()
    try:
        pid, ours, worker = _fork(zygote)
        assert pid in descendants(os.getpid()) and pid != zygote.proc.pid
        assert worker.poll() is None
        ours.close()  # the controller's end: the worker exits quietly
        assert worker.wait(timeout=60) == 0
    finally:
        zygote.close()
    assert zygote.proc.returncode == 0


@pytest.mark.parametrize("how", ["kill", "close_zygote", "kill_zygote"], ids=["killed", "zygote-closed", "zygote-killed"])
def test_no_worker_outlives_a_kill_or_its_zygote(how: str) -> None:
    zygote = Zygote()
    pid, ours, worker = _fork(zygote)
    try:
        if how == "kill":
            worker.kill()
            assert worker.wait(timeout=60) == -signal.SIGKILL
        elif how == "close_zygote":
            zygote.close()
        else:
            zygote.proc.kill()
            zygote.proc.wait(timeout=60)
            assert worker.wait(timeout=60) == -signal.SIGKILL  # reported, not raised
        deadline = time.monotonic() + 30
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(pid)
    finally:
        ours.close()
        zygote.close()


def test_a_zygote_that_cannot_start_is_reported_with_its_traceback(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('this torch is broken')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(REPO)]))
    zygote = Zygote()
    ours, theirs = socket.socketpair()
    try:
        with pytest.raises(ZygoteError, match=r"(?s)zygote failed to start: ImportError: this torch is broken.*traceback in the zygote"):
            zygote.fork(theirs)
    finally:
        ours.close()
        theirs.close()
        zygote.close()


def test_a_worker_failing_at_start_is_named_and_the_others_are_torn_down() -> None:
    g = _graph()
    programs = {**synthetic_programs(g), "gen": "tests.reliability.userfns:failing_program"}
    config = RunConfig(steps=3, backend="process", programs=programs, stall_timeout_s=30)
    with pytest.raises(NodeBuildError, match=r"node 'gen' \(generator\): building its program failed: ValueError"):
        run_graph(g, config)
    assert descendants(os.getpid()) == []  # the zygote and the workers that did start are gone


HEAVY = ("transformers", "pyarrow", "matplotlib", "tensorboard")
CHECK = f"""
import sys
import flowrl
from flowrl.examples.llamarl import build_llamarl
from flowrl.runtime.config import RunConfig
from flowrl.runtime.run import run_graph
import flowrl.runtime.backends.process.worker  # what the zygote preloads for every worker
run_graph(build_llamarl(), RunConfig(steps=1, progress=False))
print(sorted(m for m in {HEAVY!r} if m in sys.modules))
"""


def test_flowrl_and_the_default_example_import_no_heavy_optional_library() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_a_prestarted_zygote_no_run_took_ends_with_the_command() -> None:
    from flowrl.runtime.backends.process import zygote

    with pytest.raises(RuntimeError, match="the command failed"), zygote.prestarted():
        assert len(descendants(os.getpid())) == 1
        raise RuntimeError("the command failed before its run")
    assert descendants(os.getpid()) == []
