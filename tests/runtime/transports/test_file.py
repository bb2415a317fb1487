"""FileTransport: the conformance suite, what lands on disk, safetensors compatibility, and failures."""

from __future__ import annotations

import errno
import json
import os
import struct

import pytest
import torch

from flowrl.errors import TransportError
from flowrl.runtime.transports import file as file_module
from flowrl.runtime.transports.file import FileTransport, read_safetensors_layout, write_safetensors
from tests.runtime.transports.conformance import DTYPES, TransportConformance, random_tensor, same_bytes


def _header(blob: bytes) -> bytes:
    return struct.pack("<Q", len(blob)) + blob


class TestFileConformance(TransportConformance):
    concurrent_versions = 40  # each publish fsyncs a file and the directory
    random_examples = 8

    def open_pair(self, tmp_path):
        return FileTransport(str(tmp_path / "weights")), FileTransport(str(tmp_path / "weights"))


class TestFileWithoutFsyncConformance(TransportConformance):
    random_examples = 3

    def open_pair(self, tmp_path):
        return FileTransport(str(tmp_path), fsync=False, keep=1), FileTransport(str(tmp_path), fsync=False, keep=1)


def test_only_the_newest_versions_stay_on_disk(tmp_path):
    t = FileTransport(str(tmp_path))
    for v in [0, 1, 2, 5, 9]:
        t.publish({"w": torch.full((3,), float(v))}, v)
    assert sorted(os.listdir(tmp_path)) == ["LATEST", "v5.safetensors", "v9.safetensors"]  # no temporary files either
    assert (tmp_path / "LATEST").read_text() == "9\n"
    t.close()


def test_files_are_standard_safetensors(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    gen = torch.Generator().manual_seed(3)
    state = {f"t{i}": random_tensor((i % 3 + 1, 5), d, gen) for i, d in enumerate(DTYPES)}
    state["scalar"] = torch.tensor(2.5, dtype=torch.bfloat16)
    t = FileTransport(str(tmp_path))
    t.publish(state, 4)
    loaded = safetensors_torch.load_file(str(tmp_path / "v4.safetensors"))
    assert sorted(loaded) == sorted(state)
    assert all(same_bytes(loaded[k], state[k]) for k in state)
    # ... and it reads files that the safetensors package wrote
    safetensors_torch.save_file(state, str(tmp_path / "v7.safetensors"))
    (tmp_path / "LATEST").write_text("7\n")
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    assert t.fetch_into(target, newer_than=4) == 7
    assert all(same_bytes(target[k], state[k]) for k in state)
    t.close()


def test_unaligned_tensors_from_other_writers_are_read(tmp_path):
    """safetensors files need not align offsets to item sizes; such tensors are copied, not viewed."""
    state = {"byte": torch.tensor([7], dtype=torch.uint8), "f": torch.arange(3.0)}
    path = tmp_path / "v0.safetensors"
    write_safetensors(str(path), state)
    data = bytearray(path.read_bytes())
    layout, start = read_safetensors_layout(bytes(data))
    assert [t.name for t in layout.tensors] == ["f", "byte"]  # ours: widest first, so every offset is aligned
    # rewrite the file with the uint8 first: 'f' lands at an odd offset
    header = json.loads(data[8:start])
    header["byte"]["data_offsets"], header["f"]["data_offsets"] = [0, 1], [1, 13]
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + bytes([7]) + state["f"].numpy().tobytes())
    (tmp_path / "LATEST").write_text("0\n")
    target = {"byte": torch.zeros(1, dtype=torch.uint8), "f": torch.zeros(3)}
    assert FileTransport(str(tmp_path)).fetch_into(target) == 0
    assert torch.equal(target["f"], state["f"]) and target["byte"].item() == 7


def test_a_new_writer_continues_after_the_directory_latest(tmp_path):
    FileTransport(str(tmp_path)).publish({"w": torch.ones(1)}, 5)
    again = FileTransport(str(tmp_path))
    assert again.latest_version() == 5
    with pytest.raises(TransportError, match=r"version 3 published after version 5"):
        again.publish({"w": torch.ones(1)}, 3)
    again.publish({"w": torch.ones(1)}, 6)


def test_fetch_rereads_latest_when_its_file_was_pruned(tmp_path, monkeypatch):
    t = FileTransport(str(tmp_path), keep=1)
    t.publish({"w": torch.full((2,), 1.0)}, 1)
    t.publish({"w": torch.full((2,), 2.0)}, 2)  # v1 is pruned
    real = FileTransport._read_latest
    answers = iter([1])  # the first read of LATEST is stale: it names the pruned v1

    monkeypatch.setattr(FileTransport, "_read_latest", lambda self: next(answers, None) or real(self))
    target = {"w": torch.zeros(2)}
    assert t.fetch_into(target) == 2 and torch.equal(target["w"], torch.full((2,), 2.0))


def test_latest_naming_a_missing_file_is_an_error(tmp_path):
    t = FileTransport(str(tmp_path), max_retries=3)
    (tmp_path / "LATEST").write_text("8\n")
    with pytest.raises(TransportError, match=r"gone 3 times in a row"):
        t.fetch_into({"w": torch.zeros(1)})
    (tmp_path / "LATEST").write_text("eight\n")
    with pytest.raises(TransportError, match=r"not a version number"):
        t.latest_version()


def test_a_failed_write_leaves_the_previous_version_and_no_litter(tmp_path, monkeypatch):
    t = FileTransport(str(tmp_path))
    t.publish({"w": torch.full((2,), 1.0)}, 1)
    real = file_module.write_safetensors

    def disk_full(path, state, **kw):
        real(path, state, **kw)  # the bytes are there, then the device fills up
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(file_module, "write_safetensors", disk_full)
    with pytest.raises(TransportError, match=r"could not write version 2: .*No space left"):
        t.publish({"w": torch.full((2,), 2.0)}, 2)
    assert sorted(os.listdir(tmp_path)) == ["LATEST", "v1.safetensors"]
    target = {"w": torch.zeros(2)}
    assert t.fetch_into(target) == 1 and torch.equal(target["w"], torch.ones(2))
    monkeypatch.setattr(file_module, "write_safetensors", real)
    t.publish({"w": torch.full((2,), 2.0)}, 2)  # and version 2 can be published once there is room


@pytest.mark.parametrize(
    ("blob", "match"),
    [
        (b"\x01", r"too short"),
        ((10**9).to_bytes(8, "little") + b"{}", r"declares a 1000000000-byte header"),
        ((2).to_bytes(8, "little") + b"[]", r"unreadable safetensors header"),
        (_header(b'{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,8]}}') + bytes(8), r"'w' \(F32\[4\]\) has data_offsets \[0, 8\]"),
        (_header(b'{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}') + bytes(8), r"'w' .* do not fit .* file's 8 data bytes"),
        (_header(b'{"w":{"dtype":"C128","shape":[1],"data_offsets":[0,16]}}') + bytes(16), r"dtype code 'C128'"),
    ],
    ids=["short", "huge-header", "not-an-object", "offsets-not-the-shape", "offsets-past-the-end", "unknown-dtype"],
)
def test_corrupt_files_are_errors_naming_the_file(tmp_path, blob, match):
    (tmp_path / "v0.safetensors").write_bytes(blob)
    (tmp_path / "LATEST").write_text("0\n")
    with pytest.raises(TransportError, match=match):
        FileTransport(str(tmp_path)).fetch_into({"w": torch.zeros(4)})


@pytest.mark.parametrize(("kwargs", "match"), [({"keep": 0}, r"keep=0"), ({"directory": ""}, r"directory=''")])
def test_bad_options(tmp_path, kwargs, match):
    with pytest.raises(TransportError, match=match):
        FileTransport(**{"directory": str(tmp_path), **kwargs})


def test_unsupported_dtype_names_the_tensor(tmp_path):
    with pytest.raises(TransportError, match=r"tensor 'z' has dtype torch.complex128"):
        FileTransport(str(tmp_path)).publish({"z": torch.zeros(2, dtype=torch.complex128)}, 0)
    assert not [n for n in os.listdir(tmp_path) if n != "LATEST"]
