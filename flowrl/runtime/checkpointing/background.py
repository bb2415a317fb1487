"""Checkpoints written behind training: a state taken in memory now, written to disk by a thread.

A checkpoint has two parts (``resume.save_run_checkpoint``): taking the state (the trainer stops
for it: a copy of its tensors to CPU memory, ``stage``) and writing it (``torch.save`` of the copy,
fsync, the rename into ``step-*`` and ``LATEST``: ``BackgroundSave`` runs this on its thread while
the trainer goes on). A program that can split its save so has ``snapshot(path) -> write``
(``PolicyProgram``, a syncing ``ReferenceProgram``, a sharded policy's rank through
``sharded_state.snapshot_sharded``, and ``RemoteProgram``, whose peers write behind their steps
while its write polls them); any other program's ``save`` runs whole while the trainer waits
(``snapshot_or_save``).

- At most one save is in flight: the next waits for the previous (``BackgroundSave.submit``), so the
  staging buffers (``stage``) are reused and never written while a writer reads them.
- A checkpoint becomes ``LATEST`` only once its files are on disk (``CheckpointWriter.commit``, last
  step of the write); a kill during the write leaves the previous checkpoint as ``LATEST`` and a
  staging folder the next run sweeps away.
- A failed write is raised by the next ``submit`` or by ``wait`` (the run's end), naming the step and
  the intact previous checkpoint; the run does not go on past it unsaid.

Example:
    >>> import torch
    >>> buffers = {}
    >>> state = {"version": 3, "model": {"w": torch.ones(2)}}
    >>> copy = stage(state, buffers)
    >>> _ = state["model"]["w"].add_(1.0)  # training goes on
    >>> copy["model"]["w"].tolist(), copy["version"]
    ([1.0, 1.0], 3)
    >>> stage(state, buffers)["model"]["w"] is copy["model"]["w"]  # the same buffer, refilled
    True
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from flowrl.errors import CheckpointError

__all__ = ["BackgroundSave", "snapshot_or_save", "stage"]

#: What a program's ``snapshot(path)`` returns: the write of the state it took (called on the save's thread).
Write = Callable[[], None]


def stage(value: Any, buffers: dict[Any, Any], key: tuple[Any, ...] = ()) -> Any:
    """A copy of ``value`` (nested dicts, lists and tuples of tensors and plain values) with every tensor
    copied into a CPU buffer of ``buffers`` kept from the last call (allocated on the first call, or when
    a tensor's shape or dtype changed): the memory is already mapped, so the copy runs at memory speed.

    A ``DTensor`` (a shard of a policy over ranks) is staged as its local shard's copy, wrapped again with
    the same mesh, placements and global shape (DCP writes it as the original). The caller owns
    ``buffers`` and must not stage again while a write still reads the previous copy."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        local = stage(value.to_local(), buffers, key)
        return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride())
    if isinstance(value, torch.Tensor):
        src = value.detach()
        buf = buffers.get(key)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            pin = src.is_cuda and torch.cuda.is_available()  # page-locked: a device's copy runs at the bus's speed
            buf = buffers[key] = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin)
        buf.copy_(src)
        return buf
    if isinstance(value, dict):
        return {k: stage(v, buffers, (*key, k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(stage(v, buffers, (*key, i)) for i, v in enumerate(value))
    return value


def snapshot_or_save(program: Any, path: str) -> Write | None:
    """``program.snapshot(path)`` (the state taken now; the write returned) where the program has one;
    else ``program.save(path)`` now, whole (None: nothing left to write)."""
    snapshot = getattr(program, "snapshot", None)
    if snapshot is None:
        program.save(path)
        return None
    return snapshot(path)


class BackgroundSave:
    """One checkpoint write at a time on a daemon thread (see the module docstring).

    Args:
        background: False: ``submit`` writes before it returns (what a run does when told to save
            synchronously, and what the benchmark compares against).
    """

    def __init__(self, *, background: bool = True) -> None:
        self.background = background
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.what = ""  # the save in flight (or last), for messages

    @property
    def in_flight(self) -> bool:
        """Whether a write is running."""
        return self._thread is not None and self._thread.is_alive()

    def submit(self, write: Callable[[], Any], what: str) -> None:
        """Run ``write`` (the rest of checkpoint ``what``) on the thread, once the previous write is done.

        Raises:
            CheckpointError: the previous write failed.
        """
        self.wait()
        self.what = what
        if not self.background:
            write()
            return

        def run() -> None:
            try:
                write()
            except BaseException as exc:  # noqa: BLE001 - raised on the trainer's side by the next submit / wait
                self._error = exc

        self._thread = threading.Thread(target=run, name="flowrl-checkpoint", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Block until the write in flight (if any) is on disk.

        Raises:
            CheckpointError: it failed (its own error, or one naming ``what``).
        """
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is None:
            return
        if isinstance(error, CheckpointError):
            raise error
        raise CheckpointError(f"writing {self.what} failed in the background ({type(error).__name__}: {error})") from error
