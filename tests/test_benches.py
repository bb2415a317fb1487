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


def test_trainer_parallel_layouts_are_the_meshes_they_name(tmp_path):
    """benches/trainer_parallel.py's placement files decode against its graph into the layouts it
    reports (the planner is given the same placement), on the HF example's tiny model."""
    from flowrl.examples.hf_copy import ASSETS
    from flowrl.graph.refs import load_file_module

    sys.path.insert(0, str(BENCHES))
    try:
        import trainer_parallel
    finally:
        sys.path.remove(str(BENCHES))
    forms = {}
    for name, (placement, sharding, micro) in trainer_parallel.LAYOUTS.items():
        path = tmp_path / f"graph_{name}.py"
        path.write_text(trainer_parallel.GRAPH.format(model=str(ASSETS), new_tokens=4, sharding=sharding, micro_batch=2 if micro == "pp" else micro))
        forms[name] = trainer_parallel.strategy(placement, load_file_module(path).build_graph())
    assert forms == {"one": "gen:d1@0 | policy:d1@1", "dp2": "gen:d1@0 | policy:d2@1-2", "tp2": "gen:d1@0 | policy:t2@1-2", "pp2": "gen:d1@0 | policy:p2@1-2"}


def test_moe_layouts_places_and_prices_the_layouts_it_names(tmp_path):
    """benches/moe_layouts.py's placement files decode against its graph into one process, FSDP2 alone and
    ep = 2 (``policy:d2e2``), and the planner prices the ep = 2 layout with an all-to-all and no expert gathers."""
    import argparse
    import json

    from flowrl.calibration.measure import Measurements
    from flowrl.graph.refs import load_file_module
    from flowrl.placement.forms import decode_placement

    sys.path.insert(0, str(BENCHES))
    try:
        import moe_layouts
    finally:
        sys.path.remove(str(BENCHES))
    args = argparse.Namespace(hidden=32, layers=2, experts=4, top_k=2, expert_width=16)
    model = moe_layouts.write_model(tmp_path / "moe", args)
    m = Measurements(matmul_flops=40e9, copy_bandwidth=6e9, op_overhead_s=4e-6, cores=2, memory_bytes=2**30)
    forms, predicted = {}, {}
    for name, (placement, sharding, _) in moe_layouts.LAYOUTS.items():
        path = tmp_path / f"graph_{name}.py"
        path.write_text(moe_layouts.GRAPH.format(model=str(model), prompts=str(tmp_path / "p.jsonl"), new_tokens=4, sharding=sharding))
        forms[name] = str(decode_placement(json.dumps(placement).encode(), load_file_module(path).build_graph(), where="test"))
        predicted[name] = moe_layouts.predict(path, m, placement)
    assert forms == {"one": "gen:d1@0 | policy:d1@1", "fsdp2": "gen:d1@0 | policy:d2@1-2", "ep2": "gen:d1@0 | policy:d2e2@1-2"}
    assert predicted["ep2"]["policy_parts_s"]["ep_comm"] > 0 and predicted["fsdp2"]["policy_parts_s"]["ep_comm"] == 0
    assert predicted["ep2"]["policy_parts_s"]["dp_comm"] < predicted["fsdp2"]["policy_parts_s"]["dp_comm"]  # no expert gathered
