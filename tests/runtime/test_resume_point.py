"""Where a resume starts (``flowrl.runtime.checkpointing.resume_point``): LATEST's checkpoint when whole,
else the newest whole one below it; without LATEST the newest whole ``step-*``; what it passes over named."""

from __future__ import annotations

import msgspec

from flowrl.runtime.checkpointing.resume_point import incomplete, resume_point
from flowrl.runtime.checkpointing.store import CheckpointMeta


def _step(d, step: int, *, files: dict[str, str] | None = None, write: bool = True):
    path = d / f"step-{step:08d}"
    path.mkdir(parents=True)
    files = {"policy": "policy-policy.pt"} if files is None else files
    for name in files.values() if write else ():
        (path / name).write_bytes(b"state")
    meta = CheckpointMeta(version=step, data_position=step * 4, graph="g", graph_sha256="0" * 64, files=files)
    (path / "meta.json").write_bytes(msgspec.json.encode(meta))
    return path


def test_latest_when_whole_and_newer_interrupted_saves_named(tmp_path):
    _step(tmp_path, 2)
    four = _step(tmp_path, 4)
    (tmp_path / "LATEST").write_text(four.name)
    (tmp_path / ".step-00000006.tmp-77").mkdir()
    (tmp_path / ".step-00000004.tmp-78").mkdir()  # not newer: a retry of step 4's save, nothing passed over
    point = resume_point(tmp_path)
    assert point.path == four
    assert point.skipped == ((".step-00000006.tmp-77", "the save of step 6 was interrupted"),)


def test_latest_pointed_back_stands_over_newer_whole_checkpoints(tmp_path):
    two = _step(tmp_path, 2)
    _step(tmp_path, 4)
    (tmp_path / "LATEST").write_text(two.name)
    assert resume_point(tmp_path).path == two


def test_an_unwhole_latest_falls_back_to_the_newest_whole_one_below_it(tmp_path):
    two = _step(tmp_path, 2)
    _step(tmp_path, 4, write=False)  # its state file never written
    _step(tmp_path, 6)  # newer than LATEST: not a candidate
    (tmp_path / "LATEST").write_text("step-00000004")
    point = resume_point(tmp_path)
    assert point.path == two
    assert point.skipped == (("step-00000004", "its state policy-policy.pt is not whole: its save did not finish"),)


def test_without_latest_the_newest_whole_step_directory(tmp_path):
    _step(tmp_path, 2)
    four = _step(tmp_path, 4)
    (tmp_path / "step-00000006").mkdir()
    point = resume_point(tmp_path)
    assert point.path == four
    assert point.skipped == (("step-00000006", "no meta.json: its save did not finish"),)


def test_an_unreadable_meta_is_not_an_interrupted_save(tmp_path):
    """meta.json is written before the directory is renamed into place: one that cannot be read is
    corrupt, and read_meta refuses it by name rather than a resume quietly going back."""
    path = tmp_path / "step-00000002"
    path.mkdir()
    (path / "meta.json").write_text("{")
    assert incomplete(path) is None


def test_a_sharded_state_without_its_index_is_unwhole(tmp_path):
    path = _step(tmp_path, 2, files={"policy": "policy-policy.dcp"}, write=False)
    (path / "policy-policy.dcp").mkdir()
    (path / "policy-policy.dcp" / "__0_0.distcp").write_bytes(b"shard")
    assert incomplete(path) == "its state policy-policy.dcp is not whole: its save did not finish"
