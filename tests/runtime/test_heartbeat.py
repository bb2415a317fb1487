"""The torchrun heartbeat in one process: a real store, rank 0's watch, and stand-ins for the other ranks.

``end_process`` is replaced by a recorder (the real one ends the process); rank 1's hello names a
``sleep`` process of this test, which the test stops or kills to be what rank 1's process would be.
The torchrun jobs with real faults are ``tests/reliability/test_liveness.py``.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time

import pytest

from flowrl.errors import ConfigError
from flowrl.runtime.backends.torchrun import heartbeat as hb
from flowrl.runtime.config import RunConfig

dist = pytest.importorskip("torch.distributed")

BOUND_S = 0.6
SLACK_S = 5.0  # a loaded 2-core machine's scheduling


@pytest.fixture
def store():
    import datetime

    master = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
    yield dist.PrefixStore("flowrl/attempt-0", master)


@pytest.fixture
def ended(monkeypatch):
    """The messages ``end_process`` was called with, and an event set at the first. The heartbeat's
    thread then waits there, as for the real one's end, until the test has checked (``beat.done()``
    lets it go on, and it ends)."""
    said: list[str] = []
    first, release = threading.Event(), threading.Event()

    def record(message: str, **_: object) -> None:
        said.append(message)
        first.set()
        release.wait()

    monkeypatch.setattr(hb, "end_process", record)
    yield said, first, release
    release.set()


def _done(beat: hb.Heartbeat, release: threading.Event) -> None:
    beat._stop.set()  # before the recorder lets the thread go on, so that it ends rather than judging again
    release.set()
    beat.done()


def _peer(store, rank: int, proc: subprocess.Popen) -> None:
    import socket

    start = open(f"/proc/{proc.pid}/stat", "rb").read().rsplit(b")", 1)[1].split()[19].decode()
    store.set(f"live/hello/{rank}", f"{socket.gethostname()} {proc.pid} {start}")
    store.add(f"live/{rank}", 1)


def _rank0(store) -> hb.Heartbeat:
    beat = hb.Heartbeat(store, 0, 2, hb.rank_roles({"gen": [0], "policy": [1]}, 2), BOUND_S, interval_s=0.1)
    beat.start()
    return beat


def test_a_stopped_rank_is_named_killed_and_ends_the_watcher_within_the_bound(store, ended) -> None:
    said, first, release = ended
    peer = subprocess.Popen(["sleep", "60"])
    try:
        _peer(store, 1, peer)
        peer.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        beat = _rank0(store)
        assert first.wait(BOUND_S + SLACK_S), "rank 0 did not notice the stopped rank"
        took = time.monotonic() - t0
        assert BOUND_S <= took <= BOUND_S + SLACK_S, took
        assert said[0].startswith(f"rank 1 (node 'policy') is stopped (its process {peer.pid} is in state T"), said
        assert "SIGKILLed" in said[0] and "--liveness-timeout 0.6" in said[0] and "ending rank 0 (node 'gen')" in said[0], said
        assert peer.wait(timeout=5) == -signal.SIGKILL  # a stopped rank cannot end itself: the watcher killed it
        _done(beat, release)
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()


def test_a_dead_rank_is_named_gone(store, ended) -> None:
    said, first, release = ended
    peer = subprocess.Popen(["sleep", "60"])
    _peer(store, 1, peer)
    peer.kill()
    peer.wait()
    beat = _rank0(store)
    assert first.wait(BOUND_S + SLACK_S)
    assert said[0].startswith(f"rank 1 (node 'policy') died (its process {peer.pid} is gone)"), said
    assert beat.dead_peer() == f"rank 1 (node 'policy') died (its process {peer.pid} is gone)"
    _done(beat, release)


def test_a_rank_that_left_is_not_judged_and_a_peers_failure_ends_every_rank(store, ended) -> None:
    said, first, release = ended
    peer = subprocess.Popen(["sleep", "60"])
    try:
        _peer(store, 1, peer)
        store.add("live/1", hb.DONE)  # rank 1 left run_torchrun: its counter stands still by design
        beat = _rank0(store)
        assert not first.wait(BOUND_S * 3), said
        store.compare_set("live/failed", "", "rank 1 (node 'policy') said why")
        assert first.wait(SLACK_S)
        assert said == ["rank 0 (node 'gen') ends: rank 1 (node 'policy') said why"], said
        _done(beat, release)
    finally:
        peer.kill()
        peer.wait()


def test_rank_roles_name_every_rank() -> None:
    assert hb.rank_roles({"gen": [0], "policy": [1, 2], "reference": [2]}, 4) == {
        0: "node 'gen'", 1: "node 'policy'", 2: "nodes 'policy', 'reference'", 3: "no node"}


def test_the_liveness_timeout_is_refused_off_torchrun_and_when_not_positive() -> None:
    assert RunConfig(backend="torchrun", liveness_timeout_s=5.0).liveness_timeout_s == 5.0
    with pytest.raises(ConfigError, match="backend='local' runs no heartbeat"):
        RunConfig(liveness_timeout_s=5.0)
    with pytest.raises(ConfigError, match="must be > 0"):
        RunConfig(backend="torchrun", liveness_timeout_s=0.0)
