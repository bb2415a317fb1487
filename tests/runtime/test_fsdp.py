"""An FSDP2 policy (``sharding="fsdp"``) under torchrun on gloo: equal to one process, sharded, resumable.

The jobs run with ``python -m torch.distributed.run`` (CPU, gloo, 2-4 ranks). This file is also their
entry point (``python tests/runtime/test_fsdp.py MODE OUT ...``):

- ``step`` (3 ranks: FSDP over 0-1, a generator rank 2), once per model family (built-in, HF Llama
  with a tied head, HF Qwen2 untied with biases, LoRA on Qwen2): one sharded step on half the batch per
  rank, its trainer started on the meta device as a run starts it (``fsdp_init``), against a
  one-process padded ``Trainer`` built whole on the whole batch (the sharded ranks pack, the default, on uneven
  lengths; clipped gradients, parameters, AdamW moments); the elements each rank holds against a replica's; the gathered checkpoint, a second step uninterrupted
  and after loading the checkpoint into a fresh sharded trainer (same dp) and into one process (dp 2
  -> 1); the collective transport from the shards (``fsdp((0, 1))``) to rank 2, bit for bit;
- ``mixed``: ``param_dtype="bfloat16"``; ``checkpointing``: gradient checkpointing + micro-batches;
- ``bitwise``: a real run whose generator ranks hash their weights against the final checkpoint.

Beside them: the refusals (before any work), the CLI pipeline (3 processes, reward rises, export),
and (``--runslow``) a CLI resume on the same and on another dp size, and a file weight edge. The sharded
checkpoints a run writes (torch.distributed.checkpoint) are ``test_sharded_checkpoint.py``'s; the
gathered one-file state here (``full_state``) is their reference and what an older FSDP run wrote.
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
from flowrl.examples.llamarl import build_llamarl
from flowrl.graph.builder import GraphBuilder
from flowrl.graph.configs import OptimizerConfig

from tests.runtime.test_torchrun import _rows, _torchrun  # the jobs run with PYTHONPATH=ROOT (see _torchrun)

ROOT = Path(__file__).resolve().parents[2]
THIS = Path(__file__).resolve()


def fsdp_graph(max_staleness: int = 1, transport: str = "inprocess"):
    """The default example with its policy sharded with FSDP2 (weights over ``transport``)."""
    g = build_llamarl(max_staleness=max_staleness)
    b = GraphBuilder("llamarl_fsdp", model=g.node("policy").model)
    prompts = b.source("prompts", task="copy", batch_size=16)
    gen = b.generator("gen", prompts, n_samples=16, max_new_tokens=5, temperature=1.0)
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    aipo = b.loss("aipo", gen, reward, objective="aipo", rho=4.0, normalize_std=True)
    policy = b.policy("policy", aipo, lr=1e-3, sharding="fsdp")
    b.weights(policy, gen, max_staleness=max_staleness, transport=transport)
    return b.build()


def fsdp_file_graph():
    """``fsdp_graph`` with its weights over files: the policy gathers its shards and its lead writes."""
    return fsdp_graph(transport="file")


# -- bad input: before any work ----------------------------------------------------------------------
def test_mixed_precision_needs_fsdp():
    with pytest.raises(ConfigError, match=r"param_dtype='bfloat16' is FSDP2's mixed precision and needs sharding='fsdp'"):
        OptimizerConfig(param_dtype="bfloat16")
    assert OptimizerConfig(sharding="fsdp", param_dtype="bfloat16", reduce_dtype="float32").param_dtype == "bfloat16"


@pytest.mark.parametrize("backend", ["local", "process"])
def test_fsdp_on_a_one_process_backend_is_refused_before_any_work(tmp_path, backend):
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.run import run_graph

    with pytest.raises(ConfigError, match=rf"policy 'policy' has sharding='fsdp'.*the '{backend}' backend runs it in one process; launch under torchrun"):
        run_graph(fsdp_graph(), RunConfig(steps=1, backend=backend, metrics=str(tmp_path / "m.jsonl")))
    assert not (tmp_path / "m.jsonl").exists()


@pytest.mark.parametrize(
    ("ranks", "axes", "match"),
    [
        ({"gen": (0,), "policy": ()}, {}, r"policy 'policy' has sharding='fsdp' but the plan gives it no rank"),
        ({"gen": (0,), "policy": (1, 2)}, {"policy": (("dp", "pp"), (1, 2))}, r"its mesh also has \{'pp': 2\}; give the policy a mesh of dp=2 only"),
    ],
    ids=["no-rank", "pp-axis"],
)
def test_fsdp_placements_are_refused(ranks, axes, match):
    from flowrl.runtime.parallel.fsdp import check_ranks

    with pytest.raises(ConfigError, match=match):
        check_ranks(fsdp_graph(), ranks, axes)
    check_ranks(fsdp_graph(), {"gen": (0,), "policy": (1, 2)}, {"policy": (("dp",), (2,))})  # fine
    check_ranks(fsdp_graph(), {"gen": (0,), "policy": (1,)}, {})  # one rank: FSDP2 over a 1-rank mesh (resume a sharded run on fewer ranks)
    check_ranks(fsdp_graph(), {"gen": (0,), "policy": (1, 2, 3, 4)}, {"policy": (("dp", "tp"), (2, 2))})  # FSDP2 over dp of a tp policy (tp_train)


@pytest.mark.parametrize(
    ("sizes", "micro", "match"),
    [([32, 0], 0, r"shards of \[32, 0\] samples; every rank needs at least one group: make the source's batch_size >= 2"),
     ([48, 32], 16, r"shards of \[48, 32\] samples make \[3, 2\] micro-batches of 16")],
    ids=["empty-shard", "uneven-micro-batches"],
)
def test_shards_that_would_desynchronise_the_ranks_are_refused(sizes, micro, match):
    from flowrl.runtime.parallel.fsdp import check_shards

    with pytest.raises(ConfigError, match=match):
        check_shards("policy", sizes, micro)
    check_shards("policy", [32, 32], 16)


def test_the_collective_trainer_layout_is_fsdp_shards():
    """The options the torchrun backend gives the collective transport for an FSDP policy."""
    from flowrl.runtime.weights.torchrun_edges import collective_options
    from flowrl.placement.resharding import ShardLayout, dp_replicas, fsdp

    def layout(graph):
        options = collective_options(graph, "policy", "gen", {"gen": (0,), "policy": (1, 2)}, {}, {}, 30.0)
        return msgspec.convert(options["trainer_layout"], ShardLayout)

    assert layout(fsdp_graph()) == fsdp((1, 2))
    assert layout(build_llamarl()) == dp_replicas((1, 2))


# -- the sharded step, its memory, its checkpoint, its weights (one torchrun job per model family) ---
@pytest.fixture(scope="module", params=["builtin", pytest.param("lora", marks=pytest.mark.slow), pytest.param("llama", marks=pytest.mark.slow), pytest.param("qwen2", marks=pytest.mark.slow)])  # HF families and LoRA: --runslow (CI time; test_lora_torchrun's FSDP run stays)
def step_result(request, tmp_path_factory):
    """One job per model family, shared by the tests below: (result, its directory, family, HF dir).
    ``lora``: LoRA adapters (r=2 on q_proj and v_proj) on a Qwen2 model, its frozen base sharded too."""
    family, directory = request.param, ""
    if family != "builtin":
        from tests.hf_fixtures import make_hf_dir

        tie = family == "llama"  # a tied head (Llama) and an untied one with qkv biases (Qwen2)
        directory = str(make_hf_dir(tmp_path_factory.mktemp(family), "qwen2" if family == "lora" else family, tie=tie))
    out = tmp_path_factory.mktemp(f"step-{family}")
    proc = _torchrun(3, [str(THIS), "step", str(out), family, directory], out, retry_cxx_abort=True)  # see CXX_ABORT
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "result.json").read_text()), out, family, directory


def test_a_sharded_step_equals_a_one_process_step(step_result):
    """Gradients (after clipping by the global norm) and parameters after one AdamW step, FSDP over
    2 ranks on half the batch each vs one process on the whole batch (float32 summation order), each
    element within its float32 bound derived in ``tests/tolerances.py`` (``_step_bounds``). Measured
    before (builtin / llama / qwen2): gradients 4.9e-10 / 2.3e-10 / 2.3e-10, AdamW moments 5.1e-11 /
    2.2e-11 / 2.2e-11, parameters 7.9e-7 / 1.1e-5 / 7.1e-7 (an element whose gradient is within
    rounding of 0: AdamW's first step is ~lr sign(g))."""
    r, *_ = step_result
    assert r["shards"][0] > 0 and r["shards"][1] > 0 and r["tokens"][0] != r["tokens"][1], r  # uneven token counts: the scale matters
    assert r["fsdp_forwards"]["packed"] >= 1, r["fsdp_forwards"]  # the FSDP ranks ran packed rows (the default), the one process padded
    assert r["init_diff"] == 0.0
    assert r["grad_norm_ref"] > r["grad_clip"], r  # the clip is active, so the global norm is checked too
    # each element within its derived float32 bound (tests/tolerances.py, CONTRIBUTING item 6): the
    # gradients of two sums of the same contributions, clipped by norms within grad_norm_atol; the
    # moments (1 - b1) d and (1 - b2)(2|g| + d) d; the parameters through AdamW's m / (sqrt(v) + eps)
    assert abs(r["grad_norm_fsdp"] - r["grad_norm_ref"]) <= r["grad_norm_atol"], r
    assert r["grad_over_bound"] <= 1.0, r
    assert r["param_over_bound"] <= 1.0, r
    assert r["exp_avg_over_bound"] <= 1.0 and r["exp_avg_sq_over_bound"] <= 1.0, r


def test_each_rank_holds_about_half_of_the_replicas_state(step_result):
    """Parameters + AdamW moments (elements) per rank vs a replica's: 1/2 up to the rounding of
    ``torch.chunk`` rows (measured exactly 0.5 on these tiny models, whose dim 0 sizes are all even)."""
    r, *_ = step_result
    replica = r["numel_replica"]
    for mine in r["numel_ranks"]:
        assert abs(mine["params"] / replica["params"] - 0.5) < 0.05, r
        assert abs(mine["optimizer"] / replica["optimizer"] - 0.5) < 0.05, r
    assert sum(m["params"] for m in r["numel_ranks"]) == replica["params"]  # every element once


def test_a_sharded_checkpoint_resumes_exactly_on_any_dp_size(step_result):
    """The gathered checkpoint holds the sharded trainer's full state exactly; the step after loading it
    into a fresh sharded trainer equals the uninterrupted run's bit for bit (same dp: same
    arithmetic), and after loading it into one process (dp 2 -> 1) within the derived float32 bound of
    that AdamW step (measured 1.7e-7 / 1.2e-7 / 2.9e-7, builtin / llama / qwen2). (A state whose
    AdamW step count was shared with another trainer, and so advanced, gave 1.5e-3.)"""
    r, tmp, *_ = step_result
    state = torch.load(tmp / "policy.pt", weights_only=True)
    assert int(state["version"]) == 1 and set(state) >= {"model", "optimizer", "model_config"}
    assert r["checkpoint_vs_fsdp"] == 0.0 and r["checkpoint_moments_vs_fsdp"] == 0.0, r
    assert r["state_is_none"] == [False, True]  # gathered on the lead only: the other rank never holds the whole state
    assert r["uneven_to_lead"] == [[True] * 3, [True] * 3]  # 5, 1 and 0 rows over 2 ranks: equal on the lead, None elsewhere
    assert r["resumed_fsdp_diff"] == 0.0, r
    assert r["resumed_one_process"]["param_over_bound"] <= 1.0, r  # AdamW's second step from equal states (_step_bounds)
    assert r["resumed_version"] == 2


def test_the_generator_receives_the_trainers_full_weights_from_the_shards(step_result):
    r, *_ = step_result
    assert r["transport_equal"], r
    assert r["transport_bytes_received"] == r["weight_bytes"], r  # every byte once, from the shards
    assert all(b > 0 for b in r["transport_bytes_sent"]), r  # both shards sent


def test_flowrl_export_of_a_sharded_checkpoint_loads(step_result):
    transformers = pytest.importorskip("transformers")
    from flowrl.models.hf_export import export_hf

    r, tmp, family, directory = step_result
    state = torch.load(tmp / "policy.pt", weights_only=True)
    out = export_hf(state, tmp / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True, dtype=torch.float32)
    exported = model.state_dict()
    if family == "builtin":
        from flowrl.graph.configs import ModelConfig
        from flowrl.models.hf_export import hf_config_and_state

        _, expected = hf_config_and_state(msgspec.convert(state["model_config"], ModelConfig), state["model"])
    elif family == "lora":  # merged: peft's merge_and_unload of the gathered adapters into the base
        from flowrl.graph.configs import HFModelConfig
        from flowrl.models.lora import merged_model

        expected = merged_model(msgspec.convert(state["model_config"], HFModelConfig), state["model"]).state_dict()
        assert all(bool(t.abs().sum() > 0) for n, t in state["model"].items() if ".lora_B." in n)  # B moved from 0: a real merge
    else:
        expected = state["model"]
    for name, t in expected.items():
        assert torch.equal(exported[name], t), name


@pytest.mark.slow  # CI time; run with --runslow
def test_mixed_precision_computes_in_bfloat16_and_keeps_float32_master_weights(tmp_path):
    """param_dtype='bfloat16': the blocks see bfloat16 activations, the sharded parameters and AdamW's
    moments stay float32, and the gradient is the float32 one-process gradient up to bfloat16's
    rounding (relative error of the whole gradient: measured 9.0e-3; tolerance 5e-2)."""
    proc = _torchrun(2, [str(THIS), "mixed", str(tmp_path)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads((tmp_path / "result.json").read_text())
    assert r["block_input_dtype"] == "torch.bfloat16", r
    assert r["param_dtypes"] == ["torch.float32"] and r["moment_dtypes"] == ["torch.float32"], r
    assert 0 < r["grad_rel_error"] < 5e-2, r  # measured (bfloat16 rounding: no float32 bound, CONTRIBUTING item 5)


@pytest.mark.slow  # CI time; run with --runslow
@pytest.mark.parametrize("family", ["builtin", "llama"])
def test_gradient_checkpointing_and_micro_batches_keep_the_sharded_gradient(tmp_path, family):
    """FSDP with gradient_checkpointing=True and micro_batch_size=8 (several all-gather / reduce-scatter
    rounds per step, recomputed blocks) against one process without either: gradients within their
    derived float32 bound (``_step_bounds``; measured 2.3e-10 builtin, 1.2e-10 llama)."""
    directory = ""
    if family != "builtin":
        from tests.hf_fixtures import make_hf_dir

        directory = str(make_hf_dir(tmp_path / family, family))
    proc = _torchrun(2, [str(THIS), "checkpointing", str(tmp_path), family, directory], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads((tmp_path / "result.json").read_text())
    assert r["passes_per_rank"] > 1 and r["grad_over_bound"] <= 1.0, r


# -- the whole pipeline ------------------------------------------------------------------------------
@pytest.mark.slow  # CI time; run with --runslow
def test_a_2_rank_fsdp_policy_trains_with_a_generator_rank(tmp_path):
    """3 processes on gloo: generator on rank 0, the FSDP policy on ranks 1-2, weights over the
    collective transport from the shards. Every step within the staleness bound, the reward rises,
    each step the shards together put one full copy of the weights on the wire, and the final
    checkpoint (each rank's shards, ``policy-policy.dcp``) exports through the CLI and builds."""
    (tmp_path / "place.json").write_text(json.dumps({"gen": [0], "policy": [1, 2]}))
    steps = 60
    proc = _torchrun(3, ["-m", "flowrl", "run", "tests.runtime.test_fsdp:fsdp_graph", "--backend", "torchrun",
                         "--plan", "place.json", "--steps", str(steps), "--quiet", "--metrics", "m.jsonl",
                         "--checkpoint-dir", "ck"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(tmp_path / "m.jsonl")
    assert [r["policy_version"] for r in rows] == list(range(1, steps + 1))
    assert all(0 <= r["staleness"] <= 1 for r in rows)
    first = sum(r["reward_mean"] for r in rows[:10]) / 10
    last = sum(r["reward_mean"] for r in rows[-10:]) / 10
    assert last > first + 0.05, (first, last)  # measured: 0.07 -> 0.16 (first/last 10 steps, one run)
    from flowrl.runtime.checkpointing.store import read_policy_state
    from flowrl.models.families.builtin.model import Transformer

    nbytes = 4 * sum(p.numel() for p in Transformer(fsdp_graph().node("policy").model).parameters())
    assert all(r["weights/collective_bytes"] == nbytes for r in rows), rows[0]
    state = read_policy_state(tmp_path / "ck")
    assert int(state["version"]) == steps
    assert sum(t.numel() for t in state["model"].values()) >= nbytes // 4  # full tensors, not shards
    transformers = pytest.importorskip("transformers")
    export = subprocess.run([sys.executable, "-m", "flowrl", "export", "ck", "-o", "hf"], cwd=tmp_path, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert export.returncode == 0, export.stderr[-2000:]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True, dtype=torch.float32)
    assert torch.equal(model.state_dict()["model.embed_tokens.weight"], state["model"]["tok_embeddings.weight"])


@pytest.mark.slow  # CI time (test_the_generator_receives_the_trainers_full_weights_from_the_shards stays)
@pytest.mark.parametrize("place", [{"policy": [0, 1], "gen": [2]}, {"policy": [0, 1], "gen": [0, 1]}], ids=["disjoint", "colocated"])
def test_the_generators_weights_equal_the_final_checkpoint_bit_for_bit(tmp_path, place):
    """A real run (3 steps, k = 0) with the FSDP policy on ranks 0-1 and the generator on its own rank or
    as replicas on the policy's ranks (each rank then both sends shards and receives the whole state):
    after the last sync every generator rank's weights hash like the final checkpoint's (sharded, read consolidated)."""
    (tmp_path / "place.json").write_text(json.dumps(place))
    world = 1 + max(r for rs in place.values() for r in rs)
    proc = _torchrun(world, [str(THIS), "bitwise", str(tmp_path)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from tests.runtime.test_torchrun import _state_hash

    hashes = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("gen-rank*.json"))]
    assert {h["rank"] for h in hashes} == set(place["gen"]), proc.stderr[-3000:]
    from flowrl.runtime.checkpointing.store import read_policy_state

    state = read_policy_state(tmp_path / "ck")
    assert all(h["version"] == int(state["version"]) == 3 for h in hashes), hashes
    assert all(h["sha256"] == _state_hash(state["model"]) for h in hashes)


@pytest.mark.slow
def test_an_fsdp_policy_publishes_gathered_weights_on_a_file_edge(tmp_path):
    """A transport with one writer (file): every rank gathers, the lead publishes; the run keeps the bound."""
    (tmp_path / "place.json").write_text(json.dumps({"gen": [0], "policy": [1, 2]}))
    proc = _torchrun(3, ["-m", "flowrl", "run", "tests.runtime.test_fsdp:fsdp_file_graph", "--backend", "torchrun",
                         "--plan", "place.json", "--steps", "4", "--quiet", "--metrics", "m.jsonl", "--max-staleness", "0"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(tmp_path / "m.jsonl")
    assert [r["policy_version"] for r in rows] == [1, 2, 3, 4] and all(r["staleness"] == 0 for r in rows)


@pytest.mark.slow  # 5 torchrun jobs, ~3 min on 2 cores; the fast check of the same is test_a_sharded_checkpoint_resumes_exactly_on_any_dp_size
def test_a_run_resumed_from_a_sharded_checkpoint_continues_as_the_uninterrupted_one(tmp_path):
    """Through the CLI at k = 0 (every step's rollout from the previous step's weights): a run of 4
    steps, and a run of 2 steps resumed to 4, once on the same 2 policy ranks, once on 3 and once on 1
    (other dp sizes, from copies of the same checkpoint; on one rank the policy runs whole and saves one
    file, so the same graph resumes on fewer ranks), and the one-rank run resumed on 2 ranks again; a copy missing a rank's shard file is refused, every rank
    stopping with the fix before any work. The same dp gives the same rewards and the same final
    weights bit for bit; dp 3 and dp 1 the same rewards and final weights within 1e-5 (float summation order
    through the reduce-scatters: the fast test measures 1.7e-7 for dp 2 -> 1 after one step on the
    built-in model; here two AdamW steps compound it; 1e-5 leaves room for that, not for a wrong shard)."""
    import shutil

    from flowrl.runtime.checkpointing.store import read_policy_state

    def launch(nproc, place, steps, ck, *extra):
        (tmp_path / "place.json").write_text(json.dumps(place))
        return _torchrun(nproc, ["-m", "flowrl", "run", "tests.runtime.test_fsdp:fsdp_graph", "--backend", "torchrun",
                                 "--plan", "place.json", "--steps", str(steps), "--quiet", "--metrics", f"{ck}.jsonl",
                                 "--checkpoint-dir", ck, "--checkpoint-every", "2", "--max-staleness", "0", *extra], tmp_path)

    def run(nproc, place, steps, ck, *extra):
        proc = launch(nproc, place, steps, ck, *extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return _rows(tmp_path / f"{ck}.jsonl")

    two, three, one = {"gen": [0], "policy": [1, 2]}, {"gen": [0], "policy": [1, 2, 3]}, {"gen": [0], "policy": [1]}
    whole = run(3, two, 4, "a")
    run(3, two, 2, "b")
    shutil.copytree(tmp_path / "b", tmp_path / "c")
    shutil.copytree(tmp_path / "b", tmp_path / "d")
    shutil.copytree(tmp_path / "b", tmp_path / "e")
    (missing,) = (tmp_path / "e").glob("step-*/policy-policy.dcp/__1_0.distcp")
    missing.unlink()  # rank 2's shards: a checkpoint no layout can be resharded from
    refused = launch(3, two, 4, "e", "--resume")
    said = " ".join(refused.stderr.split())  # the CLI wraps its message
    assert refused.returncode != 0 and "lacks shard files ['__1_0.distcp'] of the 2 ranks that wrote it" in said, refused.stderr[-3000:]
    assert "resume from an intact checkpoint" in said and not (tmp_path / "e.jsonl").exists()  # the fix; no step ran
    assert "flowrl/" not in "".join(line for line in refused.stderr.splitlines() if line.strip().startswith("File "))  # torchrun's traceback only
    same = run(3, two, 4, "b", "--resume")[-2:]  # the resumed run appends to b's metrics
    others = [run(4, three, 4, "c", "--resume")[-2:], run(2, one, 4, "d", "--resume")[-2:]]
    want = [r["reward_mean"] for r in whole[2:]]
    for rows in (same, *others):
        assert [r["policy_version"] for r in rows] == [3, 4] and [r["reward_mean"] for r in rows] == want
    back = run(3, two, 6, "d", "--resume")[-2:]  # dp 1's one-file state read by 2 sharded ranks (it once took it for shards)
    assert [r["policy_version"] for r in back] == [5, 6] and next((tmp_path / "d").glob("step-*6/policy-policy.dcp/__1_0.distcp"))
    final = {k: read_policy_state(tmp_path / k)["model"] for k in ("a", "b", "c")}
    final["d"] = read_policy_state(tmp_path / "d" / "step-00000004")["model"]
    assert all(torch.equal(final["b"][n], t) for n, t in final["a"].items())
    diff = max(float((final[k][n] - t).abs().max()) for k in ("c", "d") for n, t in final["a"].items())
    assert diff < 1e-5, diff  # measured, not derived: after two steps the second gradient is taken at weights the first moved apart (CONTRIBUTING item 6)


# -- the job's entry point (run under torchrun) ---------------------------------------------------------
def _batch(family: str, directory: str, seed: int) -> dict[str, torch.Tensor]:
    """A scored rollout, the same on every rank (seeded generation)."""
    from flowrl.operators.generation import Generator

    if family == "builtin":
        from flowrl.operators.scoring import Scorer
        from flowrl.operators.source import PromptSource

        graph = build_llamarl()
        source = PromptSource(graph.node("prompts"))
        for _ in range(seed + 1):
            prompts = source.next_batch()
        rollout = Generator(graph.node("gen"), seed=seed).generate(prompts)
        g = torch.Generator().manual_seed(seed)  # uneven prompts (the first tokens read as padding) and early ends: rows to pack
        lens = torch.randint(1, rollout["sample_prompt_lens"].max() + 1, rollout["sample_prompt_lens"].shape, generator=g)
        mask = rollout["completion_mask"] & (torch.arange(rollout["completion_mask"].shape[1]) < torch.randint(1, 6, lens.shape, generator=g)[:, None])
        return {**rollout, **Scorer(graph.node("reward")).score(rollout), "sample_prompt_lens": torch.minimum(rollout["sample_prompt_lens"], lens), "completion_mask": mask}
    from tests.models.helpers import hf_generator_node, left_padded

    g = torch.Generator().manual_seed(seed)
    rows = [[1] + torch.randint(3, 40, (int(n),), generator=g).tolist() for n in torch.randint(1, 6, (8,), generator=g)]
    rollout = Generator(hf_generator_node(Path(directory), n_samples=4, max_new_tokens=6), seed=seed).generate(left_padded(rows))
    mask = rollout["completion_mask"].clone()
    ends = torch.randint(1, mask.shape[1] + 1, (mask.shape[0],), generator=g)  # uneven lengths (as if EOS came early)
    mask &= torch.arange(mask.shape[1])[None, :] < ends[:, None]
    lens = torch.minimum(rollout["completion_lens"], ends.to(rollout["completion_lens"].dtype))  # the extent ends there too: rows to pack
    return {**rollout, "completion_mask": mask, "completion_lens": lens, "rewards": torch.randn(mask.shape[0], generator=g)}


LORA = dict(r=2, alpha=4, target_modules=("q_proj", "v_proj"))


def _policy(family: str, directory: str, sharding: str, packing: bool | None = None):
    from flowrl.graph.configs import HFModelConfig, LoraConfig
    from flowrl.graph.nodes import PolicyNode

    lora = LoraConfig(**LORA) if family == "lora" else None
    model = build_llamarl().node("policy").model if family == "builtin" else HFModelConfig(path=directory, init="random", seed=3, lora=lora)
    return PolicyNode(name="policy", model=model, optimizer=OptimizerConfig(lr=1e-2, grad_clip=0.01, sharding=sharding, packing=packing))


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _max_diff(a: dict, b: dict) -> float:
    return max(float((_full(a[k]).float() - _full(b[k]).float()).abs().max()) for k in b)


def _trained(trainer) -> list:
    """The parameters the optimizer holds, in its order (a LoRA policy's adapters only)."""
    return [p for group in trainer.optimizer.param_groups for p in group["params"]]


def _published(trainer) -> dict:
    """What the trainer's checkpoint holds as its model: the state dict, or a LoRA policy's adapters."""
    from flowrl.models.lora import adapter_weights

    return adapter_weights(trainer.model) if trainer.lora else dict(trainer.model.state_dict())


def _step_bounds(mine, ref, mags, batch: dict, grad_norm: float, family: str, partials: int = 2, step: int = 1) -> dict:
    """Each gradient (after the clip), AdamW moment and parameter after the step (the ``step``-th, from
    states equal before it), as its largest |difference| / derived float32 bound (``tests/tolerances.py``:
    <= 1 passes), and the global norm's bound."""
    from tests.tolerances import U32, adamw_param_atol, clipped_atol, grad_norm_atol

    params = _trained(ref)
    width = batch["sample_prompt_ids"].shape[1] + batch["completion_ids"].shape[1]
    extra = [LORA["r"]] * 2 * len(LORA["target_modules"]) if family == "lora" else []
    tol = mags.tolerances(seq_len=width, partials=2, extra=extra, named=[(str(i), p) for i, p in enumerate(params)], grad_norm=grad_norm)  # ranks x micro-batches
    group = ref.optimizer.param_groups[0]
    grad_tol = clipped_atol(tol, {str(i): p.grad for i, p in enumerate(params)}, grad_norm=grad_norm, max_norm=0.01)
    over = {"grad": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0, "param": 0.0}

    def ratio(a, b, bound) -> float:
        return float(((_full(a).double() - b.double()).abs() / bound.double()).nan_to_num(posinf=1e30).max())

    for i, (p, q) in enumerate(zip(_trained(mine), params)):
        d, state, mstate = grad_tol[str(i)], ref.optimizer.state[q], mine.optimizer.state[p]
        b1, b2 = group["betas"]
        over["grad"] = max(over["grad"], ratio(p.grad, q.grad, d))
        # from equal moments: m += (1 - b1) g, v += (1 - b2) g^2, each moved by its gradient's d
        over["exp_avg"] = max(over["exp_avg"], ratio(mstate["exp_avg"], state["exp_avg"], (1 - b1) * d + 2 * U32 * state["exp_avg"].abs()))
        v_tol = (1 - b2) * (2 * q.grad.abs() + d) * d + 4 * U32 * state["exp_avg_sq"]
        over["exp_avg_sq"] = max(over["exp_avg_sq"], ratio(mstate["exp_avg_sq"], state["exp_avg_sq"], v_tol))
        bound = adamw_param_atol(d, state["exp_avg"], state["exp_avg_sq"], q, step=step, lr=group["lr"], betas=tuple(group["betas"]), eps=group["eps"])
        over["param"] = max(over["param"], ratio(p, q.detach(), bound))
    return {f"{k}_over_bound": v for k, v in over.items()} | {"grad_norm_atol": grad_norm_atol(tol, grad_norm)}


def _step_job(out: str, family: str, directory: str) -> int:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from flowrl.graph.nodes import LossNode
    from flowrl.models.lora import adapter_shapes
    from flowrl.models.registry import weight_shapes
    from flowrl.operators.trainer import Trainer
    from flowrl.runtime.parallel.distributed import recv_batch, send_batch, shard_by_groups
    from flowrl.runtime.parallel.fsdp import full_state, full_weights, load_full_state, local_numel, local_weights, shard_trainer_, token_scale
    from flowrl.runtime.parallel.fsdp_init import meta_build
    from flowrl.placement.resharding import dp_replicas, fsdp
    from flowrl.runtime.transports.collective import CollectiveTransport
    from tests.tolerances import GradientMagnitudes

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    trainers = (0, 1)
    mesh = DeviceMesh("cpu", torch.tensor(trainers), mesh_dim_names=("dp",))  # every rank creates it
    loss = LossNode(name="aipo")
    batches = [_batch(family, directory, s) for s in (0, 1)]
    torch.manual_seed(0)
    ref = Trainer(_policy(family, directory, "replicate", packing=False), loss)  # padded; the FSDP ranks pack (the default)
    result: dict = {"grad_clip": 0.01, "lr": 1e-2}
    shards = [shard_by_groups(b, 2) for b in batches]
    if rank in trainers:
        torch.manual_seed(0)
        node = _policy(family, directory, "fsdp")
        model, source = meta_build(node.model)  # as ShardedPolicy starts it: on the meta device, this rank's rows read or drawn
        mine = Trainer(node, loss, model=model)
        shard_trainer_(mine, mesh, source=source)
        layouts = result.setdefault("fsdp_forwards", {"packed": 0, "padded": 0})
        mine.model.register_forward_pre_hook(
            lambda m, a, k: layouts.__setitem__(key := "padded" if k.get("packed_positions") is None else "packed", layouts[key] + 1), with_kwargs=True
        )
        result["init_diff"] = _max_diff(dict(mine.model.named_parameters()), dict(ref.model.named_parameters()))

        def fsdp_step(trainer, b, shard):
            trainer.loss_scale = token_scale(2, float(shard["completion_mask"].sum()), float(b["completion_mask"].sum()))
            return trainer.train_step(shard)

        with GradientMagnitudes(ref.model) as mags:  # the whole batch's |delta|.|x| sums (tests/tolerances.py)
            ref_metrics = ref.train_step(batches[0])
        metrics = fsdp_step(mine, batches[0], shards[0][rank])
        result.update(_step_bounds(mine, ref, mags, batches[0], ref_metrics["policy/grad_norm"], family))
        result.update(
            shards=[int(s["completion_mask"].shape[0]) for s in shards[0]],
            tokens=[int(s["completion_mask"].sum()) for s in shards[0]],
            grad_norm_ref=ref_metrics["policy/grad_norm"],
            grad_norm_fsdp=metrics["policy/grad_norm"],
            max_grad_diff=max(float((_full(p.grad) - q.grad).abs().max()) for p, q in zip(_trained(mine), _trained(ref))),
            max_param_diff=_max_diff(dict(mine.model.named_parameters()), dict(ref.model.named_parameters())),
            max_moment_diff=max(
                float((_full(mine.optimizer.state[p][k]) - ref.optimizer.state[q][k]).abs().max())
                for p, q in zip(_trained(mine), _trained(ref)) for k in ("exp_avg", "exp_avg_sq")
            ),
        )
        numel = torch.tensor([local_numel(mine)["params"], local_numel(mine)["optimizer"]])
        every = [torch.zeros_like(numel) for _ in trainers]
        dist.all_gather(every, numel, group=mesh.get_group())
        result["numel_ranks"] = [{"params": int(n[0]), "optimizer": int(n[1])} for n in every]
        result["numel_replica"] = local_numel(ref)
        state = full_state(mine)  # every rank sends its rows; rank 0, the lead, alone gets the state and writes it
        published = {k: _full(v) for k, v in _published(mine).items()}  # all-gathers: every rank calls them
        moments = [_full(mine.optimizer.state[p][k]) for p in _trained(mine) for k in ("exp_avg", "exp_avg_sq")]
        result["state_is_none"] = state is None
        from torch.distributed.tensor import Shard, distribute_tensor

        from flowrl.runtime.parallel.fsdp import _to_lead

        uneven = []  # rows torch.chunk splits unevenly, or into fewer chunks than ranks
        for rows in (5, 1, 0):
            whole = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)
            got = _to_lead(distribute_tensor(whole, mesh, [Shard(0)], src_data_rank=None))
            uneven.append(got is None if rank else bool(torch.equal(got, whole)))
        result["uneven_to_lead"] = uneven
        if rank == 0:
            torch.save(state, Path(out) / "policy.pt")
            result["checkpoint_vs_fsdp"] = _max_diff(state["model"], published)
            saved = [state["optimizer"]["state"][i][k] for i, _ in enumerate(_trained(mine)) for k in ("exp_avg", "exp_avg_sq")]
            result["checkpoint_moments_vs_fsdp"] = max(float((a - b).abs().max()) for a, b in zip(saved, moments))
        fsdp_step(mine, batches[1], shards[1][rank])  # uninterrupted
        uninterrupted = {k: _full(v).clone() for k, v in mine.model.state_dict().items()}
        ref.train_step(batches[1])
        result["step2_fsdp_vs_ref"] = _max_diff(uninterrupted, dict(ref.model.state_dict()))
        diffs = torch.cat([(uninterrupted[k] - ref.model.state_dict()[k]).flatten() for k in uninterrupted])
        result["step2_diff_norm"] = float(diffs.norm())
        dist.barrier(group=mesh.get_group())
        saved = torch.load(Path(out) / "policy.pt", weights_only=True)
        torch.manual_seed(99)  # other initial weights: only the checkpoint can make them equal
        fresh = Trainer(_policy(family, directory, "fsdp"), loss)
        shard_trainer_(fresh, mesh)
        load_full_state(fresh, saved)
        fsdp_step(fresh, batches[1], shards[1][rank])
        result["resumed_fsdp_diff"] = _max_diff(dict(fresh.model.state_dict()), uninterrupted)
        result["resumed_version"] = fresh.version
        one = Trainer(_policy(family, directory, "replicate", packing=False), loss)
        one.load_state(torch.load(Path(out) / "policy.pt", weights_only=True))
        with GradientMagnitudes(one.model) as mags:
            one_metrics = one.train_step(batches[1])
        result["resumed_one_process"] = _step_bounds(mine, one, mags, batches[1], one_metrics["policy/grad_norm"], family, step=2)
        result["resumed_one_process_diff"] = _max_diff(dict(one.model.state_dict()), uninterrupted)
        result["resumed_one_process_vs_ref"] = _max_diff(dict(one.model.state_dict()), dict(ref.model.state_dict()))
    # the collective transport, straight from the shards: ranks 0-1 publish, rank 2 fetches the full state
    config = _policy(family, directory, "fsdp").model
    shapes = adapter_shapes(config) if family == "lora" else weight_shapes(config)
    params = {n: {"shape": list(s), "dtype": str(d).removeprefix("torch.")} for n, (s, d) in shapes.items()}
    t = CollectiveTransport(params=params, trainer_layout=fsdp(trainers), generator_layout=dp_replicas((2,)), channel="fsdp-test", timeout_s=30)
    if rank in trainers:
        t.publish(local_weights(mine.model), 7)
        full = full_weights(mine.model)
        sent = torch.tensor([t.bytes_sent])
        dist.all_reduce(sent, group=mesh.get_group())
        if rank == 0:
            send_batch(full, dst=2)
        every_sent = [torch.zeros(1, dtype=torch.int64) for _ in trainers]
        dist.all_gather(every_sent, torch.tensor([t.bytes_sent]), group=mesh.get_group())
        result["transport_bytes_sent"] = [int(x) for x in every_sent]
    else:
        target = {n: torch.empty(s, dtype=d) for n, (s, d) in shapes.items()}
        got = None
        while got is None:
            got = t.fetch_into(target, newer_than=-1)
        full = recv_batch(src=0)
        result.update(
            transport_equal=got == 7 and all(torch.equal(target[n], full[n]) for n in target),
            transport_bytes_received=t.bytes_received,
            weight_bytes=sum(v.numel() * v.element_size() for v in target.values()),
        )
    t.close()
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)  # test-only plumbing: plain JSON-able dicts
    if rank == 0:
        merged = {**results[0], **results[2], "transport_bytes_sent": results[0]["transport_bytes_sent"],
                  "state_is_none": [results[0]["state_is_none"], results[1]["state_is_none"]],
                  "uneven_to_lead": [results[0]["uneven_to_lead"], results[1]["uneven_to_lead"]]}
        Path(out, "result.json").write_text(json.dumps(merged))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _bitwise_job(out: str) -> int:
    """``fsdp_graph`` for 3 steps at k = 0 on place.json; each generator rank hashes the newest version it fetched."""
    from tests.runtime.test_torchrun import _run_and_hash_generator_weights

    return _run_and_hash_generator_weights(fsdp_graph(max_staleness=0), Path(out))


def _checkpointing_job(out: str, family: str, directory: str) -> int:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from flowrl.graph.nodes import LossNode
    from flowrl.operators.trainer import Trainer
    from flowrl.runtime.parallel.distributed import shard_by_groups
    from flowrl.runtime.parallel.fsdp import shard_trainer_, token_scale
    from tests.tolerances import GradientMagnitudes

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    batch, loss = _batch(family, directory, 0), LossNode(name="aipo")

    def node(sharding, ckpt, micro):
        n = _policy(family, directory, sharding)
        return msgspec.structs.replace(n, optimizer=msgspec.structs.replace(n.optimizer, gradient_checkpointing=ckpt, micro_batch_size=micro))

    torch.manual_seed(0)
    ref = Trainer(node("replicate", False, 0), loss)
    torch.manual_seed(0)
    mine = Trainer(node("fsdp", True, 8), loss)
    shard_trainer_(mine, mesh)
    with GradientMagnitudes(ref.model) as mags:  # the one process's |delta|.|x| sums, no recomputation (tests/tolerances.py)
        ref_metrics = ref.train_step(batch)
    shard = shard_by_groups(batch, 2)[rank]
    mine.loss_scale = token_scale(2, float(shard["completion_mask"].sum()), float(batch["completion_mask"].sum()))
    mine.train_step(shard)
    diff = max(float((_full(p.grad) - q.grad).abs().max()) for p, q in zip(mine.model.parameters(), ref.model.parameters()))
    passes = -(-int(shard["completion_mask"].shape[0]) // 8)
    bounds = _step_bounds(mine, ref, mags, batch, ref_metrics["policy/grad_norm"], family, partials=2 * passes)
    if rank == 0:
        Path(out, "result.json").write_text(json.dumps({"max_grad_diff": diff, "passes_per_rank": passes, **bounds}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _mixed_job(out: str) -> int:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from flowrl.graph.nodes import LossNode
    from flowrl.operators.trainer import Trainer
    from flowrl.runtime.parallel.distributed import shard_by_groups
    from flowrl.runtime.parallel.fsdp import shard_trainer_, token_scale
    from tests.tolerances import GradientMagnitudes

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    batch = _batch("builtin", "", 0)
    loss = LossNode(name="aipo")
    torch.manual_seed(0)
    ref = Trainer(_policy("builtin", "", "replicate"), loss)
    node = _policy("builtin", "", "fsdp")
    node = msgspec.structs.replace(node, optimizer=msgspec.structs.replace(node.optimizer, param_dtype="bfloat16", grad_clip=0.0))
    torch.manual_seed(0)
    mine = Trainer(node, loss)
    shard_trainer_(mine, mesh)
    seen = []
    mine.model.layers[0].register_forward_pre_hook(lambda module, args: seen.append(str(args[0].dtype)))
    ref_node = msgspec.structs.replace(ref.node, optimizer=msgspec.structs.replace(ref.node.optimizer, grad_clip=0.0))
    ref.node = ref_node
    ref.train_step(batch)
    shard = shard_by_groups(batch, 2)[rank]
    mine.loss_scale = token_scale(2, float(shard["completion_mask"].sum()), float(batch["completion_mask"].sum()))
    mine.train_step(shard)
    grads = torch.cat([_full(p.grad).flatten() for p in mine.model.parameters()])
    want = torch.cat([p.grad.flatten() for p in ref.model.parameters()])
    if rank == 0:
        Path(out, "result.json").write_text(json.dumps({
            "block_input_dtype": seen[0],
            "param_dtypes": sorted({str(p.dtype) for p in mine.model.parameters()}),
            "moment_dtypes": sorted({str(s["exp_avg"].dtype) for s in mine.optimizer.state.values()}),
            "grad_rel_error": float((grads - want).norm() / want.norm()),
        }))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":  # a rank: ends without interpreter teardown (see rank_exit)
    from flowrl.runtime.backends.torchrun.rank_exit import end_rank_process

    if sys.argv[1] == "bitwise":
        end_rank_process(_bitwise_job(sys.argv[2]))
    if sys.argv[1] == "checkpointing":
        end_rank_process(_checkpointing_job(sys.argv[2], sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else ""))
    if sys.argv[1] == "mixed":
        end_rank_process(_mixed_job(sys.argv[2]))
    if sys.argv[1] == "step":
        end_rank_process(_step_job(sys.argv[2], sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else ""))
    raise SystemExit(f"unknown mode {sys.argv[1]!r}")
