"""The staleness gate alone: k per gated edge, the minimum version, group deadlines, the check."""

from __future__ import annotations

import pytest

from flowrl.examples import build_example
from flowrl.runtime.staleness import EdgeBound, StalenessGate, StalenessViolation


def _gate(k: int = 1, updates: int = 1) -> StalenessGate:
    return StalenessGate(bounds={"gen": EdgeBound(k=k, updates=updates, policy="policy")}, updates=updates)


def test_of_reads_each_gated_edge_and_the_runs_override():
    graph = build_example("llamarl")
    (edge,) = graph.gated_weight_edges()
    gate = StalenessGate.of(graph)
    assert gate.bounds == {edge.dst: EdgeBound(k=edge.max_staleness, updates=graph.updates_per_batch(), policy=edge.src)}
    assert StalenessGate.of(graph, 3).bound(edge.dst).k == 3
    assert StalenessGate.of(graph, 0).widest() == 0 and StalenessGate.of(graph, 2).widest() == 2


@pytest.mark.parametrize(("k", "updates", "seq", "expected"), [(0, 1, 5, 5), (1, 1, 5, 4), (2, 3, 5, 9), (1, 2, 0, -2)])
def test_min_version_is_u_times_seq_minus_k(k, updates, seq, expected):
    assert _gate(k, updates).min_version("gen", seq) == expected


@pytest.mark.parametrize(("k", "updates", "version", "expected"), [(0, 1, 4, 4), (1, 1, 4, 5), (2, 3, 7, 4), (1, 2, 6, 4)])
def test_a_groups_deadline_is_its_versions_step_plus_k(k, updates, version, expected):
    assert _gate(k, updates).bound("gen").deadline(version) == expected


def test_the_policy_is_checked_against_its_smallest_edge():
    gate = StalenessGate(bounds={"a": EdgeBound(k=2, policy="p"), "b": EdgeBound(k=1, policy="p"), "c": EdgeBound(k=5, policy="q")})
    assert gate.gated_by("p") == ["a", "b"] and gate.policy_k("p") == 1 and gate.policy_k("none") == 0
    assert gate.gates("a") and not gate.gates("p")
    with pytest.raises(Exception, match="no gated weight edge"):
        gate.bound("p")


@pytest.mark.parametrize("updates", [1, 2])
def test_check_accepts_the_bound_and_refuses_past_it(updates):
    gate = _gate(k=1, updates=updates)
    seq = 4
    assert gate.check("policy", seq, updates * seq) == updates * seq  # on-policy
    assert gate.check("policy", seq, updates * (seq - 1)) == updates * (seq - 1)  # k steps behind
    with pytest.raises(StalenessViolation, match="breaks max_staleness=1"):
        gate.check("policy", seq, updates * (seq - 1) - 1)
    with pytest.raises(StalenessViolation, match="breaks"):
        gate.check("policy", seq, updates * seq + 1)  # from the future: negative staleness


def test_the_oldest_token_decides_and_a_future_token_is_refused():
    gate = _gate(k=1)
    assert gate.check("policy", 4, 4, token_versions=(3, 4)) == 3
    with pytest.raises(StalenessViolation, match="breaks"):
        gate.check("policy", 4, 4, token_versions=(2, 4))
    with pytest.raises(StalenessViolation, match="from its future"):
        gate.check("policy", 4, 4, token_versions=(4, 5))


def test_the_gate_travels_as_plain_data():
    import msgspec

    from flowrl.runtime.programs.nodes import ProgramEnv

    env = ProgramEnv(staleness=_gate(k=2, updates=3))
    back = msgspec.json.decode(msgspec.json.encode(env), type=ProgramEnv)
    assert back.staleness == env.staleness and back.staleness.min_version("gen", 5) == 9


class _NoGateBackend:
    """A user's backend written before the gate was handed down: it subclasses a built-in and takes no gate."""

    name, crosses_processes = "test-no-gate", False

    def run(self, graph, placement, config, *, on_step=None):
        from flowrl.runtime.backends.local import LocalBackend

        return LocalBackend().run(graph, placement, config, on_step=on_step)


@pytest.mark.parametrize("backend", ["local", "process", "test-no-gate"])
def test_a_run_builds_one_gate_and_hands_it_to_every_part(backend, monkeypatch):
    """``run_graph`` builds the gate once, with the run's override, and the controller, the programs'
    environment (which the process backend sends to its workers) and the default placement read that one."""
    from flowrl.runtime.backends import backend as registry
    from flowrl.runtime.backends import drive
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.control.controller import Controller
    from flowrl.runtime.run import run_graph

    built: list[StalenessGate] = []
    of = StalenessGate.of.__func__  # type: ignore[attr-defined]  # the classmethod's function, wrapped to count its calls

    def counting(cls: type[StalenessGate], graph, max_staleness=None) -> StalenessGate:
        built.append(of(cls, graph, max_staleness))
        return built[-1]

    monkeypatch.setattr(StalenessGate, "of", classmethod(counting))
    monkeypatch.setitem(registry._USER_BACKENDS, "test-no-gate", _NoGateBackend)
    seen: dict[str, object] = {}
    controller_init, placement_of = Controller.__init__, drive.run_placement

    def init(self, *args, **kwargs):
        controller_init(self, *args, **kwargs)
        seen["controller"] = self.gate

    def placement(*args, **kwargs):
        seen["placement"] = kwargs.get("gate")
        return placement_of(*args, **kwargs)

    monkeypatch.setattr(Controller, "__init__", init)
    monkeypatch.setattr(drive, "run_placement", placement)
    monkeypatch.setattr(drive, "ProgramEnv", lambda **fields: _recording_env(seen, fields))
    graph = build_example("llamarl")
    assert graph.max_staleness() != 2  # the override below changes k
    run_graph(graph, RunConfig(steps=2, backend=backend, max_staleness=2))
    assert len(built) == 1, f"{len(built)} staleness gates built in one run"
    (gate,) = built
    assert gate.tightest() == gate.widest() == 2  # the run's override, not the graph's k
    assert seen["controller"] is gate and seen["placement"] is gate and seen["env"] is gate


def _recording_env(seen: dict[str, object], fields: dict[str, object]) -> object:
    from flowrl.runtime.programs.nodes import ProgramEnv

    env = ProgramEnv(**fields)  # type: ignore[arg-type]  # the driver's own fields, passed through
    seen["env"] = env.staleness
    return env


def test_only_the_run_builds_a_gate_and_parts_built_outside_a_run_say_so():
    """The places in the runtime that call ``StalenessGate.of``: ``run_graph`` (the run's gate) and parts
    that also serve callers without one (a unit test, a notebook, a user's backend that subclasses a
    built-in and takes no gate), each building one only when none was handed to it."""
    import ast
    import re
    from pathlib import Path

    import flowrl

    def calls(source: str) -> int:
        return sum(
            isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "of" and ast.unparse(n.func.value) in ("StalenessGate", "cls")
            for n in ast.walk(ast.parse(source))
        )

    runtime = Path(flowrl.__file__).parent / "runtime"
    sites = sorted(str(p.relative_to(runtime)) for p in runtime.rglob("*.py") for _ in range(calls(p.read_text())))
    fallbacks = ["backends/drive.py", "backends/torchrun/backend.py", "control/controller.py", "control/executor_placement.py", "programs/nodes.py"]
    assert sites == sorted([*fallbacks, "run.py"]), sites
    for path in fallbacks:
        text = (runtime / path).read_text()
        assert re.search(r"gate if gate is not None else StalenessGate\.of\(|\(gate or StalenessGate\.of\(|\(env\.staleness or StalenessGate\.of\(", text), path
