"""A run interrupted and resumed from its checkpoint consumes exactly the prompts an uninterrupted run does."""

from __future__ import annotations

import pytest

from flowrl.errors import CheckpointError, NodeExecutionError
from flowrl.runtime.checkpoint import latest_checkpoint
from flowrl.runtime.run import run_graph
from tests.runtime.helpers import synthetic_config


@pytest.mark.parametrize("k", [0, 2])
@pytest.mark.parametrize("fail_step", [4, 7])
def test_resume_after_failure_loses_and_repeats_nothing(graph_k, tmp_path, k, fail_step):
    g = graph_k(k)
    steps = 12
    reference = run_graph(g, synthetic_config(g, steps=steps))
    ckpt = tmp_path / "ckpt"
    with pytest.raises(NodeExecutionError):
        run_graph(g, synthetic_config(g, steps=steps, checkpoint_dir=str(ckpt), checkpoint_every=3,
                                       options={"fail_node": "gen", "fail_step": fail_step}))
    path = latest_checkpoint(ckpt)
    assert path is not None
    first = (fail_step - k) // 3 * 3  # the newest checkpoint the failed run could have written
    resumed = run_graph(g, synthetic_config(g, steps=steps, checkpoint_dir=str(ckpt), resume=True))
    done_before = resumed.rows[0]["step"] - 1
    assert done_before % 3 == 0 and done_before >= min(first, done_before)
    before = reference.consumed[:done_before]
    assert before + resumed.consumed == reference.consumed
    assert resumed.version == steps
    assert all(0 <= r["staleness"] <= k for r in resumed.rows)
    assert resumed.rows[0]["rollout_version"] >= done_before - k  # versions continue across the boundary


def test_resume_into_another_graph_is_refused(graph_k, tmp_path):
    g1, g2 = graph_k(1), graph_k(2)
    run_graph(g1, synthetic_config(g1, steps=3, checkpoint_dir=str(tmp_path)))
    with pytest.raises(CheckpointError, match="different definition"):
        run_graph(g2, synthetic_config(g2, steps=6, checkpoint_dir=str(tmp_path), resume=True))


def test_checkpoint_is_atomic(graph_k, tmp_path):
    g = graph_k(1)
    run_graph(g, synthetic_config(g, steps=6, checkpoint_dir=str(tmp_path), checkpoint_every=2))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["LATEST", "step-00000002", "step-00000004", "step-00000006"]
    assert (tmp_path / "LATEST").read_text() == "step-00000006"


def test_process_backend_checkpoints_and_resumes(graph_k, tmp_path):
    """The final checkpoint is taken from the worker processes before they are shut down."""
    g = graph_k(1)
    first = run_graph(g, synthetic_config(g, steps=4, backend="process", checkpoint_dir=str(tmp_path)))
    assert first.checkpoint is not None and first.checkpoint.name == "step-00000004"
    resumed = run_graph(g, synthetic_config(g, steps=6, backend="process", checkpoint_dir=str(tmp_path), resume=True))
    assert [r["step"] for r in resumed.rows] == [5, 6]
    assert first.consumed + resumed.consumed == run_graph(g, synthetic_config(g, steps=6)).consumed
