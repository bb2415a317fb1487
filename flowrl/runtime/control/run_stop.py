"""How a run ends: its trainer's last step, its first failure, or a stall.

``RunStop`` is the controller's part that every executor thread and the supervising thread share:

- ``done()``: the policy finished its last step; ``supervise`` returns.
- ``fail(node, step, exc)``: the first failure is kept with its node and step (the ones after it
  follow from it: closed channels, a stopped clock) and ``stopped`` is set, so every executor
  returns within one step; ``raise_failure`` raises it as one ``NodeExecutionError``.
- ``progress()``: an executor finished a step; ``supervise`` fails the run as ``"controller"`` when
  none has for ``stall_timeout_s``.

Example:
    >>> stop = RunStop(stall_timeout_s=60.0)
    >>> stop.fail("gen", 3, ValueError("boom")), stop.fail("policy", 3, RuntimeError("closed")), stop.stopped()
    (True, False, True)
    >>> stop.failure[:2]
    ('gen', 3)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from flowrl.errors import NodeExecutionError
from flowrl.graph.ir import Graph

__all__ = ["RunStop"]


class RunStop:
    """A run's end (see the module docstring); ``stall_timeout_s``: how long no step may finish."""

    def __init__(self, *, stall_timeout_s: float) -> None:
        self.stall_timeout_s = stall_timeout_s
        self.failure: tuple[str, int | None, BaseException] | None = None
        self._lock, self._stop, self._done = threading.Lock(), threading.Event(), threading.Event()
        self._progress_at = time.monotonic()

    def stopped(self) -> bool:
        return self._stop.is_set()

    def stop(self) -> None:
        self._stop.set()

    def done(self) -> None:
        self._done.set()

    def progress(self) -> None:
        self._progress_at = time.monotonic()

    def fail(self, node: str, step: int | None, exc: BaseException) -> bool:
        """Keep ``exc`` if it is the run's first failure (True), and stop the run either way."""
        with self._lock:
            first = self.failure is None
            if first:
                self.failure = (node, step, exc)
        self._stop.set()
        return first

    def supervise(self, describe: Callable[[], str], fail: Callable[[str, int | None, BaseException], None], poll_s: float = 0.05) -> None:
        """Wait for ``done``, a stop, or a stall: then ``fail("controller", None, TimeoutError)``
        naming the channels (``describe()``)."""
        while not self._done.wait(poll_s) and not self._stop.is_set():
            if time.monotonic() - self._progress_at > self.stall_timeout_s:
                return fail("controller", None, TimeoutError(
                    f"no executor finished a step in {self.stall_timeout_s:.0f} s (channels: {describe()}); "
                    "a program is hung or far slower than stall_timeout_s allows"
                ))  # fmt: skip

    def raise_failure(self, graph: Graph) -> None:
        """Raise the first failure as ``NodeExecutionError`` naming its node, kind and step (itself if it is one); nothing if none."""
        if self.failure is None:
            return
        node, step, exc = self.failure
        if isinstance(exc, NodeExecutionError):
            raise exc
        where = f" at step {step}" if step is not None else ""
        who = f"node {node!r} ({graph.node(node).kind})" if node in graph else f"the {node}"  # a stall: the controller's
        raise NodeExecutionError(f"{who} failed{where}: {type(exc).__name__}: {exc}", node=node, step=step) from exc
