"""A 2-rank gloo job whose rank 0 ends while its gloo worker thread waits for the GIL (``test_rank_exit.py``).

``python tests/runtime/rank_exit_job.py sys.exit|end_rank_process`` under torchrun. Rank 0 leaves a
process group alive past ``destroy_process_group()`` (as DTensor's caches do in an FSDP job), with a
Python callback on its last all-reduce, which rank 1 joins 1 s late: the gloo worker thread that
completes it asks for the GIL while rank 0's last exit step holds it (a C call, registered first so
that it runs last). With ``sys.exit``, once finalization has begun rank 0 lets the GIL go (an object
freed at teardown sleeps), the worker gets it, CPython ends that thread (``pthread_exit``) and its
unwinding through a ``noexcept`` frame aborts the rank: ``terminate called without an active
exception``, as CI saw at the end of torchrun jobs. ``end_rank_process`` never begins finalization.
"""

import atexit
import ctypes
import sys
import time

atexit.register(ctypes.PyDLL(None).sleep, 2)  # runs last, holding the GIL: a PyDLL call does not release it

import torch  # noqa: E402 - after the handler above, so that torch's own exit handlers run before it
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo")
rank = dist.get_rank()
if rank == 1:
    time.sleep(1.0)  # rank 0's all-reduce completes later, on its gloo worker thread
done = dist.all_reduce(torch.ones(1), async_op=True).get_future().then(lambda fut: None)  # the worker runs it: the GIL
if rank == 1:
    done.wait()
    time.sleep(3.0)  # while rank 0 ends
    dist.destroy_process_group()
    sys.exit(0)

KEEP = dist.group.WORLD  # the group outlives destroy_process_group, as in a job that built FSDP2 or DTensors
dist.destroy_process_group()


class _Late:
    """Freed in interpreter teardown, after finalization began; its sleep lets the GIL go."""

    def __del__(self, sleep=time.sleep):
        sleep(0.2)


LATE = _Late()
if sys.argv[1] == "end_rank_process":
    from flowrl.runtime.backends.torchrun.rank_exit import end_rank_process

    end_rank_process(0)
sys.exit(0)
