"""A run's checkpoints as the controller takes and restores them: the policies' state (and that of
references that sync with them, ``Node.keeps_state``) plus the data position.

The files and their format (``step-NNNNNNNN/``, ``meta.json``, ``LATEST``) belong to
``flowrl.runtime.checkpointing.store``; this module decides what a run puts in them and reads back:

- :func:`take_run_checkpoint` / :func:`save_run_checkpoint`: every policy program saves its state into a staging folder (one
  file ``policy-<node>.pt``, or a program whose ranks hold shards, ``sharded_state``, a directory
  ``policy-<node>.dcp`` of every rank's shards: ``flowrl.runtime.checkpointing.sharded_state``), which
  is committed with the run's version and data position (the index of the next unread prompt) and,
  for continuous batching, which delivers prompts out of order, the indices above it that the
  trainer consumed already (``delivered_ahead``: a resumed run skips them, so every prompt is
  delivered exactly once). ``take_run_checkpoint`` takes the state now and returns the write (which
  ``background.BackgroundSave`` runs behind training); a
  failure removes the staging folder and names the previous checkpoint, which stays intact.
- :func:`restore_run_checkpoint`: loads the newest complete checkpoint into the programs (each policy
  its state; each source seeks to the data position), or returns None when there is none.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from flowrl.errors import CheckpointError
from flowrl.graph.ir import Graph
from flowrl.runtime.checkpointing.background import snapshot_or_save
from flowrl.runtime.checkpointing.resume_point import resume_point
from flowrl.runtime.checkpointing.store import CheckpointMeta, CheckpointWriter, graph_fingerprint, read_meta, state_file

if TYPE_CHECKING:
    from flowrl.runtime.programs.nodes import NodeProgram  # annotations only: checkpointing sits below the programs

__all__ = ["Restored", "take_run_checkpoint", "save_run_checkpoint", "restore_run_checkpoint"]


class Restored(msgspec.Struct, frozen=True, kw_only=True):
    """What a resumed run continues from: the checkpoint's folder, version and data position."""

    path: Path
    version: int
    data_position: int
    delivered_ahead: tuple[int, ...] = ()


def take_run_checkpoint(
    directory: str,
    graph: Graph,
    programs: Mapping[str, NodeProgram],
    *,
    version: int,
    data_position: int,
    previous: Path | None,
    delivered_ahead: tuple[int, ...] = (),
    keep: int = 3,
) -> Callable[[], Path]:
    """Take the state of every node that keeps some (``Node.keeps_state``: the policies, syncing
    references) in ``programs`` at ``version`` now (``background.snapshot_or_save``: a copy in memory
    where the program can split its save, else its files written); returns the write that finishes
    the checkpoint (the copies' files, then ``CheckpointWriter.commit``: ``LATEST``) and gives the
    committed folder. The write may run on another thread while training goes on.

    The newest ``keep`` checkpoints stay in ``directory`` (``RunConfig.keep_checkpoints``).

    Raises:
        CheckpointError: a program failed to save or the disk is full (here or from the write),
            naming the step, the folder and the intact ``previous`` checkpoint.
    """
    writer = CheckpointWriter(directory, keep=keep, graph=graph)
    staging = writer.staging(version)

    def failed(exc: Exception) -> CheckpointError:
        shutil.rmtree(staging, ignore_errors=True)  # never leave a half-written checkpoint behind
        kept = f"; the previous checkpoint {previous} is intact" if previous else ""
        return CheckpointError(
            f"writing the checkpoint of step {version // graph.updates_per_batch()} (version {version}) to {directory} failed "
            f"({type(exc).__name__}: {exc}){kept}; free disk space or choose another --checkpoint-dir"
        )

    files, writes = {}, []
    try:
        for node in (n for n in graph.nodes if n.keeps_state()):  # the policies, and references that sync
            program = programs[node.name]
            files[node.name] = state_file(node.name, kind=node.kind, sharded=bool(getattr(program, "sharded_state", False)))
            if (write := snapshot_or_save(program, str(staging / files[node.name]))) is not None:
                writes.append(write)
    except Exception as exc:
        raise failed(exc) from exc
    meta = CheckpointMeta(
        version=version,
        data_position=data_position,
        delivered_ahead=delivered_ahead,
        graph=graph.name,
        graph_sha256=graph_fingerprint(graph),
        files=files,
        wall_time=time.time(),
    )

    def finish() -> Path:
        try:
            for write in writes:
                write()
            return writer.commit(staging, meta)
        except Exception as exc:
            raise failed(exc) from exc

    return finish


def save_run_checkpoint(directory: str, graph: Graph, programs: Mapping[str, NodeProgram], **options: Any) -> Path:
    """``take_run_checkpoint`` and its write at once (the trainer waits for the disk); returns the committed folder."""
    return take_run_checkpoint(directory, graph, programs, **options)()


def restore_run_checkpoint(directory: str, graph: Graph, programs: Mapping[str, NodeProgram], *, steps: int) -> Restored | None:
    """Load the newest complete checkpoint in ``directory`` (``resume_point.resume_point``: LATEST's, or
    the newest whole one below it when LATEST's save was interrupted) into ``programs``; None when there
    is none (a fresh run).

    The checkpoint's version counts optimizer steps; the run's ``steps`` count batches, each
    ``graph.updates_per_batch()`` versions.

    Raises:
        CheckpointError: the checkpoint holds a node this graph lacks, a file cannot be loaded, or it
            is already at ``steps``.
    """
    path = resume_point(directory).path
    if path is None:
        return None
    meta = read_meta(path, graph)
    for name, fname in meta.files.items():
        if name not in programs:
            raise CheckpointError(f"checkpoint {path} holds state for node {name!r}, which this graph lacks")
        try:
            programs[name].load(str(path / fname))
        except CheckpointError:
            raise
        except Exception as exc:  # a corrupt, foreign or poisoned file (weights_only refuses code)
            raise CheckpointError(
                f"checkpoint {path} cannot be loaded: {fname} for node {name!r} is unreadable "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                "resume from an intact checkpoint (remove this one and point LATEST at an older step-*)"
            ) from exc
    for node in graph.nodes_of_kind("source"):
        programs[node.name].seek(meta.data_position)
    updates = graph.updates_per_batch()
    if meta.version % updates:
        raise CheckpointError(
            f"checkpoint {path} is at version {meta.version}, not a whole number of batches of {updates} optimizer steps "
            "(num_iterations * num_mini_batches): resume it with the graph that wrote it"
        )
    if meta.version // updates >= steps:
        raise CheckpointError(
            f"checkpoint {path} is at step {meta.version // updates} (version {meta.version}), already >= --steps {steps}; "
            "raise --steps to train further"
        )
    return Restored(path=path, version=meta.version, data_position=meta.data_position, delivered_ahead=meta.delivered_ahead)
