"""A trainer rank's one send buffer: the staging memory of its packed pieces, bounded and reused.

verl, NeMo-RL and TRL send weights bucket by bucket through one buffer of bounded size that is
reused as sends complete; so does the collective transport. :class:`SendBuffer` hands out regions
of one buffer in turn, wrapping around at its end (a ring): a region is taken for a piece before it
is packed, and the send posted from it is recorded; taking a region that overlaps sends still in
flight first waits for them, oldest first. So a rank never holds more staging memory than the
buffer, whatever the size of its share of the weights (the pieces are cut to at most half of it:
``messages.piece_limit``, so one is packed while the previous one is on the wire).

The buffer is allocated at the first piece, uninitialised (``torch.empty``): pages it never writes
take no memory.

Example:
    >>> buf = SendBuffer(64, "cpu", wait=lambda works: None)
    >>> [buf.take(n)[0] for n in (24, 24, 24)]   # 16-byte aligned; the third wraps to the start
    [0, 32, 0]
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["SendBuffer"]

_ALIGN = 16


class SendBuffer:
    """Regions of one ``nbytes`` buffer on ``device`` for pieces being packed and sent.

    Args:
        nbytes: the buffer's size (the most staging memory the rank holds).
        device: where it lives (the transport's device).
        wait: waits for a list of send works (the transport's, with its timeout and error). Each work
            is waited for once, here (gloo's send work must not be waited for twice: a second wait
            waits for a send that never comes).

    Attributes:
        nbytes: the buffer's size.
        peak_bytes: the most bytes in flight at once (regions taken and not yet known to be sent).
    """

    def __init__(self, nbytes: int, device: str | torch.device, wait: Callable[[list[Any]], None]) -> None:
        self.nbytes = int(nbytes)
        self.peak_bytes = 0
        self._device = torch.device(device)
        self._wait = wait
        self._buf: torch.Tensor | None = None
        self._head = 0
        self._inflight: deque[tuple[int, int, list[Any]]] = deque()  # (lo, hi, works), oldest first

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the buffer held now (0 before the first piece)."""
        return 0 if self._buf is None else self._buf.numel()

    def take(self, n: int) -> tuple[int, torch.Tensor]:
        """A region of ``n`` bytes that no send in flight reads: ``(start, the region's bytes)``.

        Waits for the oldest sends in flight until none overlaps it.

        Raises:
            ValueError: ``n`` is larger than the buffer (the pieces were cut for another size).
        """
        if n > self.nbytes:
            raise ValueError(f"a piece of {n} bytes does not fit a send buffer of {self.nbytes}: pieces must be cut to it")
        if self._buf is None:
            self._buf = torch.empty(self.nbytes, dtype=torch.uint8, device=self._device)
        lo = self._head if self._head + n <= self.nbytes else 0
        hi = lo + n
        while any(a < hi and lo < b for a, b, _ in self._inflight):
            self._wait(self._inflight.popleft()[2])
        self._head = -(-hi // _ALIGN) * _ALIGN
        return lo, self._buf[lo:hi]

    def sent(self, lo: int, n: int, works: list[Any]) -> None:
        """Record that the region at ``lo`` of ``n`` bytes is being sent by ``works``."""
        self._inflight.append((lo, lo + n, works))
        self.peak_bytes = max(self.peak_bytes, sum(b - a for a, b, _ in self._inflight))

    def pending(self) -> list[Any]:
        """The works of the sends recorded and not yet waited for."""
        return [w for _, _, works in self._inflight for w in works]

    def drain(self) -> None:
        """Wait for every send recorded (the whole buffer is free afterwards)."""
        while self._inflight:
            self._wait(self._inflight.popleft()[2])
