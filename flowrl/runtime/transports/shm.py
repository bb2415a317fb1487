"""``SharedMemoryTransport``: weights between processes of one machine, in a named shared-memory segment.

The segment is a file in ``/dev/shm`` (POSIX shared memory on Linux: what ``shm_open`` opens),
created and ``mmap``-ed with plain ``os`` calls rather than ``multiprocessing.shared_memory``: on
Python < 3.13 that class registers every *attaching* process with the resource tracker, which then
unlinks the writer's segment when a reader exits and prints leak warnings; here only the creator
owns the segment, and nothing else tracks it. Tensors are ``torch.frombuffer`` views of the mapping,
so a publish and a fetch are one ``copy_`` each.

Segment layout (little-endian int64 control words, then a msgspec-JSON header, then data)::

    [0, 4096)          control words: MAGIC, header length, slot count, publish count,
                       then per slot i at word 8 + 2*i: seq (odd while written), version
    [4096, +hdr)       ShmHeader (msgspec JSON): slots, slot_nbytes, data_offset, StateLayout
    [data_offset, ...) ``slots`` slots of ``slot_nbytes`` each; tensor t of slot i at
                       data_offset + i*slot_nbytes + t.offset

Protocol (a seqlock per slot; ``slots`` = 2 by default, a double buffer):

- publish number c (c = 0, 1, ...) writes slot c % slots: seq += 1 (odd), copy the tensors, set the
  slot's version, seq += 1 (even), then publish count = c + 1, which makes that slot the newest.
- fetch reads the publish count, takes the newest slot, reads its seq (retries while odd), copies
  the tensors into the target, and reads seq again: equal means no publish touched the slot during
  the copy, so every tensor is from the version it returns; otherwise it retries. A reader is only
  disturbed when the writer laps it (``slots`` publishes during one copy).

The creator makes the segment at its first publish (its size depends on the state), under a
temporary name that it then hard-links to the final one, so a reader never maps a half-initialised
segment; readers attach lazily by name, and see ``-1`` until then. The creator unlinks the segment at
``close()``, on garbage collection, or at interpreter exit, whichever comes first (never in a forked
child). A creator killed with SIGKILL leaves the file behind: the process backend removes it.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
import uuid
import weakref
from collections.abc import Mapping

import msgspec
import numpy as np
import torch

from flowrl.errors import TransportError
from flowrl.runtime.transports.weight_transport import (
    StateLayout,
    State,
    check_state,
    check_target,
    check_version,
    copy_tensor,
    dtype_from_name,
    layout_of,
)
from flowrl.transport_traits import BUILTINS

__all__ = ["SharedMemoryTransport", "ShmHeader", "read_header", "backoff", "fence", "unlink_quietly"]

MAGIC = 0x3157_5452_4C57_4F46  # b"FOWLRTW1" read as little-endian int64: a flowrl weight segment, format 1
_W_MAGIC, _W_HEADER_LEN, _W_SLOTS, _W_COUNT = 0, 1, 2, 3
_CONTROL_BYTES = 4096
_MAX_SLOTS = (_CONTROL_BYTES // 8 - 8) // 2
_PAGE = 4096


def _seq_word(slot: int) -> int:
    return 8 + 2 * slot


def _version_word(slot: int) -> int:
    return 9 + 2 * slot


class ShmHeader(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The segment's self-description, so a reader needs only its name.

    Attributes:
        slots: how many copies of the state the segment holds.
        slot_nbytes: bytes per slot (the layout's size rounded up to a page).
        data_offset: byte offset of slot 0.
        layout: names, dtypes, shapes and offsets (within a slot) of the tensors.
    """

    slots: int
    slot_nbytes: int
    data_offset: int
    layout: StateLayout


_fence_lock = threading.Lock()


def fence() -> None:
    """A full memory barrier (a mutex acquire + release) between seqlock control and data accesses.

    x86 already keeps stores (and loads) in program order; this keeps the protocol right on weaker
    memory models (ARM) too, at ~100 ns per call.
    """
    with _fence_lock:
        pass


def unlink_quietly(path: str, pid: int) -> None:
    """Remove the file at ``path`` if this is process ``pid`` (a finalizer's body) and it is still there."""
    if os.getpid() == pid:  # a forked child must not remove its parent's segment
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class _Mapping:
    """An open segment: the mmap, the control words and per-slot tensor views."""

    def __init__(self, mm: mmap.mmap, header: ShmHeader) -> None:
        self.mm = mm
        self.header = header
        self.control = np.frombuffer(mm, dtype=np.int64, count=_CONTROL_BYTES // 8)
        base = torch.frombuffer(mm, dtype=torch.uint8)
        self.slots: list[dict[str, torch.Tensor]] = []
        for i in range(header.slots):
            start = header.data_offset + i * header.slot_nbytes
            views = {}
            for t in header.layout.tensors:
                raw = base[start + t.offset : start + t.offset + t.nbytes]
                views[t.name] = raw.view(dtype_from_name(t.dtype)).view(t.shape)
            self.slots.append(views)

    def close(self) -> None:
        self.slots.clear()
        del self.control
        try:
            self.mm.close()
        except BufferError:  # a view escaped (e.g. in a traceback); the mapping goes when it does
            pass


class SharedMemoryTransport:
    """Weights between processes on one machine through a named shared-memory segment.

    Args:
        name: the segment's name (a file name in ``directory``). ``None`` on the creator picks a
            unique one (see ``segment_name``); readers must name it.
        create: ``True`` on the one writer (it creates, owns and unlinks the segment), ``False`` on
            readers, which attach by name and may only fetch.
        slots: copies of the state the creator keeps (>= 2): more slots let a slow reader survive
            more publishes during one copy, at the cost of memory.
        directory: where segments live; ``/dev/shm`` by default (the temp directory where that
            does not exist, which still shares pages through the page cache).
        max_retries: how many times a fetch retries when the writer overwrote the slot it was
            copying before it gives up with ``TransportError``.

    Raises:
        TransportError: bad options; the creator's name is taken by an existing segment.

    Example:
        >>> writer = SharedMemoryTransport(create=True)
        >>> reader = SharedMemoryTransport(writer.segment_name, create=False)  # e.g. in another process
        >>> reader.latest_version()
        -1
        >>> writer.publish({"w": torch.ones(2)}, version=0)
        >>> target = {"w": torch.zeros(2)}
        >>> reader.fetch_into(target), target["w"].tolist()
        (0, [1.0, 1.0])
        >>> reader.close(); writer.close()
    """

    name = "shm"
    #: a named shared-memory segment: processes of one machine; copies in and out of it
    traits = BUILTINS["shm"]

    def __init__(
        self,
        name: str | None = None,
        *,
        create: bool = True,
        slots: int = 2,
        directory: str | None = None,
        max_retries: int = 1000,
    ) -> None:
        if name is None:
            if not create:
                raise TransportError("shm: a reader (create=False) must name the segment to attach to; pass name=<the writer's segment_name>")
            name = f"flowrl-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        name = name.lstrip("/")  # shm_open-style names may start with '/'
        if not name or "/" in name or name in (".", "..") or len(name) > 200:
            raise TransportError(f"shm: segment name {name!r} is not a plain file name (no '/', 1..200 characters); pick e.g. 'flowrl-run1-policy-gen'")
        if not isinstance(slots, int) or not 2 <= slots <= _MAX_SLOTS:
            raise TransportError(f"shm: slots={slots!r} is out of range; use 2 (a double buffer) to {_MAX_SLOTS}")
        if not isinstance(max_retries, int) or max_retries < 1:
            raise TransportError(f"shm: max_retries={max_retries!r} must be a positive int")
        if directory is None:
            directory = "/dev/shm" if os.path.isdir("/dev/shm") else _tempdir()
        self.segment_name = name
        self.path = os.path.join(directory, name)
        self._create = bool(create)
        self._slots = slots
        self._max_retries = max_retries
        self._map: _Mapping | None = None
        self._layout: StateLayout | None = None
        self._last_version = -1
        self._closed = False
        self._lock = threading.Lock()  # one publish at a time; attach once
        self._finalizer: weakref.finalize | None = None
        if self._create and os.path.exists(self.path):
            raise TransportError(
                f"shm: segment {self.path!r} already exists: another transport uses the name {name!r}, or a crashed run "
                f"left it behind; pick another name, or delete the file if no process uses it"
            )

    # -- writer side --------------------------------------------------------------------------

    def publish(self, state: State, version: int) -> None:
        with self._lock:
            self._check_open("publish")
            if not self._create:
                raise TransportError(
                    f"shm: the reader of segment {self.segment_name!r} cannot publish; publish on the transport opened with create=True"
                )
            check_version(self.label, version, self._last_version)
            if self._map is None:
                self._map = self._create_segment(layout_of(state, transport=self.label))
            else:
                check_state(self.label, self._map.header.layout, state, version)
            m = self._map
            control = m.control
            count = int(control[_W_COUNT])
            slot = count % self._slots
            seq = int(control[_seq_word(slot)])
            control[_seq_word(slot)] = seq + 1  # odd: being written
            fence()
            for k, dst in m.slots[slot].items():
                copy_tensor(dst, state[k])
            fence()
            control[_version_word(slot)] = version
            fence()
            control[_seq_word(slot)] = seq + 2  # even: complete
            fence()
            control[_W_COUNT] = count + 1  # the newest slot is now `slot`
            self._last_version = version

    def _create_segment(self, layout: StateLayout) -> _Mapping:
        slot_nbytes = max(_PAGE, -(-layout.nbytes // _PAGE) * _PAGE)
        probe = msgspec.json.encode(ShmHeader(slots=self._slots, slot_nbytes=slot_nbytes, data_offset=0, layout=layout))
        data_offset = -(-(_CONTROL_BYTES + len(probe) + 32) // _PAGE) * _PAGE  # room for data_offset's digits
        header = ShmHeader(slots=self._slots, slot_nbytes=slot_nbytes, data_offset=data_offset, layout=layout)
        encoded = msgspec.json.encode(header)
        size = data_offset + self._slots * slot_nbytes
        tmp = f"{self.path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.ftruncate(fd, size)
                mm = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            mm[_CONTROL_BYTES : _CONTROL_BYTES + len(encoded)] = encoded
            control = np.frombuffer(mm, dtype=np.int64, count=_CONTROL_BYTES // 8)
            control[_W_HEADER_LEN] = len(encoded)
            control[_W_SLOTS] = self._slots
            for i in range(self._slots):
                control[_version_word(i)] = -1
            control[_W_MAGIC] = MAGIC
            del control
            try:
                os.link(tmp, self.path)  # atomic: readers see the whole segment or none
            except FileExistsError:
                mm.close()
                raise TransportError(
                    f"shm: segment {self.path!r} appeared while this transport created it: another writer uses the name "
                    f"{self.segment_name!r}; give each weight edge its own name"
                ) from None
        finally:
            os.unlink(tmp)
        self._finalizer = weakref.finalize(self, unlink_quietly, self.path, os.getpid())
        return _Mapping(mm, header)

    # -- reader side --------------------------------------------------------------------------

    def latest_version(self) -> int:
        self._check_open("latest_version")
        m = self._attach()
        if m is None:
            return -1
        for attempt in range(self._max_retries):
            control = m.control
            count = int(control[_W_COUNT])
            if count == 0:
                return -1
            slot = (count - 1) % m.header.slots
            seq = int(control[_seq_word(slot)])
            fence()
            version = int(control[_version_word(slot)])
            fence()
            if seq % 2 == 0 and int(control[_seq_word(slot)]) == seq:
                return version
            backoff(attempt)
        raise self._lapped(m)

    def fetch_into(self, target: Mapping[str, torch.Tensor], *, newer_than: int = -1) -> int | None:
        """Copy the newest version into ``target`` (see the protocol), retrying when the writer laps the copy.

        Raises:
            TransportError: ``target`` does not match the layout (nothing written); or ``max_retries``
                copies in a row were overwritten, in which case ``target`` holds a mix of versions
                and must be fetched again before use.
        """
        self._check_open("fetch_into")
        m = self._attach()
        if m is None:
            return None
        checked = False
        control = m.control
        for attempt in range(self._max_retries):
            count = int(control[_W_COUNT])
            if count == 0:
                return None
            slot = (count - 1) % m.header.slots
            seq = int(control[_seq_word(slot)])
            fence()
            version = int(control[_version_word(slot)])
            fence()
            if seq % 2 == 1 or int(control[_seq_word(slot)]) != seq:
                backoff(attempt)
                continue
            if version <= newer_than:
                return None
            if not checked:
                check_target(self.label, m.header.layout, target)
                checked = True
            for k, src in m.slots[slot].items():
                copy_tensor(target[k], src)
            fence()
            if int(control[_seq_word(slot)]) == seq:
                return version
            backoff(attempt)  # the writer lapped us: the target holds a mix; copy again
        raise self._lapped(m)

    def _attach(self) -> _Mapping | None:
        """The mapping, attaching to the segment on first use; ``None`` while it does not exist yet."""
        if self._map is not None or self._create:
            return self._map
        with self._lock:
            if self._map is None:
                self._map = _open_segment(self.path, self.segment_name)
        return self._map

    def _lapped(self, m: _Mapping) -> TransportError:
        return TransportError(
            f"shm: segment {self.segment_name!r}: no consistent read in {self._max_retries} attempts: the writer overwrote "
            f"the slot being read every time (it publishes {m.header.slots} versions faster than this reader copies one); "
            f"open the writer with more slots, or publish less often"
        )

    # -- both ---------------------------------------------------------------------------------

    @property
    def label(self) -> str:
        return f"shm segment {self.segment_name!r}"

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._map is not None:
                self._map.close()
                self._map = None
            if self._finalizer is not None:
                self._finalizer()  # the creator unlinks the segment (once)

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise TransportError(f"{self.label}: {op}() called after close(); open a new transport")


def backoff(attempt: int) -> None:
    """Let the writer finish the slot: yield the CPU at first, then sleep a millisecond per attempt."""
    if attempt < 10:
        os.sched_yield()
    else:
        time.sleep(0.001)


def _tempdir() -> str:
    import tempfile

    return tempfile.gettempdir()


def _open_segment(path: str, name: str) -> _Mapping | None:
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size < _CONTROL_BYTES:
            raise TransportError(f"shm: {path!r} ({size} bytes) is not a flowrl weight segment; is {name!r} the writer's segment name?")
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    control = np.frombuffer(mm, dtype=np.int64, count=_CONTROL_BYTES // 8)
    magic, header_len = int(control[_W_MAGIC]), int(control[_W_HEADER_LEN])
    del control
    try:
        if magic != MAGIC:
            raise TransportError(f"shm: {path!r} is not a flowrl weight segment (bad magic); is {name!r} the writer's segment name?")
        header = msgspec.json.decode(mm[_CONTROL_BYTES : _CONTROL_BYTES + header_len], type=ShmHeader)
        expected = header.data_offset + header.slots * header.slot_nbytes
        if size != expected:
            raise TransportError(f"shm: segment {path!r} has {size} bytes but its header describes {expected}; it is corrupt")
    except (TransportError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        mm.close()
        if isinstance(exc, TransportError):
            raise
        raise TransportError(f"shm: segment {path!r} has an unreadable header ({exc}); it is corrupt or from another flowrl version") from exc
    return _Mapping(mm, header)


def read_header(path: str) -> ShmHeader:
    """The header of the segment file at ``path`` (for inspection and tests)."""
    m = _open_segment(path, os.path.basename(path))
    if m is None:
        raise TransportError(f"shm: no segment at {path!r}")
    try:
        return m.header
    finally:
        m.close()
