"""Checkpoints of a sharded policy written behind training under torchrun (FSDP2 on 2 ranks, k = 0):
each rank stages its shards (DCP's ``async_save``) and writes them while the next step runs; every
checkpoint is committed whole, at its own step's version, and a run resumed from one that was written
while a later step trained ends with the uninterrupted run's weights bit for bit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.runtime.test_torchrun import _rows, _torchrun

PLACE = {"gen": [0], "policy": [1, 2]}


def _run(tmp_path: Path, ck: str, steps: int, *extra: str):
    (tmp_path / "place.json").write_text(json.dumps(PLACE))
    proc = _torchrun(3, ["-m", "flowrl", "run", "tests.runtime.test_fsdp:fsdp_graph", "--backend", "torchrun", "--plan", "place.json",
                         "--steps", str(steps), "--quiet", "--metrics", f"{ck}.jsonl", "--checkpoint-dir", ck, "--checkpoint-every", "1",
                         "--max-staleness", "0", *extra], tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _rows(tmp_path / f"{ck}.jsonl")


@pytest.mark.slow  # CI time (a torchrun job, ~25 s at load 6); the default suite's vLLM test (test_vllm_torchrun, direct-k0) checks every checkpoint an FSDP2 policy writes behind training against vLLM's weights, bit for bit
def test_every_sharded_checkpoint_written_behind_training_is_whole_at_its_steps_version(tmp_path):
    from flowrl.runtime.checkpointing.sharded_state import check_complete, read_state
    from flowrl.runtime.checkpointing.store import latest_checkpoint

    rows = _run(tmp_path, "a", 3)
    ck = tmp_path / "a"
    assert [r["step"] for r in rows] == [1, 2, 3] and latest_checkpoint(ck) == ck / "step-00000003"
    assert sorted(p.name for p in ck.glob("step-*")) == ["step-00000001", "step-00000002", "step-00000003"]
    assert not list(ck.glob(".step-*")) and not list(ck.glob(".trash-*"))  # nothing half-written left
    for step in (1, 2, 3):
        state = ck / f"step-{step:08d}" / "policy-policy.dcp"
        assert check_complete(state).version == step and int(read_state(state)["version"]) == step


@pytest.mark.slow  # CI time (a second torchrun job); the test above checks every checkpoint is whole
def test_a_run_resumed_from_a_checkpoint_written_behind_training_ends_bit_for_bit_equal(tmp_path):
    """Step 2's checkpoint was written while step 3 trained: resumed from it, step 3 gives the same weights."""
    from flowrl.runtime.checkpointing.store import read_policy_state

    whole = _run(tmp_path, "a", 3)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "step-00000003")
    (tmp_path / "b" / "LATEST").write_text("step-00000002")
    shutil.copy(tmp_path / "a.jsonl", tmp_path / "b.jsonl")
    resumed = _run(tmp_path, "b", 3, "--resume")
    assert resumed[-1]["step"] == 3 and resumed[-1]["reward_mean"] == whole[-1]["reward_mean"]
    a, b = read_policy_state(tmp_path / "a"), read_policy_state(tmp_path / "b")
    assert int(a["version"]) == int(b["version"]) == 3
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
