"""A LoRA policy under torchrun (gloo, CPU): replicated, sharded with FSDP2 or tensor-parallel, its adapters (and only
they) travel over the collective transport, and every generator rank ends with the final checkpoint's
adapters bit for bit.

This file is also the jobs' entry point (``python tests/runtime/test_lora_torchrun.py OUT MODEL_DIR
SHARDING``): the run of ``lora_graph`` for 3 steps at k = 0 on ``place.json``, each generator rank
hashing the newest adapters it fetched (``test_torchrun._run_and_hash_generator_weights``).
The sharded step itself (gradients, moments, checkpoint, resume on another dp size, export) is
``test_fsdp.py``'s ``lora`` family.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.runtime.test_torchrun import _rows, _state_hash, _torchrun

ROOT = Path(__file__).resolve().parents[2]
THIS = Path(__file__).resolve()
LORA = dict(r=2, alpha=4, target_modules=["q_proj", "v_proj"])


def lora_graph(model_dir: str, sharding: str = "fsdp"):
    """prompts -> gen -> reward -> aipo -> policy (LoRA on a Hugging Face model in ``model_dir``)."""
    from flowrl.graph.builder import GraphBuilder
    from flowrl.graph.configs import HFModelConfig

    b = GraphBuilder("lora_torchrun", model=HFModelConfig(path=model_dir, init="random", seed=0))
    prompts = b.source("prompts", task="copy", batch_size=8)
    gen = b.generator("gen", prompts, n_samples=4, max_new_tokens=4, temperature=1.0)
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    aipo = b.loss("aipo", gen, reward, objective="aipo", rho=4.0)
    policy = b.policy("policy", aipo, lr=1e-2, lora=LORA, sharding=sharding)
    b.weights(policy, gen, max_staleness=0)
    return b.build()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.hf_fixtures import make_hf_dir

    return make_hf_dir(tmp_path_factory.mktemp("qwen2"), "qwen2", tie=False)


@pytest.mark.parametrize(
    ("sharding", "place"),
    # both --runslow (a 3-rank job each, ~21 s: CI time); test_fsdp_init's LoRA case and test_lora's one-process runs stay
    [pytest.param("fsdp", {"policy": [0, 1], "gen": [2]}, marks=pytest.mark.slow),
     pytest.param("replicate", {"policy": [0, 1], "gen": [2]}, marks=pytest.mark.slow),
     pytest.param("replicate", {"policy": {"ranks": [0, 1], "mesh": {"tp": 2}}, "gen": [2]}, marks=pytest.mark.slow)],  # tp_policy: adapters split with their targets
    ids=["fsdp", "replicas", "tensor-parallel"],
)
def test_the_generators_adapters_equal_the_final_checkpoints_bit_for_bit(tmp_path, model_dir, sharding, place):
    """Before this test a LoRA policy could not run under torchrun at all: the collective transport
    was given the full model's shapes and refused the adapters the trainer published."""
    (tmp_path / "place.json").write_text(json.dumps(place))
    proc = _torchrun(3, [str(THIS), str(tmp_path), str(model_dir), sharding], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from flowrl.runtime.checkpointing.store import read_policy_state

    state = read_policy_state(tmp_path / "ck")  # FSDP: each rank's shards (policy-policy.dcp), consolidated here
    assert int(state["version"]) == 3
    step = tmp_path / "ck" / (tmp_path / "ck" / "LATEST").read_text()
    sharded = sharding == "fsdp" or isinstance(place["policy"], dict)  # FSDP2 or tensor-parallel: each rank writes its shards
    assert [p.name for p in step.glob("policy-*")] == ["policy-policy.dcp" if sharded else "policy-policy.pt"]
    assert sorted(state["model"]) == sorted(
        f"model.layers.{i}.self_attn.{m}.lora_{ab}.weight" for i in range(2) for m in ("q_proj", "v_proj") for ab in "AB"
    )
    assert any(bool(t.abs().sum() > 0) for n, t in state["model"].items() if ".lora_B." in n)  # trained, not the zero start
    hashes = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("gen-rank*.json"))]
    assert [h["rank"] for h in hashes] == place["gen"], proc.stderr[-3000:]
    adapter_bytes = sum(t.numel() * 4 for t in state["model"].values())
    for h in hashes:
        assert h["version"] == 3 and h["sha256"] == _state_hash(state["model"]), h
        assert 0 < h["bytes_received"] <= 4 * adapter_bytes, h  # adapters only (a few syncs), never the base
    rows = _rows(tmp_path / "metrics.jsonl")
    assert [r["policy_version"] for r in rows] == [1, 2, 3] and all(r["staleness"] == 0 for r in rows)


def test_a_tensor_parallel_generator_with_lora_is_refused_naming_the_replicas_fix(model_dir):
    from flowrl.errors import ConfigError
    from flowrl.runtime.weights.torchrun_edges import collective_options

    graph = lora_graph(str(model_dir), "replicate")
    ranks = {"policy": (0,), "gen": (1, 2)}
    with pytest.raises(ConfigError, match=r"generator 'gen' has a tensor-parallel mesh \(tp=2\) and LoRA adapters .*\"mesh\": \{\"dp\": 2\}"):
        collective_options(graph, "policy", "gen", ranks, {}, {"gen": (("tp",), (2,))}, 30.0)
    options = collective_options(graph, "policy", "gen", ranks, {}, {"gen": (("dp",), (2,))}, 30.0)  # replicas: fine
    assert all(".lora_" in name for name in options["params"])


def _job(out: str, model_dir: str, sharding: str) -> int:
    import os

    from tests.runtime.test_torchrun import _run_and_hash_generator_weights

    os.chdir(out)
    return _run_and_hash_generator_weights(lora_graph(model_dir, sharding), Path(out), metrics="metrics.jsonl")


if __name__ == "__main__":  # a rank: ends without interpreter teardown (see rank_exit)
    from flowrl.runtime.backends.torchrun.rank_exit import end_rank_process

    sys.path.insert(0, str(ROOT))
    torch.set_num_threads(1)
    end_rank_process(_job(*sys.argv[1:4]))
