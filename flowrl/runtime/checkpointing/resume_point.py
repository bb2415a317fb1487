"""The checkpoint a resume starts from: the newest complete one in a directory, and what it passed over.

``LATEST`` names the newest committed checkpoint (``flowrl.runtime.checkpointing.store.CheckpointWriter.commit``
renames a whole ``step-*`` directory into place, then points ``LATEST`` at it). A resume starts there,
unless that checkpoint is not whole (a save interrupted on a filesystem without atomic renames, a copy
cut short, a sharded state missing a rank's files): then from the newest complete ``step-*`` below it.
Without ``LATEST`` (a run killed between its first checkpoint's rename and its first ``LATEST``), the
newest complete ``step-*`` directory. What a resume passes over, incomplete checkpoints and the staging
folders of interrupted saves (``.step-NNNNNNNN.tmp-PID``) newer than the one chosen, is named in
:attr:`ResumePoint.skipped`, for the run to say.

A ``step-*`` directory is complete when it holds its ``meta.json`` and every state file that lists
is whole (``sharded_index.written``; a sharded state also every rank's shard file). A ``meta.json``
that cannot be read is not an interrupted save (it is written before the directory is renamed into
place): such a checkpoint is chosen, and ``store.read_meta`` refuses it by name.

Example:
    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> (d / "step-00000002").mkdir(); _ = (d / "step-00000002" / "meta.json").write_text("{}")
    >>> (d / "step-00000004").mkdir()  # a save that never finished: no meta.json
    >>> _ = (d / "LATEST").write_text("step-00000004")
    >>> point = resume_point(d)
    >>> point.path.name, point.skipped
    ('step-00000002', (('step-00000004', 'no meta.json: its save did not finish'),))
    >>> resume_point(d / "nowhere")
    ResumePoint(path=None, skipped=())
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from flowrl.errors import CheckpointError

__all__ = ["ResumePoint", "resume_point", "incomplete"]


class ResumePoint(msgspec.Struct, frozen=True):
    """Where a resume starts: ``path``, the checkpoint (None: the directory holds no complete one),
    and ``skipped``, each checkpoint or interrupted save newer than it, as ``(name, why)``."""

    path: Path | None
    skipped: tuple[tuple[str, str], ...] = ()


class _Files(msgspec.Struct):
    """The part of a checkpoint's ``store.CheckpointMeta`` a completeness check reads: its state files."""

    files: dict[str, str]


def incomplete(path: Path) -> str | None:
    """Why the ``step-*`` directory ``path`` is not a whole checkpoint, or None when it is."""
    from flowrl.runtime.checkpointing.sharded_index import read_info, written

    if not path.is_dir():
        return "it does not exist"
    if not (path / "meta.json").is_file():
        return "no meta.json: its save did not finish"
    try:
        meta = msgspec.json.decode((path / "meta.json").read_bytes(), type=_Files)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None  # not an interrupted save: read_meta refuses it, naming the file
    for name in meta.files.values():
        if not written(path / name):
            return f"its state {name} is not whole: its save did not finish"
        if (path / name).is_dir():
            try:
                read_info(path / name)
            except CheckpointError as exc:
                return f"its state {name} is not whole: {str(exc).split(';')[0]}"
    return None


def _step(name: str) -> int | None:
    tail = name.removeprefix("step-")
    return int(tail) if name.startswith("step-") and tail.isdigit() else None


def _staged_step(name: str) -> int | None:
    """The step of a staging folder ``.step-NNNNNNNN.tmp-PID`` (``CheckpointWriter.staging``)."""
    head = name.removeprefix(".").split(".tmp-", 1)[0]
    return _step(head) if name.startswith(".step-") and ".tmp-" in name else None


def resume_point(directory: str | os.PathLike[str]) -> ResumePoint:
    """The newest complete checkpoint in ``directory`` (see the module docstring); reads, never writes."""
    d = Path(directory)
    if not d.is_dir():
        return ResumePoint(None)
    steps = sorted(((s, p) for p in d.glob("step-*") if p.is_dir() and (s := _step(p.name)) is not None), reverse=True)
    skipped: list[tuple[str, str]] = []
    pointer = d / "LATEST"
    if pointer.is_file():
        named = d / pointer.read_text().strip()
        why = incomplete(named)
        if why is None:
            return ResumePoint(named, _interrupted_saves(d, _step(named.name)))
        skipped.append((named.name, why))
        top = _step(named.name)
        steps = [(s, p) for s, p in steps if top is None or s < top]  # LATEST's choice stands, or one older
    for step, path in steps:
        why = incomplete(path)
        if why is None:
            return ResumePoint(path, (*_interrupted_saves(d, step), *skipped))
        skipped.append((path.name, why))
    return ResumePoint(None, (*_interrupted_saves(d, None), *skipped))


def _interrupted_saves(d: Path, above: int | None) -> tuple[tuple[str, str], ...]:
    """The staging folders of saves that never finished, of steps after ``above`` (every one when None)."""
    found = sorted((s, p.name) for p in d.glob(".step-*.tmp-*") if (s := _staged_step(p.name)) is not None and (above is None or s > above))
    return tuple((name, f"the save of step {s} was interrupted") for s, name in reversed(found))
