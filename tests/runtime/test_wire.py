"""``runtime/wire.py``: a frame is a length, a msgspec JSON header and the tensors' raw bytes; never pickle."""

from __future__ import annotations

import json
import socket
import struct

import pytest
import torch

from flowrl.runtime.wire import DTYPES, ConnectionLost, recv_message, send_message


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def test_tensors_of_every_dtype_and_shape_arrive_bit_for_bit(pair):
    a, b = pair
    g = torch.Generator().manual_seed(0)
    tensors = {name: (torch.randn(3, 2, generator=g) * 100).to(dtype) for name, dtype in DTYPES.items()}
    tensors |= {"scalar": torch.tensor(7.5), "empty": torch.empty(0, 4), "strided": torch.arange(12.0).reshape(3, 4).t()}
    send_message(a, {"op": "step", "seq": 3}, tensors)
    header, got = recv_message(b)
    assert header == {"op": "step", "seq": 3}
    assert list(got) == list(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name  # the same bits


def test_the_frame_is_a_length_a_json_header_and_raw_bytes(pair):
    a, b = pair
    send_message(a, {"op": "x"}, {"w": torch.tensor([1.0, 2.0])})
    frame = b.recv(1 << 16)
    (length,) = struct.unpack("<Q", frame[:8])
    assert json.loads(frame[8 : 8 + length]) == {"op": "x", "tensors": [["w", "float32", [2]]]}  # JSON, not a pickle
    assert frame[8 + length :] == torch.tensor([1.0, 2.0]).numpy().tobytes()


def test_a_dtype_that_cannot_cross_is_refused_naming_the_tensor(pair):
    with pytest.raises(TypeError, match=r"tensor 'z' has dtype torch.complex64, which cannot cross processes"):
        send_message(pair[0], {}, {"z": torch.zeros(2, dtype=torch.complex64)})


def test_a_closed_peer_is_a_lost_connection(pair):
    a, b = pair
    a.close()
    with pytest.raises(ConnectionLost, match="closed by the other process"):
        recv_message(b)
