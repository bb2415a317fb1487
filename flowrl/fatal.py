"""Ending this process at once, from any thread, after a watchdog found a failure nothing else will report.

A watchdog thread (a torchrun rank's heartbeat, ``flowrl.runtime.backends.torchrun.heartbeat``; the vLLM
engine's process watch, ``flowrl.operators.engines.vllm_watch``) sees what the main thread cannot:
a peer rank that stopped answering, an engine process that died while the main thread waits on it
forever. ``end_process`` ends the process from that thread in bounded time: it prints the message
once (``flowrl run: error: ...``), runs the hooks registered with ``on_end`` (a heartbeat tells its
peers why, so they end too), stops this process's descendants (SIGTERM, then SIGKILL after
``grace_s``: vLLM's engine processes, so none is left behind), flushes stdout and stderr and
calls ``os._exit``: no interpreter teardown, which could wait on the very thread that hangs.
A second caller (another watchdog, at the same moment) waits for the first to end the process.
A Ctrl-C reaches every process of the terminal's group, vLLM's too: the CLI notes it
(``note_interrupt``) before anything else, and a watchdog that sees a child end after it stays silent.

Example:
    >>> remove = on_end(lambda message: None)   # a heartbeat tells its peers this way
    >>> remove()
    >>> ending(), interrupted()
    (False, False)
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

__all__ = ["end_process", "on_end", "descendant_pids", "ending", "interrupted", "note_interrupt"]

_hooks: list[Callable[[str], None]] = []
_lock = threading.Lock()
_ending = threading.Event()
_interrupted = threading.Event()


def note_interrupt() -> None:
    """Record that this process was interrupted (Ctrl-C): its children got the SIGINT too and end by design."""
    _interrupted.set()


def interrupted() -> bool:
    """True once ``note_interrupt`` ran: a watchdog then takes a child's end for the interrupt's, not a failure."""
    return _interrupted.is_set()


def on_end(hook: Callable[[str], None]) -> Callable[[], None]:
    """Run ``hook(message)`` when ``end_process`` ends this process; returns a function that removes it."""
    _hooks.append(hook)

    def remove() -> None:
        if hook in _hooks:
            _hooks.remove(hook)

    return remove


def ending() -> bool:
    """True once ``end_process`` has begun in this process."""
    return _ending.is_set()


def descendant_pids(root: int) -> list[int]:
    """Pids of every live descendant of ``root``, children first, from ``/proc`` (empty elsewhere)."""
    parents: dict[int, list[int]] = {}
    try:
        entries = [int(e) for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    for pid in entries:
        try:
            stat = Path(f"/proc/{pid}/stat").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(b")", 1)[1].split()[1])  # fields after the command name, which may hold spaces
        parents.setdefault(ppid, []).append(pid)
    found, todo = [], list(parents.get(root, []))
    while todo:
        pid = todo.pop(0)
        found.append(pid)
        todo.extend(parents.get(pid, []))
    return found


def _stop_descendants(grace_s: float) -> None:
    pids = descendant_pids(os.getpid())
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    for pid in descendant_pids(os.getpid()):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
    except OSError:
        return False
    if state == b"Z":  # a zombie of ours: reap it
        try:
            os.waitpid(pid, os.WNOHANG)
        except OSError:
            pass
        return False
    return True


def end_process(message: str, *, code: int = 1, grace_s: float = 3.0) -> NoReturn:
    """Print ``flowrl run: error: {message}``, run the ``on_end`` hooks, stop the descendants and ``os._exit(code)``.

    Safe from any thread; only the first call acts, later ones block until the process is gone.
    """
    with _lock:
        first = not _ending.is_set()
        _ending.set()
    if not first:
        while True:
            time.sleep(3600)
    try:
        print(f"flowrl run: error: {message}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass
    for hook in list(_hooks):
        try:
            hook(message)
        except Exception:  # noqa: BLE001 - ending regardless: a hook must not keep the process alive
            pass
    _stop_descendants(grace_s)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(code)
