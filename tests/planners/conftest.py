"""Planner fixtures: the capability table in another state (``flowrl.mesh_support.MESH_SUPPORT``)."""

from __future__ import annotations

import msgspec
import pytest

from flowrl.mesh_support import COMBINATIONS, MESH_SUPPORT


@pytest.fixture
def every_axis_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every kind runs every axis, in every combination, under torchrun (a runtime beyond today's: critics
    and reward models over several ranks, a policy's pp x tp).

    The search over tensor- and pipeline-parallel trainers (its pruning, its hints, tp groups across
    hosts) is tested in this state, which the table reaches row by row; ``test_runnable.py`` tests
    that the search proposes only what the table says runs, in both states of a row.
    """
    for key, entry in list(MESH_SUPPORT.items()):
        if key[1] == "torchrun" and not entry.runs:
            monkeypatch.setitem(MESH_SUPPORT, key, msgspec.structs.replace(entry, runs=True))
    for key in list(COMBINATIONS):  # and every combination of axes, whatever the node's settings
        monkeypatch.setitem(COMBINATIONS, key, ())
