"""Where the program steps of a colocation group run: under the group's lock, or on its one compute thread.

The controller runs one executor thread per node, and the executors of one colocation group never
run a step at the same time. When the programs run in the controller's process (the ``local``
backend), torch's intra-op parallelism decides how to do that. torch's CPU backend is OpenMP
(libgomp), and OpenMP gives every OS thread that runs a parallel region its own team of worker
threads, kept for the life of that thread. libgomp counts every worker of every team, and once
they outnumber the cores it stops spinning between parallel regions (its throttled spin count,
whatever ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` say): each of the thousands of small regions of a
step then wakes its workers through the kernel. Two colocated executors with all cores each (two
teams on the cores of one team) made every step of the default example about 2x slower than the
same steps from one thread (generator 15 -> 31 ms, trainer 25 -> 45 ms on 2 cores), although
they only take turns.

So with ``intra_op_threads`` (the ``local`` backend) each colocation group gets a
:class:`ComputeThread`: one thread that runs its executors' steps one at a time with the group's
intra-op threads, so a group has one OpenMP team, however many executors it has. The executor
threads keep everything else (channels, the version clock, metrics) and hand the step over. An
executor outside every group (a source, a scorer: nodes without devices) runs its steps itself with
one intra-op thread, and so starts no team. A group of one intra-op thread starts no team either:
it is a :class:`GroupLock` (its executors run their own steps, one at a time), which spares a
thread hand-over per step (with groups on one core each, k >= 1 on 2 cores, the hand-over cost
about 4 ms of a 44 ms step, the threads contending for the GIL). Without ``intra_op_threads`` (the
programs are proxies of other processes, whose steps use no torch threads here) a group is a
:class:`GroupLock` as well.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

from flowrl.runtime.parallel.threads import set_intra_op_threads

__all__ = ["StepRunner", "GroupLock", "ComputeThread", "group_runners", "set_thread_cores"]

T = TypeVar("T")


class StepRunner(Protocol):
    """Runs the steps of one colocation group's executors one at a time."""

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` when no other step of the group runs; return its result or raise its exception."""
        ...

    def close(self) -> None:
        """Release what the runner holds (idempotent)."""
        ...


class GroupLock:
    """The group's steps run on their executors' threads, one at a time under one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the calling thread while holding the group's lock."""
        with self._lock:
            return fn()

    def close(self) -> None:
        """Nothing to release."""


class ComputeThread:
    """One daemon thread that runs the group's steps in the order they are handed over.

    Args:
        name: the thread's name (``flowrl-compute-<first node>``).
        intra_op_threads: torch intra-op threads of this thread (``torch.set_num_threads`` sets the
            calling thread's OpenMP thread count, so it is set on this thread, before its first step).
        cores: pin the thread (and so the OpenMP workers it starts) to these cores; empty: no pinning.

    Example:
        >>> import torch
        >>> runner = ComputeThread("flowrl-compute-doc", intra_op_threads=1)
        >>> runner.call(torch.get_num_threads), runner.call(lambda: threading.current_thread().name)
        (1, 'flowrl-compute-doc')
        >>> runner.close()
    """

    def __init__(self, name: str, *, intra_op_threads: int, cores: Iterable[int] = ()) -> None:
        self.intra_op_threads = intra_op_threads
        self.cores = tuple(sorted(set(cores)))
        self._tasks: queue.SimpleQueue[tuple[Callable[[], object], Future[Any]] | None] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)  # like the executors: never blocks exit
        self._thread.start()

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the compute thread and wait for it.

        Raises:
            RuntimeError: the runner is closed.
            BaseException: whatever ``fn`` raised, with its traceback.
        """
        if self._closed:
            raise RuntimeError(f"compute thread {self._thread.name!r} is closed")
        done: Future[T] = Future()
        self._tasks.put((fn, done))
        return done.result()

    def close(self, timeout: float = 5.0) -> None:
        """Let the thread finish the steps handed over already, then end it; wait up to ``timeout``
        seconds for that (a step stuck past it is left to the daemon thread). Idempotent."""
        if not self._closed:
            self._closed = True
            self._tasks.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _main(self) -> None:
        set_thread_cores(self.cores)
        set_intra_op_threads(self.intra_op_threads)
        while (task := self._tasks.get()) is not None:
            fn, done = task
            try:
                result = fn()
            except BaseException as exc:  # noqa: BLE001 - raised again on the executor thread that waits
                done.set_exception(exc)
            else:
                done.set_result(result)


def group_runners(
    groups: list[list[str]], *, intra_op_threads: int | None, cores: dict[str, tuple[int, ...]],
) -> dict[str, StepRunner]:
    """The step runner of each node in a colocation group (nodes in no group have none).

    Args:
        groups: the placement's colocation groups (``Placement.groups``).
        intra_op_threads: torch intra-op threads of each group's compute thread; ``None`` (the steps
            run elsewhere: worker processes) or 1 (the executor threads run with one): each group is a
            :class:`GroupLock`.
        cores: cores to pin each node's steps to (empty or missing: no pinning); a compute thread is
            pinned to the union of its group's cores.

    Example:
        >>> runners = group_runners([["gen", "policy"]], intra_op_threads=1, cores={})
        >>> runners["gen"] is runners["policy"], type(runners["gen"]).__name__
        (True, 'GroupLock')
    """
    runners: dict[str, StepRunner] = {}
    for group in groups:
        runner: StepRunner
        if intra_op_threads is None or intra_op_threads == 1:
            runner = GroupLock()
        else:
            group_cores = [c for name in group for c in cores.get(name, ())]
            runner = ComputeThread(f"flowrl-compute-{group[0]}", intra_op_threads=intra_op_threads, cores=group_cores)
        for name in group:
            runners[name] = runner
    return runners


def set_thread_cores(cores: Iterable[int]) -> None:
    """Pin the calling thread to ``cores`` (nothing when empty, or where the OS cannot)."""
    cores = tuple(cores)
    if cores and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(threading.get_native_id(), cores)
        except OSError:
            pass
