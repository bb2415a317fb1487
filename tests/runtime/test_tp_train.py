"""A tensor-parallel policy (a ``tp`` axis on its mesh) under torchrun on gloo: equal to one process,
its weights and checkpoints resharded into other layouts.

The jobs run with ``python -m torch.distributed.run`` (CPU, gloo). This file is also their entry point
(``python tests/runtime/test_tp_train.py MODE OUT ...``):

- ``step`` (2 ranks at tp = 2, or 4 ranks at dp = 2 x tp = 2 with FSDP2), per model family: one step
  of a trainer sharded by ``tp_train.shard_tp_trainer_`` (on its dp part of the batch) against a
  one-process ``Trainer`` on the whole batch (clipped gradients, AdamW moments, parameters, within
  their derived float32 bounds, ``test_fsdp._step_bounds``); the sharded checkpoint
  (torch.distributed.checkpoint) read back whole in one process (tp -> 1) and a second step from it;
  a one-file state loaded into the sharded ranks (1 -> tp); with 2 ranks, an FSDP2 dp = 2 policy's
  sharded checkpoint loaded into the tp = 2 policy (dp 2 -> tp 2); the collective transport from the
  shards (``trainer_layouts``) into a whole replica on rank 0, every byte once.

Beside them: the refusals (before any work) and the CLI pipeline (``flowrl run --backend torchrun
--plan`` with the policy's mesh ``{"tp": 2}``: it trains, its generator holds the trainer's weights,
its checkpoint exports).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch

from flowrl.errors import ConfigError
from flowrl.graph.configs import HFModelConfig, LoraConfig, ModelConfig, OptimizerConfig
from flowrl.graph.nodes import PolicyNode

from tests.runtime.test_fsdp import _batch, _full, _max_diff, _policy, _published, _step_bounds, _trained, fsdp_graph
from tests.runtime.test_torchrun import _rows, _torchrun  # the jobs run with PYTHONPATH=ROOT (see _torchrun)

ROOT = Path(__file__).resolve().parents[2]
THIS = Path(__file__).resolve()


# -- bad input: before any work ----------------------------------------------------------------------
def _node(model, **optimizer) -> PolicyNode:
    return PolicyNode(name="policy", model=model, optimizer=OptimizerConfig(**optimizer))


@pytest.mark.parametrize(
    ("model", "sizes", "optimizer", "match"),
    [
        (ModelConfig(dim=48, n_heads=6, n_kv_heads=3, n_layers=1), {"tp": 2}, {},
         r"policy 'policy' \(mesh .*'tp': 2.*\): tensor parallelism splits attention by whole heads: tp=2 must divide n_kv_heads=3"),
        (ModelConfig(dim=64, n_heads=4, n_kv_heads=4, n_layers=1, ffn_dim=36), {"tp": 8}, {},
         r"tp=8 must divide n_heads=4 and n_kv_heads=4"),
        (ModelConfig(dim=64, n_heads=4, n_kv_heads=2, n_layers=1, ffn_dim=45), {"tp": 2}, {},
         r"tp=2 must divide every split width \(layers\.0\.feed_forward\.w1\.weight splits 45.*ffn_dim"),
        (ModelConfig(dim=64, n_heads=4, n_kv_heads=2, n_layers=1), {"dp": 2, "tp": 2}, {},
         r"dp=2 x tp=2 needs sharding='fsdp'"),
        (ModelConfig(dim=64, n_heads=4, n_kv_heads=2, n_layers=1), {"pp": 2, "tp": 2}, {}, r"has no pipeline stages; .*pp=1"),
    ],
    ids=["kv-heads", "heads", "mlp-width", "dp-replicas", "pp"],
)
def test_a_tp_the_policy_cannot_take_is_refused_by_name(model, sizes, optimizer, match):
    from flowrl.runtime.parallel.tp_train import check_tp_policy

    with pytest.raises(ConfigError, match=match):
        check_tp_policy(_node(model, **optimizer), {"dp": 1, "tp": 1, "pp": 1, **sizes})


def test_lora_dropout_on_a_tp_policy_is_refused_by_name(tmp_path):
    from tests.hf_fixtures import make_hf_dir

    from flowrl.runtime.parallel.tp_train import check_tp_policy

    model = HFModelConfig(path=str(make_hf_dir(tmp_path / "q", "qwen2", weights=False)), init="random",
                          lora=LoraConfig(r=2, alpha=4, target_modules=("q_proj",), dropout=0.1))
    with pytest.raises(ConfigError, match=r"LoRA dropout=0.1 on a tensor-parallel policy would draw a different mask.*dropout=0.0"):
        check_tp_policy(_node(model), {"dp": 1, "tp": 2, "pp": 1})
    check_tp_policy(_node(msgspec.structs.replace(model, lora=LoraConfig(r=2, alpha=4, target_modules=("q_proj",)))), {"dp": 1, "tp": 2, "pp": 1})


def test_a_lora_policy_splits_its_adapters_with_their_targets(tmp_path):
    """A column target's B splits like it (A whole), a row target's A (B whole): the plan and the layouts agree."""
    from tests.hf_fixtures import make_hf_dir

    from flowrl.models.lora import add_adapters
    from flowrl.models.registry import build_model
    from flowrl.placement.resharding import replicated, tp_column, tp_row
    from flowrl.runtime.parallel.tensor_parallel import param_splits
    from flowrl.runtime.parallel.tp_train import head_local, tp_plan, trainer_layouts

    model = HFModelConfig(path=str(make_hf_dir(tmp_path / "q", "qwen3", weights=False)), init="random",
                          lora=LoraConfig(r=2, alpha=4, target_modules=("q_proj", "o_proj")))
    net = build_model(model)
    add_adapters(net, model, owner="policy")
    plan = {k: type(v).__name__ for k, v in tp_plan(net, param_splits(model)).items() if k.startswith("model.layers.0.self_attn")}
    at = "model.layers.0.self_attn."
    assert plan == {at + "q_proj.base_layer": "ColwiseParallel", at + "q_proj.lora_B.default": "ColwiseParallel", at + "k_proj": "ColwiseParallel",
                    at + "v_proj": "ColwiseParallel", at + "o_proj.base_layer": "RowwiseParallel", at + "o_proj.lora_A.default": "RowwiseParallel"}
    assert [n for n in head_local(net, param_splits(model)) if n.startswith(at)] == [at + "q_norm.weight", at + "k_norm.weight"]
    lay = trainer_layouts(model, (0, 1), dp=1, tp=2, fsdp=False)
    assert (lay[at + "q_proj.lora_A.weight"], lay[at + "q_proj.lora_B.weight"]) == (replicated((0, 1), axis="tp"), tp_column((0, 1)))
    assert (lay[at + "o_proj.lora_A.weight"], lay[at + "o_proj.lora_B.weight"]) == (tp_row((0, 1)), replicated((0, 1), axis="tp"))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_the_hf_plans_come_from_the_family_split_table(tmp_path, family):
    """Every Linear the split table splits gets its style; a bad head count of a Hugging Face config is refused."""
    from tests.hf_fixtures import make_hf_dir

    from flowrl.models.registry import meta_model
    from flowrl.runtime.parallel.tensor_parallel import param_splits
    from flowrl.runtime.parallel.tp_train import check_tp_policy, tp_plan

    model = HFModelConfig(path=str(make_hf_dir(tmp_path / family, family, weights=False)), init="random")
    plan = tp_plan(meta_model(model))
    splits = {n.removesuffix(".weight"): s for n, s in param_splits(model).items() if n.endswith(".weight") and s != "replicated"}
    assert {k: type(v).__name__ for k, v in plan.items()} == {k: "ColwiseParallel" if s == "column" else "RowwiseParallel" for k, s in splits.items()}
    assert len(plan) == 2 * 7  # 2 layers x (q, k, v, o, gate, up, down)
    check_tp_policy(_node(model), {"dp": 1, "tp": 2, "pp": 1})
    with pytest.raises(ConfigError, match=r"tp=4 must divide num_key_value_heads=2"):
        check_tp_policy(_node(model), {"dp": 1, "tp": 4, "pp": 1})


def three_kv_heads_graph():
    """``fsdp_graph``'s pipeline on a model of 6 heads and 3 kv heads, which tp = 2 cannot split."""
    from flowrl.graph.builder import GraphBuilder

    b = GraphBuilder("three_kv_heads", model=ModelConfig(vocab_size=16, dim=48, n_layers=1, n_heads=6, n_kv_heads=3, max_seq_len=32))
    prompts = b.source("prompts", task="copy", batch_size=4)
    gen = b.generator("gen", prompts, n_samples=2, max_new_tokens=5)
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    policy = b.policy("policy", b.loss("aipo", gen, reward, objective="aipo"), lr=1e-3)
    b.weights(policy, gen, max_staleness=1)
    return b.build()


def test_a_tp_that_does_not_divide_the_heads_is_refused_at_launch_before_any_work(tmp_path):
    (tmp_path / "place.json").write_text(json.dumps({"gen": [0], "policy": {"ranks": [1, 2], "mesh": {"tp": 2}}}))
    proc = _torchrun(3, ["-m", "flowrl", "run", "tests.runtime.test_tp_train:three_kv_heads_graph", "--backend", "torchrun",
                         "--plan", "place.json", "--steps", "2", "--quiet", "--metrics", "m.jsonl"], tmp_path)
    said = " ".join(proc.stderr.split())
    assert proc.returncode != 0 and "policy 'policy' (mesh" in said and "tp=2 must divide n_kv_heads=3" in said, proc.stderr[-3000:]
    assert "pick a tp size dividing both" in said and not (tmp_path / "m.jsonl").exists()


def test_the_collective_trainer_layout_is_the_tp_shards():
    """The options the torchrun backend gives the collective transport for a tp = 2 policy: per name."""
    from flowrl.placement.resharding import ShardLayout, replicated, tp_column, tp_row
    from flowrl.runtime.weights.torchrun_edges import collective_options

    options = collective_options(fsdp_graph(), "policy", "gen", {"gen": (0,), "policy": (1, 2)}, {}, {"policy": (("tp",), (2,))}, 30.0)
    layouts = {n: msgspec.convert(v, ShardLayout) for n, v in options["trainer_layout"].items()}
    assert layouts["layers.0.attention.wq.weight"] == tp_column((1, 2))
    assert layouts["layers.0.feed_forward.w2.weight"] == tp_row((1, 2))
    assert layouts["tok_embeddings.weight"] == replicated((1, 2), axis="tp")


# -- one step, its checkpoint, its weights (one torchrun job per layout and family) ------------------
@pytest.fixture(scope="module", params=["builtin-tp2", pytest.param("llama-tp2", marks=pytest.mark.slow), pytest.param("qwen2-tp2", marks=pytest.mark.slow),
                                        "qwen3-tp2", "builtin-dp2tp2", pytest.param("qwen2-dp2tp2", marks=pytest.mark.slow), pytest.param("qwen3-dp2tp2", marks=pytest.mark.slow),
                                        pytest.param("lora-tp2", marks=pytest.mark.slow), pytest.param("qwen3_moe-tp2", marks=pytest.mark.slow),
                                        pytest.param("lora-dp2tp2", marks=pytest.mark.slow)])  # CI time: Qwen3 (q/k norms summed over tp) stays
def step_result(request, tmp_path_factory):
    family, layout = request.param.split("-")
    dp = 2 if layout == "dp2tp2" else 1
    directory = ""
    if family != "builtin":
        from tests.hf_fixtures import make_hf_dir

        hf = "qwen2" if family == "lora" else family  # LoRA: on Qwen2 (biases) at every kind of target (LORA_TP)
        directory = str(make_hf_dir(tmp_path_factory.mktemp(family), hf, tie=family == "llama"))  # a tied head (llama), untied with biases (qwen2)
    out = tmp_path_factory.mktemp(f"tp-{request.param}")
    proc = _torchrun(2 * dp, [str(THIS), "step", str(out), family, directory, str(dp)], out, retry_cxx_abort=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "result.json").read_text()), family, dp


def test_a_tp_step_equals_a_one_process_step(step_result):
    """Gradients (clipped by the global norm), AdamW moments and parameters after one step at tp = 2
    (and dp = 2 x tp = 2 with FSDP2 on half the batch each) vs one process on the whole batch, each
    element within its float32 bound (``test_fsdp._step_bounds``, ``tests/tolerances.py``)."""
    r, family, dp = step_result
    assert r["sharded"] > 0, r  # the split weights are DTensors over tp
    assert r["grad_norm_ref"] > r["grad_clip"], r  # the clip is active, so the global norm is checked too
    assert abs(r["grad_norm_tp"] - r["grad_norm_ref"]) <= r["grad_norm_atol"], r
    assert r["grad_over_bound"] <= 1.0, r
    assert r["exp_avg_over_bound"] <= 1.0 and r["exp_avg_sq_over_bound"] <= 1.0, r
    assert r["param_over_bound"] <= 1.0, r
    assert r["replicated_alike"], r  # the plain (replicated) parameters stay equal bit for bit across the tp ranks
    assert r["loss_tp"] == pytest.approx(r["loss_ref"], rel=1e-5), r


def test_a_tp_checkpoint_resumes_on_another_layout(step_result):
    """Sharded save (each rank its shards, full names): read whole in one process it equals the
    trainer's full state exactly (tp -> 1); a second step from it in one process equals the sharded
    trainer's second step within the bound of that step; a one-file state loaded into fresh sharded
    ranks gives them exactly that state (1 -> tp); with 2 ranks, an FSDP2 dp = 2 policy's sharded
    checkpoint loaded into the tp = 2 policy equals the FSDP2 one's state exactly (dp 2 -> tp 2)."""
    r, family, dp = step_result
    assert r["checkpoint_vs_tp"] == 0.0 and r["checkpoint_moments_vs_tp"] == 0.0, r
    assert r["checkpoint_names_full"], r
    assert r["second_step"]["param_over_bound"] <= 1.0, r
    assert r["one_file_into_tp"] == 0.0, r
    if dp == 1:
        assert r["fsdp_into_tp"] == 0.0 and r["fsdp_into_tp_moments"] == 0.0, r


def test_the_generator_receives_the_full_weights_from_the_tp_shards(step_result):
    r, *_ = step_result
    assert r["transport_equal"], r
    # rank 0 fetches and holds shards itself: what it lacks comes over the wire, each byte once, from the ranks holding it
    assert 0 < r["transport_bytes_received"] == r["minimum_wire_bytes"] == r["transport_bytes_sent_other_ranks"] < r["weight_bytes"], r


def test_flowrl_export_of_a_tp_checkpoint_writes_one_hf_directory(step_result, tmp_path):
    transformers = pytest.importorskip("transformers")
    from flowrl.models.hf_export import export_hf
    from flowrl.runtime.checkpointing.sharded_state import read_state

    r, family, _ = step_result
    state = read_state(r["checkpoint"])
    out = export_hf(state, tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True, dtype=torch.float32)
    exported = model.state_dict()
    name = "model.layers.0.self_attn.q_proj.weight"
    if family == "lora":  # merged: peft's merge_and_unload of the adapters into the base
        from flowrl.models.lora import merged_model

        want = merged_model(msgspec.convert(state["model_config"], HFModelConfig), state["model"]).state_dict()[name]
        assert all(bool(t.abs().sum() > 0) for n, t in state["model"].items() if ".lora_B." in n)  # B moved from 0: a real merge
    else:
        want = state["model"]["layers.0.attention.wq.weight" if family == "builtin" else name]
    assert torch.equal(exported[name], want)


# -- the whole pipeline ------------------------------------------------------------------------------
TP2 = {"gen": [0], "policy": {"ranks": [1, 2], "mesh": {"tp": 2}}}
DP2_TP2 = {"gen": [0], "policy": {"ranks": [0, 1, 2, 3], "mesh": {"dp": 2, "tp": 2}}}  # FSDP2 over dp (fsdp_graph's sharding), the generator colocated


# ~20 s each; the default suite runs a tp policy (beside a tp generator) through the CLI in tests/test_mesh_support.py's walk
@pytest.mark.parametrize(("transport", "place"), [pytest.param("inprocess", TP2, marks=pytest.mark.slow), pytest.param("file", TP2, marks=pytest.mark.slow),
                                                  pytest.param("inprocess", DP2_TP2, marks=pytest.mark.slow)], ids=["tp2", "tp2-file", "dp2-tp2"])
def test_a_tp_policy_trains_through_the_cli_and_its_generator_holds_its_weights(tmp_path, transport, place):
    """The generator on rank 0, the policy on ranks 1-2 with the mesh {"tp": 2} (or on ranks 0-3 with
    {"dp": 2, "tp": 2}, FSDP2 over dp); weights over the collective transport from the shards (or a file
    edge: gathered, the lead writes). Every step runs; on the collective edge the generator's weights
    hash like the final checkpoint's (sharded, read whole) and with the generator apart the shards put
    one copy on the wire per step; the checkpoint exports."""
    (tmp_path / "place.json").write_text(json.dumps(place))
    ranks = place["policy"]["ranks"]
    proc = _torchrun(1 + max(ranks), [str(THIS), "run", str(tmp_path), transport], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    from flowrl.runtime.checkpointing.store import read_policy_state
    from tests.runtime.test_torchrun import _state_hash

    rows = _rows(tmp_path / "m.jsonl")
    assert [r["policy_version"] for r in rows] == [1, 2, 3]
    assert all(abs(r["policy/grad_norm"]) > 0 for r in rows)
    state = read_policy_state(tmp_path / "ck")
    assert next((tmp_path / "ck").glob(f"step-*/policy-policy.dcp/__{len(ranks) - 1}_0.distcp"))  # each rank wrote its shards
    if transport == "inprocess":  # the generator's rank hashes what it fetched on the collective edge
        hashes = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("gen-rank*.json"))]
        assert [h["version"] for h in hashes] == [3] and hashes[0]["sha256"] == _state_hash(state["model"])
    if transport == "inprocess":
        nbytes = 4 * sum(t.numel() for t in state["model"].values())
        if 0 not in ranks:
            assert all(r["weights/collective_bytes"] == nbytes for r in rows), rows[0]  # every byte once, from the shards
        else:  # rank 0 holds its own shards: the rest crosses
            assert all(0 < r["weights/collective_bytes"] < nbytes for r in rows), rows[0]
    export = subprocess.run([sys.executable, "-m", "flowrl", "export", "ck", "-o", "hf"], cwd=tmp_path, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert export.returncode == 0, export.stderr[-2000:]
    assert (tmp_path / "hf" / "config.json").is_file()


@pytest.mark.slow  # one 4-rank torchrun job, ~30 s on 2 cores
def test_a_tp_policy_feeds_a_tp_generator(tmp_path):
    """Policy tp = 2 on ranks 2-3, generator tp = 2 on ranks 0-1 (each rank its shards of both: the
    collective transport reshards shard to shard). At k = 0 every rollout comes from the weights the
    policy trains on: mu (the sharded generator) equals pi (the sharded trainer) within float32
    rounding (``graph_logprob_atol``), which a weight that did not arrive would break."""
    from tests.tolerances import graph_logprob_atol

    (tmp_path / "place.json").write_text(json.dumps({"gen": {"ranks": [0, 1], "mesh": {"tp": 2}}, "policy": {"ranks": [2, 3], "mesh": {"tp": 2}}}))
    proc = _torchrun(4, ["-m", "flowrl", "run", "tests.runtime.test_fsdp:fsdp_graph", "--backend", "torchrun", "--plan", "place.json",
                         "--steps", "3", "--max-staleness", "0", "--quiet", "--metrics", "m.jsonl"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(tmp_path / "m.jsonl")
    atol = graph_logprob_atol(fsdp_graph(max_staleness=0), steps=3)
    assert [r["policy_version"] for r in rows] == [1, 2, 3] and all(r["staleness"] == 0 for r in rows)
    assert all(r["mismatch/tokens"] > 0 and r["mismatch/abs_logp_max"] < atol for r in rows), (rows, atol)


@pytest.mark.slow  # 4 torchrun jobs, ~3 min on 2 cores; the fast check of the same is test_a_tp_checkpoint_resumes_on_another_layout
def test_a_tp_run_resumes_on_one_rank_and_back(tmp_path):
    """Through the CLI at k = 0: 4 steps at tp = 2; 2 steps at tp = 2 resumed to 4 on tp = 2 and, from a
    copy, on one rank (the policy whole: tp 2 -> 1), whose one-file state then resumes on tp = 2 to 6
    (1 -> tp 2). Steps 3-4 draw the same rewards as the uninterrupted run (their rollouts come from
    weights loaded exactly); the final weights of tp = 2 resumed equal the uninterrupted ones bit for
    bit (same layout, same arithmetic), those of one rank within 1e-5 (two AdamW steps compound the
    float summation order of the tp all-reduces: measured, as test_fsdp's resume, not derived)."""
    import shutil

    from flowrl.runtime.checkpointing.store import read_policy_state

    def run(nproc, policy, steps, ck, *extra):
        (tmp_path / "place.json").write_text(json.dumps({"gen": [0], "policy": policy}))
        proc = _torchrun(nproc, ["-m", "flowrl", "run", "tests.runtime.test_fsdp:fsdp_graph", "--backend", "torchrun",
                                 "--plan", "place.json", "--steps", str(steps), "--quiet", "--metrics", f"{ck}.jsonl",
                                 "--checkpoint-dir", ck, "--checkpoint-every", "2", "--max-staleness", "0", *extra], tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return _rows(tmp_path / f"{ck}.jsonl")

    tp2, one = {"ranks": [1, 2], "mesh": {"tp": 2}}, [1]
    whole = run(3, tp2, 4, "a")
    run(3, tp2, 2, "b")
    shutil.copytree(tmp_path / "b", tmp_path / "c")
    same = run(3, tp2, 4, "b", "--resume")[-2:]
    fewer = run(2, one, 4, "c", "--resume")[-2:]
    want = [r["reward_mean"] for r in whole[2:]]
    for rows in (same, fewer):
        assert [r["policy_version"] for r in rows] == [3, 4] and rows[0]["reward_mean"] == want[0], (rows, want)
    assert next((tmp_path / "c").glob("step-*4/policy-policy.pt"))  # one rank: the whole policy's one file
    back = run(3, tp2, 6, "c", "--resume")[-2:]
    assert [r["policy_version"] for r in back] == [5, 6] and next((tmp_path / "c").glob("step-*6/policy-policy.dcp/__1_0.distcp"))
    final = {k: read_policy_state(tmp_path / k)["model"] for k in ("a", "b")}
    final["c"] = read_policy_state(tmp_path / "c" / "step-00000004")["model"]
    assert all(torch.equal(final["b"][n], t) for n, t in final["a"].items())
    diff = max(float((final["c"][n] - t).abs().max()) for n, t in final["a"].items())
    assert diff < 1e-5, diff


# -- a tensor-parallel reference ---------------------------------------------------------------------
def test_a_tp_reference_the_program_cannot_run_is_refused_by_name():
    from flowrl.examples import build_example
    from flowrl.runtime.parallel.tp_train import check_tp_meshes

    graph = build_example("llamarl_ref")
    check_tp_meshes(graph, {"ref": (("tp",), (2,))})  # frozen, 4 heads: runs
    with pytest.raises(ConfigError, match=r"reference 'ref' \(mesh .*\): a tensor-parallel reference splits its model over tp only; .*\{'dp': 2\} must be 1"):
        check_tp_meshes(graph, {"ref": (("dp", "tp"), (2, 2))})
    with pytest.raises(ConfigError, match=r"reference 'ref' .*tp=8 must divide n_heads=4"):
        check_tp_meshes(graph, {"ref": (("tp",), (8,))})
    ref = graph.node("ref")
    syncing = msgspec.structs.replace(ref, reference=msgspec.structs.replace(ref.reference, sync_steps=2))
    from flowrl.runtime.parallel.tp_train import check_tp_reference

    with pytest.raises(ConfigError, match=r"a syncing reference \(sync_steps=2\) cannot be tensor-parallel.*sync_steps=0"):
        check_tp_reference(syncing, {"dp": 1, "tp": 2, "pp": 1})


@pytest.mark.slow  # two torchrun jobs, ~1 min on 2 cores
def test_a_tp_reference_gives_the_one_rank_references_log_probs(tmp_path):
    """``llamarl_ref`` at k = 0, seed 0, with its frozen reference on one rank and on two as tp = 2: the
    first step's rollout is the same (same generator, same seed), so its KL to the reference and its
    loss differ only by the reference's float32 rounding (``graph_logprob_atol``, one step)."""
    from flowrl.examples import build_example
    from tests.tolerances import graph_logprob_atol

    def run(ref, nproc, name):
        (tmp_path / f"{name}.json").write_text(json.dumps({"gen": [0], "policy": [1], "ref": ref}))
        proc = _torchrun(nproc, ["-m", "flowrl", "run", "llamarl_ref", "--backend", "torchrun", "--plan", f"{name}.json", "--steps", "2",
                                 "--max-staleness", "0", "--seed", "0", "--quiet", "--metrics", f"{name}.jsonl"], tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return _rows(tmp_path / f"{name}.jsonl")

    one, tp = run([2], 3, "one"), run({"ranks": [2, 3], "mesh": {"tp": 2}}, 4, "tp")
    atol = graph_logprob_atol(build_example("llamarl_ref"), steps=1)
    assert one[0]["reward_mean"] == tp[0]["reward_mean"]
    assert abs(one[0]["loss/kl_ref"] - tp[0]["loss/kl_ref"]) <= atol, (one[0], tp[0], atol)
    assert abs(one[0]["loss"] - tp[0]["loss"]) <= atol, (one[0]["loss"], tp[0]["loss"], atol)
    assert [r["policy_version"] for r in tp] == [1, 2]


# -- the jobs' entry points (run under torchrun) -----------------------------------------------------
LORA_TP = dict(r=2, alpha=4, target_modules=("q_proj", "v_proj", "o_proj", "down_proj"))  # column and row targets
def _tp_node(family: str, directory: str, dp: int) -> PolicyNode:
    """The policy at tp = 2: FSDP2 over dp when dp > 1 (``check_tp_policy``'s rule), plain at dp = 1."""
    return _policy(family, directory, "fsdp" if dp > 1 else "replicate")


def _step_job(out: str, family: str, directory: str, dp: int) -> int:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    from flowrl.graph.nodes import LossNode
    from flowrl.models.lora import adapter_shapes
    from flowrl.models.registry import weight_shapes
    from flowrl.operators.trainer import Trainer
    from flowrl.placement.resharding import dp_replicas, minimum_bytes
    from flowrl.runtime.checkpointing.sharded_state import load_sharded, read_state, save_sharded
    from flowrl.runtime.parallel.distributed import shard_by_groups
    from flowrl.runtime.parallel.fsdp import full_weights, load_full_state, local_weights, shard_trainer_, token_scale
    from flowrl.runtime.parallel.tp_train import shard_tp_trainer_, trainer_layouts
    from flowrl.runtime.transports.collective import CollectiveTransport
    from tests.tolerances import GradientMagnitudes

    import tests.runtime.test_fsdp as fsdp_tests

    from tests.runtime.test_expert_parallel import MoeGradientMagnitudes

    magnitudes = MoeGradientMagnitudes if family.endswith("_moe") else GradientMagnitudes  # a MoE: its routers' and stacked experts' too

    fsdp_tests.LORA = LORA_TP  # test_fsdp's policy and bounds read it: adapters on column and row targets alike
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    grid = torch.arange(world).reshape(dp, 2)
    mesh = DeviceMesh("cpu", grid, mesh_dim_names=("dp", "tp")) if dp > 1 else DeviceMesh("cpu", grid[0], mesh_dim_names=("tp",))
    loss = LossNode(name="aipo")
    batches = [_batch(family, directory, s) for s in (0, 1)]
    torch.manual_seed(0)
    ref = Trainer(_policy(family, directory, "replicate", packing=False), loss)  # padded; the tp ranks pack (the default)

    def build(seed: int) -> Trainer:
        torch.manual_seed(seed)
        t = Trainer(_tp_node(family, directory, dp), loss)
        shard_tp_trainer_(t, mesh, group=group, fsdp=dp > 1)
        return t

    def step(t: Trainer, b: dict) -> dict:
        part = shard_by_groups(b, dp)[rank // 2]
        if dp > 1:
            t.loss_scale = token_scale(dp, float(part["completion_mask"].sum()), float(b["completion_mask"].sum()))
        return t.train_step(part)

    mine = build(0)
    with magnitudes(ref.model) as mags:
        ref_metrics = ref.train_step(batches[0])
    metrics = step(mine, batches[0])
    part, whole = shard_by_groups(batches[0], dp)[rank // 2]["completion_mask"].sum(), batches[0]["completion_mask"].sum()
    weighted = torch.tensor([metrics["loss"] * float(part) / float(whole) / 2])  # each dp part's token share, counted by its 2 tp ranks
    dist.all_reduce(weighted)
    result: dict = {"grad_clip": 0.01, "sharded": sum(isinstance(p, DTensor) for p in mine.model.parameters())}
    result.update(_step_bounds(mine, ref, mags, batches[0], ref_metrics["policy/grad_norm"], family))
    result.update(grad_norm_ref=ref_metrics["policy/grad_norm"], grad_norm_tp=metrics["policy/grad_norm"], loss_ref=ref_metrics["loss"], loss_tp=float(weighted))
    untouched = [p.to_local() if isinstance(p, DTensor) else p for p in mine.model.parameters()  # left whole by tp (FSDP2 may chunk them over dp)
                 if not isinstance(p, DTensor) or "tp" not in (p.device_mesh.mesh_dim_names or ())]
    plain = torch.cat([p.detach().flatten() for p in untouched])
    every = [torch.zeros_like(plain) for _ in range(world)]
    dist.all_gather(every, plain)
    result["replicated_alike"] = all(torch.equal(e, every[2 * (r // 2)]) for r, e in enumerate(every))
    # the sharded checkpoint: each rank its shards, read whole in one process (tp -> 1)
    ck = Path(out) / "tp.dcp"
    save_sharded(mine, ck, group=group)
    dist.barrier()
    state = read_state(ck)
    full_model = {k: _full(v) for k, v in _published(mine).items()}
    moments = [_full(mine.optimizer.state[p][k]) for p in _trained(mine) for k in ("exp_avg", "exp_avg_sq")]
    result["checkpoint"] = str(ck)
    result["checkpoint_names_full"] = sorted(state["model"]) == sorted(_published(ref))
    result["checkpoint_vs_tp"] = _max_diff(state["model"], full_model)
    saved = [state["optimizer"]["state"][i][k] for i, _ in enumerate(_trained(mine)) for k in ("exp_avg", "exp_avg_sq")]
    result["checkpoint_moments_vs_tp"] = max(float((a - b).abs().max()) for a, b in zip(saved, moments))
    one = Trainer(_policy(family, directory, "replicate", packing=False), loss)
    one.load_state(state)
    with magnitudes(one.model) as mags:
        one_metrics = one.train_step(batches[1])
    step(mine, batches[1])
    result["second_step"] = _step_bounds(mine, one, mags, batches[1], one_metrics["policy/grad_norm"], family, step=2)
    # a one-file state into fresh sharded ranks (1 -> tp)
    fresh = build(99)
    load_full_state(fresh, one.state())
    result["one_file_into_tp"] = _max_diff(_published(fresh), _published(one))
    if dp == 1:  # an FSDP2 dp = 2 policy's sharded checkpoint into the tp = 2 policy (dp 2 -> tp 2)
        dp_mesh = DeviceMesh("cpu", torch.arange(world), mesh_dim_names=("dp",))
        torch.manual_seed(5)
        sharded = Trainer(_policy(family, directory, "fsdp"), loss)
        shard_trainer_(sharded, dp_mesh)
        part = shard_by_groups(batches[0], 2)[rank]
        sharded.loss_scale = token_scale(2, float(part["completion_mask"].sum()), float(batches[0]["completion_mask"].sum()))
        sharded.train_step(part)
        save_sharded(sharded, Path(out) / "fsdp.dcp", group=group)
        into = build(7)
        load_sharded(into, Path(out) / "fsdp.dcp", group=group)
        result["fsdp_into_tp"] = _max_diff(_published(into), _published(sharded))
        result["fsdp_into_tp_moments"] = max(
            float((_full(into.optimizer.state[p][k]) - _full(sharded.optimizer.state[q][k])).abs().max())
            for p, q in zip(_trained(into), _trained(sharded)) for k in ("exp_avg", "exp_avg_sq")
        )
    # the collective transport from the shards into a whole replica on rank 0 (colocated)
    config = _tp_node(family, directory, dp).model
    shapes = adapter_shapes(config) if family == "lora" else weight_shapes(config)
    params = {n: {"shape": list(s), "dtype": str(d).removeprefix("torch.")} for n, (s, d) in shapes.items()}
    layouts = trainer_layouts(config, tuple(range(world)), dp=dp, tp=2, fsdp=dp > 1)
    t = CollectiveTransport(params=params, trainer_layout=layouts, generator_layout=dp_replicas((0,)), channel="tp-test", timeout_s=30)
    t.publish(local_weights(mine.model), 7)
    full = full_weights(mine.model)  # all-gathers: every rank
    sent = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sent, torch.tensor([t.bytes_sent]))
    if rank == 0:
        target = {n: torch.empty(s, dtype=d) for n, (s, d) in shapes.items()}
        got = None
        while got is None:
            got = t.fetch_into(target, newer_than=-1)
        result.update(
            transport_equal=got == 7 and all(torch.equal(target[n], full[n]) for n in target),
            transport_bytes_received=t.bytes_received,
            weight_bytes=sum(v.numel() * v.element_size() for v in target.values()),
            minimum_wire_bytes=sum(minimum_bytes(s, d, layouts[n], dp_replicas((0,))) for n, (s, d) in shapes.items()),
            transport_bytes_sent_other_ranks=int(sum(int(s) for s in sent[1:])),
        )
    dist.barrier()
    t.close()
    if rank == 0:
        Path(out, "result.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _run_job(out: str, transport: str) -> int:
    """``fsdp_graph`` (policy sharding at dp = 1 is moot) for 3 steps at k = 0 on place.json, checkpointing;
    each generator rank hashes the newest version it fetched."""
    from tests.runtime.test_torchrun import _run_and_hash_generator_weights

    return _run_and_hash_generator_weights(fsdp_graph(max_staleness=0, transport=transport), Path(out), metrics="m.jsonl")


if __name__ == "__main__":  # a rank: ends without interpreter teardown (see rank_exit)
    from flowrl.runtime.backends.torchrun.rank_exit import end_rank_process

    if sys.argv[1] == "step":
        end_rank_process(_step_job(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])))
    if sys.argv[1] == "run":
        end_rank_process(_run_job(sys.argv[2], sys.argv[3]))
    raise SystemExit(f"unknown mode {sys.argv[1]!r}")


def test_grad_squares_is_the_float64_sum_of_squares_within_float32_rounding():
    """A hand-computed case exactly (3^2 + 4^2 + 12^2 = 169, float32 and bfloat16 alike: every step is
    exact), float64 kept float64, and a random gradient within the float32 bound of a sum of n squares
    (relative (n + 2) u, u = 2^-24: the norm's sum plus its square root and the squaring)."""
    from flowrl.runtime.parallel.tp_train import grad_squares

    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        got = grad_squares(torch.tensor([[3.0, 4.0], [12.0, 0.0]], dtype=dtype))
        assert got.dtype == torch.float64 and float(got) == 169.0, (dtype, got)
    g = torch.randn(100_000, generator=torch.Generator().manual_seed(0))
    exact = float(g.double().square().sum())
    assert abs(float(grad_squares(g)) - exact) <= (g.numel() + 2) * 2.0**-24 * exact, (float(grad_squares(g)), exact)
    assert abs(float(grad_squares(g.double())) - exact) <= (g.numel() + 2) * 2.0**-53 * exact  # float64 stays float64
