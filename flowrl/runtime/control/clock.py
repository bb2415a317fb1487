"""The version clock: how many optimizer steps the policy has completed, and waiting on it.

``version`` only grows. The generator's staleness gate waits here for ``version >= needed`` before
it samples (``needed = step - max_staleness``), which is what makes the staleness invariant hold:

    policy_version_at_consumption - rollout_version <= max_staleness

Guarded by one ``threading.Condition``; ``stop`` wakes every waiter so that a failing run never
leaves a thread blocked here.
"""

from __future__ import annotations

import threading

__all__ = ["VersionClock", "ClockStopped"]


class ClockStopped(Exception):
    """The run is stopping; a waiter should give up."""


class VersionClock:
    """A monotonically increasing policy version with blocking waits."""

    def __init__(self, version: int = 0) -> None:
        self._version = version
        self._stopped = False
        self._cond = threading.Condition()

    @property
    def version(self) -> int:
        with self._cond:
            return self._version

    def advance(self, version: int) -> None:
        """Record that the policy reached ``version`` (never moves backwards)."""
        with self._cond:
            if version < self._version:
                raise ValueError(f"version clock cannot move back from {self._version} to {version}")
            self._version = version
            self._cond.notify_all()

    def wait_for(self, version: int, timeout: float | None = None) -> int:
        """Block until the clock reads at least ``version``; returns the version it reads.

        Raises:
            ClockStopped: the run was stopped while waiting.
            TimeoutError: ``timeout`` seconds passed first.
        """
        with self._cond:
            ok = self._cond.wait_for(lambda: self._stopped or self._version >= version, timeout)
            if self._stopped:
                raise ClockStopped()
            if not ok:
                raise TimeoutError(f"policy version stayed at {self._version}, waited for {version}")
            return self._version

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
