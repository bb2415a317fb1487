"""``InProcessTransport``: weights between threads of one process, through recycled versioned buffers.

State (all under ``_lock`` unless said otherwise):

- ``_front``: the buffer holding the newest complete version (``None`` before the first publish).
  Readers only ever take the front buffer.
- ``_spare``: buffers that hold no needed version and that no reader is copying from; the publisher
  writes into one of them (or allocates one when none is free).
- each buffer's ``readers``: how many fetches are copying out of it right now.

A publish copies the state into a spare buffer *without* the lock, then swaps it in as the front
under the lock (a pointer swap), so a publish costs one copy and a reader never sees a buffer being
written: a buffer being read is never spare, and a spare one is never read. The old front goes back
to ``_spare`` at the swap, or when its last reader finishes. With one reader there are at most three
buffers (two in steady state); each concurrent reader can pin one more.

Devices: a buffer lives on the device of the state first published (a trainer on a GPU keeps its
buffers there: device-to-device copies); a publish or a fetch waits for its copies on every CUDA
device involved before it hands a buffer over or returns.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch

from flowrl.errors import TransportError
from flowrl.runtime.transports.weight_transport import StateLayout, State, check_state, check_target, check_version, copy_tensor, layout_of
from flowrl.transport_traits import BUILTINS

__all__ = ["InProcessTransport"]


class _Buffer:
    __slots__ = ("tensors", "version", "readers")

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.version = -1
        self.readers = 0


class InProcessTransport:
    """Weights shared by threads of one process (the local backend's default weight edge).

    Example:
        >>> t = InProcessTransport()
        >>> t.publish({"w": torch.arange(3.0)}, version=0)
        >>> target = {"w": torch.zeros(3, dtype=torch.bfloat16)}
        >>> t.fetch_into(target), target["w"].tolist()
        (0, [0.0, 1.0, 2.0])
        >>> t.close()
    """

    name = "inprocess"
    #: one object shared by both ends: threads of one process only
    traits = BUILTINS["inprocess"]

    def __init__(self) -> None:
        self._lock = threading.Lock()  # front/spare pointers and reader counts: held for O(1) work only
        self._publish_lock = threading.Lock()  # one publish at a time (version order, spare choice)
        self._layout: StateLayout | None = None
        self._front: _Buffer | None = None
        self._spare: list[_Buffer] = []
        self._allocated = 0
        self._last_version = -1
        self._closed = False

    @property
    def buffers_allocated(self) -> int:
        """How many state-sized buffers this transport has allocated so far (two in steady state)."""
        return self._allocated

    def publish(self, state: State, version: int) -> None:
        with self._publish_lock:
            self._check_open("publish")
            check_version(self.name, version, self._last_version)
            if self._layout is None:
                layout = layout_of(state, transport=self.name)
            else:
                layout = self._layout
                check_state(self.name, layout, state, version)
            with self._lock:
                buf = self._spare.pop() if self._spare else None
            if buf is None:
                buf = _Buffer({k: torch.empty(t.shape, dtype=t.dtype, device=t.device) for k, t in state.items()})
                self._allocated += 1
            for k, dst in buf.tensors.items():
                copy_tensor(dst, state[k])
            _synchronize([*buf.tensors.values(), *state.values()])
            buf.version = version
            with self._lock:
                old, self._front = self._front, buf
                if old is not None and old.readers == 0:
                    self._spare.append(old)
                self._layout = layout
                self._last_version = version

    def latest_version(self) -> int:
        self._check_open("latest_version")
        front = self._front
        return -1 if front is None else front.version

    def fetch_into(self, target: Mapping[str, torch.Tensor], *, newer_than: int = -1) -> int | None:
        self._check_open("fetch_into")
        with self._lock:
            buf = self._front
            if buf is None or buf.version <= newer_than:
                return None
            buf.readers += 1
            layout = self._layout
        try:
            assert layout is not None  # set with the first front buffer
            check_target(self.name, layout, target)
            for k, src in buf.tensors.items():
                copy_tensor(target[k], src)
            _synchronize([*buf.tensors.values(), *target.values()])
            return buf.version
        finally:
            with self._lock:
                buf.readers -= 1
                if buf.readers == 0 and buf is not self._front and not self._closed:
                    self._spare.append(buf)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._front = None
            self._spare.clear()

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise TransportError(f"{self.name}: {op}() called after close(); open a new transport")


def _synchronize(tensors: list[torch.Tensor]) -> None:
    """Wait for copies queued on the CUDA streams of ``tensors``' devices, so a buffer handed over is
    complete (no-op when every tensor is on the CPU)."""
    devices = {t.device for t in tensors if t.device.type == "cuda"}
    for device in devices:
        torch.cuda.current_stream(device).synchronize()
