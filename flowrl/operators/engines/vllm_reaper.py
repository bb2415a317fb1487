"""vLLM's processes end with the process that started them, however that process ends.

vLLM runs its engine core and its workers as processes of their own. ``VLLMGenerator.close`` shuts
them down, but a process killed with SIGKILL runs no ``close``: the kernel's OOM killer, or the
process backend killing a failed run's worker. vLLM's processes then live on, re-parented to init,
holding the model's memory (seen on this machine: an OOM-killed bench left a 5.5 GB vLLM worker
behind, which starved the next run into an OOM kill of its own).

``Reaper.watch(pids)`` starts one small watchdog process in a session of its own, holding the read
end of a pipe whose write end only this process holds. When this process ends without ``close``, the
pipe reads EOF and the watchdog SIGKILLs the recorded processes, each only if it is still the same
process (its start time in ``/proc/PID/stat`` unchanged, so a reused pid is never hit), then exits.
``close()`` tells it the processes were shut down properly, and it exits without killing anything.
``descendants()`` lists this process's descendants, to diff around vLLM's start. Linux only (it
reads ``/proc``); elsewhere ``watch`` returns a reaper that does nothing.

Example:
    >>> reaper = Reaper.watch([])   # nothing to watch: no watchdog is started
    >>> reaper.close()
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

__all__ = ["Reaper", "descendants", "started_since", "start_time"]

#: The watchdog: argv is "pid:start_time" pairs; it kills them when stdin ends without "done".
_WATCHDOG = """
import os, signal, sys
said = sys.stdin.buffer.read()
if said.strip() != b"done":
    for item in sys.argv[1:]:
        pid, start = item.split(":")
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                same = f.read().rsplit(b")", 1)[1].split()[19].decode() == start
            if same:
                os.kill(int(pid), signal.SIGKILL)
        except (OSError, IndexError, ValueError):
            pass
"""


def start_time(pid: int) -> str | None:
    """Field 22 of ``/proc/PID/stat`` (the process's start time in clock ticks), or None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return stat.rsplit(b")", 1)[1].split()[19].decode()  # fields after the command name, which may hold spaces


def descendants(root: int | None = None) -> set[int]:
    """Pids of every live descendant of ``root`` (default: this process), from ``/proc`` (empty elsewhere)."""
    root = os.getpid() if root is None else root
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc/self/stat").exists() else ():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int(entry.joinpath("stat").read_bytes().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def started_since(before: set[int]) -> set[int]:
    """This process's descendants not in ``before``, less multiprocessing's resource tracker: it lives
    as long as this process may start others, and exits by itself once nothing holds its pipe."""
    def tracker(pid: int) -> bool:
        try:
            return b"resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return False

    return {pid for pid in descendants() - before if not tracker(pid)}


class Reaper:
    """A watchdog that SIGKILLs ``pids`` if this process ends without ``close`` (module docstring)."""

    def __init__(self, proc: subprocess.Popen[bytes] | None, items: tuple[tuple[int, str], ...] = ()) -> None:
        self._proc = proc
        self._items = items

    @classmethod
    def watch(cls, pids: Iterable[int]) -> Reaper:
        items = tuple((pid, start) for pid in sorted(pids) if (start := start_time(pid)) is not None)
        if not items:
            return cls(None)
        proc = subprocess.Popen(
            [sys.executable, "-S", "-c", _WATCHDOG, *(f"{pid}:{start}" for pid, start in items)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,  # not in this process's group: a kill of the group leaves it to do its job
            close_fds=True,
        )
        return cls(proc, items)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def close(self) -> None:
        """After the owner's own shutdown: a watched process still running is killed now, and the
        watchdog exits without killing anything (idempotent)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for pid, start in self._items:
            if start_time(pid) == start:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        try:
            assert proc.stdin is not None
            proc.stdin.write(b"done")
            proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
