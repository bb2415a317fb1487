"""A timeline of what every executor did, written as Chrome trace JSON (opens in Perfetto / chrome://tracing).

One track (``tid``) per executor, named by thread-name metadata events; one complete event
(``"ph": "X"``) per span: generate, score, train, weight publish, weight fetch, wait. Thread-safe.
The runtime's controller records the measured timeline with it, the planner's
``planners.timeline`` the predicted one, so the two open side by side; pure (no torch).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgspec

from flowrl.fileio import write_atomic

__all__ = ["Tracer"]


class Tracer:
    """Collects spans; ``save(path)`` writes them. A disabled tracer records nothing and costs nothing.

    Args:
        enabled: record spans.
        origin: the time (``time.perf_counter()`` seconds) the trace starts at; default: now. A
            predicted timeline (``flowrl.planners.timeline``) passes 0 and adds spans in seconds from it.
    """

    def __init__(self, enabled: bool = True, *, origin: float | None = None) -> None:
        self.enabled = enabled
        self._t0 = time.perf_counter() if origin is None else origin
        self._events: list[dict[str, Any]] = []
        self._tracks: dict[str, int] = {}
        self._lock = threading.Lock()

    def _tid(self, track: str) -> int:
        if track not in self._tracks:
            self._tracks[track] = len(self._tracks) + 1
        return self._tracks[track]

    def add(self, track: str, name: str, start: float, end: float, **args: Any) -> None:
        """A span on ``track`` from ``start`` to ``end`` (``time.perf_counter()`` seconds)."""
        if not self.enabled:
            return
        with self._lock:
            self._events.append(
                {
                    "name": name,
                    "cat": track,
                    "ph": "X",
                    "ts": (start - self._t0) * 1e6,
                    "dur": max(0.0, end - start) * 1e6,
                    "pid": 1,
                    "tid": self._tid(track),
                    "args": args,
                }
            )

    def counter(self, track: str, name: str, at: float, value: float) -> None:
        """A counter sample (``"ph": "C"``, a value track in Perfetto) named ``name`` on ``track``'s process row."""
        if not self.enabled:
            return
        with self._lock:
            self._tid(track)
            self._events.append({"name": f"{track} {name}", "ph": "C", "ts": (at - self._t0) * 1e6, "pid": 1, "tid": self._tid(track), "args": {name: value}})

    @contextmanager
    def span(self, track: str, name: str, **args: Any) -> Iterator[dict[str, Any]]:
        """Time the block as a span; the yielded dict's items become the span's args."""
        start = time.perf_counter()
        extra: dict[str, Any] = dict(args)
        try:
            yield extra
        finally:
            self.add(track, name, start, time.perf_counter(), **extra)

    def spans(self, track: str | None = None, name: str | None = None) -> list[dict[str, Any]]:
        """Recorded spans, optionally filtered; times in microseconds as in the file."""
        with self._lock:
            tid = self._tracks.get(track) if track is not None else None
            return [
                e for e in self._events
                if (track is None or e["tid"] == tid) and (name is None or e["name"] == name)
            ]

    def to_dict(self) -> dict[str, Any]:
        with self._lock:
            meta = [
                {"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": track}}
                for track, tid in self._tracks.items()
            ]
            meta.append({"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "flowrl"}})
            return {"traceEvents": meta + list(self._events), "displayTimeUnit": "ms"}

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the trace atomically (``flowrl.fileio.write_atomic``)."""
        write_atomic(path, msgspec.json.encode(self.to_dict()))
