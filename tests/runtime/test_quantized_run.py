"""An int8 generator in real runs: AIPO's metrics show the mismatch it causes, a stopped run resumes
exactly, and the process backend's shared-memory weight edge re-quantizes just as the in-process one."""

from __future__ import annotations

import pytest
import torch

from flowrl.errors import NodeExecutionError
from flowrl.examples.llamarl import build_llamarl
from flowrl.runtime.config import RunConfig
from flowrl.runtime.run import run_graph


class _StopAt(Exception):
    """Raised from ``on_step`` to stop a run mid-way, as a crash of the trainer would."""


def _run(workdir, steps: int, *, backend: str = "local", objective: str = "aipo", resume: bool = False, stop_at: int | None = None):
    def stop(row):
        if row["step"] == stop_at:
            raise _StopAt(f"stopped by the test after step {stop_at}")

    graph = build_llamarl(max_staleness=0, precision="int8", objective=objective, transport="shm" if backend == "process" else "inprocess")
    config = RunConfig(steps=steps, max_staleness=0, backend=backend, checkpoint_dir=str(workdir / "ck"), checkpoint_every=2,
                       metrics=str(workdir / "m.jsonl"), resume=resume, progress=False, stall_timeout_s=120)  # fmt: skip
    return run_graph(graph, config, on_step=stop)


def _weights(result) -> dict[str, torch.Tensor]:
    return torch.load(result.checkpoint / "policy-policy.pt", weights_only=True)["model"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("int8"), 4)


def test_aipo_metrics_show_the_quantization_mismatch(uninterrupted):
    """At k = 0 a float32 generator's ratios pi/mu are 1 up to float rounding (max within 1e-6, KL 0);
    an int8 one moves them (measured: max ~1.0015, KL ~1e-7), and the rows carry ratio and truncated fraction,
    and the mismatch over every token (measured: ``mismatch/abs_logp_max`` 1.6e-3 to 2.1e-3, kl -3e-5 to 6e-6)."""
    for row in uninterrupted.rows:
        assert row["staleness"] == 0
        assert "aipo/ratio_mean" in row and "aipo/truncated_frac" in row and 0 <= row["aipo/truncated_frac"] < 0.5
        assert row["aipo/ratio_max"] > 1 + 1e-4 and row["aipo/kl"] > 1e-9
        # the engine/trainer mismatch on the tokens of the trainer's weights (all of them at k = 0): not 0
        assert row["mismatch/tokens"] == row["aipo/tokens"] > 0 and row["mismatch/abs_logp_max"] > 1e-4


def test_a_stopped_int8_run_resumes_exactly(uninterrupted, tmp_path):
    with pytest.raises(NodeExecutionError, match="stopped by the test"):
        _run(tmp_path, 4, stop_at=3)
    resumed = _run(tmp_path, 4, resume=True)
    assert [r["step"] for r in resumed.rows] == [3, 4]
    assert resumed.consumed == uninterrupted.consumed[2:]
    want, got = _weights(uninterrupted), _weights(resumed)
    assert all(torch.equal(want[n], got[n]) for n in want)


@pytest.mark.slow  # worker start-up: 10-50 s on a loaded 2-core machine
def test_the_process_backend_gives_the_same_int8_run(uninterrupted, tmp_path):
    """The generator in its own process fetches over shared memory into float targets and re-quantizes:
    same prompts, same final weights as the in-process run, bit for bit."""
    result = _run(tmp_path, 4, backend="process")
    assert result.consumed == uninterrupted.consumed
    want, got = _weights(uninterrupted), _weights(result)
    assert all(torch.equal(want[n], got[n]) for n in want)


def test_pg_ignores_mu_but_logs_the_ratio(tmp_path):
    result = _run(tmp_path, 2, objective="pg")
    assert all("pg/ratio_mean" in row and "pg/truncated_frac" in row and "aipo/ratio_mean" not in row for row in result.rows)


def test_an_int8_generator_with_tensor_parallelism_is_refused():
    from flowrl.errors import ConfigError
    from flowrl.runtime.backends.torchrun.rank_programs import ParallelGenerator, RankContext, set_context

    class Mesh:  # the two attributes the program reads before touching a process group
        mesh_dim_names = ("dp", "tp")
        mesh = torch.arange(2).reshape(1, 2)

    graph = build_llamarl(precision="int8")
    set_context(RankContext(rank=0, world=2, ranks={"gen": (0, 1)}, programs={}))
    try:
        with pytest.raises(ConfigError, match=r"generator 'gen': precision='int8' does not support tensor parallelism \(its mesh has tp=2\)"):
            ParallelGenerator(graph.node("gen"), graph, None, None, group=None, ranks=(0, 1), mesh=Mesh())  # type: ignore[arg-type]
    finally:
        set_context(None)
