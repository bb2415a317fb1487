"""Each colocation group's steps run on one compute thread with the group's intra-op threads (local backend)."""

from __future__ import annotations

import threading
from collections import defaultdict

import msgspec
import pytest
import torch

from flowrl.examples.llamarl import build_llamarl
from flowrl.runtime.control.compute_threads import ComputeThread, GroupLock, group_runners
from flowrl.runtime.parallel.threads import set_intra_op_threads
from flowrl.runtime.control.executor_placement import run_placement
from flowrl.runtime.run import run_graph
from flowrl.runtime.programs.synthetic import synthetic_program
from tests.runtime.helpers import synthetic_config

#: node -> {(thread name, torch intra-op threads) seen inside its program's steps}
SEEN: dict[str, set[tuple[str, int]]] = defaultdict(set)


class _Recording:
    """A synthetic program that records where its steps run."""

    def __init__(self, name: str, program) -> None:
        self.name, self.program = name, program

    def step(self, seq, inputs, min_version):
        SEEN[self.name].add((threading.current_thread().name, torch.get_num_threads()))
        return self.program.step(seq, inputs, min_version)

    def __getattr__(self, attr: str):
        return getattr(self.program, attr)


def recording_program(node, graph, env, transports):
    """Factory for ``RunConfig.programs``: the synthetic program of ``node``, recording its steps' threads."""
    return _Recording(node.name, synthetic_program(node, graph, env, transports))


@pytest.mark.parametrize(
    ("k", "threads"),
    [(0, 0), (1, 0), (0, 3), (0, 1)],
    ids=["k0-one-group", "k1-two-groups", "k0-three-threads", "k0-one-thread-lock"],
)
def test_group_steps_run_on_one_compute_thread_with_the_groups_threads(k, threads):
    graph = build_llamarl(max_staleness=k)
    recording = {n.name: f"{__name__}:recording_program" for n in graph.nodes if n.kind != "loss"}
    config = msgspec.structs.replace(synthetic_config(graph, steps=4, max_staleness=k, threads=threads, progress=False), programs=recording)
    placement = run_placement(graph, None, config)
    groups = placement.groups()
    expected_threads = threads or placement.threads_per_group()
    SEEN.clear()
    before = torch.get_num_threads()

    run_graph(graph, config)

    assert torch.get_num_threads() == before  # the caller's thread count is restored
    grouped = {name for group in groups for name in group}
    assert grouped == {"gen", "policy"}
    for group in groups:
        if expected_threads > 1:  # every step of the group: one compute thread, the group's count
            (where,) = {seen for name in group for seen in SEEN[name]}
            assert where == (f"flowrl-compute-{group[0]}", expected_threads), group
        else:  # one thread starts no OpenMP team: each executor runs its steps, under the group's lock
            assert all(SEEN[name] == {(f"flowrl-{name}", 1)} for name in group), group
    for name in ("prompts", "reward"):  # no group: their own executor thread, one intra-op thread (no OpenMP team)
        assert SEEN[name] == {(f"flowrl-{name}", 1)}, name
    assert len(groups) == (1 if k == 0 else 2)


def test_a_thread_keeps_its_count_when_another_sets_one_later():
    counts: list[int] = []
    ready, go = threading.Event(), threading.Event()

    def body() -> None:
        set_intra_op_threads(3)
        ready.set()
        go.wait()
        counts.append(torch.get_num_threads())

    thread = threading.Thread(target=body)
    before = torch.get_num_threads()
    thread.start()
    ready.wait()
    try:
        torch.set_num_threads(1)  # another thread's later setting (the process-wide default) ...
        go.set()
        thread.join()
    finally:
        torch.set_num_threads(before)
    assert counts == [3]  # ... leaves the thread's own count alone


def test_compute_thread_raises_the_steps_error_on_the_caller():
    runner = ComputeThread("flowrl-compute-test", intra_op_threads=1)

    def fail() -> None:
        raise ValueError("step 3 failed")

    try:
        with pytest.raises(ValueError, match="step 3 failed") as info:
            runner.call(fail)
        assert info.traceback[-1].name == "fail"  # the step's own frame is kept
        assert runner.call(lambda: threading.current_thread().name) == "flowrl-compute-test"  # still serving
    finally:
        runner.close()
    with pytest.raises(RuntimeError, match="compute thread 'flowrl-compute-test' is closed"):
        runner.call(lambda: None)


@pytest.mark.parametrize(
    ("intra_op_threads", "kind"),
    [(None, GroupLock), (1, GroupLock), (2, ComputeThread)],
    ids=["proxies-lock", "one-thread-lock", "local-compute-thread"],
)
def test_group_runners_share_one_runner_per_group(intra_op_threads, kind):
    runners = group_runners([["gen", "policy"], ["ref"]], intra_op_threads=intra_op_threads, cores={})
    try:
        assert set(runners) == {"gen", "policy", "ref"}
        assert runners["gen"] is runners["policy"] is not runners["ref"]
        assert all(isinstance(r, kind) for r in runners.values())
    finally:
        for runner in runners.values():
            runner.close()


def test_a_run_that_fails_before_its_first_step_ends_its_compute_threads(monkeypatch, tmp_path):
    from flowrl.errors import CheckpointError
    from flowrl.runtime.checkpointing.checkpointer import Checkpointer

    def refuse(self, *, continuous):
        raise CheckpointError("checkpoint unreadable")

    monkeypatch.setattr(Checkpointer, "restore", refuse)
    graph = build_llamarl(max_staleness=0)
    config = synthetic_config(graph, steps=2, max_staleness=0, threads=2, resume=True, checkpoint_dir=str(tmp_path), progress=False)
    with pytest.raises(CheckpointError, match="checkpoint unreadable"):
        run_graph(graph, config)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("flowrl-compute-")]
