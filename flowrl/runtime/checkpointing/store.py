"""Checkpoints that resume without losing or repeating a prompt, written atomically.

Layout of ``DIR``::

    LATEST                  the name of the newest complete checkpoint (replaced atomically)
    LOCK                    held (flock) by the run writing here; the OS releases it when that process ends
    step-00000010/          one checkpoint (after trainer step 10), renamed into place only once complete
        policy-<node>.pt    trainer state (weights, optimizer, version), loaded with weights_only=True
        policy-<node>.dcp/  or, for a policy sharded over ranks (FSDP2), every rank's shards of that state
                            (torch.distributed.checkpoint; ``flowrl.runtime.checkpointing.sharded_state``)
        graph.json          the graph that wrote it (``flowrl sample`` / ``flowrl eval`` read it)
        meta.json           CheckpointMeta: version, data position, graph fingerprint

A directory belongs to one run at a time (``lock_directory``), and a fresh run does not start
over a directory that holds another run's checkpoints unless told to (``prepare_directory``).

Rollouts in flight at checkpoint time are not saved: their prompts are re-queued (the data
position is the first prompt the trainer has not consumed), so a resumed run regenerates them with
weights at least as fresh. That keeps the staleness bound trivially true across the boundary and
costs at most ``max_staleness`` batches of generation.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import msgspec

from flowrl.errors import CheckpointError, FlowrlError
from flowrl.graph.ir import Graph
from flowrl.graph.serialize import from_json, to_json

__all__ = [
    "CheckpointMeta",
    "graph_fingerprint",
    "CheckpointWriter",
    "latest_checkpoint",
    "read_policy_state",
    "read_meta",
    "holds_checkpoints",
    "prepare_directory",
    "lock_directory",
    "state_file",
    "GRAPH_FILE",
    "LOCK_FILE",
]

#: The graph that wrote a checkpoint, in each ``step-*`` directory.
GRAPH_FILE = "graph.json"
#: The lock file a running writer holds in the checkpoint directory.
LOCK_FILE = "LOCK"


class CheckpointMeta(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a checkpoint holds besides tensors.

    Attributes:
        version: policy version (completed optimizer steps) at the checkpoint.
        data_position: index of the first prompt the trainer has not consumed.
        delivered_ahead: prompt indices above ``data_position`` the trainer consumed already
            (continuous batching delivers out of order; empty in lock step).
        graph: graph name; graph_sha256: fingerprint of its JSON (a resume into another graph fails).
        files: node name -> state file name in the checkpoint directory.
    """

    version: int
    data_position: int
    graph: str
    graph_sha256: str
    files: dict[str, str]
    delivered_ahead: tuple[int, ...] = ()
    wall_time: float = 0.0
    format: int = 1


def state_file(node: str, *, kind: str = "policy", sharded: bool = False) -> str:
    """The name of ``node``'s state in a ``step-*`` directory: ``<kind>-<node>.pt`` (a policy's, or a
    syncing reference's), or a directory ``policy-<node>.dcp`` when the policy's ranks each write their
    own shards.

    Example:
        >>> state_file("policy"), state_file("policy", sharded=True), state_file("ref", kind="reference")
        ('policy-policy.pt', 'policy-policy.dcp', 'reference-ref.pt')
    """
    from flowrl.runtime.checkpointing.sharded_state import SHARDED_SUFFIX

    return f"{kind}-{node}{SHARDED_SUFFIX if sharded else '.pt'}"


def graph_fingerprint(graph: Graph) -> str:
    return hashlib.sha256(to_json(graph, indent=0).encode()).hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointWriter:
    """Writes checkpoints into ``directory``, keeping the newest ``keep``; with ``graph``, each one
    also holds the graph as ``graph.json``."""

    def __init__(self, directory: str | os.PathLike[str], *, keep: int = 3, graph: Graph | None = None) -> None:
        self.directory = Path(directory)
        self.keep = keep
        self.graph = graph

    def _step(self, version: int) -> int:
        """The trainer step a checkpoint of policy ``version`` follows: its directory's number (``version``
        over the graph's updates per batch; the version itself without a graph)."""
        return version // self.graph.updates_per_batch() if self.graph is not None else version

    def staging(self, version: int) -> Path:
        """A fresh temporary directory to write the state files of ``version`` into.

        Staging directories and LATEST temporaries left by a writer that was killed (its pid is
        gone) are removed first: they never looked complete, and nothing else will remove them.
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        self._sweep_orphans()
        tmp = self.directory / f".step-{self._step(version):08d}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        return tmp

    def commit(self, staging: Path, meta: CheckpointMeta) -> Path:
        """Finish a checkpoint: meta.json (last), fsync, rename into place, then point LATEST at it.

        A kill at any point leaves LATEST naming the previous complete checkpoint or this one, never
        a directory without its meta.json: the directory becomes ``step-*`` in one rename, whole.
        """
        from flowrl.runtime.checkpointing.sharded_state import check_complete, written

        for f in meta.files.values():
            if not written(staging / f):  # a file, or a sharded state's directory with its index and info (written last)
                raise CheckpointError(f"checkpoint state file {f!r} was not written in {staging}")
            if (staging / f).is_dir():
                check_complete(staging / f)  # every rank's shard file is here (not on another host's disk)
        if self.graph is not None:
            (staging / GRAPH_FILE).write_text(to_json(self.graph))
        (staging / "meta.json").write_bytes(msgspec.json.encode(meta))
        for written_path in sorted(staging.rglob("*"), key=lambda p: len(p.parts), reverse=True):  # a sharded state's files, then its folder
            if written_path.is_dir():
                _fsync_dir(written_path)
                continue
            with open(written_path, "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(staging)
        final = self.directory / f"step-{self._step(meta.version):08d}"
        trash = None
        if final.exists():  # the same step written again (a fresh run in a used directory): move it aside
            trash = self.directory / f".trash-{final.name}-{os.getpid()}"
            os.replace(final, trash)
        os.replace(staging, final)
        latest_tmp = self.directory / f"LATEST.tmp-{os.getpid()}"
        latest_tmp.write_text(final.name)
        os.replace(latest_tmp, self.directory / "LATEST")
        _fsync_dir(self.directory)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        self._prune(self._step(meta.version))
        return final

    def _prune(self, last: int) -> None:
        """Keep the ``keep`` newest checkpoints up to step ``last`` (the one just written, which LATEST
        names, among them); never touch newer ones (another run's, in a reused directory)."""
        steps = {p: _step_of(p) for p in self.directory.glob("step-*") if p.is_dir()}
        done = sorted(p for p, step in steps.items() if step is not None and step <= last)
        for old in done[: -self.keep]:
            # renamed aside first, in one step: a kill during the deletion must not leave a
            # ``step-*`` directory with its meta.json and half its state files (the sweep of a
            # later run removes the trash of a killed one)
            trash = self.directory / f".trash-{old.name}-{os.getpid()}"
            os.replace(old, trash)
            shutil.rmtree(trash, ignore_errors=True)

    def _sweep_orphans(self) -> None:
        for p in [*self.directory.glob(".step-*.tmp-*"), *self.directory.glob("LATEST.tmp-*"), *self.directory.glob(".trash-*")]:
            pid = p.name.rsplit("-", 1)[-1]
            if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)


def _step_of(path: Path) -> int | None:
    tail = path.name.removeprefix("step-")
    return int(tail) if tail.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint in ``directory``, or None if there is none."""
    pointer = Path(directory) / "LATEST"
    if not pointer.is_file():
        return None
    path = Path(directory) / pointer.read_text().strip()
    if not (path / "meta.json").is_file():
        raise CheckpointError(f"{pointer} points at {path.name}, which is not a complete checkpoint; remove LATEST to start over")
    return path


def read_meta(path: Path, graph: Graph) -> CheckpointMeta:
    """The checkpoint's meta, checked against ``graph``."""
    try:
        meta = msgspec.json.decode((path / "meta.json").read_bytes(), type=CheckpointMeta)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CheckpointError(f"checkpoint {path} has an unreadable meta.json: {exc}") from None
    if meta.graph_sha256 != graph_fingerprint(graph) and not _same_graph_with_defaults(path, graph):
        raise CheckpointError(
            f"checkpoint {path} was written for graph {meta.graph!r} with a different definition{_changes(path, graph)}; "
            "resume with the same graph, or start a new run in another --checkpoint-dir"
        )
    return meta


def _same_graph_with_defaults(path: Path, graph: Graph) -> bool:
    """Whether the checkpoint's ``graph.json``, read by this flowrl, is ``graph``.

    A graph file omits nothing, so one written before flowrl gained a config field lacks it and hashes
    differently; read back, the field takes its default. Equal once read, the graph is the same: the
    checkpoint resumes (a field whose default differs from what the older flowrl did is the
    config's to version, as ever).
    """
    try:
        stored = from_json((path / GRAPH_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError, msgspec.MsgspecError, FlowrlError):
        return False
    return to_json(stored) == to_json(graph)


def _changes(path: Path, graph: Graph, *, shown: int = 3) -> str:
    """What differs between the checkpoint's ``graph.json`` and ``graph``: the first ``shown`` paths."""
    import json

    from flowrl.graph.diff import graph_diff

    try:
        stored = json.loads((path / GRAPH_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ""  # an older checkpoint without graph.json: the fingerprint alone
    changed = graph_diff(stored, json.loads(to_json(graph)))
    if not changed:
        return ""
    more = f" (and {len(changed) - shown} more)" if len(changed) > shown else ""
    return f" (checkpoint -> now: {'; '.join(changed[:shown])}{more})"


def holds_checkpoints(directory: str | os.PathLike[str]) -> bool:
    """True if ``directory`` holds a ``LATEST`` pointer or any ``step-*`` checkpoint."""
    d = Path(directory)
    return (d / "LATEST").exists() or any(p.is_dir() for p in d.glob("step-*"))


def prepare_directory(
    directory: str | os.PathLike[str],
    *,
    resume: bool | Literal["auto"],
    overwrite: bool,
    report: Callable[[str], None] | None = None,
) -> Path | None:
    """Check what a run may do with ``directory`` before it starts; returns the checkpoint to resume from.

    Call it holding the directory's lock (``lock_directory``): with ``overwrite`` it deletes, and the
    decision it returns holds only while nothing else writes there.

    Args:
        directory: the checkpoint directory.
        resume: True: continue from its newest complete checkpoint (which must exist); ``"auto"``:
            continue from it when there is one, start fresh when there is none (a job that torchrun
            restarts runs the same command every time); False: a fresh run.
        overwrite: start over: delete the checkpoints it holds (``step-*``, ``LATEST``) first.
        report: called with a line for each incomplete checkpoint or interrupted save a resume passes
            over (``resume_point.ResumePoint.skipped``).

    Returns:
        The checkpoint to resume from, or None for a fresh run.

    Raises:
        CheckpointError: resuming (True) from a directory with no complete checkpoint, a fresh run
            into a directory that holds checkpoints without ``overwrite``, or resuming and
            ``overwrite`` at once.
    """
    from flowrl.runtime.checkpointing.resume_point import resume_point

    d = Path(directory)
    flag = "--resume auto" if resume == "auto" else "--resume"
    if resume and overwrite:
        raise CheckpointError(f"{flag} continues the checkpoints in --checkpoint-dir, --overwrite-checkpoints deletes them; pick one")
    if resume:
        point = resume_point(d)
        if report is not None:
            for name, why in point.skipped:
                report(f"skipping {d / name} ({why}); {_resumes_from(point.path)}")
        if point.path is not None or resume == "auto":
            return point.path
        where = "does not exist" if not d.exists() else "holds no complete checkpoint"
        raise CheckpointError(
            f"--resume: checkpoint directory {str(directory)!r} {where}; check the path, or drop --resume to start a fresh run "
            "(--resume auto continues when there is a checkpoint and starts fresh when there is none)"
        )
    if holds_checkpoints(d) and not overwrite:
        newest = latest_checkpoint(d) if (d / "LATEST").exists() else None
        what = f"the checkpoints of an earlier run (newest {newest.name})" if newest else "checkpoints of an earlier run"
        raise CheckpointError(
            f"checkpoint directory {str(directory)!r} holds {what}; a fresh run would overwrite them. "
            "Add --resume to continue that run, or --overwrite-checkpoints to delete them and start over "
            "(or choose another --checkpoint-dir); a command that must work on a first start and on a restart "
            "(torchrun --max-restarts) takes --resume auto"
        )
    if overwrite:
        _delete_checkpoints(d)
    return None


def _resumes_from(path: Path | None) -> str:
    return f"resuming from {path.name}, the newest complete one" if path is not None else "no complete checkpoint is left"


def _delete_checkpoints(directory: Path) -> None:
    """Remove ``LATEST`` (first: no pointer at a half-deleted checkpoint) and every ``step-*``."""
    (directory / "LATEST").unlink(missing_ok=True)
    for p in directory.glob("step-*"):
        shutil.rmtree(p, ignore_errors=True)


@contextlib.contextmanager
def lock_directory(directory: str | os.PathLike[str], *, create: bool = True) -> Iterator[Path]:
    """Hold ``directory``'s advisory lock (``flock`` on ``LOCK``) while the body runs.

    The OS releases the lock when the holder exits, however it exits (SIGKILL included), so a crashed
    run never leaves a directory locked.

    Args:
        directory: the checkpoint directory.
        create: make the directory if it does not exist (a resume does not: it needs one).

    Raises:
        CheckpointError: naming the holder's pid when another process holds the lock, or when
            ``directory`` does not exist and ``create`` is false.
    """
    d = Path(directory)
    if not create and not d.is_dir():
        raise CheckpointError(
            f"--resume: checkpoint directory {str(directory)!r} does not exist; check the path, or drop --resume to start a fresh run"
        )
    created = not d.exists()
    d.mkdir(parents=True, exist_ok=True)
    fd = os.open(d / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise CheckpointError(
                f"checkpoint directory {str(directory)!r} is in use by another flowrl run (pid {holder}); "
                "wait for it to finish, stop it, or choose another --checkpoint-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield d
        failed = False
    except BaseException:
        failed = True
        raise
    finally:
        if created and failed and [p.name for p in d.iterdir()] == [LOCK_FILE]:
            # a run that failed before its first checkpoint leaves no directory behind it (removed
            # while still locked, so no other run can hold it)
            (d / LOCK_FILE).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                d.rmdir()
        os.close(fd)  # releases the lock


def now() -> float:
    return time.time()


def _listed_policies(path: Path) -> dict[str, str]:
    """node -> policy state file that ``path``'s meta.json lists (empty when it lists none or is not a CheckpointMeta)."""
    try:
        meta = msgspec.json.decode((path / "meta.json").read_bytes(), type=CheckpointMeta)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return {}
    return {n: f for n, f in meta.files.items() if f.startswith("policy-")}


def read_policy_state(source: str | Path, *, node: str | None = None, optimizer: bool = True) -> dict[str, Any]:
    """The policy state saved in a checkpoint: a ``step-*`` directory, or a run's checkpoint
    directory (its ``LATEST``), in the one-file format (``Trainer.state()``); a sharded policy's
    ``policy-<node>.dcp`` is consolidated in this process (``flowrl.runtime.checkpointing.sharded_state.read_state``).
    ``optimizer=False``: without the optimizer's state, which is then not read.

    Raises:
        CheckpointError: when there is no checkpoint, no policy file (naming the one meta.json lists), or
            several and ``node`` is unset; an incomplete sharded state, one missing a rank's shard file or
            one with a file cut short.
    """
    from flowrl.runtime.checkpointing.sharded_state import SHARDED_SUFFIX, read_state

    path = Path(source).expanduser()
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist (pass a run's --checkpoint-dir or one step-* directory in it)")
    if not (path / "meta.json").is_file():
        latest = latest_checkpoint(path)
        if latest is None:
            raise CheckpointError(f"{str(path)!r} holds no checkpoint (no meta.json, no LATEST)")
        path = latest
    files = sorted([*path.glob("policy-*.pt"), *path.glob(f"policy-*{SHARDED_SUFFIX}")])
    names = [f.name.removeprefix("policy-").removesuffix(".pt").removesuffix(SHARDED_SUFFIX) for f in files]
    listed = _listed_policies(path)
    gone = sorted(f for n, f in listed.items() if (node is None or n == node) and not (path / f).exists())
    if gone:
        raise CheckpointError(
            f"checkpoint {str(path)!r} lacks {gone}, which its meta.json lists (a copy without them, or a directory every "
            "rank did not see); copy them in, or pass an older step-* directory"
        )
    if node is not None:
        if node not in names:
            raise CheckpointError(f"checkpoint {str(path)!r} has no policy {node!r} (it has {names})")
        files = [f for f, name in zip(files, names) if name == node]
    if len(files) != 1:
        raise CheckpointError(f"checkpoint {str(path)!r} holds policies {names}; name one (--node)")
    state = read_state(files[0], optimizer=optimizer)
    if "model" not in state or "model_config" not in state:
        raise CheckpointError(f"{str(files[0])!r} is not a policy state (no 'model' or 'model_config')")
    return state
