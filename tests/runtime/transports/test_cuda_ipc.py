"""CudaIpcTransport: handles and options; the whole protocol across real processes on any machine
(``memory="host"``: slots in /dev/shm); the same with GPU memory where a CUDA device is.

The cross-process tests run a writer process (``cuda_ipc_peer.py``) and fetch here: a continuous
stream (every fetched state must be one version), deterministic laps (the writer rewrites the slot
being copied, or stops half-way through it), a reader before the first publish and after the
writer's close. Each runs over host memory everywhere and over CUDA memory where there is a GPU; on
a machine without CUDA the GPU variants are skipped, visibly (pytest's skip summary names them).
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch

from flowrl.errors import TransportError
from flowrl.runtime.transports.weight_transport import layout_of
import flowrl.runtime.transports.cuda_ipc as cuda_ipc
from flowrl.runtime.transports.cuda_ipc import CudaIpcHandle, CudaIpcTransport, HostSlotHandle, IpcHeader
from flowrl.runtime.transports.registry import create_transport, transport_traits
from flowrl.runtime.transports.slot_memory import open_slots
from tests.runtime.transports.conformance import TransportConformance
from tests.runtime.transports.cuda_ipc_peer import make_state

REPO = Path(__file__).resolve().parents[3]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (this machine has none)")

#: what UntypedStorage._share_cuda_() returns: device, handle, size, offset, ref counter file and offset, event, sync
SHARE_TUPLE = (0, b"\x01\x02ipc\x00handle", 4096, 512, b"/torch_123_456", 8, b"\xffevent", True)


MEMORIES = ["host", pytest.param("cuda", marks=needs_cuda)]


def _segment() -> str:
    return f"flowrl-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(autouse=True)
def no_leaked_segments() -> Iterator[None]:
    """Every control segment and host slot file a test made (named after this pid) is gone after it."""
    yield
    leaked = glob.glob(f"/dev/shm/flowrl-test-{os.getpid()}-*")
    for path in leaked:
        os.unlink(path)
    assert not leaked, f"left in /dev/shm: {leaked}"


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
        ({"memory": "gpu"}, r"memory='gpu' is not one of \('cuda', 'host'\)"),
        ({"memory": "host", "device": 0}, r"device=0 applies to memory='cuda' only"),
    ],
    ids=["slots", "retries", "reader-without-name", "bad-name", "memory", "host-with-device"],
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


# --- with a GPU: the conformance suite, and a writer in another process ---------------------------


@needs_cuda
class TestCudaIpcConformance(TransportConformance):
    """Writer and reader in this process (the reader uses the writer's buffers: CUDA cannot map a
    process's own handle); the seqlock over the control segment is the same as across processes."""

    random_examples = 5

    def open_pair(self, tmp_path):
        name = _segment()
        return CudaIpcTransport(name, create=True), CudaIpcTransport(name, create=False)




# --- on any machine: the protocol over host shared memory ----------------------------------------


class TestCudaIpcHostMemoryConformance(TransportConformance):
    """The whole transport with its slots in /dev/shm: the reader maps the writer's slot files and
    reads the control segment as a reader in another process does (its own mappings, no shortcut)."""

    random_examples = 5

    def open_pair(self, tmp_path):
        name = _segment()
        return CudaIpcTransport(name, create=True, memory="host"), CudaIpcTransport(name, create=False)


class TestCudaIpcHostMemoryThreeSlotsConformance(TransportConformance):
    random_examples = 2
    concurrent_versions = 60

    def open_pair(self, tmp_path):
        name = _segment()
        return CudaIpcTransport(name, create=True, memory="host", slots=3), CudaIpcTransport(name, create=False)


def test_host_slots_are_named_in_json_and_unlinked_at_close():
    name = _segment()
    writer, reader = CudaIpcTransport(name, create=True, memory="host", slots=3), CudaIpcTransport(name, create=False)
    writer.publish({"w": torch.arange(5.0)}, 0)
    target = {"w": torch.zeros(5)}
    assert reader.fetch_into(target) == 0 and target["w"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    wire = bytes(writer._block["header"].numpy())
    assert b'"memory":"host"' in wire and b"pickle" not in wire
    handles = msgspec.json.decode(wire, type=IpcHeader).handles
    assert [type(h) for h in handles] == [HostSlotHandle] * 3
    assert [h.path for h in handles] == [f"/dev/shm/{name}.slot{i}" for i in range(3)]
    assert all(os.path.exists(h.path) for h in handles)
    writer.close()
    assert not any(os.path.exists(h.path) for h in handles) and not os.path.exists(f"/dev/shm/{name}")
    with pytest.raises(TransportError, match=r"the writer closed the edge \(its last version was 0\)"):
        reader.fetch_into(target)
    reader.close()


def test_reader_of_a_closed_writer_that_it_never_attached_sees_nothing():
    name = _segment()
    writer = CudaIpcTransport(name, create=True, memory="host")
    writer.publish({"w": torch.ones(2)}, 0)
    writer.close()
    late = CudaIpcTransport(name, create=False)  # the segment is gone: as before the first publish
    assert late.latest_version() == -1 and late.fetch_into({"w": torch.zeros(2)}) is None
    late.close()


def test_a_slot_file_in_the_way_is_an_error_naming_it():
    name = _segment()
    squatter = f"/dev/shm/{name}.slot1"
    Path(squatter).write_bytes(b"x")
    writer = CudaIpcTransport(name, create=True, memory="host")
    try:
        with pytest.raises(TransportError, match=rf"slot file '{squatter}' already exists"):
            writer.publish({"w": torch.ones(2)}, 0)
    finally:
        writer.close()
        os.unlink(squatter)
    assert not os.path.exists(f"/dev/shm/{name}.slot0")


def test_a_header_mixing_slot_memories_is_refused_and_a_gone_slot_file_named():
    gone = HostSlotHandle(path=f"/dev/shm/{_segment()}.slot0", size_bytes=256)
    with pytest.raises(TransportError, match=r"mixes 1 cuda and 1 host slot handles; a flowrl writer keeps all its slots in one memory"):
        open_slots((CudaIpcHandle.from_share_tuple(SHARE_TUPLE), gone), "cuda_ipc segment 'x'", None)
    with pytest.raises(TransportError, match=rf"slot file '{gone.path}' is gone: the writer closed the edge or exited"):
        open_slots((gone,), "cuda_ipc segment 'x'", None)


# --- a writer in another process (host memory anywhere, GPU memory where there is one) ------------


class Peer:
    """The writer process (``cuda_ipc_peer.py``), driven one command line at a time."""

    def __init__(self, segment: str, memory: str, numel: int, slots: int = 2) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.runtime.transports.cuda_ipc_peer", segment, memory, str(numel), str(slots)],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        self.watchdog = threading.Timer(120, self.proc.kill)
        self.watchdog.start()
        self.expect("ready")

    def expect(self, reply: str) -> None:
        line = self.proc.stdout.readline().strip()
        if line != reply:
            self.proc.kill()
            raise AssertionError(f"writer process said {line!r}, expected {reply!r}; stderr:\n{self.proc.stderr.read()}")

    def ask(self, command: str, reply: str) -> None:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        self.expect(reply)

    def finish(self) -> None:
        try:
            self.proc.stdin.close()  # end of input: the peer exits (its finalizers unlink what it made)
            self.proc.wait(30)
        finally:
            self.watchdog.cancel()
        assert self.proc.returncode == 0, self.proc.stderr.read()


@pytest.fixture
def peer(request) -> Iterator[tuple[Peer, CudaIpcTransport, dict[str, torch.Tensor]]]:
    """A writer process on ``request.param`` memory (2 slots), a reader here, and a target."""
    memory, numel = request.param, 1 << 14
    segment = _segment()
    p = Peer(segment, memory, numel)
    reader = CudaIpcTransport(segment, create=False)
    try:
        yield p, reader, make_state(numel, "cuda" if memory == "cuda" else "cpu")
    finally:
        reader.close()
        p.finish()


def _torn(target: dict[str, torch.Tensor], version: int) -> list[str]:
    return [k for k, x in target.items() if not bool((x == version).all())]


@pytest.mark.parametrize("peer", MEMORIES, indirect=True)
def test_a_writer_process_streams_and_every_fetch_is_one_version(peer):
    """Before the first publish: nothing. Then the writer publishes 300 versions back to back while
    this process fetches: every fetched state holds exactly the version returned, and versions never
    go back. After the writer's close: a clear error, and its slots are gone."""
    writer, reader, target = peer
    assert reader.latest_version() == -1 and reader.fetch_into(target) is None
    writer.ask("publish 1", "published 0")
    assert reader.latest_version() == 0 and reader.fetch_into(target) == 0 and not _torn(target, 0)
    last = 300
    writer.proc.stdin.write(f"stream {last}\n")
    writer.proc.stdin.flush()
    seen, torn = [], []
    deadline = time.monotonic() + 60
    while (not seen or seen[-1] < last) and time.monotonic() < deadline:
        got = reader.fetch_into(target)
        torn += [f"{k}@{got}" for k in _torn(target, got)]
        seen.append(got)
    writer.expect(f"published {last}")
    assert not torn, torn
    assert seen[-1] == last and seen == sorted(seen)
    writer.ask("close", "closed")
    with pytest.raises(TransportError, match=rf"the writer closed the edge \(its last version was {last}\)"):
        reader.fetch_into(target)
    with pytest.raises(TransportError, match=r"the writer closed the edge"):
        reader.latest_version()
    assert not glob.glob(f"/dev/shm/{reader.segment_name}*")


def _during_first_copy(monkeypatch, action, every_attempt=False):
    """Make this process's fetch run ``action`` right after it copied the first tensor of an attempt
    (of the first attempt only, unless ``every_attempt``): the writer then acts mid-copy."""
    real, calls = cuda_ipc.copy_tensor, []

    def copy(dst, src):
        real(dst, src)
        calls.append(1)
        if len(calls) % len(make_state(16, "cpu")) == 1 and (every_attempt or len(calls) == 1):
            action()

    monkeypatch.setattr(cuda_ipc, "copy_tensor", copy)
    return calls


@pytest.mark.parametrize("peer", MEMORIES, indirect=True)
def test_a_reader_lapped_mid_copy_copies_again(peer, monkeypatch):
    """The writer publishes twice (a full lap of 2 slots) while this process copies version 0: the
    target holds parts of versions 0 and 2, the slot's seq changed, so the fetch copies again."""
    writer, reader, target = peer
    writer.ask("publish 1", "published 0")
    calls = _during_first_copy(monkeypatch, lambda: writer.ask("publish 2", "published 2"))
    assert reader.fetch_into(target) == 2
    assert not _torn(target, 2)
    assert len(calls) == 2 * len(target), "one lapped copy, then one whole"


@pytest.mark.parametrize("peer", MEMORIES, indirect=True)
def test_a_reader_lapped_every_time_gives_up_after_max_retries(peer, monkeypatch):
    writer, reader, target = peer
    impatient = CudaIpcTransport(reader.segment_name, create=False, max_retries=3)
    writer.ask("publish 1", "published 0")
    published = iter(range(2, 100, 2))
    calls = _during_first_copy(monkeypatch, lambda: writer.ask("publish 2", f"published {next(published)}"), every_attempt=True)
    try:
        with pytest.raises(TransportError, match=r"no consistent read in 3 attempts: the writer overwrote the slot being read every time"):
            impatient.fetch_into(target)
    finally:
        impatient.close()
    assert len(calls) == 3 * len(target)


@pytest.mark.parametrize("peer", MEMORIES, indirect=True)
def test_a_writer_stopped_half_way_through_the_slot_being_read_is_not_missed(peer, monkeypatch):
    """While this process copies version 0 (slot 0), the writer publishes 1 (slot 1) and stops after
    two tensors of version 2 in slot 0: the slot's seq is odd, so the fetch copies again, and takes
    version 1; once the writer finishes, version 2."""
    writer, reader, target = peer
    writer.ask("publish 1", "published 0")

    def lap_half_way():
        writer.ask("publish 1", "published 1")
        writer.ask("stall 2", "stalled 2")

    _during_first_copy(monkeypatch, lap_half_way)
    assert reader.fetch_into(target) == 1
    assert not _torn(target, 1)
    writer.ask("resume", "published 2")
    assert reader.fetch_into(target) == 2 and not _torn(target, 2)
