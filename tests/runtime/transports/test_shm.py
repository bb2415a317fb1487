"""SharedMemoryTransport: the conformance suite, real writer and reader processes, the segment's header,
the seqlock's retry, and cleanup without resource_tracker warnings."""

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
from flowrl.runtime.transports.registry import create_transport
from flowrl.runtime.transports.shm import SharedMemoryTransport, read_header
from tests.runtime.transports.conformance import TransportConformance
from tests.runtime.transports.shm_peer import make_state

REPO = Path(__file__).resolve().parents[3]


def _segment() -> str:
    return f"flowrl-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class TestSharedMemoryConformance(TransportConformance):
    def open_pair(self, tmp_path):
        name = _segment()
        writer = SharedMemoryTransport(name, create=True)
        return writer, SharedMemoryTransport(name, create=False)  # opened before the segment exists


class TestSharedMemoryThreeSlotsConformance(TransportConformance):
    random_examples = 3

    def open_pair(self, tmp_path):
        name = _segment()
        return SharedMemoryTransport(name, create=True, slots=3), SharedMemoryTransport(name, create=False)


@pytest.fixture
def edge():
    name = _segment()
    writer = SharedMemoryTransport(name, create=True)
    reader = SharedMemoryTransport(name, create=False)
    yield writer, reader
    reader.close()
    writer.close()
    assert not os.path.exists(writer.path)


def test_options_travel_as_plain_data():
    name = _segment()
    options = msgspec.json.decode(msgspec.json.encode({"name": name, "create": True, "slots": 2}))
    writer = create_transport("shm", **options)
    reader = create_transport("shm", name=name, create=False)
    writer.publish({"w": torch.ones(3)}, 0)
    assert reader.latest_version() == 0
    reader.close()
    writer.close()


def test_segment_is_described_by_a_msgspec_header(edge):
    writer, _ = edge
    assert not os.path.exists(writer.path), "the segment is created at the first publish, when its size is known"
    writer.publish({"emb": torch.zeros(10, 4, dtype=torch.bfloat16), "scale": torch.tensor(2.0)}, 0)
    header = read_header(writer.path)
    assert [(t.name, t.dtype, t.shape) for t in header.layout.tensors] == [("emb", "bfloat16", (10, 4)), ("scale", "float32", ())]
    assert header.slots == 2 and header.data_offset % 4096 == 0
    assert os.path.getsize(writer.path) == header.data_offset + 2 * header.slot_nbytes
    raw = Path(writer.path).read_bytes()  # plain JSON at byte 4096, its length in control word 1
    length = int.from_bytes(raw[8:16], "little")
    assert msgspec.json.decode(raw[4096 : 4096 + length])["layout"]["tensors"][0]["name"] == "emb"


def test_reader_retries_when_the_writer_laps_it(edge):
    """Two publishes during the reader's copy rewrite the slot it copies: the seqlock makes it copy again."""
    writer, reader = edge
    state = {"a": torch.zeros(4), "b": torch.zeros(4)}
    writer.publish(state, 0)
    writer.publish({k: v + 1 for k, v in state.items()}, 1)
    target = {"a": torch.zeros(4), "b": torch.zeros(4)}
    assert reader.fetch_into(target) == 1
    mapping = reader._map
    newest = 1  # version 1 is the second publish: slot 1

    class Lapping(dict):
        laps = 0

        def items(self):
            if not Lapping.laps:  # while the reader is about to copy slot 1, the writer publishes twice
                Lapping.laps += 1
                writer.publish({k: torch.full((4,), 2.0) for k in state}, 2)  # slot 0
                writer.publish({k: torch.full((4,), 3.0) for k in state}, 3)  # slot 1 again
            return super().items()

    mapping.slots[newest] = Lapping(mapping.slots[newest])
    assert reader.fetch_into(target) == 3
    assert Lapping.laps == 1
    assert torch.equal(target["a"], torch.full((4,), 3.0)) and torch.equal(target["b"], torch.full((4,), 3.0))


def test_a_slot_always_being_written_is_an_error_after_max_retries():
    name = _segment()
    writer = SharedMemoryTransport(name, create=True)
    reader = SharedMemoryTransport(name, create=False, max_retries=3)
    writer.publish({"w": torch.ones(2)}, 0)
    writer._map.control[8] += 1  # slot 0's seq odd: as if the writer were stuck in the middle of a publish
    with pytest.raises(TransportError, match=r"no consistent read in 3 attempts.*more slots"):
        reader.fetch_into({"w": torch.zeros(2)})
    reader.close()
    writer.close()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"name": "a/b"}, r"not a plain file name"),
        ({"name": ""}, r"not a plain file name"),
        ({"slots": 1}, r"slots=1 is out of range"),
        ({"name": None, "create": False}, r"must name the segment"),
        ({"max_retries": 0}, r"max_retries=0"),
    ],
    ids=["slash", "empty", "one-slot", "reader-without-name", "no-retries"],
)
def test_bad_options(kwargs, match):
    with pytest.raises(TransportError, match=match):
        SharedMemoryTransport(**kwargs)


def test_stale_segment_name_is_refused(tmp_path):
    stale = tmp_path / "flowrl-stale"
    stale.write_bytes(b"\0" * 8192)
    with pytest.raises(TransportError, match=r"already exists.*delete the file if no process uses it"):
        SharedMemoryTransport("flowrl-stale", create=True, directory=str(tmp_path))
    reader = SharedMemoryTransport("flowrl-stale", create=False, directory=str(tmp_path))
    with pytest.raises(TransportError, match=r"not a flowrl weight segment"):
        reader.fetch_into({"w": torch.zeros(1)})
    reader.close()


def test_reader_cannot_publish(edge):
    _, reader = edge
    with pytest.raises(TransportError, match=r"reader .* cannot publish"):
        reader.publish({"w": torch.ones(1)}, 0)


def test_writer_and_reader_processes():
    """A writer process publishes 60 versions while this process fetches: never torn, never backwards."""
    segment, versions, numel = _segment(), 60, 65536
    writer = subprocess.Popen(
        [sys.executable, "-m", "tests.runtime.transports.shm_peer", "writer", segment, str(versions), str(numel)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    watchdog = threading.Timer(90, writer.kill)
    watchdog.start()
    reader = SharedMemoryTransport(segment, create=False)  # attaches once the writer's segment exists
    target = make_state(numel)
    seen, torn = [], []
    try:
        assert writer.stdout.readline() == "published 0\n", writer.stderr.read()
        assert reader.fetch_into(target) == 0
        writer.stdin.write("go\n")
        writer.stdin.flush()
        deadline = time.monotonic() + 60
        while (not seen or seen[-1] < versions - 1) and time.monotonic() < deadline:
            got = reader.fetch_into(target)  # copies every time, to overlap the writer's publishes
            bad = [k for k, x in target.items() if not bool((x == got).all())]
            if bad:
                torn.append(f"version {got}: {bad}")
                break
            seen.append(got)
        assert writer.stdout.readline() == "published all\n"
        _, writer_err = writer.communicate("close\n", timeout=60)
    finally:
        watchdog.cancel()
        reader.close()
        if writer.poll() is None:
            writer.kill()
    assert torn == []
    assert seen == sorted(seen) and seen[-1] == versions - 1
    assert writer.returncode == 0, writer_err
    assert writer_err == ""  # no resource_tracker warnings, nothing else either
    assert not os.path.exists(f"/dev/shm/{segment}")


_CLEANUP_SCRIPT = """
import os, sys, torch
from flowrl.runtime.transports.shm import SharedMemoryTransport
closed, kept = SharedMemoryTransport(sys.argv[1] + "-closed"), SharedMemoryTransport(sys.argv[1] + "-kept")
for t in (closed, kept):
    t.publish({"w": torch.ones(1000)}, 0)
reader = SharedMemoryTransport(kept.segment_name, create=False)  # attached, never closed
assert reader.fetch_into({"w": torch.zeros(1000)}) == 0
closed.close()
print(os.path.exists(closed.path), os.path.exists(kept.path), flush=True)
pid = os.fork()
if pid == 0:
    sys.exit(0)  # a forked child runs the finalizers at exit: it must not unlink its parent's segment
os.waitpid(pid, 0)
print(os.path.exists(kept.path), flush=True)
# exit without closing `kept` or `reader`
"""


def test_segments_are_unlinked_at_close_and_at_exit_without_warnings():
    segment = _segment()
    proc = subprocess.run(
        [sys.executable, "-W", "default", "-c", _CLEANUP_SCRIPT, segment],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "True", "True"]  # closed: gone; kept: there, also after the child exited
    assert proc.stderr == ""  # no resource_tracker "leaked shared_memory" warnings
    assert not os.path.exists(f"/dev/shm/{segment}-kept") and not os.path.exists(f"/dev/shm/{segment}-closed")
