"""A thread's torch intra-op threads, set so that no other thread's later setting changes them.

The controller's executor threads, the compute threads of a colocation group and the evaluator's
worker each call it first (``control/compute_threads``, ``control/executors``, ``evaluation/during_run``).
"""

from __future__ import annotations

import torch

__all__ = ["set_intra_op_threads"]


def set_intra_op_threads(threads: int) -> None:
    """Give the calling thread ``threads`` torch intra-op threads, whatever other threads set later.

    ``torch.set_num_threads`` sets the calling thread's OpenMP thread count and a process-wide
    default; a thread's first parallel op (or ``torch.get_num_threads``) copies that default into
    the thread once. Taking that copy first keeps a later ``set_num_threads`` of another thread
    from overriding this thread's count.

    Example:
        >>> import threading
        >>> seen: list[int] = []
        >>> thread = threading.Thread(target=lambda: (set_intra_op_threads(1), seen.append(torch.get_num_threads())))
        >>> thread.start(); thread.join(); seen
        [1]
    """
    torch.get_num_threads()  # the thread's one-time copy of the process-wide default, taken now
    torch.set_num_threads(threads)
