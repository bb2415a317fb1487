"""Messages between processes: a msgspec header plus raw tensor bytes, never pickle.

Frame layout on a stream socket::

    u64 header length | header (msgspec JSON) | the tensors' bytes, in header order

The header is a ``dict`` with the caller's keys plus ``tensors``: ``[[name, dtype, shape], ...]``.
Only the dtypes in ``DTYPES`` cross; anything else is a ``TypeError`` naming the tensor.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

import msgspec
import torch

__all__ = ["send_message", "recv_message", "ConnectionLost", "DTYPES"]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in DTYPES.items()}
_LEN = struct.Struct("<Q")
MAX_HEADER = 64 * 1024 * 1024


class ConnectionLost(Exception):
    """The other end closed the connection (it exited or was killed)."""


def send_message(sock: socket.socket, header: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None) -> None:
    """Send ``header`` and ``tensors`` (contiguous copies made as needed) as one frame."""
    tensors = tensors or {}
    meta = []
    payload = []
    for name, t in tensors.items():
        if t.dtype not in _NAMES:
            raise TypeError(f"tensor {name!r} has dtype {t.dtype}, which cannot cross processes; use one of {sorted(DTYPES)}")
        t = t.detach().cpu().contiguous()
        meta.append([name, _NAMES[t.dtype], list(t.shape)])
        if t.numel():
            payload.append(t.view(torch.uint8).reshape(-1).numpy().tobytes() if t.dim() else t.reshape(1).view(torch.uint8).numpy().tobytes())
    raw = msgspec.json.encode({**header, "tensors": meta})
    sock.sendall(_LEN.pack(len(raw)) + raw)
    for chunk in payload:
        sock.sendall(chunk)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionLost("connection closed by the other process")
        got += k
    return buf


def recv_message(sock: socket.socket) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Receive one frame: ``(header, tensors)``."""
    (length,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if length > MAX_HEADER:
        raise ConnectionLost(f"message header of {length} bytes is over the {MAX_HEADER}-byte limit")
    header = msgspec.json.decode(_recv_exact(sock, length))
    tensors: dict[str, torch.Tensor] = {}
    for name, dtype_name, shape in header.pop("tensors", []):
        dtype = DTYPES[dtype_name]
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if numel == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        buf = _recv_exact(sock, nbytes)
        tensors[name] = torch.frombuffer(buf, dtype=dtype).reshape(shape)
    return header, tensors
