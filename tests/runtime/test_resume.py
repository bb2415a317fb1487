"""A run interrupted and resumed from its checkpoint consumes exactly the prompts an uninterrupted run does.

Most cases use the synthetic operators (fast, any timing); one runs the default example's real
operators, so the real prompt source's ``seek`` and the real trainer's state are what resume; and a
resume must start from exactly the checkpoint LATEST names.
"""

from __future__ import annotations

import msgspec
import pytest

from flowrl.errors import CheckpointError, NodeExecutionError
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
    # LATEST read here, not through the code under test (k=2, fail_step=4 may fail before step 3's checkpoint)
    latest = int((ckpt / "LATEST").read_text().removeprefix("step-")) if (ckpt / "LATEST").exists() else 0
    # gen starts step fail_step only once the policy is at version fail_step - k, so every checkpoint
    # below that version was committed (the one at exactly that version may still be in flight)
    first = (fail_step - k - 1) // 3 * 3
    assert latest >= first
    resumed = run_graph(g, synthetic_config(g, steps=steps, checkpoint_dir=str(ckpt), resume=True))
    done_before = resumed.rows[0]["step"] - 1
    assert done_before == latest  # the resume starts right after the checkpoint LATEST names
    before = reference.consumed[:done_before]
    assert before + resumed.consumed == reference.consumed
    assert resumed.version == steps
    assert all(0 <= r["staleness"] <= k for r in resumed.rows)
    assert resumed.rows[0]["rollout_version"] >= done_before - k  # versions continue across the boundary


@pytest.mark.parametrize(("latest", "first_step"), [("step-00000006", 7), ("step-00000002", 3)], ids=["newest", "pointed-back"])
def test_resume_starts_from_exactly_the_checkpoint_latest_names(graph_k, tmp_path, latest, first_step):
    """Of step-2, step-4 and step-6, a resume loads the one LATEST names (also one a user pointed it back
    at, as the error for a corrupt checkpoint advises), not the newest directory nor a neighbour."""
    g = graph_k(1)
    reference = run_graph(g, synthetic_config(g, steps=8))
    run_graph(g, synthetic_config(g, steps=6, checkpoint_dir=str(tmp_path), checkpoint_every=2))
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000002", "step-00000004", "step-00000006"]
    (tmp_path / "LATEST").write_text(latest)
    resumed = run_graph(g, synthetic_config(g, steps=8, checkpoint_dir=str(tmp_path), resume=True))
    assert [r["step"] for r in resumed.rows] == list(range(first_step, 9))
    assert resumed.consumed == reference.consumed[first_step - 1:]


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


class _StopAt(Exception):
    """Raised from ``on_step`` to stop a run mid-way, as a crash of the trainer would."""


def _real_run(backend: str, steps: int, workdir, *, resume: bool | str = False, stop_at: int | None = None):
    """The default example with its real operators (synchronous, so its weights are reproducible bit for
    bit), checkpointing every 2 steps; stopped by a failure after step ``stop_at`` if given."""
    from flowrl.examples import build_example
    from flowrl.runtime.config import RunConfig

    def stop(row):
        if row["step"] == stop_at:
            raise _StopAt(f"stopped by the test after step {stop_at}")

    config = RunConfig(steps=steps, max_staleness=0, backend=backend, checkpoint_dir=str(workdir / "ck"), checkpoint_every=2,
                       metrics=str(workdir / "m.jsonl"), resume=resume, progress=False, stall_timeout_s=120)
    return run_graph(build_example("llamarl"), config, on_step=stop)


def _final_weights(result) -> dict:
    import torch

    return torch.load(result.checkpoint / "policy-policy.pt", weights_only=True)["model"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """An uninterrupted real run of 6 steps: (its prompts per step, its final weights)."""
    workdir = tmp_path_factory.mktemp("uninterrupted")
    result = _real_run("local", 6, workdir)
    return result.consumed, _final_weights(result)


@pytest.mark.parametrize("backend", ["local", pytest.param("process", marks=pytest.mark.slow)])  # process: --runslow (CI time; test_process_backend_checkpoints_and_resumes stays)
def test_real_run_stopped_and_resumed_equals_an_uninterrupted_one(uninterrupted, tmp_path, backend):
    """Through the real prompt source (not the synthetic one): the metrics' ``prompt_index`` rows and the
    final weights of a run stopped after step 5 and resumed (from step 4) equal an uninterrupted run's."""
    import torch

    from tests.reliability.killresume import check_run

    want, weights = uninterrupted
    with pytest.raises(NodeExecutionError, match="stopped by the test"):
        _real_run(backend, 6, tmp_path, stop_at=5)
    assert (tmp_path / "ck" / "LATEST").read_text() == "step-00000004"
    resumed = _real_run(backend, 6, tmp_path, resume=True)
    assert [r["step"] for r in resumed.rows] == [5, 6]
    problems: list[str] = []
    lost, repeated = check_run(tmp_path / "m.jsonl", want, 0, problems)
    assert not problems, "\n".join(problems)
    assert (lost, repeated) == (0, 0)
    got = _final_weights(resumed)
    assert got.keys() == weights.keys()
    assert all(torch.equal(got[name], weights[name]) for name in weights), "the resumed run's final weights differ"


def test_a_checkpoint_from_before_a_new_config_field_resumes(graph_k, tmp_path):
    """A flowrl that gained a config field with a default hashes the same graph differently; the
    checkpoint's graph.json, read back, is that graph, so the resume goes on (and a real change is
    still refused)."""
    import hashlib
    import json

    from flowrl.runtime.checkpointing.store import CheckpointMeta, latest_checkpoint

    g = graph_k(1)
    run_graph(g, synthetic_config(g, steps=3, checkpoint_dir=str(tmp_path)))
    step = latest_checkpoint(tmp_path)
    # what an older flowrl wrote: the loss config without clip_eps_high (its default, added later)
    stored = json.loads((step / "graph.json").read_text())
    loss = next(n for n in stored["nodes"] if n["kind"] == "loss")
    assert "clip_eps_high" in loss["loss"], loss
    del loss["loss"]["clip_eps_high"]
    (step / "graph.json").write_text(json.dumps(stored))
    old_sha = hashlib.sha256(json.dumps(stored, separators=(",", ":")).encode()).hexdigest()
    meta = msgspec.json.decode((step / "meta.json").read_bytes(), type=CheckpointMeta)
    (step / "meta.json").write_bytes(msgspec.json.encode(msgspec.structs.replace(meta, graph_sha256=old_sha)))
    resumed = run_graph(g, synthetic_config(g, steps=5, checkpoint_dir=str(tmp_path), resume=True))
    assert [r["step"] for r in resumed.rows] == [4, 5]
    g2 = graph_k(2)
    with pytest.raises(CheckpointError, match="different definition"):
        run_graph(g2, synthetic_config(g2, steps=6, checkpoint_dir=str(tmp_path), resume=True))


def test_real_run_with_resume_auto_starts_fresh_then_continues_bit_for_bit(uninterrupted, tmp_path):
    """``resume="auto"``, the same config for a first start and a restart: into an empty directory a
    fresh run (stopped after step 5), then from its checkpoint of step 4 to the end, with the rows'
    prompts and the final weights of an uninterrupted run."""
    import torch

    from tests.reliability.killresume import check_run

    want, weights = uninterrupted
    with pytest.raises(NodeExecutionError, match="stopped by the test"):
        _real_run("local", 6, tmp_path, resume="auto", stop_at=5)
    assert (tmp_path / "ck" / "LATEST").read_text() == "step-00000004"
    resumed = _real_run("local", 6, tmp_path, resume="auto")
    assert [r["step"] for r in resumed.rows] == [5, 6]
    problems: list[str] = []
    assert check_run(tmp_path / "m.jsonl", want, 0, problems) == (0, 0) and not problems, problems
    got = _final_weights(resumed)
    assert all(torch.equal(got[name], weights[name]) for name in weights), "the resumed run's final weights differ"
