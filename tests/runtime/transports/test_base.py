"""``copy_tensor``'s raw memcpy is taken only between CPU tensors: never handed a device pointer."""

from __future__ import annotations

import pytest
import torch

from flowrl.runtime.transports import weight_transport as base
from flowrl.runtime.transports.weight_transport import copy_tensor, memcpy_applies


@pytest.mark.parametrize(
    "dst, src, expected",
    [
        (torch.zeros(4), torch.ones(4), True),
        (torch.zeros(4), torch.ones(4, dtype=torch.float64), False),
        (torch.zeros(4, 2).t(), torch.ones(2, 4), False),
        (torch.zeros(4, device="meta"), torch.ones(4), False),
        (torch.zeros(4), torch.ones(4, device="meta"), False),
        (torch.zeros(4, device="meta"), torch.ones(4, device="meta"), False),
    ],
    ids=["cpu-cpu", "cast", "strided", "device-dst", "device-src", "device-both"],
)
def test_memcpy_applies_only_to_contiguous_cpu_tensors_of_one_dtype(dst, src, expected):
    assert memcpy_applies(dst, src) is expected


@pytest.fixture
def count_memcpy(monkeypatch):
    calls: list[int] = []
    real = base._as_bytes

    def spy(t: torch.Tensor):
        assert t.device.type == "cpu", f"memcpy handed a {t.device} tensor"
        calls.append(t.numel())
        return real(t)

    monkeypatch.setattr(base, "_as_bytes", spy)
    return calls


def test_cpu_copies_take_the_memcpy(count_memcpy):
    dst = torch.zeros(5)
    copy_tensor(dst, torch.arange(5.0))
    assert dst.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0] and count_memcpy == [5, 5]


@pytest.mark.parametrize("side", ["dst", "src", "both"])
def test_device_copies_go_through_torch(count_memcpy, side):
    """The "meta" device stands in for CUDA: a device tensor on either side must never reach numpy."""
    dst = torch.zeros(5, device="meta" if side in ("dst", "both") else "cpu")
    src = torch.ones(5, device="meta" if side in ("src", "both") else "cpu")
    if side == "src":
        with pytest.raises(NotImplementedError, match="meta"):  # torch's copy_ ran: a meta tensor holds no data
            copy_tensor(dst, src)
    else:
        copy_tensor(dst, src)
    assert count_memcpy == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)")
def test_cuda_round_trip_through_copy_tensor(count_memcpy):
    gpu = torch.arange(6.0, device="cuda")
    host = torch.zeros(6)
    copy_tensor(host, gpu)
    back = torch.zeros(6, device="cuda")
    copy_tensor(back, host)
    assert host.tolist() == list(range(6)) and torch.equal(back, gpu) and count_memcpy == []
