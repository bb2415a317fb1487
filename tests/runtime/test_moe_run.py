"""Mixture-of-experts directories through the runs a user starts: GRPO with a reference, PPO with a critic.

Each graph is what ``flowrl run`` builds and runs (``run_graph`` with a ``RunConfig``) over a tiny
Qwen3-MoE or Qwen2-MoE directory (``tests/hf_fixtures.py``: 8 experts, top-2) and a prompt file of
the fixture tokenizer's words; one step each, on one process.
"""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.data.files import write_jsonl
from flowrl.graph.builder import GraphBuilder
from flowrl.graph.configs import HFModelConfig
from flowrl.runtime.config import RunConfig
from flowrl.runtime.run import run_graph

pytest.importorskip("transformers")


def _graph(directory, tmp_path, *, critic: bool):
    prompts = tmp_path / "prompts.jsonl"
    write_jsonl(prompts, [{"prompt": f"{a} {b} ="} for a in "abcd" for b in "0123"])
    b = GraphBuilder("moe", model=HFModelConfig(path=str(directory)))
    src = b.source("prompts", data=str(prompts), prompt_field="prompt", batch_size=2)
    gen = b.generator("gen", src, n_samples=4, max_new_tokens=4)
    score = b.scorer("reward", gen, fn="tests.operators.userfns:mean_id_reward")
    if critic:
        value = b.critic("critic", gen, score, lr=1e-3)
        loss = b.loss("loss", gen, score, value, objective="ppo")
    else:
        ref = b.reference("ref", gen)
        loss = b.loss("loss", gen, score, ref, objective="grpo", kl_coef=0.1)
    policy = b.policy("policy", loss, lr=1e-2)
    b.weights(policy, gen, max_staleness=0)
    return b.build()


@pytest.mark.parametrize(("family", "critic"), [("qwen3_moe", False), ("qwen2_moe", True)], ids=["qwen3_moe-grpo-reference", "qwen2_moe-ppo-critic"])
def test_a_moe_directory_trains_as_policy_reference_and_critic(request, tmp_path, family, critic):
    """The two families share the adapter: each one graph (both roles on both would repeat the same path)."""
    from flowrl.models.registry import build_model
    from tests.tolerances import graph_logprob_atol, k3_atol

    hf_moe_dir = request.getfixturevalue(f"hf_{family}_dir")
    graph = _graph(hf_moe_dir, tmp_path, critic=critic)
    atol = graph_logprob_atol(graph, steps=0)  # k = 0: the batch is drawn, scored and trained by version 0
    result = run_graph(graph, RunConfig(steps=1, checkpoint_dir=str(tmp_path / "ckpt"), device="cpu"))
    assert result.version == 1
    (row,) = [r for r in result.rows if "policy/grad_norm" in r]
    assert row["policy/grad_norm"] > 0 and math.isfinite(row["loss/total"])
    assert 1 <= row["moe/load_max_over_mean"] <= row["moe/load_max_over_mean_max"] <= 8 / 2 and row["moe/aux_loss"] > 0  # at most E / k
    assert row["mismatch/tokens"] > 0 and row["mismatch/abs_logp_max"] <= atol  # the engine's mu is the trainer's pi
    (checkpoint,) = (tmp_path / "ckpt").glob("step-*")
    trained = torch.load(checkpoint / "policy-policy.pt", weights_only=True)["model"]
    initial = build_model(HFModelConfig(path=str(hf_moe_dir))).state_dict()
    moved = {n for n in trained if not torch.equal(trained[n], initial[n])}
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in moved) and any(n.endswith("mlp.experts.down_proj") for n in moved)
    assert any(n.endswith("mlp.gate.weight") for n in moved)  # the router trains too
    if critic:
        assert row["critic/grad_norm"] > 0 and math.isfinite(row["critic/value_loss"]) and (checkpoint / "critic-critic.pt").is_file()
    else:  # the reference is the policy's version 0, which drew and scored this batch: KL 0 within rounding
        assert abs(row["loss/kl_ref"]) <= k3_atol(atol)


def moe_fsdp_graph(model_dir: str):
    """prompts -> gen -> reward -> aipo -> policy on ``model_dir``, the policy FSDP2-sharded, k = 0."""
    b = GraphBuilder("moe_fsdp", model=HFModelConfig(path=model_dir))
    prompts = b.source("prompts", task="copy", batch_size=4)
    gen = b.generator("gen", prompts, n_samples=2, max_new_tokens=4, temperature=1.0)
    reward = b.scorer("reward", gen, fn="tests.operators.userfns:mean_id_reward")
    aipo = b.loss("aipo", gen, reward, objective="aipo", rho=4.0)
    policy = b.policy("policy", aipo, lr=1e-2, sharding="fsdp")
    b.weights(policy, gen, max_staleness=0)
    return b.build()


def test_fsdp2_shards_a_moe_policy_and_its_checkpoint_exports(hf_qwen3_moe_dir, tmp_path, capsys):
    """2 ranks under torchrun, the generator beside the policy's shards (each block's router and stacked
    experts sharded by rows, ``Shard(0)``: 4 of the 8 experts on each rank), 2 steps at k = 0: the second
    step's rollout is drawn with the weights the shards published after the first, so its mu equals the
    trainer's pi within rounding only if every expert arrived. ``flowrl export`` of the sharded
    checkpoint writes a directory transformers loads as ``Qwen3MoeForCausalLM`` with the trained logits."""
    import json

    transformers = pytest.importorskip("transformers")
    from flowrl.cli.main import main
    from flowrl.graph.serialize import to_json
    from flowrl.runtime.checkpointing.store import read_policy_state
    from tests.runtime.test_torchrun import _rows, _torchrun
    from tests.tolerances import graph_logprob_atol, logit_atol

    graph = moe_fsdp_graph(str(hf_qwen3_moe_dir))
    (tmp_path / "graph.json").write_text(to_json(graph))
    (tmp_path / "place.json").write_text(json.dumps({"policy": [0, 1], "gen": [0, 1]}))
    proc = _torchrun(2, ["-m", "flowrl", "run", "graph.json", "--backend", "torchrun", "--plan", "place.json", "--steps", "2",
                         "--quiet", "--metrics", "m.jsonl", "--checkpoint-dir", "ck"], tmp_path, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(tmp_path / "m.jsonl")
    assert [r["policy_version"] for r in rows] == [1, 2] and all(r["staleness"] == 0 for r in rows)
    assert rows[1]["mismatch/tokens"] > 0 and rows[1]["mismatch/abs_logp_max"] <= graph_logprob_atol(graph, steps=1)
    assert all(1 <= r["moe/load_max_over_mean"] <= r["moe/load_max_over_mean_max"] <= 8 / 2 for r in rows)  # every row: the experts' load
    state = read_policy_state(tmp_path / "ck")
    initial = transformers.AutoModelForCausalLM.from_pretrained(str(hf_qwen3_moe_dir), local_files_only=True, dtype=torch.float32)
    assert int(state["version"]) == 2 and sorted(state["model"]) == sorted(initial.state_dict())  # gathered: whole tensors, every name
    assert not torch.equal(state["model"]["model.layers.0.mlp.experts.gate_up_proj"], initial.state_dict()["model.layers.0.mlp.experts.gate_up_proj"])
    capsys.readouterr()
    assert main(["export", str(tmp_path / "ck"), "-o", str(tmp_path / "hf")]) == 0, capsys.readouterr().err
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True, dtype=torch.float32)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    initial.load_state_dict(state["model"], strict=False)  # the trained weights (a tied head is the embedding) in transformers' own model
    ids = torch.tensor([[1, 5, 6, 7, 8, 9, 2], [1, 12, 30, 4, 3, 3, 3]])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, initial(input_ids=ids).logits, rtol=0, atol=logit_atol(model, list(ids)))


def test_a_run_of_a_moe_directory_with_dense_blocks_is_refused_before_any_work(hf_qwen3_moe_dir, tmp_path):
    """``mlp_only_layers`` (``flowrl.models.hf.check_hf_dir``, the run's preflight): named, nothing started, no checkpoint."""
    import json
    import shutil

    from flowrl.errors import ConfigError

    d = shutil.copytree(hf_qwen3_moe_dir, tmp_path / "m")
    (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()), "mlp_only_layers": [0]}))
    with pytest.raises(ConfigError, match=r"node 'gen': .* has mlp_only_layers=\[0\]; flowrl reads a qwen3_moe \(Qwen3MoeForCausalLM\) directory only with mlp_only_layers=\[\]"):
        run_graph(_graph(d, tmp_path, critic=False), RunConfig(steps=1, checkpoint_dir=str(tmp_path / "ckpt"), device="cpu"))
    assert not (tmp_path / "ckpt").exists()
