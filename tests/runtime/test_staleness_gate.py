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
