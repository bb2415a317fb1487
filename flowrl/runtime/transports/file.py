"""``FileTransport``: weights through safetensors files in a directory, the baseline to beat.

Each publish writes ``v{version}.safetensors`` under a temporary name, fsyncs it, renames it into
place (atomic), then replaces the ``LATEST`` pointer file the same way, and prunes all but the
newest ``keep`` versions. A reader reads ``LATEST`` and maps the file it names, so it only ever sees
complete files; if that file was pruned in between (a newer one exists), it reads ``LATEST`` again.
A file being read stays readable after it is pruned (POSIX keeps unlinked open files).

The files are standard safetensors (8-byte little-endian header length, a JSON header of
``name -> {dtype, shape, data_offsets}``, then raw little-endian data), written and read here with
plain ``os``/``mmap`` and msgspec: no pickle, no code execution, and no dependency on the
``safetensors`` package, whose files this reads and whose loader reads these.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
import threading
import uuid
from collections.abc import Mapping
from typing import Any

import msgspec
import torch

from flowrl.errors import TransportError
from flowrl.runtime.transports.weight_transport import (
    StateLayout,
    State,
    TensorSpec,
    check_state,
    check_target,
    check_version,
    copy_tensor,
    dtype_name,
    layout_of,
)
from flowrl.transport_traits import BUILTINS

__all__ = ["FileTransport", "write_safetensors", "read_safetensors_layout", "SAFETENSORS_DTYPES"]

#: safetensors dtype codes -> torch dtypes (the subset torch and safetensors share).
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
}
_CODES = {dtype_name(d): code for code, d in SAFETENSORS_DTYPES.items()}
_VERSION_FILE = re.compile(r"^v(\d+)\.safetensors$")
_MAX_HEADER = 100 << 20


class _Entry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    dtype: str
    shape: list[int]
    data_offsets: tuple[int, int]


def write_safetensors(path: str, state: State, *, metadata: dict[str, str] | None = None, fsync: bool = True) -> None:
    """Write ``state`` to ``path`` in safetensors format (tensors ordered by decreasing item size,
    so every tensor's offset is a multiple of its item size and can be viewed in place).

    Raises:
        TransportError: a tensor's dtype has no safetensors code.
    """
    header: dict[str, Any] = {}
    order = sorted(state.items(), key=lambda kv: -kv[1].element_size())  # stable: keeps the state's order within a size
    offset = 0
    for name, tensor in order:
        code = _CODES.get(dtype_name(tensor.dtype))
        if code is None:
            raise TransportError(
                f"file: tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot store; "
                f"supported: {sorted(_CODES)}"
            )
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": code, "shape": list(tensor.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt", **(metadata or {})}
    encoded = msgspec.json.encode(header)
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for _, tensor in order:
            if tensor.numel():
                f.write(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data)  # a memoryview: no copy
        f.flush()
        if fsync:
            os.fsync(f.fileno())


def read_safetensors_layout(mm: mmap.mmap | bytes, *, path: str = "<buffer>") -> tuple[StateLayout, int]:
    """The layout (offsets relative to the data section) of a safetensors buffer, and where its data starts.

    Raises:
        TransportError: naming ``path``, when the buffer is not a valid safetensors file.
    """
    size = len(mm)
    if size < 8:
        raise TransportError(f"file: {path!r} is {size} bytes, too short for a safetensors file")
    (header_len,) = struct.unpack("<Q", mm[:8])
    if header_len > min(size - 8, _MAX_HEADER):
        raise TransportError(f"file: {path!r} declares a {header_len}-byte header in a {size}-byte file; it is not a safetensors file")
    try:
        raw = msgspec.json.decode(mm[8 : 8 + header_len], type=dict[str, msgspec.Raw])
        entries = {k: msgspec.json.decode(v, type=_Entry) for k, v in raw.items() if k != "__metadata__"}
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise TransportError(f"file: {path!r} has an unreadable safetensors header: {exc}") from exc
    data_start = 8 + header_len
    specs = []
    for name, e in entries.items():
        dtype = SAFETENSORS_DTYPES.get(e.dtype)
        if dtype is None:
            raise TransportError(f"file: {path!r}: tensor {name!r} has dtype code {e.dtype!r}, which flowrl does not read")
        begin, end = e.data_offsets
        numel = 1
        for d in e.shape:
            numel *= d
        itemsize = torch.empty((), dtype=dtype).element_size()
        if min(e.shape, default=0) < 0 or end - begin != numel * itemsize or begin < 0 or data_start + end > size:
            raise TransportError(
                f"file: {path!r}: tensor {name!r} ({e.dtype}{e.shape}) has data_offsets {[begin, end]} that do not fit "
                f"its shape or the file's {size - data_start} data bytes; the file is corrupt"
            )
        specs.append(TensorSpec(name=name, dtype=dtype_name(dtype), shape=tuple(e.shape), offset=begin, nbytes=end - begin))
    return StateLayout(tensors=tuple(specs), nbytes=size - data_start), data_start


class FileTransport:
    """Weights through versioned safetensors files in ``directory``: the simple, durable baseline.

    Both sides open it with the same ``directory``; either can be created first.

    Args:
        directory: where ``v{version}.safetensors`` and ``LATEST`` live (created if missing).
        keep: how many newest versions to keep on disk (>= 1; 2 by default, so a reader that read
            ``LATEST`` just before a publish still finds its file).
        fsync: fsync files and the directory at each publish (durable across a crash); ``False``
            trades that for speed.
        max_retries: how many times a fetch re-reads ``LATEST`` when the file it names was pruned.

    Example:
        >>> import tempfile
        >>> t = FileTransport(tempfile.mkdtemp())
        >>> t.publish({"w": torch.ones(2)}, version=0)
        >>> target = {"w": torch.zeros(2)}
        >>> t.fetch_into(target), target["w"].tolist()
        (0, [1.0, 1.0])
        >>> t.close()
    """

    name = "file"
    #: files in a directory both ends see: processes, and hosts given a shared directory
    traits = BUILTINS["file"]

    def __init__(self, directory: str, *, keep: int = 2, fsync: bool = True, max_retries: int = 100) -> None:
        if not isinstance(directory, str) or not directory:
            raise TransportError(f"file: directory={directory!r} must be a non-empty path string")
        if not isinstance(keep, int) or keep < 1:
            raise TransportError(f"file: keep={keep!r} must be an int >= 1 (how many newest versions stay on disk)")
        if not isinstance(max_retries, int) or max_retries < 1:
            raise TransportError(f"file: max_retries={max_retries!r} must be a positive int")
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as exc:
            raise TransportError(f"file: cannot create the weights directory {directory!r}: {exc}") from exc
        self.directory = directory
        self._keep = keep
        self._fsync = fsync
        self._max_retries = max_retries
        self._layout: StateLayout | None = None
        self._last_version = -1
        self._closed = False
        self._lock = threading.Lock()

    @property
    def label(self) -> str:
        return f"file transport in {self.directory!r}"

    def version_path(self, version: int) -> str:
        return os.path.join(self.directory, f"v{version}.safetensors")

    def publish(self, state: State, version: int) -> None:
        with self._lock:
            self._check_open("publish")
            check_version(self.label, version, max(self._last_version, self._read_latest()))
            if self._layout is None:
                layout = layout_of(state, transport=self.label)
            else:
                layout = self._layout
                check_state(self.label, layout, state, version)
            final = self.version_path(version)
            tmp = os.path.join(self.directory, f".v{version}.safetensors.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            try:
                write_safetensors(tmp, state, metadata={"flowrl_version": str(version)}, fsync=self._fsync)
                os.replace(tmp, final)
                self._write_latest(version)
            except BaseException as exc:
                _remove(tmp)
                if isinstance(exc, OSError):
                    raise TransportError(f"{self.label}: could not write version {version}: {exc}") from exc
                raise
            self._layout = layout
            self._last_version = version
            self._prune()

    def latest_version(self) -> int:
        self._check_open("latest_version")
        return self._read_latest()

    def fetch_into(self, target: Mapping[str, torch.Tensor], *, newer_than: int = -1) -> int | None:
        self._check_open("fetch_into")
        for _ in range(self._max_retries):
            version = self._read_latest()
            if version <= newer_than:
                return None
            path = self.version_path(version)
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue  # pruned after we read LATEST: a newer version is there now
            try:
                size = os.fstat(fd).st_size
                # A private (copy-on-write) mapping is writable as far as torch.frombuffer can tell; nothing writes it.
                mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE) if size else b""
            finally:
                os.close(fd)
            try:
                _copy_out(mm, path, self.label, target)
            finally:
                if isinstance(mm, mmap.mmap):
                    try:
                        mm.close()
                    except BufferError:  # a view is still referenced (e.g. by a traceback); closed when collected
                        pass
            return version
        raise TransportError(
            f"{self.label}: LATEST named a file that was gone {self._max_retries} times in a row; "
            f"is something else deleting its files?"
        )

    def close(self) -> None:
        self._closed = True

    # -- internals ----------------------------------------------------------------------------

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise TransportError(f"{self.label}: {op}() called after close(); open a new transport")

    def _read_latest(self) -> int:
        path = os.path.join(self.directory, "LATEST")
        try:
            with open(path, "rb") as f:
                text = f.read(64)
        except FileNotFoundError:
            return -1
        try:
            return int(text)
        except ValueError:
            raise TransportError(f"{self.label}: {path!r} holds {text!r}, not a version number; remove it or use a fresh directory") from None

    def _write_latest(self, version: int) -> None:
        tmp = os.path.join(self.directory, f".LATEST.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            with open(tmp, "wb") as f:
                f.write(f"{version}\n".encode())
                f.flush()
                if self._fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, os.path.join(self.directory, "LATEST"))
        except OSError:
            _remove(tmp)
            raise
        if self._fsync:
            fd = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(fd)  # both renames reach the disk
            finally:
                os.close(fd)

    def _prune(self) -> None:
        versions = sorted(int(m.group(1)) for n in os.listdir(self.directory) if (m := _VERSION_FILE.match(n)))
        for v in versions[: -self._keep]:
            _remove(self.version_path(v))


def _copy_out(mm: mmap.mmap | bytes, path: str, label: str, target: Mapping[str, torch.Tensor]) -> None:
    layout, data_start = read_safetensors_layout(mm, path=path)
    check_target(label, layout, target)
    base = torch.frombuffer(mm, dtype=torch.uint8) if len(mm) else torch.empty(0, dtype=torch.uint8)
    for spec in layout.tensors:
        raw = base[data_start + spec.offset : data_start + spec.offset + spec.nbytes]
        dtype = getattr(torch, spec.dtype)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if (data_start + spec.offset) % itemsize:
            raw = raw.clone()  # another writer's unaligned tensor: copy it to an aligned buffer first
        copy_tensor(target[spec.name], raw.view(dtype).view(spec.shape))


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
