"""A vLLM engine process that dies under a run ends the run within a second, naming it.

vLLM's own monitor notices a dead engine core only sometimes in time: a generator waiting on its
outputs, or on a weight update's reply, may wait for the run's stall timeout (seen: "no executor
finished a step in 300 s"). ``EngineWatch`` polls the processes vLLM started (engine core, workers)
every ``POLL_S``; when one is gone while the generator still holds vLLM, it ends this process with a
message naming the generator and the process (``flowrl.fatal.end_process``: its other processes
stopped too). The run's driver sees what any dead worker shows it: the process backend's controller
a closed socket naming the node; under torchrun the rank's heartbeat tells every peer
(``flowrl.runtime.backends.torchrun.heartbeat``) and torchrun can restart the job with ``--resume auto``.
A restart of the job, not of the engine in place: the engine's weights, its requests in flight and
the weight route's groups (the direct route's, into its workers) all died with it, and the job's
restart rebuilds them from the newest checkpoint by the path every start already takes.

``close`` (before the generator shuts vLLM down), a Ctrl-C (``flowrl.fatal.interrupted``: it reached
vLLM's processes too), the generator being garbage-collected and the
interpreter's exit (``atexit``, before vLLM's own exit handler stops its processes) end the watch
without a word.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from flowrl.fatal import end_process, interrupted
from flowrl.operators.engines.vllm_reaper import start_time

__all__ = ["EngineWatch", "POLL_S"]

POLL_S = 0.5


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


class EngineWatch:
    """Watches ``pids`` for ``owner`` (``"generator 'gen'"``) while ``holder`` (the generator) lives (module docstring)."""

    def __init__(self, owner: str, pids: Iterable[int], holder: Any) -> None:
        self.owner = owner
        self._items = [(pid, start, _name(pid)) for pid in sorted(pids) if (start := start_time(pid)) is not None]
        self._stop = threading.Event()
        self._holder = weakref.ref(holder)
        self._thread: threading.Thread | None = None
        if self._items:
            atexit.register(self.close)
            self._thread = threading.Thread(target=self._run, name="flowrl-vllm-watch", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop watching (idempotent): vLLM's processes are about to end by design."""
        self._stop.set()
        atexit.unregister(self.close)

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            if self._holder() is None or interrupted():  # a Ctrl-C reached vLLM's processes too: they end by design
                return
            for pid, start, name in self._items:
                if start_time(pid) != start and not self._stop.is_set() and not interrupted():
                    end_process(f"{self.owner}: vLLM's engine process {pid} ({name}) died under the run; "
                                "ending this process and vLLM's others (the run resumes from its newest checkpoint: --resume, or "
                                "--resume auto under torchrun --max-restarts)")
