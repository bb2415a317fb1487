"""This machine as the OS reports it: its memory and the cores this process may use (no torch).

Shared by the planner (the ``cpu`` cluster preset, calibration) and the runtime (the memory check
before a run), so that both read the same figures.
"""

from __future__ import annotations

import os

__all__ = ["host_memory_bytes", "host_cores"]


def host_memory_bytes() -> int:
    """This machine's physical memory in bytes (8 GiB where the OS does not say: not POSIX)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 8 * 1024**3


def host_cores() -> int:
    """The cores this process may run on (its CPU affinity; the machine's count where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
