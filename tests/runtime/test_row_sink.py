"""The row sink alone: rows written in step order, each after the evaluation it waits for."""

from __future__ import annotations

import json
from concurrent.futures import Future

import pytest

from flowrl.errors import NodeExecutionError
from flowrl.examples import build_example
from flowrl.runtime.config import RunConfig
from flowrl.runtime.observe.row_sink import RowSink


class _Evaluations:
    """Stands in for ``evaluation.Evaluator``: one Future per submitted version, finished by the test."""

    def __init__(self, *args, **kwargs) -> None:
        self.futures: dict[int, Future] = {}
        self.closed = False

    def submit(self, program, version: int) -> Future:
        self.futures[version] = Future()
        return self.futures[version]

    def close(self) -> None:
        self.closed = True


@pytest.fixture(autouse=True)
def _no_model(monkeypatch):
    monkeypatch.setattr("flowrl.runtime.observe.row_sink.Evaluator", _Evaluations)


def _sink(tmp_path, *, eval_every: int = 0):
    graph = build_example("llamarl")
    config = RunConfig(steps=10, metrics=str(tmp_path / "m.jsonl"), eval_every=eval_every, eval_data="held-out.jsonl" if eval_every else None)
    written, failures = [], []
    sink = RowSink(graph, config, on_step=written.append, fail=lambda node, step, exc: failures.append((node, step, exc)))
    sink.open(0)
    return sink, written, failures, tmp_path / "m.jsonl", sink.eval_policy


def _add(sink, policy, seq):
    sink.add({"step": seq + 1, "policy_version": seq + 1}, policy=policy, seq=seq, version=seq + 1, batch={}, program=None)


def _steps(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_rows_are_written_as_they_come_without_evaluations(tmp_path):
    sink, written, _, path, policy = _sink(tmp_path)
    for seq in range(3):
        _add(sink, policy, seq)
    assert [r["step"] for r in written] == [1, 2, 3] == _steps(path)
    sink.close(wait=True)
    assert [r["step"] for r in sink.rows] == [1, 2, 3]


def test_a_row_waits_for_its_evaluation_and_holds_the_rows_after_it(tmp_path):
    sink, written, failures, path, policy = _sink(tmp_path, eval_every=2)
    for seq in range(3):  # step 2 is evaluated
        _add(sink, policy, seq)
    assert [r["step"] for r in written] == [1]
    sink.evaluator.futures[2].set_result({"eval/version": 2.0, "eval/reward": 0.5})
    _add(sink, policy, 3)  # step 4 waits for its own evaluation
    assert [r["step"] for r in written] == [1, 2, 3]
    assert written[1]["eval/reward"] == 0.5 and written[1]["eval/version"] == 2
    sink.evaluator.futures[4].set_result({"eval/reward": 0.75})
    sink.write(wait=True)
    assert _steps(path) == [1, 2, 3, 4] and written[3]["eval/reward"] == 0.75 and not failures


def test_close_without_waiting_drops_unfinished_evaluations_not_rows(tmp_path):
    sink, written, _, path, policy = _sink(tmp_path, eval_every=2)
    for seq in range(4):
        _add(sink, policy, seq)
    evaluator = sink.evaluator
    sink.close(wait=False)
    assert _steps(path) == [1, 2, 3, 4] and "eval/reward" not in written[1] and evaluator.closed


def test_a_failed_evaluation_fails_the_run_and_its_row_is_written(tmp_path):
    sink, written, failures, path, policy = _sink(tmp_path, eval_every=2)
    _add(sink, policy, 0)
    _add(sink, policy, 1)
    sink.evaluator.futures[2].set_exception(ValueError("no such row"))
    sink.write(wait=True)
    ((node, step, error),) = failures
    assert node == policy and step == 2 and isinstance(error, NodeExecutionError)
    assert "evaluating policy" in str(error) and "no such row" in str(error)
    assert _steps(path) == [1, 2]



def test_notes_reach_the_row_of_their_step_once(tmp_path):
    sink, *_ = _sink(tmp_path)
    sink.note("gen", 3, {"gen_s": 0.5, "version": 2}, generator=True)
    sink.note("prompts", 3, {"data/epoch": 1, "position": 7}, generator=False)  # only namespaced keys go to the row
    sink.note("judge", 3, {"judge/unparsed/judge": 2}, generator=False)
    sink.note("gen", 4, {"gen_s": 0.25}, generator=True)
    gen, metrics = sink.noted(3, generators=["gen"])
    assert gen == {"gen_s": 0.5, "version": 2} and metrics == {"data/epoch": 1, "judge/unparsed/judge": 2}
    assert sink.noted(3, generators=["gen"]) == ({}, {})  # taken once
    assert sink.noted(4, generators=["other", "gen"]) == ({"gen_s": 0.25}, {})


def test_add_step_builds_the_row_from_the_noted_infos(tmp_path):
    """A step's row: the trainer's batch and info, the last gated generator's notes, the other nodes' namespaced metrics."""
    import torch

    sink, written, _, _, policy = _sink(tmp_path)
    sink.note("gen", 0, {"gen_s": 0.5, "fetch_s": 0.1}, generator=True)
    sink.note("prompts", 0, {"data/epoch": 1, "plain": 3}, generator=False)
    batch = {"rewards": torch.tensor([1.0, 0.0]), "prompt_index": torch.tensor([4, 4]), "rollout_version": torch.tensor(0),
             "completion_lens": torch.tensor([3, 5]), "completion_mask": torch.ones(2, 5)}  # fmt: skip
    row = sink.add_step(policy, 0, version=1, generators=["gen"], program=None, rollout_version=0, batch=batch,
                        info={"loss": 0.25, "train_s": 0.2}, time_s=1.0, idle_s=0.0, updates=1)  # fmt: skip
    assert written == [row] and row["step"] == 1 and row["policy_version"] == 1
    assert row["data/epoch"] == 1 and "plain" not in row, "another node's namespaced keys only"
    assert row["gen_s"] == 0.5, "the generator's info"
    assert sink.noted(0, generators=["gen"]) == ({}, {}), "the notes are taken"
    sink.close(wait=True)
