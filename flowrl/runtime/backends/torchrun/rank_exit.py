"""How a rank's process ends: the steps of a normal exit up to interpreter teardown, then ``os._exit``.

Why. A gloo worker thread frees a finished collective's work after the caller has moved on
(``ProcessGroupGloo::runLoop`` -> ``~AsyncAllreduceWork`` -> its tensors); a tensor whose Python object
was freed first owns that object, and dropping it takes the GIL (``TensorImpl::decref_pyobject``).
When that happens after the main thread has begun finalizing the interpreter, CPython ends the
worker thread (``pthread_exit``), and its unwinding through the ``noexcept`` destructor calls
``std::terminate``: a rank that finished its work dies of ``terminate called without an active
exception`` / ``Fatal Python error: Aborted``, the dump listing only the main thread, with no Python
frame (this stack was caught in test_torchrun's data-parallel job by a ``std::terminate`` hook).
Only a group that ``destroy_process_group()`` did not free leaves such a thread running past the
job's code, and every torchrun job has one: DTensor's sharding caches (one in C++), FSDP's state
and flowrl's weight transports hold them (in ``flowrl run llamarl`` on 3 ranks, one group's
threads still run on rank 0 and three groups' on each policy rank). So a rank does not finalize.

What still runs, in CPython's own order (``Py_FinalizeEx`` before it tears anything down):
``threading``'s exit hooks and the join of non-daemon threads (``threading._shutdown``), every
``atexit`` handler (in a real run: ``logging.shutdown``, ``multiprocessing``'s children, weakref
finalizers, W&B's teardown and temporary directories, torch's dynamo and fake-tensor summaries),
then stdout and stderr flushed. What does not: module teardown, the last garbage collection (an
open file that nobody closed loses its buffer: flowrl closes its metrics, trace, TensorBoard and
W&B writers itself) and C++ static destructors.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn

__all__ = ["is_rank_process", "native_threads", "end_rank_process"]


def is_rank_process() -> bool:
    """True in a process that a distributed launcher started as one rank (torchrun sets ``RANK`` and ``WORLD_SIZE``)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def native_threads() -> int:
    """How many of this process's threads Python's ``threading`` does not know: C++ libraries' own
    (gloo's ``gloo_tcp_loop`` never runs Python, so a live gloo group always shows; so does an
    OpenMP pool, which torchrun's ``OMP_NUM_THREADS=1`` leaves out). 1 where ``/proc`` cannot tell."""
    try:
        tasks = len(os.listdir("/proc/self/task"))
    except OSError:
        return 1
    return max(0, tasks - threading.active_count())


def end_rank_process(code: int) -> NoReturn:
    """End this process with exit status ``code`` after a normal exit's cleanup, skipping interpreter teardown.

    Call it once the rank's own cleanup is done (``destroy_process_group``, writers closed), as the
    last thing its entry point does. ``flowrl`` itself ends this way under torchrun
    (``flowrl.cli.main.main``).
    """
    shutdown = getattr(threading, "_shutdown", None)  # CPython's first exit step; absent elsewhere
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed or missing, as at a normal exit: nothing to keep
            pass
    os._exit(code)
