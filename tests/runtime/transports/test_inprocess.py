"""InProcessTransport: the conformance suite, and buffers recycled without ever writing one being read."""

from __future__ import annotations

import threading

import torch

from flowrl.runtime.transports.inprocess import InProcessTransport
from tests.runtime.transports.conformance import TransportConformance


class TestInProcessConformance(TransportConformance):
    def open_pair(self, tmp_path):
        t = InProcessTransport()
        return t, t


class _BlockingTarget(dict):
    """A target whose ``n``-th item lookup blocks until released: a fetch caught in the middle of its copy."""

    def __init__(self, tensors, *, block_at: int) -> None:
        super().__init__(tensors)
        self.lookups = 0
        self.block_at = block_at
        self.reached = threading.Event()
        self.release = threading.Event()

    def __getitem__(self, key):
        self.lookups += 1
        if self.lookups == self.block_at:
            self.reached.set()
            self.release.wait(30)
        return super().__getitem__(key)


def test_publishing_reuses_two_buffers():
    t = InProcessTransport()
    state = {"w": torch.zeros(64)}
    target = {"w": torch.zeros(64)}
    for v in range(20):
        t.publish(state.copy(), v)
        assert t.fetch_into(target) == v
    assert t.buffers_allocated == 2
    t.close()


def test_a_buffer_being_read_is_never_written():
    t = InProcessTransport()
    t.publish({"a": torch.zeros(8), "b": torch.zeros(8)}, 0)
    # check_target looks up 'a' and 'b' (lookups 1, 2); the copy looks up 'a' (3) then blocks before 'b' (4).
    target = _BlockingTarget({"a": torch.full((8,), -1.0), "b": torch.full((8,), -1.0)}, block_at=4)
    got = []
    reader = threading.Thread(target=lambda: got.append(t.fetch_into(target)), name="test-reader")
    reader.start()
    assert target.reached.wait(30)
    for v in range(1, 4):  # three publishes while the reader holds version 0's buffer
        t.publish({"a": torch.full((8,), float(v)), "b": torch.full((8,), float(v))}, v)
    target.release.set()
    reader.join(30)
    assert got == [0]
    assert torch.equal(target["a"], torch.zeros(8)) and torch.equal(target["b"], torch.zeros(8)), "the reader saw a torn state"
    assert t.buffers_allocated == 3  # version 0's buffer stayed pinned, so the publisher needed a third
    fresh = {"a": torch.zeros(8), "b": torch.zeros(8)}
    for v in range(4, 10):
        t.publish({"a": torch.full((8,), float(v)), "b": torch.full((8,), float(v))}, v)
        assert t.fetch_into(fresh) == v and torch.equal(fresh["b"], torch.full((8,), float(v)))
    assert t.buffers_allocated == 3  # the released buffer went back to the pool
    t.close()
