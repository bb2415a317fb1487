"""Where ``CudaIpcTransport`` keeps its slots: GPU memory shared through CUDA IPC, or host shared memory.

The transport's protocol (a control block, a seqlock per slot; see ``cuda_ipc.py``) does not care
what the slots are made of; a *slot memory* does the four things that do:

- ``allocate(count, nbytes, state)`` (writer): ``count`` flat ``uint8`` buffers of ``nbytes`` each,
  and one handle per buffer that a reader in another process can map;
- ``open(handle)`` (reader): map one handle as a flat ``uint8`` tensor;
- ``wait(buffer)``: return once the copies queued into or out of ``buffer`` are done, and order
  them before the control words that follow;
- ``close()``: drop the buffers (the writer also frees or unlinks them).

Two kinds, told apart by their handle (a tagged msgspec union, so a reader learns the kind from the
header and never needs an option; no pickle crosses the process boundary):

==========  =====================  ================================================================
memory      handle                 what it is
==========  =====================  ================================================================
``cuda``    :class:`CudaIpcHandle`  GPU buffers shared with ``UntypedStorage._share_cuda_()`` and
                                   mapped with ``_new_shared_cuda`` (what ``torch.multiprocessing``
                                   does for a CUDA tensor); ``wait`` is ``torch.cuda.synchronize``.
``host``    :class:`HostSlotHandle` one POSIX shared-memory file per slot (``<segment>.slot<i>``
                                   beside the control segment in ``/dev/shm``), created by the
                                   writer, ``mmap``-ed by readers, unlinked by the writer at close,
                                   garbage collection or exit; ``wait`` is a memory fence.
==========  =====================  ================================================================

``host`` runs the whole transport (two processes, the seqlock, attach, close) on any machine: it is
the protocol's test double where there is no GPU, and works as a CPU fallback, at the cost of ``shm``
(which keeps its slots in one segment with the control words).
"""

from __future__ import annotations

import mmap
import os
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
import torch

from flowrl.errors import TransportError
from flowrl.runtime.transports.shm import fence, unlink_quietly

__all__ = [
    "CudaIpcHandle",
    "HostSlotHandle",
    "SlotHandle",
    "CudaSlots",
    "HostSlots",
    "SlotMemory",
    "open_slots",
    "slot_nbytes",
    "share_storage",
    "open_storage",
]

_ALIGN = 256  # slot sizes rounded up, so that every slot starts aligned for any dtype

#: (handle, offset) -> the buffer this process shared: CUDA cannot open a process's own IPC handle, so a
#: reader in the writer's process uses the buffer itself (as ``torch.multiprocessing``'s ``shared_cache`` does)
_SHARED: weakref.WeakValueDictionary[tuple[bytes, int], torch.Tensor] = weakref.WeakValueDictionary()


class CudaIpcHandle(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="memory", tag="cuda"):
    """One CUDA allocation as another process maps it: the fields of ``UntypedStorage._share_cuda_()``.

    Attributes:
        device: the CUDA device index in the writer's numbering.
        handle: the ``cudaIpcMemHandle_t`` of the allocation (opaque bytes).
        size_bytes: the storage's size.
        offset_bytes: the storage's offset in the allocation (the caching allocator packs storages).
        ref_counter_handle: the shared-memory file of torch's producer/consumer reference counter.
        ref_counter_offset: this storage's counter in that file.
        event_handle: a ``cudaIpcEventHandle_t`` the consumer waits on before using the memory, if any.
        event_sync_required: whether the consumer must wait on ``event_handle``.
    """

    device: int
    handle: bytes
    size_bytes: int
    offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None = None
    event_sync_required: bool = False

    @classmethod
    def from_share_tuple(cls, fields: tuple[Any, ...]) -> CudaIpcHandle:
        """From the 8-tuple ``UntypedStorage._share_cuda_()`` returns.

        Raises:
            TransportError: if it is not such a tuple (another torch version's layout).
        """
        if len(fields) != 8:
            raise TransportError(
                f"cuda_ipc: UntypedStorage._share_cuda_() returned {len(fields)} fields, expected 8 "
                f"(device, handle, size, offset, ref counter handle, ref counter offset, event handle, event sync); "
                f"this torch ({torch.__version__}) shares CUDA memory differently"
            )
        device, handle, size, offset, ref_handle, ref_offset, event, sync = fields
        return cls(
            device=int(device), handle=bytes(handle), size_bytes=int(size), offset_bytes=int(offset),
            ref_counter_handle=bytes(ref_handle), ref_counter_offset=int(ref_offset),
            event_handle=None if event is None else bytes(event), event_sync_required=bool(sync),
        )

    def new_shared_args(self, device: int | None = None) -> tuple[Any, ...]:
        """The arguments of ``UntypedStorage._new_shared_cuda`` that map this allocation (on ``device``,
        by default the writer's index)."""
        return (
            self.device if device is None else device, self.handle, self.size_bytes, self.offset_bytes,
            self.ref_counter_handle, self.ref_counter_offset, self.event_handle, self.event_sync_required,
        )


class HostSlotHandle(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="memory", tag="host"):
    """One slot in host shared memory, as a reader on the same machine maps it.

    Attributes:
        path: the slot's file (in ``/dev/shm``, beside the control segment).
        size_bytes: its size.
    """

    path: str
    size_bytes: int


#: a slot's handle: its type says the slot memory (the ``memory`` tag in JSON)
SlotHandle = CudaIpcHandle | HostSlotHandle


def slot_nbytes(layout_nbytes: int) -> int:
    """Bytes per slot for a state of ``layout_nbytes``: rounded up to ``_ALIGN``, at least ``_ALIGN``."""
    return max(_ALIGN, -(-layout_nbytes // _ALIGN) * _ALIGN)


# --- CUDA ------------------------------------------------------------------------------------------


def share_storage(buffer: torch.Tensor) -> CudaIpcHandle:
    """The IPC handle of ``buffer``'s storage (a flat CUDA tensor over all of it), for another process to
    map with :func:`open_storage`."""
    handle = CudaIpcHandle.from_share_tuple(buffer.untyped_storage()._share_cuda_())
    _SHARED[(handle.handle, handle.offset_bytes)] = buffer
    return handle


def open_storage(handle: CudaIpcHandle, device: int | None = None) -> torch.Tensor:
    """Map a storage another process shared (:func:`share_storage`) as a flat ``uint8`` CUDA tensor.

    Raises:
        TransportError: if CUDA cannot open the handle (another GPU, a writer that exited).
    """
    index = handle.device if device is None else device
    own = _SHARED.get((handle.handle, handle.offset_bytes))
    if own is not None:  # shared by this very process
        return own
    try:
        torch.cuda._lazy_init()
        storage = torch.UntypedStorage._new_shared_cuda(*handle.new_shared_args(index))
    except Exception as exc:  # RuntimeError from CUDA
        raise TransportError(
            f"cuda_ipc: could not map the writer's CUDA memory on cuda:{index} ({type(exc).__name__}: {exc}); "
            "both processes must see the same GPU and the writer must still be running"
        ) from exc
    flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}")
    return flat.set_(storage, 0, (handle.size_bytes,), (1,))


def _need_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise TransportError(
            f"cuda_ipc: {what} needs a CUDA device and this process sees none; use 'shm' between CPU processes "
            f"(or memory='host', this transport's CPU form)"
        )


class CudaSlots:
    """Slots in GPU memory, shared through CUDA IPC handles (``memory="cuda"``).

    Args:
        label: the transport's label, for errors.
        device: the writer's CUDA device for the slots (default: that of the first CUDA tensor of the
            first published state, else the current device); on a reader, the index to map the
            handles on (default: the writer's index).
    """

    def __init__(self, label: str, device: torch.device | None = None) -> None:
        self.label = label
        self.device = device

    def allocate(self, count: int, nbytes: int, state: Mapping[str, torch.Tensor]) -> tuple[list[torch.Tensor], tuple[CudaIpcHandle, ...]]:
        """``count`` zeroed GPU buffers of ``nbytes`` and their IPC handles.

        Raises:
            TransportError: no CUDA device, or ``device`` is not a CUDA device.
        """
        _need_cuda("publish")
        device = self.device or next((t.device for t in state.values() if t.is_cuda), None) or torch.device("cuda", torch.cuda.current_device())
        if device.type != "cuda":
            raise TransportError(f"{self.label}: device={device} is not a CUDA device; the slots live in GPU memory")
        buffers = [torch.zeros(nbytes, dtype=torch.uint8, device=device) for _ in range(count)]
        return buffers, tuple(share_storage(b) for b in buffers)

    def open(self, handle: CudaIpcHandle) -> torch.Tensor:
        """Map the writer's buffer (on ``device``'s index if given).

        Raises:
            TransportError: no CUDA device here, or CUDA cannot open the handle.
        """
        _need_cuda("fetch_into")
        return open_storage(handle, None if self.device is None else self.device.index)

    def wait(self, buffer: torch.Tensor) -> None:
        """Wait until the copies queued on ``buffer``'s device are done."""
        torch.cuda.synchronize(buffer.device)

    def close(self) -> None:
        """Nothing to unlink: a writer's memory is freed once no reader maps it (torch's IPC ref counter)."""


# --- host shared memory ----------------------------------------------------------------------------


class HostSlots:
    """Slots in host shared memory, one file per slot (``memory="host"``); see the module docstring.

    Args:
        label: the transport's label, for errors.
        base_path: the control segment's path; slot i is ``<base_path>.slot<i>``.
    """

    def __init__(self, label: str, base_path: str = "") -> None:
        self.label = label
        self.base_path = base_path
        self._maps: list[mmap.mmap] = []
        self._finalizers: list[weakref.finalize] = []

    def allocate(self, count: int, nbytes: int, state: Mapping[str, torch.Tensor]) -> tuple[list[torch.Tensor], tuple[HostSlotHandle, ...]]:
        """Create ``count`` zeroed slot files of ``nbytes`` and map them.

        Raises:
            TransportError: a slot file exists already (another writer's, or a crashed run's).
        """
        buffers, handles = [], []
        for i in range(count):
            path = f"{self.base_path}.slot{i}"
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                raise TransportError(
                    f"{self.label}: slot file {path!r} already exists: another transport uses this name, or a crashed run "
                    f"left it behind; pick another name, or delete the file if no process uses it"
                ) from None
            self._finalizers.append(weakref.finalize(self, unlink_quietly, path, os.getpid()))
            try:
                os.ftruncate(fd, nbytes)
                self._maps.append(mmap.mmap(fd, nbytes))
            finally:
                os.close(fd)
            buffers.append(torch.frombuffer(self._maps[-1], dtype=torch.uint8))
            handles.append(HostSlotHandle(path=path, size_bytes=nbytes))
        return buffers, tuple(handles)

    def open(self, handle: HostSlotHandle) -> torch.Tensor:
        """Map the writer's slot file.

        Raises:
            TransportError: the file is gone (the writer closed or exited) or has another size.
        """
        try:
            fd = os.open(handle.path, os.O_RDWR)
        except FileNotFoundError:
            raise TransportError(
                f"{self.label}: slot file {handle.path!r} is gone: the writer closed the edge or exited; "
                "open the reader while the writer runs"
            ) from None
        try:
            size = os.fstat(fd).st_size
            if size != handle.size_bytes:
                raise TransportError(f"{self.label}: slot file {handle.path!r} has {size} bytes, its handle says {handle.size_bytes}; it is not this writer's")
            self._maps.append(mmap.mmap(fd, size))
        finally:
            os.close(fd)
        return torch.frombuffer(self._maps[-1], dtype=torch.uint8)

    def wait(self, buffer: torch.Tensor) -> None:
        """Order the copies (done when ``copy_`` returns, on the CPU) before the control words that follow."""
        fence()

    def close(self) -> None:
        """Unmap the slots (the caller dropped its views first); the writer unlinks its files."""
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a view escaped (e.g. in a traceback); the mapping goes when it does
                pass
        self._maps.clear()
        for f in self._finalizers:
            f()
        self._finalizers.clear()


SlotMemory = CudaSlots | HostSlots


def open_slots(handles: tuple[SlotHandle, ...], label: str, device: torch.device | None) -> tuple[SlotMemory, list[torch.Tensor]]:
    """Map every slot a writer's header names (reader), with the slot memory their handles' type says.

    Raises:
        TransportError: the handles are of two kinds (no flowrl writer makes such a header), or one
            cannot be mapped (the memory opened so far is closed first).
    """
    host = [h for h in handles if isinstance(h, HostSlotHandle)]
    cuda = [h for h in handles if isinstance(h, CudaIpcHandle)]
    if host and cuda:
        raise TransportError(
            f"{label}: the writer's header mixes {len(cuda)} cuda and {len(host)} host slot handles; "
            "a flowrl writer keeps all its slots in one memory: is the writer a flowrl cuda_ipc transport of this version?"
        )
    if host:
        host_memory = HostSlots(label)
        return host_memory, _open_all(host_memory, lambda: [host_memory.open(h) for h in host])
    cuda_memory = CudaSlots(label, device)
    return cuda_memory, _open_all(cuda_memory, lambda: [cuda_memory.open(h) for h in cuda])


def _open_all(memory: SlotMemory, open_them: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
    """``open_them()``, closing ``memory`` (what it mapped so far) if one handle cannot be opened."""
    try:
        return open_them()
    except TransportError:
        memory.close()
        raise
