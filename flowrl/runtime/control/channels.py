"""Bounded FIFO channels along data edges: backpressure when full, never a silent drop.

A ``Channel`` carries ``Message``s (a sequence number and a batch). ``put`` blocks while the channel
holds ``capacity`` messages; ``get`` blocks while it is empty. ``close`` wakes every waiter: later
``put``/``get`` raise ``ChannelClosed`` (``get`` first drains what is left only if ``drain=True``).
All state is guarded by one ``threading.Condition``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

__all__ = ["Message", "Channel", "ChannelClosed"]


class ChannelClosed(Exception):
    """The channel was closed (the run is stopping); the executor should exit its loop."""


@dataclass(frozen=True)
class Message:
    """One batch on a data edge. ``seq`` is the trainer step the batch is for (0-based)."""

    seq: int
    fields: dict[str, torch.Tensor]


class Channel:
    """A bounded FIFO between two executors.

    Args:
        name: ``"src->dst"``, used in errors and traces.
        capacity: most messages held at once (>= 1).
    """

    def __init__(self, name: str, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"channel {name}: capacity={capacity} must be >= 1")
        self.name = name
        self.capacity = capacity
        self._items: deque[Message] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self.max_depth = 0  # the most messages ever held (for tests: bounded means <= capacity)

    def put(self, message: Message, timeout: float | None = None) -> None:
        """Append ``message``, waiting while the channel is full; ``TimeoutError`` after ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while len(self._items) >= self.capacity and not self._closed:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"channel {self.name} stayed full for {timeout} s")
                self._cond.wait(remaining)
            if self._closed:
                raise ChannelClosed(self.name)
            self._items.append(message)
            self.max_depth = max(self.max_depth, len(self._items))
            self._cond.notify_all()

    def get(self, timeout: float | None = None) -> Message:
        """Pop the oldest message, waiting while the channel is empty."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._items and not self._closed:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"channel {self.name} stayed empty for {timeout} s")
                self._cond.wait(remaining)
            if self._closed:
                raise ChannelClosed(self.name)
            message = self._items.popleft()
            self._cond.notify_all()
            return message

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)
