"""The ``process`` backend's zygote: one process that imports torch and the worker's modules once and forks every worker.

Starting a worker as a fresh interpreter costs an import of torch (1-2 s of CPU each; several at once
on a small machine take 10 s and more). The zygote pays it once, and a worker is then one ``fork``
away: the zygote (``python -m flowrl.runtime.backends.process.zygote FD PARENT_PID``) imports
``flowrl.runtime.backends.process.worker`` (torch, the programs, the operators) and ``torch._dynamo`` (which the
optimizer imports when a trainer is built), and runs nothing else. Forking is safe because the
zygote never runs a torch operation and starts no thread of its own: torch's OpenMP pool does not
exist yet in it (a process that has used OpenMP cannot be forked safely), and the forked worker
sizes its own thread pool (``worker._pin``).

Control messages are msgspec JSON, one per datagram on a ``SOCK_SEQPACKET`` socket pair (never
pickle):

- controller -> zygote ``{"op": "fork"}`` with the worker's end of its socket pair attached
  (``SCM_RIGHTS``); the zygote answers ``{"forked": PID}``;
- controller -> zygote ``{"op": "kill", "pid": PID}``: SIGKILL a worker the zygote has not reaped
  (the zygote is the workers' parent, so it alone can kill without racing a reused pid);
- zygote -> controller ``{"ready": PID}`` once its imports are done (or ``{"error": ..., "traceback":
  ...}`` when they failed), and ``{"exited": PID, "code": C}`` when it reaps a worker (``C`` as
  ``Popen.returncode``: the exit status, or minus the signal that killed it).

No orphans: the zygote dies with the controller (``worker.die_with_parent``), and every worker dies
with the zygote the same way; when the controller's end closes, the zygote SIGKILLs the workers
still running, reaps them and exits.

``prestart()`` starts a zygote early (``flowrl run --backend process`` calls it before importing
torch itself), so that its imports overlap the controller's; ``take()`` hands it to the next
process-backend run, or starts one.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from flowrl.errors import FlowrlError

__all__ = ["Zygote", "ForkedWorker", "ZygoteError", "prestart", "prestarted", "discard", "take", "main"]

_MAX_MESSAGE = 1 << 16


class ZygoteError(FlowrlError):
    """The zygote could not start (its imports failed) or died; the message says which and why."""

    user_mistake = False


class Zygote:
    """The controller's handle on a zygote process: fork workers, learn when they exit, kill them.

    Thread-safe: executor threads wait on different workers at once; one lock guards the control
    socket, and exit codes read on behalf of another worker are kept for it in ``_codes``.
    """

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[4])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "flowrl.runtime.backends.process.zygote", str(theirs.fileno()), str(os.getpid())],
            pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self._sock = ours
        self._lock = threading.Lock()
        self._ready = False
        self._codes: dict[int, int] = {}
        self._live: set[int] = set()
        self._dead = False

    def fork(self, sock: socket.socket) -> ForkedWorker:
        """Fork a worker that serves ``sock`` (the worker's end of its socket pair; the caller closes its copy).

        Raises:
            ZygoteError: the zygote's imports failed, or it died.
        """
        with self._lock:
            if not self._ready:
                self._await(lambda m: "ready" in m, None)
                self._ready = True
            socket.send_fds(self._sock, [msgspec.json.encode({"op": "fork"})], [sock.fileno()])
            reply = self._await(lambda m: "forked" in m, None)
            pid = int(reply["forked"])
            self._live.add(pid)
            return ForkedWorker(self, pid)

    def returncode(self, pid: int, timeout: float | None) -> int | None:
        """The exit code of worker ``pid``, waiting up to ``timeout`` seconds for it (0: do not wait)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if pid in self._codes:
                    return self._codes[pid]
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    self._await(lambda m: m.get("exited") == pid, min(left, 0.2) if left is not None else 0.2)
                except TimeoutError:
                    pass
                except ZygoteError:  # the zygote is gone, so are its workers
                    return self._codes.setdefault(pid, -signal.SIGKILL)
                if pid in self._codes:
                    return self._codes[pid]
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def kill(self, pid: int) -> None:
        """SIGKILL worker ``pid`` unless it already exited."""
        with self._lock:
            if pid in self._codes or self._dead:
                return
            try:
                self._sock.send(msgspec.json.encode({"op": "kill", "pid": pid}))
            except OSError:
                pass

    def close(self) -> None:
        """End the zygote: it kills the workers still running, reaps them and exits."""
        with self._lock:
            self._sock.close()
            self._dead = True
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def _await(self, wanted: Any, timeout: float | None) -> dict[str, Any]:
        """Read messages (recording exits) until one satisfies ``wanted``; the lock is held.

        Raises:
            TimeoutError: none came within ``timeout`` seconds.
            ZygoteError: the zygote reported a failed start, or its end closed.
        """
        while True:
            if self._dead:  # workers not reported die with the zygote (PR_SET_PDEATHSIG), or were killed by it
                for pid in self._live - self._codes.keys():
                    self._codes[pid] = -signal.SIGKILL
                raise ZygoteError(self._death())
            self._sock.settimeout(timeout)
            try:
                data = self._sock.recv(_MAX_MESSAGE)
            except (TimeoutError, BlockingIOError):
                raise TimeoutError from None
            except OSError:
                data = b""
            finally:
                if not self._dead:
                    self._sock.settimeout(None)
            if not data:
                self._dead = True
                continue
            message = msgspec.json.decode(data)
            if "error" in message:
                self._dead = True
                raise ZygoteError(f"the process backend's zygote failed to start: {message['error']}\n"
                                  f"--- traceback in the zygote (pid {self.proc.pid}) ---\n{message.get('traceback', '')}")
            if "exited" in message:
                self._codes[int(message["exited"])] = int(message["code"])
            if wanted(message):
                return message

    def _death(self) -> str:
        code = self.proc.poll()
        how = "still running" if code is None else f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        return f"the process backend's zygote (pid {self.proc.pid}) is gone ({how}); its workers died with it"


class ForkedWorker:
    """A worker forked by a ``Zygote``: the part of ``subprocess.Popen`` the process backend uses."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote = zygote
        self.pid = pid

    def poll(self) -> int | None:
        """The exit code, or None while it runs."""
        return self.zygote.returncode(self.pid, 0)

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the worker to exit; returns its exit code.

        Raises:
            subprocess.TimeoutExpired: it still runs after ``timeout`` seconds.
        """
        code = self.zygote.returncode(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
        return code

    def kill(self) -> None:
        self.zygote.kill(self.pid)


_prestarted: Zygote | None = None


def prestart() -> None:
    """Start a zygote now, for the next process-backend run of this process to ``take``."""
    global _prestarted
    if _prestarted is None:
        _prestarted = Zygote()


def discard() -> None:
    """End a zygote ``prestart`` started that no run took (the command failed before its run)."""
    global _prestarted
    zygote, _prestarted = _prestarted, None
    if zygote is not None:  # it forked nothing: kill it rather than wait for its imports to end
        zygote.proc.kill()
        zygote.close()


@contextlib.contextmanager
def prestarted() -> Iterator[None]:
    """A zygote starts on entry, for a process-backend run inside to ``take``; one left untaken ends on exit."""
    prestart()
    try:
        yield
    finally:
        discard()


def take() -> Zygote:
    """The zygote ``prestart`` started (the caller now owns it), or a new one."""
    global _prestarted
    zygote, _prestarted = _prestarted, None
    return zygote if zygote is not None and zygote.proc.poll() is None else Zygote()


# -- the zygote process ----------------------------------------------------------------------------------


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.send(msgspec.json.encode(message))


def _reap(sock: socket.socket, children: set[int]) -> None:
    """Collect every worker that exited and report it."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        try:
            _send(sock, {"exited": pid, "code": code})
        except OSError:
            pass


def _fork_worker(control: socket.socket, wake: tuple[int, int], fd: int) -> int:
    """Fork one worker serving the socket ``fd``; in the child, never returns."""
    pid = os.fork()
    if pid:
        os.close(fd)
        return pid
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        control.close()
        for end in wake:
            os.close(end)
        from flowrl.runtime.backends.process.worker import run_worker

        run_worker(fd, os.getppid())
        code = 0
    except BaseException:  # noqa: BLE001 - a worker's last word; it exits either way
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(control: socket.socket) -> None:
    """Fork workers on request and report their exits, until the controller's end closes."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that SIGCHLD writes to the wakeup fd
    children: set[int] = set()
    watched: list[socket.socket | int] = [control, wake_r]
    try:
        while True:
            readable, _, _ = select.select(watched, [], [])
            if wake_r in readable:
                os.read(wake_r, 512)
                _reap(control, children)
            if control not in readable:
                continue
            data, fds, _, _ = socket.recv_fds(control, _MAX_MESSAGE, 1)
            if not data:
                break
            request = msgspec.json.decode(data)
            if request.get("op") == "fork" and fds:
                pid = _fork_worker(control, (wake_r, wake_w), fds[0])
                children.add(pid)
                _send(control, {"forked": pid})
            elif request.get("op") == "kill" and int(request.get("pid", 0)) in children:
                os.kill(int(request["pid"]), signal.SIGKILL)
    finally:
        for pid in children:
            os.kill(pid, signal.SIGKILL)
        for pid in list(children):
            os.waitpid(pid, 0)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the controller decides
    control = socket.socket(fileno=int(sys.argv[1]))
    try:
        import torch._dynamo  # noqa: F401 - preloaded: building a trainer's optimizer imports it

        from flowrl.runtime.backends.process.worker import die_with_parent  # torch, the programs and the operators, once for every worker
    except BaseException as exc:  # noqa: BLE001 - reported to the controller, which raises it
        _send(control, {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
        return
    die_with_parent(int(sys.argv[2]))  # after the imports: it exits at once if the controller died meanwhile
    try:
        _send(control, {"ready": os.getpid()})
        serve(control)
    except OSError:
        pass  # the controller went away
    control.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip tearing down torch's modules: nothing is left to clean up, and it takes seconds


if __name__ == "__main__":
    main()
