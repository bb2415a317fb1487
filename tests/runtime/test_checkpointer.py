"""The checkpointer alone: its cadence, a save and a restore of the programs' state and the ledger."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.errors import CheckpointError
from flowrl.examples import build_example
from flowrl.runtime.checkpointing.checkpointer import Checkpointer
from flowrl.runtime.config import RunConfig
from flowrl.runtime.ledger import PromptLedger


class _Program:
    """Keeps one number as its state; a source remembers where it was told to seek."""

    def __init__(self, state: int = 0) -> None:
        self.state, self.position = state, None

    def save(self, path: str) -> None:
        Path(path).write_text(str(self.state))

    def load(self, path: str) -> None:
        self.state = int(Path(path).read_text())

    def seek(self, position: int) -> None:
        self.position = position


def _checkpointer(tmp_path, **config) -> tuple[Checkpointer, dict[str, _Program]]:
    graph = build_example("llamarl")
    programs = {n.name: _Program() for n in graph.nodes}
    return Checkpointer(graph, RunConfig(steps=10, checkpoint_dir=str(tmp_path), **config), programs), programs


@pytest.mark.parametrize(("every", "due"), [(0, []), (1, [0, 1, 2, 3, 4, 5]), (3, [2, 5])])
def test_due_every_n_trainer_steps(tmp_path, every, due):
    checkpoints, _ = _checkpointer(tmp_path, checkpoint_every=every)
    assert [seq for seq in range(6) if checkpoints.due(seq)] == due


def test_save_then_restore_gives_back_the_state_the_version_and_the_ledger(tmp_path):
    checkpoints, programs = _checkpointer(tmp_path)
    policy = next(name for name, p in programs.items() if name == "policy")
    programs[policy].state = 7
    ledger = PromptLedger()
    ledger.consume([0, 1, 3])
    path = checkpoints.save(2, ledger)
    assert checkpoints.last == path and checkpoints.holds(2) and not checkpoints.holds(3)

    again, fresh = _checkpointer(tmp_path)
    restored = again.restore(continuous=True)
    assert restored is not None and (restored.version, restored.data_position, restored.delivered_ahead) == (2, 2, (3,))
    assert fresh[policy].state == 7 and fresh["prompts"].position == 2
    assert again.last == path and again.holds(2)


def test_prompts_delivered_out_of_order_need_continuous_batching_to_resume(tmp_path):
    checkpoints, _ = _checkpointer(tmp_path)
    ledger = PromptLedger()
    ledger.consume([0, 2])
    checkpoints.save(1, ledger)
    again, _ = _checkpointer(tmp_path)
    with pytest.raises(CheckpointError, match="batching='continuous'"):
        again.restore(continuous=False)


def test_nothing_to_restore_is_a_fresh_run(tmp_path):
    checkpoints, _ = _checkpointer(tmp_path)
    assert checkpoints.restore(continuous=False) is None and checkpoints.last is None and not checkpoints.holds(0)
