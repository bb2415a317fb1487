"""``CudaIpcTransport``: weights between processes that share a GPU, through CUDA IPC (no copy through the host).

The colocated case verl and NeMo-RL use: the trainer and the generator are processes on the same
GPU. The writer keeps ``slots`` CUDA buffers, each able to hold the whole state, and shares their
CUDA IPC handles once; a reader maps them into its own address space
(``torch.UntypedStorage._new_shared_cuda``, what ``torch.multiprocessing`` does when it unpickles a
CUDA tensor) and copies device to device. Nothing crosses a process boundary as pickle: a handle
travels as a :class:`CudaIpcHandle` (the fields of ``UntypedStorage._share_cuda_()``) in msgspec JSON.

What the slots are made of is a seam (``slot_memory.py``): ``memory="cuda"`` (the default) is the
above; ``memory="host"`` keeps them in POSIX shared memory, one ``/dev/shm`` file per slot named by a
:class:`HostSlotHandle`, so that the whole protocol (two processes, the control block, attach, the
seqlock, close) runs and is tested on a machine without a GPU, and serves as a CPU fallback. Only the
writer chooses: a reader learns the kind from the header.

The control plane is a :class:`~flowrl.runtime.transports.shm.SharedMemoryTransport` segment (named
``name``, as every transport that ``needs_segment``), which delivers consistent snapshots of a small
CPU state, the *control block*::

    count    int64[1]       publishes completed; the newest slot is (count - 1) % slots
    seq      int64[slots]   per-slot sequence, odd while the writer fills the slot
    version  int64[slots]   the version each slot holds (-1: none)
    closed   int64[1]       1 once the writer closed: its slots are going away
    header   uint8[n]       msgspec JSON of an IpcHeader: slots, the state's StateLayout, one handle per slot

Protocol (a seqlock per slot over the slot memory; 2 slots by default, a double buffer):

- publish number c fills slot c % slots: it sets the slot's seq odd (control block published), copies
  the state into the slot and waits for the copy to finish (on the device; a fence on the host), then
  sets the version, the seq even and count = c + 1 (control block published again).
- fetch reads the control block (a consistent snapshot, so the newest slot's seq is even: the slot
  being written is count % slots, never the newest), copies the newest slot into the target, waits for
  that copy, and reads the control block again: an unchanged seq means no publish touched the slot
  during the copy (the writer marks it odd before its first byte); otherwise it copies again, up to
  ``max_retries`` times. A reader is only disturbed when the writer laps it (``slots`` publishes
  during one copy, or ``slots - 1`` and the start of the next).
- close on the writer publishes ``closed = 1``, then frees its slots (CUDA: once no reader maps them;
  host: the files are unlinked) and unlinks the control segment. A reader that had attached then gets a
  ``TransportError`` saying so from ``fetch_into`` and ``latest_version``; one that attaches only after
  the close finds no segment and sees ``-1`` / ``None``, as before the first publish.

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
from collections.abc import Mapping
from typing import Literal

import msgspec
import torch

from flowrl.errors import TransportError
from flowrl.runtime.transports.weight_transport import (
    State,
    StateLayout,
    check_state,
    check_target,
    check_version,
    copy_tensor,
    dtype_from_name,
    layout_of,
)
from flowrl.transport_traits import BUILTINS
from flowrl.runtime.transports.shm import SharedMemoryTransport, backoff, read_header
from flowrl.runtime.transports.slot_memory import (
    CudaIpcHandle,
    CudaSlots,
    HostSlotHandle,
    HostSlots,
    SlotHandle,
    SlotMemory,
    open_slots,
    open_storage,
    share_storage,
    slot_nbytes,
)

__all__ = ["CudaIpcTransport", "CudaIpcHandle", "HostSlotHandle", "IpcHeader", "share_storage", "open_storage"]

MEMORIES = ("cuda", "host")


class IpcHeader(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a reader needs to map the writer's slots.

    Attributes:
        slots: how many copies of the state the writer keeps.
        slot_nbytes: bytes per slot.
        layout: names, dtypes, shapes and offsets (within a slot) of the tensors.
        handles: one per slot, all of one slot memory (their ``memory`` tag: ``cuda`` or ``host``).
    """

    slots: int
    slot_nbytes: int
    layout: StateLayout
    handles: tuple[SlotHandle, ...]


def _slots_of(block: dict[str, torch.Tensor]) -> int:
    """How many slots the writer keeps, from its control block (one seq per slot)."""
    return int(block["seq"].numel())


def _views(flat: torch.Tensor, layout: StateLayout) -> dict[str, torch.Tensor]:
    return {
        t.name: flat[t.offset : t.offset + t.nbytes].view(dtype_from_name(t.dtype)).view(t.shape)
        for t in layout.tensors
    }


class CudaIpcTransport:
    """Weights between processes on one GPU through CUDA IPC; see the module docstring.

    Args:
        name: the control segment's name (as ``shm``'s; ``None`` on the creator picks a unique one,
            see ``segment_name``); readers must name it.
        create: ``True`` on the one writer (it owns the slots and the segment), ``False`` on readers.
        slots: copies of the state the writer keeps on the GPU (>= 2).
        memory: what the writer's slots are made of: ``"cuda"`` (GPU memory shared by IPC handles) or
            ``"host"`` (POSIX shared memory: the protocol's CPU test double and fallback). A reader
            follows the writer's header and ignores it.
        device: the writer's CUDA device for the slots (default: that of the first CUDA tensor of the
            first published state, else the current device); on a reader, the index to map the
            handles on (default: the writer's index). Only for ``memory="cuda"``.
        max_retries: how many times a fetch copies again when the writer lapped it before it gives up.

    Raises:
        TransportError: bad options (the shared-memory segment's checks apply to ``name``).

    Example (``memory="host"``, so that it runs anywhere; both ends would be separate processes):
        >>> writer = CudaIpcTransport(create=True, memory="host")
        >>> reader = CudaIpcTransport(writer.segment_name, create=False)
        >>> reader.latest_version()
        -1
        >>> writer.publish({"w": torch.ones(2)}, version=0)
        >>> target = {"w": torch.zeros(2)}
        >>> reader.fetch_into(target), target["w"].tolist()
        (0, [1.0, 1.0])
        >>> writer.close()
        >>> reader.latest_version()  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        flowrl.errors.TransportError: cuda_ipc segment '...': the writer closed the edge (its last version was 0) ...
        >>> reader.close()
    """

    name = "cuda_ipc"
    #: processes sharing a GPU: a device-to-device copy into a slot and one out of it, no host copy
    traits = BUILTINS["cuda_ipc"]

    def __init__(
        self,
        name: str | None = None,
        *,
        create: bool = True,
        slots: int = 2,
        memory: Literal["cuda", "host"] = "cuda",
        device: int | str | torch.device | None = None,
        max_retries: int = 1000,
    ) -> None:
        if not isinstance(slots, int) or slots < 2:
            raise TransportError(f"cuda_ipc: slots={slots!r} must be an integer >= 2 (a double buffer or more)")
        if not isinstance(max_retries, int) or max_retries < 1:
            raise TransportError(f"cuda_ipc: max_retries={max_retries!r} must be a positive int")
        if memory not in MEMORIES:
            raise TransportError(f"cuda_ipc: memory={memory!r} is not one of {MEMORIES}; 'cuda' shares GPU memory, 'host' POSIX shared memory")
        if memory == "host" and device is not None:
            raise TransportError(f"cuda_ipc: device={device!r} applies to memory='cuda' only; host slots live in /dev/shm")
        self._control = SharedMemoryTransport(name, create=create)
        self.segment_name = self._control.segment_name
        self._create = bool(create)
        self._slots = slots
        self._device = None if device is None else torch.device(device if not isinstance(device, int) else f"cuda:{device}")
        self._memory: SlotMemory | None = None
        if self._create:
            self._memory = HostSlots(self.label, self._control.path) if memory == "host" else CudaSlots(self.label, self._device)
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
                changed, or no CUDA device is there (``memory="cuda"``).
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
            block, memory = self._block, self._memory
            assert block is not None and memory is not None  # a writer's memory is made in __init__, its block by _make_slots
            count = int(block["count"][0])
            slot = count % self._slots
            block["seq"][slot] += 1  # odd: being written
            self._send_block()
            with torch.no_grad():
                for k, dst in self._slot_views[slot].items():
                    copy_tensor(dst, state[k])
            memory.wait(self._buffers[slot])  # the bytes are in before the slot says so
            block["version"][slot] = version
            block["seq"][slot] += 1  # even: complete
            block["count"][0] = count + 1
            self._send_block()
            self._last_version = version

    def _make_slots(self, layout: StateLayout, state: State) -> None:
        assert self._memory is not None  # the writer's slot memory is made in __init__
        nbytes = slot_nbytes(layout.nbytes)
        handles: tuple[SlotHandle, ...]
        self._buffers, handles = self._memory.allocate(self._slots, nbytes, state)
        self._slot_views = [_views(b, layout) for b in self._buffers]
        header = IpcHeader(slots=self._slots, slot_nbytes=nbytes, layout=layout, handles=handles)
        encoded = msgspec.json.encode(header)
        self._header = header
        self._block = {
            "count": torch.zeros(1, dtype=torch.int64),
            "seq": torch.zeros(self._slots, dtype=torch.int64),
            "version": torch.full((self._slots,), -1, dtype=torch.int64),
            "closed": torch.zeros(1, dtype=torch.int64),
            "header": torch.frombuffer(bytearray(encoded), dtype=torch.uint8),
        }

    def _send_block(self) -> None:
        assert self._block is not None  # made by the writer's first publish, before any send
        self._control_version += 1
        self._control.publish(self._block, self._control_version)

    # -- reader side --------------------------------------------------------------------------

    def _read_block(self) -> dict[str, torch.Tensor] | None:
        """Refresh the control block (reader) and return it; None while the writer has published nothing.

        Raises:
            TransportError: the writer has closed the edge.
        """
        if self._block is None:
            if not os.path.exists(self._control.path):
                return None
            layout = read_header(self._control.path).layout
            self._block = {t.name: torch.zeros(t.shape, dtype=dtype_from_name(t.dtype)) for t in layout.tensors}
        block = self._block
        if self._control.fetch_into(block) is None:
            return None
        if int(block["closed"][0]):
            count = int(block["count"][0])
            last = int(block["version"][(count - 1) % _slots_of(block)]) if count else -1
            raise TransportError(
                f"{self.label}: the writer closed the edge (its last version was {last}) and its slots are going away; "
                "close this reader, and open a new one once a new writer publishes"
            )
        return block

    def _attach(self, block: dict[str, torch.Tensor]) -> tuple[IpcHeader, SlotMemory]:
        """Map the writer's slots (once, from the first control block that arrived); the header and the memory."""
        if self._header is not None and self._memory is not None:
            return self._header, self._memory
        try:
            header = msgspec.json.decode(block["header"].numpy().tobytes(), type=IpcHeader)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise TransportError(f"{self.label}: unreadable IPC header ({exc}); is the writer a flowrl cuda_ipc transport of this version?") from exc
        memory, self._buffers = open_slots(header.handles, self.label, self._device)
        self._memory = memory
        self._slot_views = [_views(b, header.layout) for b in self._buffers]
        self._header = header
        return header, memory

    def latest_version(self) -> int:
        """The newest version published, ``-1`` if none (or no writer yet).

        Raises:
            TransportError: after ``close()``, or (a reader) once the writer closed the edge.
        """
        self._check_open("latest_version")
        if self._create:
            return self._last_version
        with self._lock:
            block = self._read_block()
            if block is None:
                return -1
            count = int(block["count"][0])
            return -1 if count == 0 else int(block["version"][(count - 1) % _slots_of(block)])

    def fetch_into(self, target: Mapping[str, torch.Tensor], *, newer_than: int = -1) -> int | None:
        """Copy the newest version into ``target`` (device to device; see the protocol) and return it.

        Returns None if nothing newer than ``newer_than`` is there.

        Raises:
            TransportError: ``target`` does not match the layout (nothing written); the writer lapped
                ``max_retries`` copies in a row (``target`` holds a mix and must be fetched again); the
                writer closed the edge; or the writer's memory cannot be mapped.
        """
        self._check_open("fetch_into")
        with self._lock, torch.no_grad():
            if self._create:  # the writer reads its own slots
                return self._fetch_own(target, newer_than)
            checked = False
            for attempt in range(self._max_retries):
                block = self._read_block()
                if block is None:
                    return None
                count = int(block["count"][0])
                if count == 0:
                    return None
                slot = (count - 1) % _slots_of(block)
                # even: the control block is a consistent snapshot, and the slot being written is count % slots
                seq, version = int(block["seq"][slot]), int(block["version"][slot])
                if version <= newer_than:
                    return None
                header, memory = self._attach(block)
                if not checked:
                    check_target(self.label, header.layout, target)
                    checked = True
                for k, src in self._slot_views[slot].items():
                    copy_tensor(target[k], src)
                memory.wait(self._buffers[slot])
                after = self._read_block()  # the same block, refreshed (it was there a moment ago)
                if after is not None and int(after["seq"][slot]) == seq:
                    return version
                backoff(attempt)  # the writer lapped us: copy again
            raise TransportError(
                f"{self.label}: no consistent read in {self._max_retries} attempts: the writer overwrote the slot being read "
                f"every time; open the writer with more slots, or publish less often"
            )

    def _fetch_own(self, target: Mapping[str, torch.Tensor], newer_than: int) -> int | None:
        if self._header is None or self._last_version <= newer_than:
            return None
        assert self._block is not None and self._memory is not None  # made in __init__ and with the header
        check_target(self.label, self._header.layout, target)
        slot = (int(self._block["count"][0]) - 1) % self._slots
        for k, src in self._slot_views[slot].items():
            copy_tensor(target[k], src)
        self._memory.wait(self._buffers[slot])
        return self._last_version

    # -- both ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Drop the slots and the control segment. The writer first tells attached readers it closed
        (``closed = 1``), then frees its slots (CUDA: once no reader maps them; host: unlinks the files)
        and unlinks the segment; a reader unmaps. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._create and self._block is not None:
                self._block["closed"][0] = 1
                self._send_block()
            self._slot_views = []
            self._buffers = []
            if self._memory is not None:
                self._memory.close()
            self._control.close()

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise TransportError(f"{self.label}: {op}() called after close(); open a new transport")
