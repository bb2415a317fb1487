"""The checkpointer: when a run writes a checkpoint, writing it, and restoring the newest.

What a checkpoint holds and how it is written belong to ``flowrl.runtime.checkpointing.resume`` (the nodes' state,
the data position and the prompts delivered ahead of it) and ``flowrl.runtime.checkpointing.store`` (the
folders). This part keeps the run's side:

- ``due(seq)``: a checkpoint after step ``seq`` when ``(seq + 1) % checkpoint_every == 0`` (cadences
  count trainer steps).
- ``last`` / ``version``: the newest checkpoint written (or restored) and its version; the final
  checkpoint of a run is skipped when the last periodic one holds the same version (``holds``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from flowrl.errors import CheckpointError
from flowrl.runtime.checkpointing.resume import Restored, restore_run_checkpoint, save_run_checkpoint

if TYPE_CHECKING:
    from flowrl.graph.ir import Graph
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.ledger import PromptLedger
    from flowrl.runtime.programs import NodeProgram

__all__ = ["Checkpointer"]


class Checkpointer:
    """A run's checkpoints (see the module docstring).

    Args:
        graph: the running graph.
        config: the run configuration (``checkpoint_dir``, ``checkpoint_every``, ``keep_checkpoints``, ``steps``).
        programs: node name -> program, whose state the checkpoints hold.
    """

    def __init__(self, graph: Graph, config: RunConfig, programs: Mapping[str, NodeProgram]) -> None:
        self.graph, self.config, self.programs = graph, config, programs
        self.last: Path | None = None
        self.version = -1

    @property
    def enabled(self) -> bool:
        """Whether the run writes checkpoints (``checkpoint_dir`` set)."""
        return bool(self.config.checkpoint_dir)

    def due(self, seq: int) -> bool:
        """Whether a checkpoint follows step ``seq`` (every ``checkpoint_every`` trainer steps)."""
        every = self.config.checkpoint_every
        return bool(self.enabled and every and (seq + 1) % every == 0)

    def holds(self, version: int) -> bool:
        """Whether the newest checkpoint written or restored is of ``version``."""
        return self.version == version

    def save(self, version: int, ledger: PromptLedger) -> Path:
        """Checkpoint the programs' state at ``version`` with the ledger's data position (``resume.save_run_checkpoint``)."""
        if self.config.checkpoint_dir is None:
            raise CheckpointError("a checkpoint needs a checkpoint_dir; this is a flowrl bug")
        self.last = save_run_checkpoint(
            self.config.checkpoint_dir, self.graph, self.programs, version=version, data_position=ledger.watermark,
            previous=self.last, delivered_ahead=ledger.delivered_ahead(), keep=self.config.keep_checkpoints,
        )
        self.version = version
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
        self.last, self.version = restored.path, restored.version
        return restored
