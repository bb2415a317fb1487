"""Benches that hook into flowrl's own names (to time a phase) name what exists: a rename in flowrl
fails here, in the default run, not only when someone runs the bench."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHES = Path(__file__).resolve().parents[1] / "benches"


def test_weight_sync_fsdp_wraps_methods_that_exist():
    sys.path.insert(0, str(BENCHES))
    try:
        import weight_sync_fsdp
    finally:
        sys.path.remove(str(BENCHES))
    missing = [(owner, name) for owner, name, _ in weight_sync_fsdp.PHASES if not callable(getattr(weight_sync_fsdp.phase_owner(owner), name, None))]
    assert not missing, f"benches/weight_sync_fsdp.py wraps names flowrl no longer has: {missing}"
    assert {phase for *_, phase in weight_sync_fsdp.PHASES} == {"build", "sync", "checkpoint"}
