"""The checkpointer alone: its cadences (steps, minutes on a fake clock), a save and a restore of the
programs' state and the ledger, and the write behind training (``LATEST`` only once it is on disk, one
write in flight, a failed write raised with the previous checkpoint intact)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from flowrl.errors import CheckpointError, ConfigError
from flowrl.examples import build_example
from flowrl.runtime.checkpointing.checkpointer import Checkpointer
from flowrl.runtime.config import RunConfig
from flowrl.runtime.control.ledger import PromptLedger


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


class _Snapshotting(_Program):
    """Takes its state at ``snapshot``; the write waits for ``release`` (a slow disk), or raises ``fail``."""

    def __init__(self) -> None:
        super().__init__()
        self.release, self.writing, self.fail = threading.Event(), threading.Event(), None

    def snapshot(self, path: str):
        taken = self.state

        def write() -> None:
            self.writing.set()
            assert self.release.wait(30)
            if self.fail is not None:
                raise self.fail
            Path(path).write_text(str(taken))

        return write


def _checkpointer(tmp_path, program=_Program, now=None, **config) -> tuple[Checkpointer, dict[str, _Program]]:
    graph = build_example("llamarl")
    programs = {n.name: program() for n in graph.nodes}
    clock = {} if now is None else {"now": now}
    return Checkpointer(graph, RunConfig(steps=10, checkpoint_dir=str(tmp_path), **config), programs, **clock), programs


@pytest.mark.parametrize(("every", "due"), [(0, []), (1, [0, 1, 2, 3, 4, 5]), (3, [2, 5])])
def test_due_every_n_trainer_steps(tmp_path, every, due):
    checkpoints, _ = _checkpointer(tmp_path, checkpoint_every=every)
    assert [seq for seq in range(6) if checkpoints.due(seq)] == due


def _due_on(checkpoints: Checkpointer, t: list[float], steps: int, step_s: float) -> list[int]:
    """The steps after which ``checkpoints`` saves, each step ``step_s`` seconds on the fake clock ``t``."""
    due = []
    for seq in range(steps):
        t[0] += step_s
        if checkpoints.due(seq):
            due.append(seq)
            checkpoints.save(seq + 1, PromptLedger())
            checkpoints.wait()
    return due


def test_due_every_m_minutes_on_the_clock_beside_the_step_cadence(tmp_path):
    """A checkpoint after the first step that ends 5 minutes after the last one was taken (or the
    checkpointer began), on a fake clock of 70 s steps; the step cadence goes on beside it."""
    t = [100.0]
    minutes, _ = _checkpointer(tmp_path / "m", now=lambda: t[0], checkpoint_every_minutes=5)
    assert _due_on(minutes, t, 10, 70.0) == [4, 9]  # 350 s after the start, then 350 s after that
    t = [0.0]
    both, _ = _checkpointer(tmp_path / "b", now=lambda: t[0], checkpoint_every=6, checkpoint_every_minutes=5)
    assert _due_on(both, t, 12, 70.0) == [4, 5, 10, 11]  # minutes (t = 350 s), steps (6), minutes (350 s after 420), steps (12)
    with pytest.raises(ConfigError, match="checkpoint_every_minutes=-1.0 must be a finite number >= 0"):
        RunConfig(checkpoint_dir=str(tmp_path), checkpoint_every_minutes=-1.0)
    with pytest.raises(ConfigError, match="need a checkpoint directory"):
        RunConfig(checkpoint_every_minutes=5)


def test_the_write_runs_behind_training_and_latest_moves_only_once_it_is_on_disk(tmp_path):
    checkpoints, programs = _checkpointer(tmp_path, program=_Snapshotting)
    programs["policy"].state = 5
    checkpoints.save(1, PromptLedger())  # returns with the write still waiting on the disk
    assert programs["policy"].writing.wait(10)
    programs["policy"].state = 6  # training goes on: the checkpoint holds the state as it was taken
    assert not (tmp_path / "LATEST").exists() and checkpoints.last is None and checkpoints.holds(1)
    programs["policy"].release.set()
    path = checkpoints.wait()
    assert path is not None and (tmp_path / "LATEST").read_text() == path.name and (path / "policy-policy.pt").read_text() == "5"


def test_the_next_save_waits_for_the_previous_write(tmp_path):
    checkpoints, programs = _checkpointer(tmp_path, program=_Snapshotting)
    checkpoints.save(1, PromptLedger())
    assert programs["policy"].writing.wait(10)
    second = threading.Thread(target=checkpoints.save, args=(2, PromptLedger()))
    second.start()
    second.join(0.3)
    assert second.is_alive() and checkpoints.holds(1)  # at most one write in flight: the second save waits
    programs["policy"].release.set()
    second.join(10)
    assert not second.is_alive()
    assert (tmp_path / "step-00000001" / "meta.json").is_file()  # the first was on disk before the second was taken
    assert checkpoints.wait().name == "step-00000002" and (tmp_path / "LATEST").read_text() == "step-00000002"


def test_a_failed_write_is_raised_and_the_previous_checkpoint_stays_latest(tmp_path):
    checkpoints, programs = _checkpointer(tmp_path, program=_Snapshotting)
    programs["policy"].release.set()
    checkpoints.save(1, PromptLedger())
    first = checkpoints.wait()
    programs["policy"].fail = OSError(28, "No space left on device")
    checkpoints.save(2, PromptLedger())
    with pytest.raises(CheckpointError, match=rf"checkpoint of step 2 .*No space left on device.*previous checkpoint {first} is intact"):
        checkpoints.wait()
    assert (tmp_path / "LATEST").read_text() == first.name and checkpoints.last == first
    assert not list(tmp_path.glob(".step-*"))  # the half-written checkpoint is gone


def test_save_then_restore_gives_back_the_state_the_version_and_the_ledger(tmp_path):
    checkpoints, programs = _checkpointer(tmp_path)
    policy = next(name for name, p in programs.items() if name == "policy")
    programs[policy].state = 7
    ledger = PromptLedger()
    ledger.consume([0, 1, 3])
    checkpoints.save(2, ledger)
    path = checkpoints.wait()
    assert path is not None and checkpoints.last == path and checkpoints.holds(2) and not checkpoints.holds(3)

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
    checkpoints.wait()
    again, _ = _checkpointer(tmp_path)
    with pytest.raises(CheckpointError, match="batching='continuous'"):
        again.restore(continuous=False)


def test_nothing_to_restore_is_a_fresh_run(tmp_path):
    checkpoints, _ = _checkpointer(tmp_path)
    assert checkpoints.restore(continuous=False) is None and checkpoints.last is None and not checkpoints.holds(0)
