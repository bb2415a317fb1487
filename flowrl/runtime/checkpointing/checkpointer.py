"""The checkpointer: when a run writes a checkpoint, writing it, and restoring the newest.

What a checkpoint holds and how it is written belong to ``flowrl.runtime.checkpointing.resume`` (the nodes' state,
the data position and the prompts delivered ahead of it) and ``flowrl.runtime.checkpointing.store`` (the
folders). This part keeps the run's side:

- ``due(seq)``: a checkpoint after step ``seq`` when ``(seq + 1) % checkpoint_every == 0`` (cadences
  count trainer steps), or when ``checkpoint_every_minutes`` have passed since the last one was taken
  (or since the run began; ``now`` is the clock, ``time.monotonic`` unless a test passes its own).
- ``save``: the state is taken now (``resume.take_run_checkpoint``), written behind training
  (``background.BackgroundSave``: one write in flight at most, the next save waits for it); ``wait``
  blocks until the write in flight is on disk (the run's end, Ctrl-C included, waits so).
- ``last`` / ``version``: the newest checkpoint written (or restored) and the newest version taken;
  the final checkpoint of a run is skipped when the last periodic one holds the same version (``holds``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from flowrl.errors import CheckpointError
from flowrl.runtime.checkpointing.background import BackgroundSave
from flowrl.runtime.checkpointing.resume import Restored, restore_run_checkpoint, take_run_checkpoint

if TYPE_CHECKING:
    from flowrl.graph.ir import Graph
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.control.ledger import PromptLedger
    from flowrl.runtime.programs.nodes import NodeProgram

__all__ = ["Checkpointer"]


class Checkpointer:
    """A run's checkpoints (see the module docstring).

    Args:
        graph: the running graph.
        config: the run configuration (``checkpoint_dir``, ``checkpoint_every``, ``checkpoint_every_minutes``,
            ``keep_checkpoints``, ``steps``).
        programs: node name -> program, whose state the checkpoints hold.
        now: the clock of the time cadence, in seconds.
        background: False: each save writes before it returns (the trainer waits for the disk).
    """

    def __init__(
        self, graph: Graph, config: RunConfig, programs: Mapping[str, NodeProgram], *, now: Callable[[], float] = time.monotonic,
        background: bool = True,
    ) -> None:  # fmt: skip
        self.graph, self.config, self.programs = graph, config, programs
        self.last: Path | None = None
        self.version = -1
        self._now = now
        self._taken_at = now()
        self._writes = BackgroundSave(background=background)

    @property
    def enabled(self) -> bool:
        """Whether the run writes checkpoints (``checkpoint_dir`` set)."""
        return bool(self.config.checkpoint_dir)

    def due(self, seq: int) -> bool:
        """Whether a checkpoint follows step ``seq``: every ``checkpoint_every`` trainer steps, or once
        ``checkpoint_every_minutes`` have passed since the last one was taken."""
        every, minutes = self.config.checkpoint_every, self.config.checkpoint_every_minutes
        if not self.enabled:
            return False
        return bool(every and (seq + 1) % every == 0) or bool(minutes and self._now() - self._taken_at >= 60.0 * minutes)

    def holds(self, version: int) -> bool:
        """Whether the newest checkpoint written or restored is of ``version``."""
        return self.version == version

    def save(self, version: int, ledger: PromptLedger) -> None:
        """Checkpoint the programs' state at ``version`` with the ledger's data position: the state taken
        now, written behind training (``take_run_checkpoint``), after the previous write is done.

        Raises:
            CheckpointError: taking the state failed, or the previous write did.
        """
        if self.config.checkpoint_dir is None:
            raise CheckpointError("a checkpoint needs a checkpoint_dir; this is a flowrl bug")
        self._writes.wait()  # at most one write in flight; its failure is raised here, before another is taken
        write = take_run_checkpoint(
            self.config.checkpoint_dir, self.graph, self.programs, version=version, data_position=ledger.watermark,
            previous=self.last, delivered_ahead=ledger.delivered_ahead(), keep=self.config.keep_checkpoints,
        )
        self.version, self._taken_at = version, self._now()

        def finish() -> None:
            self.last = write()

        self._writes.submit(finish, f"the checkpoint of version {version}")

    def wait(self) -> Path | None:
        """Wait for the write in flight (if any); the newest checkpoint on disk.

        Raises:
            CheckpointError: that write failed (the previous checkpoint is intact).
        """
        self._writes.wait()
        return self.last

    def restore(self, *, continuous: bool) -> Restored | None:
        """Load the newest checkpoint into the programs (``resume.restore_run_checkpoint``); None: nothing to resume.

        Args:
            continuous: every generator batches continuously (only such a run can skip prompts
                delivered out of order).

        Raises:
            CheckpointError: a checkpoint with prompts delivered out of order, resumed without continuous batching.
        """
        if self.config.checkpoint_dir is None:
            raise CheckpointError("resuming needs a checkpoint_dir; this is a flowrl bug")
        restored = restore_run_checkpoint(self.config.checkpoint_dir, self.graph, self.programs, steps=self.config.steps)
        if restored is None:
            return None  # nothing to resume from: a fresh run (the CLI says so)
        if restored.delivered_ahead and not continuous:
            raise CheckpointError(
                f"checkpoint {restored.path} was written by a continuous-batching run ({len(restored.delivered_ahead)} prompts "
                "delivered out of order); resume it with the generator's batching='continuous'"
            )
        self.last, self.version, self._taken_at = restored.path, restored.version, self._now()
        return restored
