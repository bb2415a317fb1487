"""Helpers shared by the runtime tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from flowrl.graph.ir import Graph
from flowrl.runtime.config import RunConfig
from flowrl.runtime.programs.synthetic import synthetic_programs


def synthetic_config(graph: Graph, **overrides) -> RunConfig:
    """A run of ``graph`` with every operator synthetic (2 ms steps unless ``options`` say otherwise)."""
    options = {"gen_s": 0.002, "train_s": 0.002, **overrides.pop("options", {})}
    return RunConfig(programs=synthetic_programs(graph), options=options, stall_timeout_s=30, **overrides)


REPO = Path(__file__).resolve().parents[2]


def launch_ranks(module: str, world: int, tmp: Path, timeout_s: float) -> tuple[dict[int, dict[str, Any]], list[str]]:
    """Run ``python -m module RANK WORLD INIT_FILE OUT_DIR`` as ``world`` processes (a gloo group over a
    file); kill them all and fail the test if they do not finish in ``timeout_s``.

    Returns (rank -> the JSON each rank wrote to ``OUT_DIR/rank<r>.json``, for the ranks that wrote one;
    every rank's combined output).
    """
    out = tmp / "out"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen([sys.executable, "-m", module, str(r), str(world), str(tmp / "pg.init"), str(out)], cwd=REPO, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(world)
    ]
    deadline = time.monotonic() + timeout_s
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"the {world} worker ranks of {module} did not finish in {timeout_s:.0f} s (a rank hangs)")
    results = {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(world) if (out / f"rank{r}.json").exists()}
    return results, logs


@contextmanager
def generator_rank_program(graph: Graph, rank: int, world: int, dp: int, run_dir: Path, *, seed: int) -> Iterator[tuple[Any, Any, Any]]:
    """Node ``gen``'s torchrun rank program on a ``dp x (world // dp)`` mesh of this gloo world, with the
    graph's transports opened under ``run_dir``; yields ``(program, transports, group)`` and clears the
    rank context and closes the transports afterwards."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from flowrl.runtime.backends.torchrun.rank_programs import RankContext, rank_program, set_context
    from flowrl.runtime.programs.nodes import ProgramEnv, SharedTransports
    from flowrl.runtime.weights.edges import transport_specs

    ranks = tuple(range(world))
    mesh = DeviceMesh("cpu", torch.arange(world).reshape(dp, world // dp), mesh_dim_names=("dp", "tp"))
    group = dist.new_group(list(ranks))
    set_context(RankContext(rank=rank, world=world, ranks={"gen": ranks}, programs={}, groups={"gen": group}, meshes={"gen": mesh}))
    specs = transport_specs(graph, str(run_dir))
    transports = SharedTransports(specs)
    try:
        program = rank_program(graph.node("gen"), graph, ProgramEnv(transports=specs, seed=seed, weight_timeout_s=30.0), transports)
        yield program, transports, group
    finally:
        set_context(None)
        transports.close()


def edge_shard_shapes(graph: Graph, world: int, dp: int, rank: int) -> tuple[dict[str, tuple[int, ...]], dict[str, Any]]:
    """The shapes the collective transport's generator layout (``weights/torchrun_edges.py``) gives ``rank`` of
    node ``gen`` on a ``dp x tp`` mesh, and the policy's parameter specs."""
    import msgspec

    from flowrl.runtime.weights.torchrun_edges import _generator_layouts, _param_specs
    from flowrl.placement.resharding import ShardLayout, local_shape

    params = _param_specs(graph, "policy")
    layouts = _generator_layouts(graph, "gen", tuple(range(world)), (("dp", "tp"), (dp, world // dp)), params)
    return {n: local_shape(msgspec.convert(layouts[n], ShardLayout), params[n]["shape"], rank) for n in params}, params


def continuous_draws(generator: Any, prompts: list[list[int]], *, n: int, slots: int, seed: int) -> dict[str, Any]:
    """Run ``prompts`` (``n`` samples each) through a ``SlotBatcher`` of ``slots`` rows until all finish.

    Returns ``{"tokens": {"g.s": ids}, "logprobs": {"g.s": log mu}, "splices", "prefills", "compactions", "steps"}``
    (JSON-ready: what worker ranks write for the test to compare with another model's run).
    """
    import torch

    from flowrl.operators.slots import Sample, SlotBatcher

    batcher = SlotBatcher(generator, slots=slots, rng=torch.Generator().manual_seed(seed))
    for g, prompt in enumerate(prompts):
        for s in range(n):
            batcher.add(Sample(key=(g, s), prompt=list(prompt)))
    done = []
    while batcher.busy or batcher.waiting:
        done += batcher.step()
    key = lambda sample: f"{sample.key[0]}.{sample.key[1]}"  # noqa: E731
    return {
        "tokens": {key(s): s.tokens for s in done},
        "logprobs": {key(s): s.logprobs for s in done},
        "splices": batcher.splices,
        "prefills": batcher.prefills,
        "compactions": batcher.compactions,
        "steps": batcher.steps,
    }


def draws_logprob_atol(model: Any, prompts: list[list[int]], draws: dict[str, Any], *, temperature: float) -> float:
    """``tests.tolerances.logprob_atol`` of ``model`` over each ``continuous_draws`` completion with its prompt."""
    import torch

    from tests.tolerances import logprob_atol

    sequences = [torch.tensor(prompts[int(key.split(".")[0])] + tokens) for key, tokens in draws["tokens"].items()]
    return logprob_atol(model, sequences, temperature=temperature)


def compare_draws(full: dict[str, Any], tp: dict[str, Any]) -> dict[str, Any]:
    """What a worker rank reports on two ``continuous_draws`` runs: same keys, same tokens, the largest log-prob gap, the tp run's counts."""
    keys = sorted(full["tokens"])
    return {
        "keys_equal": keys == sorted(tp["tokens"]),
        "tokens_equal": all(full["tokens"][k] == tp["tokens"].get(k) for k in keys),
        "logprob_diff": max((abs(a - b) for k in keys for a, b in zip(full["logprobs"][k], tp["logprobs"].get(k, []))), default=0.0),
        "lengths": sorted({len(t) for t in tp["tokens"].values()}),
        "completions": len(keys),
        **{f"full_{c}": full[c] for c in ("splices", "prefills", "compactions", "steps")},
        **{c: tp[c] for c in ("splices", "prefills", "compactions", "steps")},
    }
