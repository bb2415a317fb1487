"""A torchrun rank's heartbeat: a dead or stopped rank of any role ends the whole job within a bound.

Why. A rank that dies closes its sockets and torchrun's agent sees its exit, but the ranks waiting on
it may not look (a generator waiting on a policy rank's direct weight send, a collective inside a
step: the process group's timeout, minutes). A rank that is stopped (SIGSTOP, a node frozen) or
wedged keeps its sockets open and its process alive: nothing notices it but the run's stall timeout.

How. Every rank runs one daemon thread with its own connection to the job's store (torchrun's agent
hosts it, so it answers while any rank is stopped) under the attempt's prefix. Every ``interval_s``
it adds 1 to ``live/<rank>``; rank 0 reads every rank's counter, every other rank reads rank 0's
and the job's ``live/failed``. A counter that has not moved for ``timeout_s`` (measured on the
reader's own clock: no clock is shared) is a rank that is dead, stopped or wedged. The reader then
names it, its nodes and the cause it can see (on the same host, ``/proc/PID``: gone, or stopped in
state ``T``), SIGKILLs a stopped or wedged rank on its own host (torchrun's agent would wait 30 s
for its SIGTERM, which a stopped process never handles), writes ``live/failed`` (first writer wins)
and ends itself (``flowrl.fatal.end_process``: its vLLM processes too). Every other rank reads
``live/failed`` within ``interval_s`` and ends with the same message. torchrun's agent then sees
failed workers and restarts them (``--max-restarts``). A rank that leaves ``run_torchrun`` (done or
failed: its exit status speaks then) adds ``DONE`` to its counter and is no longer judged.

So every rank ends within ``timeout_s + interval_s`` (plus the store's round trips and the
SIGTERM grace of its children) after the fault.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flowrl.fatal import end_process, on_end

__all__ = ["Heartbeat", "DEFAULT_TIMEOUT_S", "rank_roles", "process_state"]

DEFAULT_TIMEOUT_S = 60.0
DONE = 1 << 40  # added to a counter by a rank that left run_torchrun: no longer judged
_FAILED = "live/failed"


def rank_roles(ranks: Mapping[str, Sequence[int]], world: int) -> dict[int, str]:
    """Rank -> the nodes it serves, in words (``"node 'gen'"``, ``"nodes 'policy', 'reference'"``, or ``"no node"``)."""
    roles = {}
    for r in range(world):
        names = [n for n, rs in ranks.items() if r in rs]
        roles[r] = ("node " if len(names) == 1 else "nodes ") + ", ".join(repr(n) for n in names) if names else "no node"
    return roles


def process_state(pid: int, start: str) -> str | None:
    """The state letter of ``/proc/PID/stat`` (``R``, ``S``, ``T``...) if that process (same start time) lives; None if gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    if fields[19].decode() != start or fields[0] in (b"Z", b"X"):
        return None
    return fields[0].decode()


def _start_time() -> str:
    return Path(f"/proc/{os.getpid()}/stat").read_bytes().rsplit(b")", 1)[1].split()[19].decode()


class Heartbeat:
    """One rank's heartbeat and watch (see the module docstring).

    Args:
        store: a store client of this thread's own (``connect`` makes one) under the attempt's prefix.
        rank, world: this rank and the job's size; roles: rank -> its nodes in words (``rank_roles``).
        timeout_s: how long a rank's counter may stand still before the job ends (``--liveness-timeout``).
        interval_s: how often this rank beats and reads (default: ``timeout_s / 6``, within 0.2-5 s).
    """

    def __init__(self, store: Any, rank: int, world: int, roles: Mapping[int, str], timeout_s: float, interval_s: float | None = None) -> None:
        self.store, self.rank, self.world, self.roles = store, rank, world, dict(roles)
        self.timeout_s = float(timeout_s)
        self.interval_s = interval_s if interval_s is not None else min(5.0, max(0.2, self.timeout_s / 6))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._remove_hook = lambda: None
        self._host = socket.gethostname()
        self._peers: dict[int, tuple[str, int, str]] = {}  # rank -> (host, pid, start time)

    @classmethod
    def connect(cls, prefix: str, rank: int, world: int, roles: Mapping[int, str], timeout_s: float) -> Heartbeat | None:
        """A heartbeat over a fresh client of the job's store (``MASTER_ADDR``:``MASTER_PORT``); None outside such a job."""
        import torch.distributed as dist

        if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            return None
        wait = datetime.timedelta(seconds=max(5.0, timeout_s))
        client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=wait)
        return cls(dist.PrefixStore(prefix, client), rank, world, roles, timeout_s)

    def who(self, rank: int) -> str:
        return f"rank {rank} ({self.roles.get(rank, 'no node')})"

    def start(self) -> None:
        """Say hello (host, pid, start time), beat once and start the thread; ``end_process`` from anywhere tells the peers."""
        self.store.set(f"live/hello/{self.rank}", f"{self._host} {os.getpid()} {_start_time()}")
        self.store.add(f"live/{self.rank}", 1)
        self._remove_hook = on_end(self._tell_peers)
        self._thread = threading.Thread(target=self._run, name=f"flowrl-heartbeat-{self.rank}", daemon=True)
        self._thread.start()

    def done(self) -> None:
        """This rank left the job: stop beating and judging, and tell the peers not to judge it."""
        self._stop.set()
        self._remove_hook()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 5.0)
        try:
            self.store.add(f"live/{self.rank}", DONE)
        except Exception:  # noqa: BLE001 - the store may be gone with the job: nothing left to tell
            pass

    def _tell_peers(self, message: str) -> None:
        self.store.compare_set(_FAILED, "", f"{message} (noticed by {self.who(self.rank)})")

    # -- the thread -------------------------------------------------------------------------------
    def _run(self) -> None:
        watched = list(range(1, self.world)) if self.rank == 0 else [0]
        seen: dict[int, tuple[int, float]] = {}  # rank -> (counter, when it last moved)
        store_ok = time.monotonic()
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            try:
                self.store.add(f"live/{self.rank}", 1)
                if self.store.check([_FAILED]):
                    said = self.store.get(_FAILED).decode()
                    if not self._stop.is_set():
                        end_process(f"{self.who(self.rank)} ends: {said}")
                counters = {r: self.store.add(f"live/{r}", 0) for r in watched}
                store_ok = time.monotonic()
            except Exception as exc:  # noqa: BLE001 - judged below: a store that stays away is a failure too
                if time.monotonic() - store_ok > self.timeout_s and not self._stop.is_set():
                    end_process(f"{self.who(self.rank)} ends: the job's store at {os.environ.get('MASTER_ADDR')}:"
                                f"{os.environ.get('MASTER_PORT')} did not answer for {self.timeout_s:.0f} s "
                                f"(--liveness-timeout): {type(exc).__name__}: {exc}")
                continue
            for r, count in counters.items():
                if count >= DONE:
                    watched.remove(r)
                    continue
                last = seen.get(r)
                if last is None or count != last[0]:
                    seen[r] = (count, now)
                elif now - last[1] > self.timeout_s and not self._stop.is_set():
                    self._judge(r, now - last[1])

    def _hello(self, rank: int) -> tuple[str, int, str] | None:
        if rank not in self._peers:
            try:
                if not self.store.check([f"live/hello/{rank}"]):
                    return None
                host, pid, start = self.store.get(f"live/hello/{rank}").decode().split()
            except Exception:  # noqa: BLE001 - no hello: the cause stays unknown
                return None
            self._peers[rank] = (host, int(pid), start)
        return self._peers[rank]

    def cause(self, rank: int) -> tuple[str, int | None]:
        """What this rank can see of ``rank``'s process: (the cause in words, its pid where it is on this host and alive)."""
        hello = self._hello(rank)
        if hello is None or hello[0] != self._host:
            return "dead, stopped or hung (on another host)", None
        _, pid, start = hello
        state = process_state(pid, start)
        if state is None:
            return f"died (its process {pid} is gone)", None
        if state in ("T", "t"):
            return f"is stopped (its process {pid} is in state {state}: SIGSTOP or a debugger)", pid
        return f"is hung (its process {pid} is in state {state} but its heartbeat thread did not run)", pid

    def dead_peer(self) -> str | None:
        """A peer of this host whose process is gone (for a SIGTERM's message: which rank torchrun saw fail), in words."""
        for r in range(self.world):
            if r != self.rank:
                what, pid = self.cause(r)
                if what.startswith("died"):
                    return f"{self.who(r)} {what}"
        return None

    def _judge(self, rank: int, still_s: float) -> None:
        what, pid = self.cause(rank)
        if pid is not None:  # stopped or wedged on this host: it cannot end itself, and torchrun would wait 30 s
            try:
                os.kill(pid, signal.SIGKILL)
                what += "; SIGKILLed"
            except OSError:
                pass
        end_process(f"{self.who(rank)} {what}: its heartbeat stood still for {still_s:.1f} s "
                    f"(--liveness-timeout {self.timeout_s:g}); ending {self.who(self.rank)} so that torchrun can restart the job")
