"""How a rank's process ends: the steps of a normal exit up to interpreter teardown, then ``os._exit``.

Why. ``destroy_process_group()`` forgets the job's process groups, but does not free them while
something still holds one: DTensor's sharding caches (one of them in C++), FSDP's state and
flowrl's weight transports do, so each group's gloo threads (``gloo_tcp_loop``, two
``pt_gloo_runloop``) are still running when the interpreter finalizes (seen in every torchrun job
here: 1 group on rank 0 and 3 on each policy rank of ``flowrl run llamarl``, the FSDP init job's
one). A C++ thread that waits for the GIL once finalization has begun is ended by CPython with
``pthread_exit``, whose unwinding through a ``noexcept`` frame calls ``std::terminate``: a rank that
finished its work dies of ``terminate called without an active exception`` / ``Fatal Python error:
Aborted``, the dump listing only the main thread, with no Python frame. Which object a gloo thread
drops at that moment is not known; finalization is where it hurts, so a rank skips it.

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

__all__ = ["is_rank_process", "end_rank_process"]


def is_rank_process() -> bool:
    """True in a process that a distributed launcher started as one rank (torchrun sets ``RANK`` and ``WORLD_SIZE``)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


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
