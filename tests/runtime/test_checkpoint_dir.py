"""A checkpoint directory belongs to one run: fresh runs do not overwrite it, two runs do not share it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from flowrl.errors import CheckpointError
from flowrl.runtime.checkpointing.store import LOCK_FILE, holds_checkpoints, lock_directory, prepare_directory

HOLD = """
import sys, time
from flowrl.runtime.checkpointing.store import lock_directory
with lock_directory(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(600)
"""


def _checkpoint(directory, step):
    (directory / f"step-{step:08d}").mkdir(parents=True)
    (directory / f"step-{step:08d}" / "meta.json").write_text("{}")
    (directory / "LATEST").write_text(f"step-{step:08d}")


@pytest.mark.parametrize(
    "resume, overwrite, message",
    [
        (False, False, "holds the checkpoints of an earlier run (newest step-00000020); a fresh run would overwrite them. Add --resume to continue that run, or --overwrite-checkpoints"),
        (True, True, "pick one"),
    ],
    ids=["fresh-into-used", "both-flags"],
)
def test_refusals_on_a_used_directory(tmp_path, resume, overwrite, message):
    _checkpoint(tmp_path, 20)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        prepare_directory(tmp_path, resume=resume, overwrite=overwrite)
    assert holds_checkpoints(tmp_path)


def test_a_fresh_run_into_step_checkpoints_without_latest_is_refused(tmp_path):
    """A run killed before its first LATEST (or a LATEST deleted by hand) leaves ``step-*`` checkpoints
    only: a fresh run must still refuse to write over them."""
    _checkpoint(tmp_path, 4)
    _checkpoint(tmp_path, 8)
    (tmp_path / "LATEST").unlink()
    with pytest.raises(CheckpointError, match=re.escape("holds checkpoints of an earlier run; a fresh run would overwrite them")):
        prepare_directory(tmp_path, resume=False, overwrite=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004", "step-00000008"]  # nothing deleted


@pytest.mark.parametrize("exists", [True, False], ids=["empty", "missing"])
def test_resume_from_nothing_is_an_error(tmp_path, exists):
    d = tmp_path / "ck"
    if exists:
        d.mkdir()
    with pytest.raises(CheckpointError, match="drop --resume to start a fresh run"):
        prepare_directory(d, resume=True, overwrite=False)


def test_resume_and_overwrite_do_what_they_say(tmp_path):
    _checkpoint(tmp_path, 20)
    assert prepare_directory(tmp_path, resume=True, overwrite=False) == tmp_path / "step-00000020"
    assert prepare_directory(tmp_path, resume=False, overwrite=True) is None
    assert not holds_checkpoints(tmp_path)


def test_second_holder_fails_at_once_and_a_killed_holder_leaves_it_free(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(CheckpointError, match=f"in use by another flowrl run \\(pid {holder.pid}\\)"):
            with lock_directory(tmp_path):
                pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        holder.stdout.close()
    with lock_directory(tmp_path) as d:  # the OS released the dead holder's lock
        assert (d / LOCK_FILE).read_text().strip() == str(os.getpid())


def test_a_prune_killed_halfway_leaves_no_step_directory_that_looks_complete(tmp_path, monkeypatch):
    """CI once caught a SIGKILL during the deletion of the oldest checkpoint: ``step-00000003``
    kept its meta.json and lost its state file. Pruning renames a checkpoint aside before deleting it."""
    import shutil

    import msgspec

    from flowrl.runtime.checkpointing.store import CheckpointMeta, CheckpointWriter

    writer = CheckpointWriter(tmp_path, keep=1)

    def write(version):
        staging = writer.staging(version)
        (staging / "policy.pt").write_bytes(b"state")
        return writer.commit(staging, CheckpointMeta(version=version, data_position=0, graph="g", graph_sha256="0", files={"policy": "policy.pt"}))

    write(1)

    rmtree = shutil.rmtree

    def killed_halfway(path, ignore_errors=False):  # deletes one state file of a checkpoint, then the process "dies"
        if not (path / "meta.json").is_file():
            return rmtree(path, ignore_errors=ignore_errors)
        next(p for p in sorted(path.iterdir()) if p.name != "meta.json").unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "rmtree", killed_halfway)
    with pytest.raises(KeyboardInterrupt):
        write(2)
    monkeypatch.undo()
    for step in tmp_path.glob("step-*"):
        meta = msgspec.json.decode((step / "meta.json").read_bytes(), type=CheckpointMeta)
        assert all((step / f).is_file() for f in meta.files.values()), f"{step.name} looks complete but is not"
    assert (tmp_path / "LATEST").read_text() == "step-00000002"


def test_resume_auto_starts_fresh_on_nothing_and_continues_on_a_checkpoint(tmp_path):
    """``--resume auto``: None (a fresh run) where ``--resume`` is refused, the checkpoint where it is not."""
    assert prepare_directory(tmp_path / "missing", resume="auto", overwrite=False) is None
    assert prepare_directory(tmp_path, resume="auto", overwrite=False) is None
    _checkpoint(tmp_path, 20)
    assert prepare_directory(tmp_path, resume="auto", overwrite=False) == tmp_path / "step-00000020"
    with pytest.raises(CheckpointError, match=re.escape("--resume auto continues the checkpoints in --checkpoint-dir, --overwrite-checkpoints deletes them")):
        prepare_directory(tmp_path, resume="auto", overwrite=True)
    assert holds_checkpoints(tmp_path)


@pytest.mark.parametrize("resume", [True, "auto"])
def test_a_resume_passes_over_an_unfinished_checkpoint_and_says_so(tmp_path, resume):
    _checkpoint(tmp_path, 4)
    (tmp_path / "step-00000008").mkdir()  # renamed into place without its meta.json (not flowrl's writer)
    (tmp_path / "LATEST").write_text("step-00000008")
    lines: list[str] = []
    assert prepare_directory(tmp_path, resume=resume, overwrite=False, report=lines.append) == tmp_path / "step-00000004"
    assert lines == [f"skipping {tmp_path / 'step-00000008'} (no meta.json: its save did not finish); resuming from step-00000004, the newest complete one"]


def test_resume_with_only_unfinished_checkpoints_is_refused_and_auto_starts_fresh(tmp_path):
    (tmp_path / "step-00000002").mkdir()
    (tmp_path / "LATEST").write_text("step-00000002")
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        prepare_directory(tmp_path, resume=True, overwrite=False)
    lines: list[str] = []
    assert prepare_directory(tmp_path, resume="auto", overwrite=False, report=lines.append) is None
    assert lines == [f"skipping {tmp_path / 'step-00000002'} (no meta.json: its save did not finish); no complete checkpoint is left"]
