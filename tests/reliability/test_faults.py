"""Fault injection: a transport failing mid-publish and a full disk while checkpointing are contained."""

from __future__ import annotations

import errno
import threading

import pytest
import torch

from flowrl.errors import NodeExecutionError
from flowrl.examples.llamarl import build_llamarl
from flowrl.runtime.checkpointing.store import latest_checkpoint
from flowrl.runtime.run import run_graph
from flowrl.runtime.transports.registry import create_transport, register_transport
from tests.runtime.helpers import synthetic_config


class FlakyTransport:
    """An in-process transport that raises in the middle of publishing version ``fail_at``."""

    name = "flaky"
    fail_at = 3

    def __init__(self) -> None:
        self.inner = create_transport("inprocess")

    def publish(self, state, version):
        if version == self.fail_at:
            raise OSError("link went down in the middle of a publish")
        self.inner.publish(state, version)

    def latest_version(self):
        return self.inner.latest_version()

    def fetch_into(self, target, *, newer_than=-1):
        return self.inner.fetch_into(target, newer_than=newer_than)

    def close(self):
        self.inner.close()


def _threads_left():
    return [t.name for t in threading.enumerate() if t.name.startswith("flowrl-") and t.is_alive()]


def test_transport_failing_mid_publish_stops_the_run():
    register_transport("flaky", FlakyTransport, replace=True)
    g = build_llamarl(max_staleness=1, transport="flaky")
    with pytest.raises(NodeExecutionError, match=r"node 'policy' \(policy\) failed at step 2: OSError: link went down"):
        run_graph(g, synthetic_config(g, steps=10))
    assert not _threads_left()


def test_full_disk_while_checkpointing_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    g = build_llamarl(max_staleness=1)
    from flowrl.runtime.programs import synthetic

    real_save = torch.save
    calls = {"n": 0}

    def save(obj, path):
        calls["n"] += 1
        if calls["n"] == 2:
            with open(path, "wb") as f:
                f.write(b"half a checkpoint")
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(obj, path)

    monkeypatch.setattr(synthetic.torch, "save", save)
    with pytest.raises(NodeExecutionError, match="No space left on device.*step-00000002 is intact"):
        run_graph(g, synthetic_config(g, steps=10, checkpoint_dir=str(tmp_path), checkpoint_every=2))
    assert not _threads_left()
    path = latest_checkpoint(tmp_path)
    assert path is not None and path.name == "step-00000002"
    assert int(torch.load(path / "policy-policy.pt", weights_only=True)["version"]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "step-00000002"]  # no half-written staging dir
