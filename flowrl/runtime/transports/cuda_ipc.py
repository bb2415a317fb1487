"""``CudaIpcTransport``: weights between processes that share a GPU, through CUDA IPC (no copy through the host).

The colocated case verl and NeMo-RL use: the trainer and the generator are processes on the same
GPU. The writer keeps ``slots`` CUDA buffers, each able to hold the whole state, and shares their
CUDA IPC handles once; a reader maps them into its own address space
(``torch.UntypedStorage._new_shared_cuda``, what ``torch.multiprocessing`` does when it unpickles a
CUDA tensor) and copies device to device. Nothing crosses a process boundary as pickle: a handle
travels as a :class:`CudaIpcHandle` (the fields of ``UntypedStorage._share_cuda_()``) in msgspec JSON.

The control plane is a :class:`~flowrl.runtime.transports.shm.SharedMemoryTransport` segment (named
``name``, as every transport that ``needs_segment``), which delivers consistent snapshots of a small
CPU state, the *control block*::

    count    int64[1]       publishes completed; the newest slot is (count - 1) % slots
    seq      int64[slots]   per-slot sequence, odd while the writer fills the slot
    version  int64[slots]   the version each slot holds (-1: none)
    header   uint8[n]       msgspec JSON of an IpcHeader: slots, the state's StateLayout, one CudaIpcHandle per slot

Protocol (a seqlock per slot over GPU memory; 2 slots by default, a double buffer):

- publish number c fills slot c % slots: it sets the slot's seq odd (control block published), copies
  the state into the slot and waits for the copy to finish on the device, then sets the version, the
  seq even and count = c + 1 (control block published again).
- fetch reads the control block, takes the newest slot, checks that its seq is even, copies the slot
  into the target, waits for that copy, and reads the control block again: an unchanged seq means no
  publish touched the slot during the copy; otherwise it copies again. A reader is only disturbed when
  the writer laps it (``slots`` publishes during one copy).

Costs: a publish is one device-to-device copy of the state (the contract lets the trainer change its
weights as soon as publish returns, so the writer cannot lend its live parameters); a fetch is one
device-to-device copy into the target (a cast if the target's dtype differs). Both ends must see the
same physical GPU (``CUDA_VISIBLE_DEVICES`` may number it differently: the reader maps the handle on
its device ``device``, by default the one the writer names).

Example (two processes on one GPU)::

    writer = CudaIpcTransport("flowrl-run1-policy-gen", create=True)     # in the trainer
    writer.publish(dict(model.named_parameters()), version=0)
    reader = CudaIpcTransport("flowrl-run1-policy-gen", create=False)    # in the generator
    reader.fetch_into(dict(gen_model.named_parameters()))                # -> 0
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import msgspec
import torch

from flowrl.errors import TransportError
from flowrl.runtime.transports.base import (
    State,
    StateLayout,
    check_state,
    check_target,
    check_version,
    copy_tensor,
    dtype_from_name,
    layout_of,
)
from flowrl.runtime.transports.registry import TransportTraits
from flowrl.runtime.transports.shm import SharedMemoryTransport, backoff, read_header

__all__ = ["CudaIpcTransport", "CudaIpcHandle", "IpcHeader", "share_storage", "open_storage"]

_ALIGN = 256  # slot sizes rounded up, so that every slot starts aligned for any dtype

#: (handle, offset) -> the buffer this process shared: CUDA cannot open a process's own IPC handle, so a
#: reader in the writer's process uses the buffer itself (as ``torch.multiprocessing``'s ``shared_cache`` does)
_SHARED: weakref.WeakValueDictionary[tuple[bytes, int], torch.Tensor] = weakref.WeakValueDictionary()


class CudaIpcHandle(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
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


class IpcHeader(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a reader needs to map the writer's slots.

    Attributes:
        slots: how many copies of the state the writer keeps.
        slot_nbytes: bytes per slot.
        layout: names, dtypes, shapes and offsets (within a slot) of the tensors.
        handles: one per slot.
    """

    slots: int
    slot_nbytes: int
    layout: StateLayout
    handles: tuple[CudaIpcHandle, ...]


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


def _views(flat: torch.Tensor, layout: StateLayout) -> dict[str, torch.Tensor]:
    return {
        t.name: flat[t.offset : t.offset + t.nbytes].view(dtype_from_name(t.dtype)).view(t.shape)
        for t in layout.tensors
    }


def _need_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise TransportError(f"cuda_ipc: {what} needs a CUDA device and this process sees none; use 'shm' between CPU processes")


def _check_slot_device(device: torch.device, label: str) -> None:
    if device.type != "cuda":
        raise TransportError(f"{label}: device={device} is not a CUDA device; the slots live in GPU memory")


def _synchronize(device: torch.device) -> None:
    """Wait until the copies queued on ``device`` are done (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class CudaIpcTransport:
    """Weights between processes on one GPU through CUDA IPC; see the module docstring.

    Args:
        name: the control segment's name (as ``shm``'s; ``None`` on the creator picks a unique one,
            see ``segment_name``); readers must name it.
        create: ``True`` on the one writer (it owns the slots and the segment), ``False`` on readers.
        slots: copies of the state the writer keeps on the GPU (>= 2).
        device: the writer's CUDA device for the slots (default: that of the first CUDA tensor of the
            first published state, else the current device); on a reader, the index to map the
            handles on (default: the writer's index).
        max_retries: how many times a fetch copies again when the writer lapped it before it gives up.

    Raises:
        TransportError: bad options (the shared-memory segment's checks apply to ``name``).
    """

    name = "cuda_ipc"
    #: processes sharing a GPU: a device-to-device copy into a slot and one out of it, no host copy
    traits = TransportTraits(crosses_processes=True, needs_segment=True, cost="memory", memory_copies=2)

    def __init__(
        self,
        name: str | None = None,
        *,
        create: bool = True,
        slots: int = 2,
        device: int | str | torch.device | None = None,
        max_retries: int = 1000,
    ) -> None:
        if not isinstance(slots, int) or slots < 2:
            raise TransportError(f"cuda_ipc: slots={slots!r} must be an integer >= 2 (a double buffer or more)")
        if not isinstance(max_retries, int) or max_retries < 1:
            raise TransportError(f"cuda_ipc: max_retries={max_retries!r} must be a positive int")
        self._control = SharedMemoryTransport(name, create=create)
        self.segment_name = self._control.segment_name
        self._create = bool(create)
        self._slots = slots
        self._device = None if device is None else torch.device(device if not isinstance(device, int) else f"cuda:{device}")
        self._max_retries = max_retries
        self._lock = threading.Lock()
        self._closed = False
        self._header: IpcHeader | None = None
        self._buffers: list[torch.Tensor] = []  # writer: its slots; reader: the mapped slots
        self._slot_views: list[dict[str, torch.Tensor]] = []
        self._block: dict[str, torch.Tensor] | None = None  # the control block (writer: its state; reader: a fetch target)
        self._control_version = -1
        self._last_version = -1

    @property
    def label(self) -> str:
        return f"cuda_ipc segment {self.segment_name!r}"

    # -- writer side --------------------------------------------------------------------------

    def publish(self, state: State, version: int) -> None:
        """Copy ``state`` into the next slot (device to device) and make it the newest version.

        Raises:
            TransportError: a reader publishes, the version does not increase, the state's layout
                changed, or no CUDA device is there.
        """
        with self._lock:
            self._check_open("publish")
            if not self._create:
                raise TransportError(f"{self.label}: the reader cannot publish; publish on the transport opened with create=True")
            check_version(self.label, version, self._last_version)
            if self._header is None:
                self._make_slots(layout_of(state, transport=self.label), state)
            else:
                check_state(self.label, self._header.layout, state, version)
            block = self._block
            count = int(block["count"][0])
            slot = count % self._slots
            block["seq"][slot] += 1  # odd: being written
            self._send_block()
            with torch.no_grad():
                for k, dst in self._slot_views[slot].items():
                    copy_tensor(dst, state[k])
            _synchronize(self._buffers[slot].device)  # the bytes are in before the slot says so
            block["version"][slot] = version
            block["seq"][slot] += 1  # even: complete
            block["count"][0] = count + 1
            self._send_block()
            self._last_version = version

    def _make_slots(self, layout: StateLayout, state: State) -> None:
        _need_cuda("publish")
        device = self._device or next((t.device for t in state.values() if t.is_cuda), None) or torch.device("cuda", torch.cuda.current_device())
        _check_slot_device(device, self.label)
        nbytes = max(_ALIGN, -(-layout.nbytes // _ALIGN) * _ALIGN)
        self._buffers = [torch.zeros(nbytes, dtype=torch.uint8, device=device) for _ in range(self._slots)]
        self._slot_views = [_views(b, layout) for b in self._buffers]
        header = IpcHeader(slots=self._slots, slot_nbytes=nbytes, layout=layout, handles=tuple(share_storage(b) for b in self._buffers))
        encoded = msgspec.json.encode(header)
        self._header = header
        self._block = {
            "count": torch.zeros(1, dtype=torch.int64),
            "seq": torch.zeros(self._slots, dtype=torch.int64),
            "version": torch.full((self._slots,), -1, dtype=torch.int64),
            "header": torch.frombuffer(bytearray(encoded), dtype=torch.uint8),
        }

    def _send_block(self) -> None:
        self._control_version += 1
        self._control.publish(self._block, self._control_version)

    # -- reader side --------------------------------------------------------------------------

    def _read_block(self) -> bool:
        """Refresh the control block (reader); False while the writer has published nothing."""
        if self._block is None:
            if not os.path.exists(self._control.path):
                return False
            layout = read_header(self._control.path).layout
            self._block = {t.name: torch.zeros(t.shape, dtype=dtype_from_name(t.dtype)) for t in layout.tensors}
        return self._control.fetch_into(self._block) is not None

    def _attach(self) -> None:
        """Map the writer's slots (once, after the first control block arrived)."""
        if self._header is not None:
            return
        _need_cuda("fetch_into")
        try:
            header = msgspec.json.decode(self._block["header"].numpy().tobytes(), type=IpcHeader)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise TransportError(f"{self.label}: unreadable IPC header ({exc}); is the writer a flowrl cuda_ipc transport of this version?") from exc
        index = self._device.index if self._device is not None else None
        self._buffers = [open_storage(h, index) for h in header.handles]
        self._slot_views = [_views(b, header.layout) for b in self._buffers]
        self._header = header

    def latest_version(self) -> int:
        self._check_open("latest_version")
        if self._create:
            return self._last_version
        with self._lock:
            if not self._read_block():
                return -1
            count = int(self._block["count"][0])
            return -1 if count == 0 else int(self._block["version"][(count - 1) % self._slots_of()])

    def _slots_of(self) -> int:
        return int(self._block["seq"].numel())

    def fetch_into(self, target: Mapping[str, torch.Tensor], *, newer_than: int = -1) -> int | None:
        """Copy the newest version into ``target`` (device to device; see the protocol) and return it.

        Returns None if nothing newer than ``newer_than`` is there.

        Raises:
            TransportError: ``target`` does not match the layout (nothing written); the writer lapped
                ``max_retries`` copies in a row (``target`` holds a mix and must be fetched again); or
                the writer's memory cannot be mapped.
        """
        self._check_open("fetch_into")
        with self._lock, torch.no_grad():
            if self._create:  # the writer reads its own slots (the conformance suite's one-object pair)
                return self._fetch_own(target, newer_than)
            checked = False
            for attempt in range(self._max_retries):
                if not self._read_block():
                    return None
                count = int(self._block["count"][0])
                if count == 0:
                    return None
                slot = (count - 1) % self._slots_of()
                seq, version = int(self._block["seq"][slot]), int(self._block["version"][slot])
                if seq % 2:
                    backoff(attempt)
                    continue
                if version <= newer_than:
                    return None
                self._attach()
                if not checked:
                    check_target(self.label, self._header.layout, target)
                    checked = True
                for k, src in self._slot_views[slot].items():
                    copy_tensor(target[k], src)
                _synchronize(self._buffers[slot].device)
                self._read_block()
                if int(self._block["seq"][slot]) == seq:
                    return version
                backoff(attempt)  # the writer lapped us: copy again
            raise TransportError(
                f"{self.label}: no consistent read in {self._max_retries} attempts: the writer overwrote the slot being read "
                f"every time; open the writer with more slots, or publish less often"
            )

    def _fetch_own(self, target: Mapping[str, torch.Tensor], newer_than: int) -> int | None:
        if self._header is None or self._last_version <= newer_than:
            return None
        check_target(self.label, self._header.layout, target)
        slot = (int(self._block["count"][0]) - 1) % self._slots
        for k, src in self._slot_views[slot].items():
            copy_tensor(target[k], src)
        _synchronize(self._buffers[slot].device)
        return self._last_version

    # -- both ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Drop the slots (a reader unmaps them; the writer's memory is freed once no reader maps it) and
        the control segment (the writer unlinks it). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._slot_views = []
            self._buffers = []
            self._control.close()

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise TransportError(f"{self.label}: {op}() called after close(); open a new transport")

