"""CudaIpcTransport: its handle encoding and options on any machine; the conformance suite and a real
cross-process run (a writer process, this process mapping its GPU memory) where a CUDA device is.

On a machine without CUDA the GPU tests are skipped, visibly (pytest's skip summary names them).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import msgspec
import pytest
import torch

from flowrl.errors import TransportError
from flowrl.runtime.transports.base import layout_of
from flowrl.runtime.transports.cuda_ipc import CudaIpcHandle, CudaIpcTransport, IpcHeader
from flowrl.runtime.transports.registry import create_transport, transport_traits
from tests.runtime.transports.conformance import TransportConformance

REPO = Path(__file__).resolve().parents[3]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (this machine has none)")

#: what UntypedStorage._share_cuda_() returns: device, handle, size, offset, ref counter file and offset, event, sync
SHARE_TUPLE = (0, b"\x01\x02ipc\x00handle", 4096, 512, b"/torch_123_456", 8, b"\xffevent", True)


def _segment() -> str:
    return f"flowrl-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"


# --- on any machine: handles, header, options, traits --------------------------------------------


def test_handle_round_trips_through_json_without_pickle():
    handle = CudaIpcHandle.from_share_tuple(SHARE_TUPLE)
    header = IpcHeader(slots=1, slot_nbytes=4096, layout=layout_of({"w": torch.zeros(3)}), handles=(handle,))
    wire = msgspec.json.encode(header)
    assert b"pickle" not in wire and wire.startswith(b"{")
    back = msgspec.json.decode(wire, type=IpcHeader)
    assert back == header
    assert back.handles[0].new_shared_args() == SHARE_TUPLE  # the bytes survive (base64 in JSON)
    assert back.handles[0].new_shared_args(device=3)[0] == 3  # mapped on the reader's numbering of the GPU


@pytest.mark.parametrize(
    ("fields", "match"),
    [(SHARE_TUPLE[:7], r"returned 7 fields, expected 8"), (SHARE_TUPLE + (1,), r"returned 9 fields")],
    ids=["short", "long"],
)
def test_a_share_tuple_of_another_shape_is_an_error(fields, match):
    with pytest.raises(TransportError, match=match):
        CudaIpcHandle.from_share_tuple(fields)


def test_header_with_unknown_fields_is_rejected():
    handle = msgspec.to_builtins(CudaIpcHandle.from_share_tuple(SHARE_TUPLE))
    with pytest.raises(msgspec.ValidationError, match=r"unknown field `pid`"):
        msgspec.convert({**handle, "pid": 7}, CudaIpcHandle)


def test_traits_and_registry():
    traits = transport_traits("cuda_ipc")
    assert (traits.crosses_processes, traits.needs_segment, traits.cost, traits.memory_copies) == (True, True, "memory", 2)
    t = create_transport("cuda_ipc", name=_segment(), create=True)  # what a backend does for needs_segment
    assert isinstance(t, CudaIpcTransport) and t.name == "cuda_ipc" and t.latest_version() == -1
    t.close()


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"slots": 1}, r"slots=1 must be an integer >= 2"),
        ({"max_retries": 0}, r"max_retries=0 must be a positive int"),
        ({"create": False}, r"a reader \(create=False\) must name the segment"),
        ({"name": "a/b"}, r"not a plain file name"),
    ],
    ids=["slots", "retries", "reader-without-name", "bad-name"],
)
def test_option_errors(options, match):
    with pytest.raises(TransportError, match=match):
        CudaIpcTransport(**options)


def test_reader_before_the_writer_published_sees_nothing():
    reader = CudaIpcTransport(_segment(), create=False)
    assert reader.latest_version() == -1 and reader.fetch_into({"w": torch.zeros(1)}) is None
    reader.close()
    with pytest.raises(TransportError, match=r"after close\(\)"):
        reader.fetch_into({"w": torch.zeros(1)})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_publish_without_cuda_says_so():
    t = CudaIpcTransport(create=True)
    with pytest.raises(TransportError, match=r"needs a CUDA device and this process sees none; use 'shm'"):
        t.publish({"w": torch.ones(2)}, 0)
    t.close()


class TestCudaIpcProtocolOnCpu(TransportConformance):
    """The whole transport but CUDA itself, on any machine: slots in host memory, handles faked (a reader
    in the writer's process maps nothing: it uses the writer's buffers, as on a GPU). Exercises the
    control block, the seqlock, versions, casts, errors and close; not the IPC mapping or the device copies."""

    random_examples = 5

    @pytest.fixture(autouse=True)
    def _slots_in_host_memory(self, monkeypatch):
        import flowrl.runtime.transports.cuda_ipc as ipc

        def fake_share(buffer):
            handle = CudaIpcHandle.from_share_tuple((0, uuid.uuid4().bytes, buffer.numel(), 0, b"/none", 0, None, False))
            ipc._SHARED[(handle.handle, 0)] = buffer
            return handle

        monkeypatch.setattr(ipc, "_need_cuda", lambda what: None)
        monkeypatch.setattr(ipc, "_check_slot_device", lambda device, label: None)
        monkeypatch.setattr(ipc, "share_storage", fake_share)

    def open_pair(self, tmp_path):
        name = _segment()
        return CudaIpcTransport(name, create=True, device="cpu"), CudaIpcTransport(name, create=False)


# --- with a GPU: the conformance suite, and a writer in another process ---------------------------


@needs_cuda
class TestCudaIpcConformance(TransportConformance):
    """Writer and reader in this process (the reader uses the writer's buffers: CUDA cannot map a
    process's own handle); the seqlock over the control segment is the same as across processes."""

    random_examples = 5

    def open_pair(self, tmp_path):
        name = _segment()
        return CudaIpcTransport(name, create=True), CudaIpcTransport(name, create=False)


@needs_cuda
def test_a_writer_process_shares_its_gpu_memory():
    """A writer process publishes 30 versions on the GPU while this process maps its slots and fetches."""
    from tests.runtime.transports.cuda_ipc_peer import make_state

    segment, versions, numel = _segment(), 30, 1 << 16
    writer = subprocess.Popen(
        [sys.executable, "-m", "tests.runtime.transports.cuda_ipc_peer", segment, str(versions), str(numel)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    watchdog = threading.Timer(120, writer.kill)
    watchdog.start()
    reader = CudaIpcTransport(segment, create=False)
    target = make_state(numel)
    seen, torn = [], []
    try:
        assert writer.stdout.readline() == "published 0\n", writer.stderr.read()
        assert reader.fetch_into(target) == 0
        assert all(bool((x == 0).all()) for x in target.values())
        writer.stdin.write("go\n")
        writer.stdin.flush()
        deadline = time.monotonic() + 60
        while (not seen or seen[-1] < versions - 1) and time.monotonic() < deadline:
            got = reader.fetch_into(target)
            if got is None:
                continue
            torn += [f"{k}@{got}" for k, x in target.items() if not bool((x == got).all())]
            seen.append(got)
        assert writer.stdout.readline() == "published all\n", writer.stderr.read()
    finally:
        reader.close()
        if writer.poll() is None:
            writer.stdin.write("close\n")
            writer.stdin.flush()
        writer.wait(30)
        watchdog.cancel()
    assert not torn, torn
    assert seen and seen[-1] == versions - 1 and seen == sorted(seen)
    assert writer.returncode == 0, writer.stderr.read()
