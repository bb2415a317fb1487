"""Tests of the torchrun backend: placement checks, batch sharding, and real torchrun jobs on CPU (gloo).

By default (about 90 s on 2 idle cores): the default example learning with the policy data-parallel
on ranks 1-2 and the generator on rank 0, weights over the collective transport; the generator's
weights equal the trainer's bit for bit after a sync (policy replicas on two ranks, generator
replicas on two others); a rank dying mid-transfer stops the job; too few ranks; the data-parallel
equivalence. ``--runslow`` adds a tensor-parallel generator (tp2), generator replicas colocated with
the policy, the file transport, and a rank that raises. The jobs are launched with
``python -m torch.distributed.run`` (2-4 ranks, c10d rendezvous on a free local port, a timeout on
each). This file is also the jobs' entry point for what the CLI cannot express (fault injection,
the bit-for-bit check, the data-parallel equivalence check): ``python tests/runtime/test_torchrun.py MODE ...``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch

from flowrl.errors import ConfigError, PlanError
from flowrl.examples.llamarl import build_llamarl
from flowrl.placement import load_placement
from flowrl.planners.forms import read_placement
from flowrl.runtime.backends.torchrun.backend import rank_placement
from flowrl.runtime.parallel.distributed import merge_rollouts, shard_by_groups, split_prompts

ROOT = Path(__file__).resolve().parents[2]
THIS = Path(__file__).resolve()
JOB_TIMEOUT_S = 150


def file_graph():
    """The default pipeline with weights over files (a transport every rank layout can use)."""
    return build_llamarl(max_staleness=1, transport="file")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: What libstdc++ prints when ``std::terminate`` is called outside a C++ exception: what kills a rank
#: that finalizes its interpreter while a gloo worker thread, dropping a finished work's tensors, takes
#: the GIL (``flowrl.runtime.backends.torchrun.rank_exit``). Ranks end without finalizing (``end_rank_process``:
#: the jobs' entry points, ``flowrl`` itself); the jobs that only write a result file retry once on it,
#: with a warning carrying the stacks, so that a recurrence shows.
CXX_ABORT = "terminate called without an active exception"


def _torchrun(
    nproc: int, args: list[str], cwd: Path, env: dict[str, str] | None = None, *, retry_cxx_abort: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run ``args`` under torchrun. ``retry_cxx_abort``: a job that only writes its own result file runs
    once more if a rank died of ``CXX_ABORT`` (outside flowrl's Python), with a warning carrying the
    stacks, so the test reports it rather than hiding it."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONFAULTHANDLER": "1", "FLOWRL_DIST_TIMEOUT_S": "30", "FLOWRL_CONNECT_TIMEOUT_S": "30", **(env or {})}

    def once() -> subprocess.CompletedProcess[str]:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", *args,
        ]
        return subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)

    proc = once()
    if retry_cxx_abort and proc.returncode != 0 and CXX_ABORT in proc.stderr:
        import warnings

        warnings.warn(f"a torchrun rank aborted in C++ ({CXX_ABORT}); ran the job again. Its stderr:\n{proc.stderr[-6000:]}", stacklevel=2)
        proc = once()
    return proc


# -- pure parts ------------------------------------------------------------------------------------
def test_shards_are_whole_groups_and_cover_the_batch():
    gid = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 4, 4])
    batch = {"group_ids": gid, "x": torch.arange(10), "rollout_version": torch.tensor(3)}
    shards = shard_by_groups(batch, 3)
    assert [s["x"].tolist() for s in shards] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert all(int(s["rollout_version"]) == 3 for s in shards)
    assert [len(s["x"]) for s in shard_by_groups({"group_ids": gid[:2], "x": torch.arange(2)}, 3)] == [2, 0, 0]


def test_split_and_merge_rollouts_reoffset_groups_and_keep_the_oldest_version():
    prompts = {"prompt_ids": torch.arange(10).reshape(5, 2), "prompt_index": torch.arange(5)}
    parts = split_prompts(prompts, 2)
    assert [p["prompt_index"].tolist() for p in parts] == [[0, 1], [2, 3, 4]]
    rollouts = [
        {"group_ids": torch.arange(len(p["prompt_index"])).repeat_interleave(2), "prompt_index": p["prompt_index"],
         "rollout_version": torch.tensor(v)}
        for p, v in zip(parts, (4, 3))
    ]
    merged = merge_rollouts(rollouts)
    assert merged["group_ids"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert merged["prompt_index"].tolist() == [0, 1, 2, 3, 4]
    assert int(merged["rollout_version"]) == 3


@pytest.mark.parametrize(
    ("placement", "world", "match"),
    [
        ({"gen": [0], "policy": [1, 2, 3]}, 2, r"node 'policy' needs ranks \[1, 2, 3\] but torchrun launched WORLD_SIZE=2"),
        ({"gen": [0]}, 4, "gives node 'policy' no devices"),
        ({"gen": [0], "policy": [1], "reward": [0]}, 4, r"places \['reward'\], which are not device nodes"),
        ({"gen": [0], "policy": [1, 1]}, 4, "must be distinct"),
    ],
    ids=["too-few-ranks", "node-missing", "light-node-placed", "duplicate-rank"],
)
def test_bad_placements_are_plan_errors(tmp_path, placement, world, match):
    path = tmp_path / "place.json"
    path.write_text(json.dumps(placement))
    with pytest.raises(PlanError, match=match):
        rank_placement(file_graph(), read_placement(path, file_graph()), world)


def test_plan_files_give_ranks(tmp_path):
    planners = pytest.importorskip("flowrl.planners.plan")
    graph = file_graph()
    plan = planners.plan_graph(graph, "cpu:3", strategy="gen:d1@0 | policy:d2@1-2")
    planners.save_plan(plan, tmp_path / "plan.json")
    loaded = rank_placement(graph, read_placement(tmp_path / "plan.json", graph), 3)
    assert loaded.devices == {"gen": (0,), "policy": (1, 2)} and not loaded.pin  # ranks, not cores
    with pytest.raises(PlanError, match="WORLD_SIZE=2"):
        rank_placement(graph, read_placement(tmp_path / "plan.json", graph), 2)


@pytest.mark.parametrize(
    ("gen", "match"),
    [
        ({"ranks": [1, 2], "mesh": {"tp": 3}}, r"node 'gen' has mesh tp=3 = 3 ranks but 2 rank\(s\) \[1, 2\]"),
        ({"ranks": [1, 2, 3, 4], "mesh": {"dp": 2, "tp": 3}}, r"node 'gen' has mesh dp=2 x tp=3 = 6 ranks"),
        ({"ranks": [1, 2], "mesh": {"model": 2}}, r"node 'gen' has mesh axis/axes \['model'\]; the axes are \['pp', 'dp', 'tp'\]"),
        ({"ranks": [1, 2], "mesh": {"tp": 0}}, r"node 'gen' has mesh \{'tp': 0\}; every axis size must be an integer >= 1"),
        ({"ranks": [1, 2], "layout": "tp"}, r"node 'gen' must be a list of devices or .*\(Object contains unknown field `layout`\)"),
        ({"mesh": {"tp": 2}}, r"node 'gen' must be a list of devices or .*\(Object missing required field `ranks`\)"),
    ],
    ids=["product-too-big", "2d-product", "unknown-axis", "zero-axis", "unknown-key", "no-ranks"],
)
def test_bad_meshes_are_plan_errors_naming_the_node(tmp_path, gen, match):
    path = tmp_path / "place.json"
    path.write_text(json.dumps({"policy": [0], "gen": gen}))
    with pytest.raises(PlanError, match=match):
        rank_placement(file_graph(), read_placement(path, file_graph()), 8)


def test_json_placements_give_named_meshes(tmp_path):
    path = tmp_path / "place.json"
    path.write_text(json.dumps({"policy": [0], "gen": {"ranks": [1, 2, 3, 4], "mesh": {"dp": 2, "tp": 2}}}))
    placement = rank_placement(file_graph(), read_placement(path, file_graph()), 5)
    gen, policy = placement.nodes["gen"], placement.nodes["policy"]
    assert (policy.devices, policy.axes, policy.mesh_shape) == ((0,), ("pp", "dp", "tp"), (1, 1, 1))
    assert (gen.devices, gen.axes, gen.mesh_shape) == ((1, 2, 3, 4), ("pp", "dp", "tp"), (1, 2, 2))


def test_collective_options_are_plain_data_and_cover_the_model():
    """What every rank computes for a weight edge: shapes from the model config, replica layouts."""
    import msgspec

    from flowrl.operators.trainer import Trainer
    from flowrl.runtime.weights.torchrun_edges import COLLECTIVE, collective_options, participants, weight_transport
    from flowrl.placement.resharding import ShardLayout, minimum_bytes, plan_state

    graph = build_llamarl()
    assert weight_transport("inprocess") == weight_transport("collective") == COLLECTIVE
    assert weight_transport("shm") == "shm" and weight_transport("file") == "file"
    ranks = {"gen": (0, 3), "policy": (1, 2)}
    opts = collective_options(graph, "policy", "gen", ranks, {}, {"gen": (("dp",), (2,))}, 30.0)
    assert msgspec.json.decode(msgspec.json.encode(opts)) == opts  # plain data, JSON round trip
    weights = Trainer(graph.node("policy"), graph.loss_of("policy")).weights()
    assert {n: tuple(p["shape"]) for n, p in opts["params"].items()} == {n: tuple(t.shape) for n, t in weights.items()}
    assert participants(opts) == [0, 1, 2, 3]
    src = msgspec.convert(opts["trainer_layout"], ShardLayout)
    dst = msgspec.convert(opts["generator_layout"], ShardLayout)
    plans = plan_state({n: (p["shape"], p["dtype"]) for n, p in opts["params"].items()}, src, dst)
    sent = {}
    for transfers in plans.values():
        for t in transfers:
            sent[t.src_rank] = sent.get(t.src_rank, 0) + t.numel * 4
    total = sum(minimum_bytes(p["shape"], p["dtype"], src, dst) for p in opts["params"].values())
    assert sum(sent.values()) == total == 2 * 4 * sum(t.numel() for t in weights.values())  # each byte once per generator rank
    assert set(sent) == {1, 2} and min(sent.values()) > 0.3 * total  # both replicas send a share
    # a user program takes part on its lead only
    solo = collective_options(graph, "policy", "gen", ranks, {"gen": "x:y"}, {}, 30.0)
    assert participants(solo) == [0, 1, 2]


# -- jobs ------------------------------------------------------------------------------------------
def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow  # CI time (27 s; the suite reached 10m06s): the collective transport's bytes and bit-exact weights stay in CI
def test_default_example_learns_over_the_collective_transport(tmp_path):
    """The default example (inprocess weight edge -> collective): generator on rank 0, policy
    data-parallel on ranks 1-2 (different layouts: one replica vs two). It learns, every row
    respects max_staleness, and the weights crossed over the collective transport: each step the
    policy's replicas together put one full copy of the weights on the wire (one generator rank)."""
    (tmp_path / "place.json").write_text(json.dumps({"gen": [0], "policy": [1, 2]}))
    steps = 60
    proc = _torchrun(3, ["-m", "flowrl", "run", "llamarl", "--backend", "torchrun", "--plan", "place.json",
                         "--steps", str(steps), "--quiet", "--metrics", "m.jsonl"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(tmp_path / "m.jsonl")
    assert [r["policy_version"] for r in rows] == list(range(1, steps + 1))
    k = build_llamarl().weight_edges[0].max_staleness
    assert k >= 1 and all(0 <= r["staleness"] <= k for r in rows)
    assert any(r["staleness"] == 1 for r in rows)  # async: the generator ran ahead
    first = sum(r["reward_mean"] for r in rows[:10]) / 10
    last = sum(r["reward_mean"] for r in rows[-10:]) / 10
    assert last > first + 0.05 and last > 1.8 * first, (first, last)
    from flowrl.models.families.builtin.model import Transformer

    nbytes = 4 * sum(p.numel() for p in Transformer(build_llamarl().node("policy").model).parameters())
    assert all(r["weights/collective_bytes"] == nbytes for r in rows), rows[0]


@pytest.mark.slow  # CI time: 4 ranks on 2 cores, ~20 s; shard moves are bit-checked by test_collective.py, weights end to end by test_tensor_parallel's on-policy job (--runslow)
def test_generator_weights_equal_the_trainers_bit_for_bit(tmp_path):
    """Policy replicas on ranks 0-1 publish (each sends part), generator replicas on ranks 2-3 fetch;
    after the last sync every generator rank's weights hash like the final checkpoint's."""
    (tmp_path / "place.json").write_text(json.dumps(BITWISE_PLACEMENT))  # once, before the ranks start
    proc = _torchrun(4, [str(THIS), "bitwise"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    hashes = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("gen-rank*.json"))]
    assert len(hashes) == 2, proc.stderr[-3000:]
    latest = (tmp_path / "ck" / "LATEST").read_text().strip() if (tmp_path / "ck" / "LATEST").exists() else None
    ckpts = sorted((tmp_path / "ck").glob("step-*"))
    path = (tmp_path / "ck" / latest) if latest else ckpts[-1]
    state = torch.load(path / "policy-policy.pt", weights_only=True)
    assert all(h["version"] == int(state["version"]) == 3 for h in hashes), (hashes, state["version"])
    assert all(h["sha256"] == _state_hash(state["model"]) for h in hashes)
    assert {h["rank"] for h in hashes} == {2, 3}
    assert all(h["bytes_received"] > 0 for h in hashes)  # over the wire, not a local copy


@pytest.mark.slow
def test_tensor_parallel_generator_learns_over_the_collective_transport(tmp_path):
    """policy on rank 0, a tp2 generator on ranks 1-2 (a JSON placement with a mesh)."""
    (tmp_path / "place.json").write_text(json.dumps({"policy": [0], "gen": {"ranks": [1, 2], "mesh": {"tp": 2}}}))
    proc = _torchrun(3, ["-m", "flowrl", "run", "llamarl", "--backend", "torchrun", "--plan", "place.json",
                         "--steps", "60", "--quiet", "--metrics", "m.jsonl"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(tmp_path / "m.jsonl")
    assert len(rows) == 60 and all(0 <= r["staleness"] <= 1 for r in rows)
    first = sum(r["reward_mean"] for r in rows[:10]) / 10
    last = sum(r["reward_mean"] for r in rows[-10:]) / 10
    assert last > first + 0.05, (first, last)


@pytest.mark.slow
def test_real_pipeline_trains_data_parallel_over_files(tmp_path):
    """gen on rank 0; policy data-parallel on ranks 1-2 (real operators, gloo), weights over an explicit file edge."""
    (tmp_path / "place.json").write_text(json.dumps({"gen": [0], "policy": [1, 2]}))
    proc = _torchrun(3, ["-m", "flowrl", "run", "tests.runtime.test_torchrun:file_graph", "--backend", "torchrun",
                         "--plan", "place.json", "--steps", "4", "--quiet", "--metrics", "m.jsonl",
                         "--checkpoint-dir", "ck"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(tmp_path / "m.jsonl")
    assert [r["policy_version"] for r in rows] == [1, 2, 3, 4]
    assert all(0 <= r["staleness"] <= 1 for r in rows)
    g = file_graph()
    per_step = g.nodes_of_kind("source")[0].source.batch_size * g.nodes_of_kind("generator")[0].sampling.n_samples
    assert all(r["samples"] == per_step and r["train_s"] > 0 for r in rows)
    from flowrl.runtime.observe.metrics import HEALTH_KEYS

    assert all(key in r for r in rows for key in HEALTH_KEYS), [sorted(set(HEALTH_KEYS) - set(r)) for r in rows]  # the dp policy's, reduced over ranks
    assert all(0 < r["policy/entropy"] and 0 < r["policy/grad_norm"] for r in rows), rows
    assert (tmp_path / "ck").is_dir() and any((tmp_path / "ck").iterdir())
    assert "done: 4 steps" in proc.stdout and proc.stdout.count("done:") == 1  # only rank 0 reports


@pytest.mark.slow
@pytest.mark.parametrize("graph", ["tests.runtime.test_torchrun:file_graph", "llamarl"], ids=["file", "collective"])
def test_generator_replicas_colocated_with_the_policy(tmp_path, graph):
    """gen replicas on ranks 0-1, policy on rank 1 (shares rank 1 with a replica: colocation group;
    with the collective transport rank 1 holds both roles)."""
    (tmp_path / "place.json").write_text(json.dumps({"gen": [0, 1], "policy": [1]}))
    proc = _torchrun(2, ["-m", "flowrl", "run", graph, "--backend", "torchrun",
                         "--plan", "place.json", "--steps", "3", "--quiet", "--metrics", "m.jsonl", "--max-staleness", "0"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(tmp_path / "m.jsonl")
    assert [r["staleness"] for r in rows] == [0, 0, 0]
    g = file_graph()
    per_step = g.nodes_of_kind("source")[0].source.batch_size * g.nodes_of_kind("generator")[0].sampling.n_samples
    assert all(r["samples"] == per_step for r in rows)


def test_too_few_ranks_fails_on_every_rank_before_any_work(tmp_path):
    (tmp_path / "place.json").write_text(json.dumps({"gen": [0], "policy": [1, 2]}))
    proc = _torchrun(2, ["-m", "flowrl", "run", "tests.runtime.test_torchrun:file_graph", "--backend", "torchrun",
                         "--plan", "place.json", "--steps", "2", "--quiet", "--metrics", "m.jsonl"], tmp_path)
    assert proc.returncode != 0
    message = "node 'policy' needs ranks [1, 2] but torchrun launched WORLD_SIZE=2"
    # Every rank checks before any work, but torchrun's agent SIGTERMs the others as soon as one rank
    # exits, so the second rank's line may never be printed (seen once in CI): at least one says it.
    assert proc.stderr.count(message) >= 1, proc.stderr[-3000:]
    assert not (tmp_path / "m.jsonl").exists()


@pytest.mark.parametrize(
    ("mode", "expect"),
    [
        pytest.param("raise", "rank 1 of node 'gen' raised RuntimeError: injected failure in gen at step 2", marks=pytest.mark.slow),
        pytest.param("die", "rank 1 of node 'gen' died", marks=pytest.mark.slow),
        ("die-collective", "rank 1 of node 'gen' died"),
    ],
    ids=["rank-raises", "rank-dies", "rank-dies-collective"],
)
def test_a_failing_rank_stops_the_job_naming_rank_and_node(tmp_path, mode, expect):
    """A generator rank that raises or dies (with die-collective: the real generator, its weights over the
    collective transport from a policy on rank 2) stops the whole job within the test's timeout."""
    import time

    start = time.monotonic()
    (tmp_path / "place.json").write_text(json.dumps(FAIL_PLACEMENT))  # once, before the ranks start
    proc = _torchrun(3, [str(THIS), "fail", mode], tmp_path)
    assert proc.returncode != 0
    assert expect in proc.stderr, proc.stderr[-3000:]
    assert time.monotonic() - start < 90


@pytest.mark.parametrize("loss_agg", ["token_mean", pytest.param("seq_mean", marks=pytest.mark.slow), pytest.param("dr_grpo", marks=pytest.mark.slow)])  # the others: --runslow (CI time); test_loss_menu checks every aggregation's dp shares by hand
def test_data_parallel_step_equals_a_single_process_step(tmp_path, loss_agg):
    """Each replica weighs its gradient by its share of the whole batch's count under ``loss_agg``
    (``shaping.loss_normalizer``: tokens, or sequences), which DataParallelPolicy sets."""
    proc = _torchrun(2, [str(THIS), "dp", str(tmp_path / "dp.json"), loss_agg], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "dp.json").read_text())
    from flowrl.examples import build_example

    g = build_example("llamarl")
    total = g.nodes_of_kind("source")[0].source.batch_size * g.nodes_of_kind("generator")[0].sampling.n_samples
    assert result["shards"] == [total // 2, total // 2]  # whole prompt groups, split evenly
    # each gradient element, and the global norm, within the float32 bound of two sums of the same
    # contributions (tests/tolerances.py: GradientMagnitudes, clipped_atol, grad_norm_atol)
    assert result["max_grad_diff_over_bound"] <= 1.0, result
    assert abs(result["grad_norm_dp"] - result["grad_norm_ref"]) <= result["grad_norm_atol"], result
    assert abs(result["loss_dp"] - result["loss_ref"]) <= result["loss_atol"], result


# -- entry points of the jobs above (run under torchrun) -----------------------------------------
# Their plans are written by the test before launch: every rank writing the shared place.json let
# one rank read it while another truncated it ("cannot read it as JSON").
FAIL_PLACEMENT = {"gen": [1], "policy": [2]}
BITWISE_PLACEMENT = {"policy": [0, 1], "gen": [2, 3]}


class _Killer:
    """A synthetic generator that kills its own process at step 2 (a rank dying mid-run)."""

    def __init__(self, node, graph, env, transports):
        from flowrl.runtime.programs.synthetic import synthetic_program

        self.inner = synthetic_program(node, graph, env, transports)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def step(self, seq, inputs, min_version):
        if seq == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.inner.step(seq, inputs, min_version)


class _RealKiller(_Killer):
    """The built-in generator program, killing its own process at step 2 (while weights cross)."""

    def __init__(self, node, graph, env, transports):
        from flowrl.runtime.programs.nodes import GeneratorProgram

        self.inner = GeneratorProgram(node, graph, env, transports, seed=env.seed)


def _state_hash(state) -> str:
    import hashlib

    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _fail_job(mode: str) -> int:
    from flowrl.cli.main import main as cli_main  # noqa: F401 - same error printing as the CLI
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.run import run_graph
    from flowrl.runtime.programs.synthetic import synthetic_programs

    module = __name__ if __name__ != "__main__" else "tests.runtime.test_torchrun"
    if mode == "die-collective":  # real programs, default weight edge (collective)
        graph = build_llamarl()
        programs = {"gen": f"{module}:_RealKiller"}
    else:
        graph = file_graph()
        programs = synthetic_programs(graph)
    if mode == "die":
        programs["gen"] = f"{module}:_Killer"
    place = Path("place.json")  # FAIL_PLACEMENT, written by the test before launch (never by a rank: they race)
    options = {"gen_s": 0.002, "train_s": 0.002}
    if mode == "raise":
        options.update(fail_node="gen", fail_step=2)
    config = RunConfig(steps=6, backend="torchrun", programs=programs, options=options, stall_timeout_s=30)
    try:
        run_graph(graph, load_placement(place, graph), config)
    except Exception as exc:  # noqa: BLE001 - printed as the CLI would
        print(f"flowrl run: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _run_and_hash_generator_weights(graph, out: Path, steps: int = 3, metrics: str | None = None) -> int:
    """Run ``graph`` for ``steps`` steps at k = 0 on place.json (written by the test before launch, never
    by a rank: they race), final checkpoint in ck/; at the job's end, before the transports close, each
    generator rank fetches the newest version into a full model and writes its hash to
    ``out/gen-rank{RANK}.json`` (with the bytes it received). test_fsdp's bit-for-bit job uses it too."""
    import time

    import flowrl.runtime.backends.torchrun.backend as tr
    from flowrl.runtime.weights import torchrun_edges as edges
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.run import run_graph

    rank = int(os.environ["RANK"])
    real_close = edges.close_edges

    def close_after_hashing(**kw):
        t = edges.opened(edges.channel("policy", "gen"))
        if t is not None and t.is_generator:
            specs = edges._param_specs(graph, "policy")  # what the edge carries: every weight, or LoRA adapters
            target = {n: torch.zeros(spec["shape"], dtype=getattr(torch, spec["dtype"])) for n, spec in specs.items()}
            deadline, got = time.monotonic() + 20, None
            while got != steps and time.monotonic() < deadline:
                got = t.fetch_into(target, newer_than=-1)
                time.sleep(0.01)
            record = {"rank": rank, "version": got, "sha256": _state_hash(target), "bytes_received": t.bytes_received}
            Path(out, f"gen-rank{rank}.json").write_text(json.dumps(record))
        real_close(**kw)

    tr.close_edges = close_after_hashing
    try:
        run_graph(graph, load_placement("place.json", graph), RunConfig(steps=steps, backend="torchrun", checkpoint_dir="ck", stall_timeout_s=60, metrics=metrics))
    finally:
        tr.close_edges = real_close
    return 0


def _bitwise_job() -> int:
    """policy replicas on ranks 0-1, generator replicas on 2-3 (BITWISE_PLACEMENT)."""
    return _run_and_hash_generator_weights(build_llamarl(max_staleness=0), Path("."))


def _dp_job(out: str, loss_agg: str) -> int:
    import msgspec
    import torch.distributed as dist

    from flowrl.operators.generation import Generator
    from flowrl.operators.scoring import Scorer
    from flowrl.operators.source import PromptSource
    from flowrl.operators.shaping import loss_normalizer
    from flowrl.operators.trainer import Trainer
    from flowrl.runtime.parallel.distributed import broadcast_batch, make_data_parallel
    from flowrl.operators.losses import combined_rewards, loss_advantages
    from tests.tolerances import GradientMagnitudes, TokenTerms, clipped_atol, grad_norm_atol, rollout_logprob_atol

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    graph = file_graph()
    policy, loss = graph.node("policy"), graph.loss_of("policy")
    loss = msgspec.structs.replace(loss, loss=msgspec.structs.replace(loss.loss, loss_agg=loss_agg))
    batch = None
    if rank == 0:
        prompts = PromptSource(graph.node("prompts")).next_batch()
        rollout = Generator(graph.node("gen"), seed=0).generate(prompts)
        batch = {**rollout, **Scorer(graph.node("reward")).score(rollout)}
    batch = broadcast_batch(batch, src=0, group=None)
    torch.manual_seed(0)
    ref = Trainer(policy, loss)
    torch.manual_seed(0)
    unclipped = msgspec.structs.replace(policy, optimizer=msgspec.structs.replace(policy.optimizer, grad_clip=0.0))
    dp = Trainer(unclipped, loss)
    make_data_parallel(dp, group=None, max_norm=float(policy.optimizer.grad_clip))
    temperature = float(batch["sampling_temperature"][0])
    terms = TokenTerms(  # the loss's float32 bound (tests/tolerances.py), from the weights the step's forward sees
        ref._logprobs(batch, grad=False), batch["behaviour_logprobs"], batch["completion_mask"],
        logprob_tol=rollout_logprob_atol(ref.model, batch, temperature=temperature),
        advantages=loss_advantages(loss.loss, combined_rewards(loss.loss, batch), batch), ref=batch.get("ref_logprobs"), kl_coef=loss.loss.kl_coef,
    )  # fmt: skip
    with GradientMagnitudes(ref.model) as mags:  # the whole batch's |delta|.|x| sums (tests/tolerances.py)
        ref_metrics = ref.train_step(batch)
    width = batch["sample_prompt_ids"].shape[1] + batch["completion_ids"].shape[1]
    micro = policy.optimizer.micro_batch_size
    partials = world * (-(-batch["completion_ids"].shape[0] // micro) if micro else 1)  # each rank's micro-batches, all-reduced
    unclipped_atol = mags.tolerances(seq_len=width, partials=partials, grad_norm=ref_metrics["policy/grad_norm"])
    grads = {n: p.grad for n, p in ref.model.named_parameters()}
    norm_atol = grad_norm_atol(unclipped_atol, ref_metrics["policy/grad_norm"])
    atol = clipped_atol(unclipped_atol, grads, grad_norm=ref_metrics["policy/grad_norm"], max_norm=float(policy.optimizer.grad_clip))
    shard = shard_by_groups(batch, world)[rank]
    dp.dp_token_share = loss_normalizer(loss.loss, shard) / loss_normalizer(loss.loss, batch)  # as DataParallelPolicy.step
    dp_metrics = dp.train_step(shard)
    loss_dp = torch.tensor([dp_metrics["loss"] * dp.dp_token_share], dtype=torch.float64)
    dist.all_reduce(loss_dp)
    diff = max(float((a.grad - b.grad).abs().max()) for a, b in zip(ref.model.parameters(), dp.model.parameters()))
    # the largest |difference| / its float32 bound over every gradient element: <= 1 passes
    over = max(float(((a.grad - b.grad).abs() / atol[n]).nan_to_num(posinf=1e30).max())
               for (n, a), b in zip(ref.model.named_parameters(), dp.model.parameters()))
    sizes = torch.zeros(world, dtype=torch.int64)
    sizes[rank] = shard["completion_mask"].shape[0]
    dist.all_reduce(sizes)
    diffs = torch.tensor([diff, over])
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
    if rank == 0:
        Path(out).write_text(json.dumps({
            "shards": sizes.tolist(),
            "max_grad_diff": float(diffs[0]),
            "max_grad_diff_over_bound": float(diffs[1]),
            "grad_norm_atol": norm_atol,
            "grad_norm_dp": dp.dp_grad_norm,
            "grad_norm_ref": ref_metrics["policy/grad_norm"],
            "loss_dp": float(loss_dp),
            "loss_atol": terms.atol(),
            "loss_ref": ref_metrics["loss"],
        }))
    dist.barrier()  # nobody tears down (rank 0 hosts the store) while a peer is still in a collective
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":  # a rank: ends without interpreter teardown (see rank_exit)
    from flowrl.runtime.backends.torchrun.rank_exit import end_rank_process

    if sys.argv[1] == "fail":
        end_rank_process(_fail_job(sys.argv[2]))
    if sys.argv[1] == "dp":
        end_rank_process(_dp_job(sys.argv[2], sys.argv[3]))
    if sys.argv[1] == "bitwise":
        end_rank_process(_bitwise_job())
    raise SystemExit(f"unknown mode {sys.argv[1]!r}")


def test_weight_edges_of_user_programs_avoid_the_collective_transport(monkeypatch):
    """The collective transport lays out the built-in model: an edge with a user program at an end
    (synthetic operators) uses shm on one host and file across hosts; naming collective is an error."""
    from flowrl.runtime.backends.torchrun.backend import _weight_transport
    from flowrl.runtime.weights.torchrun_edges import COLLECTIVE

    g = build_llamarl(max_staleness=1)
    (edge,) = g.weight_edges
    user = {"gen": "flowrl.runtime.programs.synthetic:synthetic_program"}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert _weight_transport(edge, {}) == COLLECTIVE
    assert _weight_transport(edge, user) == "shm"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert _weight_transport(edge, user) == "file"
    explicit = msgspec.structs.replace(edge, transport="collective")
    with pytest.raises(ConfigError, match="runs a user program.*use transport='shm' or 'file'"):
        _weight_transport(explicit, user)
