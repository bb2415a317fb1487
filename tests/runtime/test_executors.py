"""The executors part alone: one executor per node but the losses, channels wired around them."""

from __future__ import annotations

import threading

import pytest

from flowrl.examples import build_example
from flowrl.placement.default import default_placement
from flowrl.runtime.control.channels import ChannelClosed
from flowrl.runtime.control.executors import Executors


class _Program:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def start(self) -> None:
        self.log.append(f"start {self.name}")

    def abort(self) -> None:
        self.log.append(f"abort {self.name}")

    def close(self) -> None:
        self.log.append(f"close {self.name}")
        raise RuntimeError("closing fails")  # must not stop the others closing


def _executors(capacity: int = 3):
    graph = build_example("llamarl")
    log: list[str] = []
    programs = {n.name: _Program(n.name, log) for n in graph.nodes}
    parts = Executors(graph, programs, default_placement(graph, 1, 1), capacity=capacity, intra_op_threads=None)
    return graph, parts, log


def test_a_loss_runs_in_its_policys_executor_and_its_edges_go_to_the_policy():
    graph, parts, _ = _executors()
    losses = {n.name for n in graph.nodes if n.kind == "loss"}
    assert set(parts.executors) == {n.name for n in graph.nodes} - losses
    names = {ch.name for ch in parts.channels}
    expected = {f"{e.src}->{e.dst}" for e in graph.edges if not (e.src in losses and e.dst == "policy")}
    assert names == expected and all(ch.capacity == 3 for ch in parts.channels)
    into_policy = {ch.name for ch in parts.executors["policy"].inputs}
    assert into_policy == {f"{e.src}->{e.dst}" for e in graph.edges if e.dst in losses | {"policy"} and e.src not in losses}
    for name, ex in parts.executors.items():
        for ch, fields in ex.outputs:
            edge = next(e for e in graph.edges if f"{e.src}->{e.dst}" == ch.name)
            assert fields == tuple(edge.fields) and parts.executors[name] is ex


def test_start_join_abort_and_close_reach_every_program():
    _graph, parts, log = _executors()
    ran: list[str] = []
    lock = threading.Lock()

    def main(ex) -> None:
        with lock:
            ran.append(ex.name)

    parts.start(main)
    parts.join(5.0)
    assert sorted(ran) == sorted(parts.executors) and all(not ex.thread.is_alive() for ex in parts.executors.values())
    assert [line for line in log if line.startswith("start")] == [f"start {n}" for n in parts.executors]
    parts.abort()
    parts.close()
    parts.close_channels()
    for ch in parts.channels:  # a closed channel refuses a get
        with pytest.raises(ChannelClosed):
            ch.get()
    assert [line for line in log if line.startswith("close")] == [f"close {n}" for n in parts.executors]
    assert [line for line in log if line.startswith("abort")] == [f"abort {n}" for n in parts.executors]
    parts.close_runners()


def test_take_merges_message_seq_from_every_input_and_refuses_another_seq():
    import torch

    from flowrl.runtime.control.channels import Message

    _graph, parts, _ = _executors()
    policy = parts.executors["policy"]
    for i, ch in enumerate(policy.inputs):
        ch.put(Message(0, {f"field{i}": torch.tensor(i)}))
    assert sorted(policy.take(0)) == [f"field{i}" for i in range(len(policy.inputs))]
    policy.inputs[0].put(Message(2, {}))
    with pytest.raises(RuntimeError, match=r"executor 'policy' expected step 1 on .*, got 2"):
        policy.take(1)


def test_each_thread_is_pinned_before_main_runs(monkeypatch):
    """Pinned to its cores and, with a compute thread per group (intra_op_threads), one torch thread of its own."""
    from flowrl.runtime.control import executors

    calls: list[tuple] = []
    monkeypatch.setattr(executors, "set_thread_cores", lambda cores: calls.append(("cores", threading.current_thread().name, cores)))
    monkeypatch.setattr(executors, "set_intra_op_threads", lambda n: calls.append(("threads", threading.current_thread().name, n)))
    _graph, parts, _ = _executors()
    parts.intra_op_threads = 2
    parts.start(lambda ex: calls.append(("main", threading.current_thread().name, ex.name)))
    parts.join(5.0)
    for name in parts.executors:
        mine = [c[0] for c in calls if c[1] == f"flowrl-{name}"]
        assert mine == ["cores", "threads", "main"], (name, mine)
    parts.close_runners()
