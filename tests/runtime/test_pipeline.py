"""A pipeline-parallel policy (a ``pp`` mesh axis) under torchrun on gloo: equal to one process, resumable.

The jobs run with ``python -m torch.distributed.run`` (CPU, gloo, 2-4 ranks). This file is also their
entry point (``python tests/runtime/test_pipeline.py MODE OUT ...``):

- ``step`` (pp=2 on 2 ranks, or pp=2 x dp=2 on 4): the policy's rank program (``PipelinePolicy``, built
  by ``rank_program`` as a run builds it) takes one step on a scored rollout, against a one-process
  ``Trainer`` on the same batch: the loss the lead reports within the loss's float32 bound, and every
  stage's clipped gradients, AdamW moments and updated parameters within theirs (``tests/tolerances.py``);
  the forward-only pass (the proximal log-probs of a batch with several updates) within the log-prob
  bound; then its checkpoint (each stage its own tensors, DCP) read in one process equal to the stages'
  tensors bit for bit, and a one-process state loaded into fresh stages bit for bit (pp 2 -> 1 -> 2);
- ``run``: a real run (generator on rank 0, the policy's mesh ``{"pp": 2}`` on ranks 1-2, two updates
  per batch) whose generator's weights hash like the final checkpoint's.
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

from tests.runtime.test_torchrun import _rows, _torchrun  # the jobs run with PYTHONPATH=ROOT (see _torchrun)

ROOT = Path(__file__).resolve().parents[2]
THIS = Path(__file__).resolve()


def pp_graph(transport: str = "inprocess", micro_batch_size: int = 8, num_iterations: int = 1, model=None, **optimizer):
    """The default example (built-in model: 2 layers, a tied head) with weights over ``transport``; the
    placement gives the policy its pp mesh."""
    model = model or build_llamarl().node("policy").model
    b = GraphBuilder("llamarl_pp", model=model)
    prompts = b.source("prompts", task="copy", batch_size=16)
    gen = b.generator("gen", prompts, n_samples=16, max_new_tokens=5, temperature=1.0)
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    aipo = b.loss("aipo", gen, reward, objective="aipo", rho=4.0, normalize_std=True)
    policy = b.policy("policy", aipo, lr=optimizer.pop("lr", 1e-3), micro_batch_size=micro_batch_size, num_iterations=num_iterations, **optimizer)
    b.weights(policy, gen, max_staleness=0, transport=transport)
    return b.build()


def pp_file_graph():
    """``pp_graph`` with its weights over files: the stages gather to the lead, which writes."""
    return pp_graph(transport="file", num_iterations=2)


def pp_iterations_graph():
    """``pp_graph`` with two updates per batch (the proximal log-probs run forward only through the stages)."""
    return pp_graph(num_iterations=2)


# -- the rule and bad input: before any work -------------------------------------------------------
def test_stages_split_the_layers_as_the_planner_prices_them():
    from flowrl.planners.parallel import stage_layers
    from flowrl.runtime.parallel.pipeline import stage_bounds

    for layers in range(1, 13):
        for pp in range(1, layers + 1):
            bounds = stage_bounds(layers, pp)
            assert bounds[0][0] == 0 and bounds[-1][1] == layers and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
            assert max(e - s for s, e in bounds) == stage_layers(layers, pp) and min(e - s for s, e in bounds) >= 1
    with pytest.raises(ConfigError, match=r"pp=3 stages of 2 layers: a stage would hold no layer; use pp <= 2"):
        stage_bounds(2, 3)


@pytest.mark.parametrize(
    ("mesh", "graph_options", "match"),
    [
        ({"pp": 3}, {}, r"policy 'policy' \(mesh \{'pp': 3\}\): pp=3 pipeline stages but its model has 2 layers.*pp <= 2"),
        ({"pp": 2, "tp": 2}, {}, r"pp x tp is not executed; use a mesh of pp and dp only \(e.g. \{\"pp\": 2, \"dp\": 2\}\)"),
        ({"pp": 2}, {"sharding": "fsdp"}, r"sharding='fsdp' shards over dp ranks, which a pipeline-parallel policy does not"),
        ({"pp": 2}, {"packing": True}, r"packing=True, but pipeline stages exchange activations of one shape.*set packing=None"),
    ],
    ids=["pp-over-layers", "pp-x-tp", "fsdp", "packing"],
)
def test_a_pipeline_the_program_cannot_run_is_refused(mesh, graph_options, match):
    from flowrl.runtime.parallel.pipeline import check_pipeline

    sizes = tuple(mesh.get(a, 1) for a in ("pp", "dp", "tp"))
    with pytest.raises(ConfigError, match=match):
        check_pipeline(pp_graph(**graph_options), {"policy": (("pp", "dp", "tp"), sizes)})
    check_pipeline(pp_graph(), {"policy": (("pp", "dp", "tp"), (2, 2, 1))})  # fine
    check_pipeline(pp_graph(**graph_options), {"policy": (("pp", "dp", "tp"), (1, 2, 1))})  # no pp: not a pipeline


def test_a_pipelines_edge_into_vllm_takes_the_hop_not_the_direct_route():
    """A default edge into a vLLM generator on ranks of its own takes the direct route
    (``placement.weight_routes.direct_edges``), which sends whole buckets from every policy rank; a
    pipeline's stages each hold their own layers, so its edge takes the hop (each stage sends its layers
    over the collective), in the runtime and in the planner alike."""
    from flowrl.examples.hf_copy import build_hf_copy
    from flowrl.placement.weight_routes import direct_edges

    graph = build_hf_copy(engine="vllm")
    ranks = {"gen": (0,), "policy": (1, 2)}
    assert direct_edges(graph, ranks) == {("policy", "gen")}
    assert direct_edges(graph, ranks, pipelined={"policy"}) == frozenset()


def test_lora_on_a_pipeline_is_refused(hf_qwen2_dir):
    from flowrl.graph.configs import HFModelConfig
    from flowrl.runtime.parallel.pipeline import check_pipeline

    model = HFModelConfig(path=str(hf_qwen2_dir), init="random", lora={"r": 2, "alpha": 4, "target_modules": ["q_proj"]})
    with pytest.raises(ConfigError, match=r"LoRA adapters are not split into pipeline stages"):
        check_pipeline(pp_graph(model=model), {"policy": (("pp", "dp", "tp"), (2, 1, 1))})


@pytest.mark.slow  # CI time (14 s): check_pipeline's refusals above are the fast check; this one the CLI's
def test_a_pp_larger_than_the_layers_is_refused_at_launch_before_any_work(tmp_path):
    """Under torchrun, through the CLI: every rank refuses before its process group starts; no traceback."""
    (tmp_path / "place.json").write_text(json.dumps({"gen": [0], "policy": {"ranks": [0, 1, 2], "mesh": {"pp": 3}}}))
    proc = _torchrun(3, ["-m", "flowrl", "run", "tests.runtime.test_pipeline:pp_graph", "--backend", "torchrun",
                         "--plan", "place.json", "--steps", "2", "--quiet", "--metrics", "m.jsonl"], tmp_path)
    assert proc.returncode != 0
    said = " ".join(proc.stderr.split())  # the CLI wraps its lines
    assert "policy 'policy' (mesh {'pp': 3}): pp=3 pipeline stages but its model has 2 layers" in said and "pp <= 2" in said, proc.stderr[-3000:]
    assert "flowrl/" not in "".join(line for line in proc.stderr.splitlines() if line.strip().startswith("File "))
    assert not (tmp_path / "m.jsonl").exists()


@pytest.mark.parametrize("family", ["builtin", "llama-pretrained", "llama-random"])
def test_each_stage_materialises_its_tensors_bit_for_bit_the_whole_builds(family, hf_llama_dir):
    """A pipeline rank builds on the meta device and materialises only its stage (a tied head's rows
    read or drawn under its embedding's name): equal, bit for bit, to building the whole model."""
    from flowrl.graph.configs import HFModelConfig
    from flowrl.models.registry import build_model
    from flowrl.runtime.backends.torchrun.pp_policy import _by_whole_names
    from flowrl.runtime.parallel.fsdp_init import materialise_, meta_build
    from flowrl.runtime.parallel.pipeline import model_layers, split_model

    config = build_llamarl().node("policy").model if family == "builtin" else HFModelConfig(path=str(hf_llama_dir), init=family.split("-")[1], seed=3)
    whole = dict(build_model(config).state_dict())
    held = set()
    for index in range(2):
        model, source = meta_build(config)
        stage = split_model(model, index, 2, model_layers(config))
        materialise_(stage, _by_whole_names(source, stage.names), "cpu")
        assert stage.tied_head is not None  # both tie their head: the last stage holds a copy
        for name, t in stage.state_dict().items():
            assert torch.equal(t, whole[name]), name
            held.add(name)
    assert held == set(whole)


def test_each_stage_publishes_its_own_layers_on_a_collective_edge():
    """The collective transport's trainer layout of a pp 2 x dp 2 policy on ranks 1-4: each weight on
    the ranks of its stage (dp replicas), the tied head's matrix on the first stage's."""
    from flowrl.placement.resharding import ShardLayout, dp_replicas
    from flowrl.runtime.weights.torchrun_edges import collective_options

    graph = pp_graph()
    options = collective_options(graph, "policy", "gen", {"gen": (0,), "policy": (1, 2, 3, 4)}, {}, {"policy": (("pp", "dp", "tp"), (2, 2, 1))}, 30.0)
    layouts = {n: msgspec.convert(v, ShardLayout) for n, v in options["trainer_layout"].items()}
    assert set(layouts) == set(options["params"])
    first, last = dp_replicas((1, 2)), dp_replicas((3, 4))
    assert layouts["tok_embeddings.weight"] == first and layouts["layers.0.attention.wq.weight"] == first
    assert layouts["layers.1.feed_forward.w2.weight"] == last and layouts["norm.weight"] == last
    assert {n for n, lay in layouts.items() if lay == first} == {n for n in layouts if n.startswith(("tok_", "layers.0."))}


# -- one step against one process, and its checkpoint across layouts (one torchrun job each) --------
@pytest.mark.parametrize(
    ("world", "family", "micro"),
    [(2, "builtin", 3), pytest.param(4, "builtin", 5, marks=pytest.mark.slow), (2, "qwen2", 0), pytest.param(2, "llama", 4, marks=pytest.mark.slow)],
    ids=["pp2-builtin-1f1b", "pp2xdp2-builtin", "pp2-qwen2-gpipe", "pp2-llama-tied"],
)
def test_a_pipeline_step_equals_one_process_and_resumes_on_another_layout(tmp_path, world, family, micro):
    """pp=2 (x dp=2 on 4 ranks): the built-in model (a tied head on both end stages), Qwen2 (untied,
    one micro-batch: GPipe), Llama (tied). Each ratio is a difference over its derived float32 bound."""
    directory = ""
    if family != "builtin":
        from tests.hf_fixtures import make_hf_dir

        directory = str(make_hf_dir(tmp_path / family, family, tie=family == "llama"))
    proc = _torchrun(world, [str(THIS), "step", str(tmp_path), family, directory, str(micro)], tmp_path, retry_cxx_abort=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert len(results) == world
    lead = results[0]
    assert abs(lead["loss"] - lead["ref_loss"]) <= lead["loss_atol"], lead
    assert abs(lead["grad_norm"] - lead["ref_grad_norm"]) <= lead["grad_norm_atol"], lead
    assert lead["updates_keys_equal"], lead  # the lead's row has every key one process's has
    held = set()
    for r in results:
        held |= set(r["names"])
        assert r["stage"] == (r["rank"] // (world // 2)), r
        assert all(v <= 1.0 for k, v in r.items() if k.endswith("_over_bound")), r
        assert r["resumed_in_one_process_equal"] and r["one_process_state_in_stages_equal"] and r["resumed_version"] == 1, r
    assert held == set(lead["whole_names"])  # every tensor of the whole model on some stage
    last = [r for r in results if r["stage"] == 1]
    assert all(r["proximal_over_bound"] <= 1.0 for r in last), last


# -- a real run --------------------------------------------------------------------------------------
@pytest.mark.slow  # ~30 s; the default suite runs a pp policy through the CLI in tests/test_mesh_support.py's walk
def test_a_run_with_a_pp_policy_publishes_the_whole_models_weights(tmp_path):
    """3 processes: the generator on rank 0, the policy's mesh {"pp": 2} on ranks 1-2 (two updates per
    batch), the default weight edge (collective). Every step at k = 0, and after the last sync the
    generator's weights hash like the final checkpoint's (each stage's tensors, read in one process);
    ``flowrl export`` of that checkpoint writes one Hugging Face directory that loads with them."""
    (tmp_path / "place.json").write_text(json.dumps({"gen": [0], "policy": {"ranks": [1, 2], "mesh": {"pp": 2}}}))
    proc = _torchrun(3, [str(THIS), "run", str(tmp_path)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from tests.runtime.test_torchrun import _state_hash
    from flowrl.runtime.checkpointing.store import read_policy_state

    rows = _rows(tmp_path / "m.jsonl")
    assert [r["policy_version"] for r in rows] == [2, 4, 6] and all(r["staleness"] == 0 for r in rows), rows  # two updates a batch
    assert all(r["weights/collective_bytes"] > 0 and "policy/grad_norm" in r and "loss" in r for r in rows)
    (hashed,) = [json.loads(p.read_text()) for p in tmp_path.glob("gen-rank*.json")]
    state = read_policy_state(tmp_path / "ck")
    assert hashed["version"] == int(state["version"]) == 6
    assert hashed["sha256"] == _state_hash(state["model"])
    transformers = pytest.importorskip("transformers")
    export = subprocess.run([sys.executable, "-m", "flowrl", "export", "ck", "-o", "hf"], cwd=tmp_path, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert export.returncode == 0, export.stderr[-2000:]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True, dtype=torch.float32)
    assert torch.equal(model.state_dict()["model.embed_tokens.weight"], state["model"]["tok_embeddings.weight"])
    assert torch.equal(model.state_dict()["model.layers.1.mlp.down_proj.weight"], state["model"]["layers.1.feed_forward.w2.weight"])


@pytest.mark.slow  # CI time: the collective edge's run above covers the program; this one the lead's gather
def test_a_pp_policy_gathers_its_stages_to_the_lead_on_a_file_edge(tmp_path):
    (tmp_path / "place.json").write_text(json.dumps({"gen": [0], "policy": {"ranks": [1, 2], "mesh": {"pp": 2}}}))
    proc = _torchrun(3, ["-m", "flowrl", "run", "tests.runtime.test_pipeline:pp_file_graph", "--backend", "torchrun",
                         "--plan", "place.json", "--steps", "3", "--quiet", "--metrics", "m.jsonl"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(tmp_path / "m.jsonl")
    assert [r["policy_version"] for r in rows] == [2, 4, 6] and all(r["staleness"] == 0 for r in rows)


@pytest.mark.slow  # 5 torchrun jobs (~3 min on 2 cores); the fast check of the same is the step test's checkpoint round trip
def test_a_pp_run_resumes_in_one_process_and_back_through_the_cli(tmp_path):
    """pp 2 -> pp 2, pp 2 -> one process -> pp 2, with ``flowrl run --resume``: the resumed rows are the
    uninterrupted run's, and the last resume writes each stage's state again."""
    import shutil

    from flowrl.runtime.checkpointing.store import read_policy_state

    def run(nproc, place, steps, ck, *extra):
        (tmp_path / "place.json").write_text(json.dumps(place))
        proc = _torchrun(nproc, ["-m", "flowrl", "run", "tests.runtime.test_pipeline:pp_graph", "--backend", "torchrun",
                                 "--plan", "place.json", "--steps", str(steps), "--quiet", "--metrics", f"{ck}.jsonl",
                                 "--checkpoint-dir", ck, "--checkpoint-every", "2", *extra], tmp_path)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        return _rows(tmp_path / f"{ck}.jsonl")

    pp2, one = {"gen": [0], "policy": {"ranks": [1, 2], "mesh": {"pp": 2}}}, {"gen": [0], "policy": [1]}
    whole = run(3, pp2, 4, "a")
    run(3, pp2, 2, "b")
    shutil.copytree(tmp_path / "b", tmp_path / "c")
    same = run(3, pp2, 4, "b", "--resume")[-2:]
    other = run(2, one, 4, "c", "--resume")[-2:]  # the stages' checkpoint read whole by one process
    want = [r["reward_mean"] for r in whole[2:]]
    for rows in (same, other):
        assert [r["policy_version"] for r in rows] == [3, 4] and [r["reward_mean"] for r in rows] == want
    back = run(3, pp2, 6, "c", "--resume")[-2:]  # one process's one-file state read by the stages
    assert [r["policy_version"] for r in back] == [5, 6] and next((tmp_path / "c").glob("step-*6/policy-policy.dcp/.metadata"))
    final = {k: read_policy_state(tmp_path / k / "step-00000004")["model"] for k in ("a", "b", "c")}
    assert all(torch.equal(final["b"][n], t) for n, t in final["a"].items())
    diff = max(float((final["c"][n] - t).abs().max()) for n, t in final["a"].items())
    assert diff < 1e-5, diff  # measured, not derived (as test_fsdp's resume): the later steps' gradients are taken at weights rounding moved apart


# -- the jobs' entry point (run under torchrun) -------------------------------------------------------
def _model(family: str, directory: str):
    from flowrl.graph.configs import HFModelConfig

    return build_llamarl().node("policy").model if family == "builtin" else HFModelConfig(path=directory, init="random", seed=3)


def _bounds(trainer, ref, mags, batch: dict, grad_norm: float, partials: int, max_norm: float) -> dict:
    """This stage's clipped gradients, AdamW moments and parameters against one process's (by the whole
    model's names), each as its largest |difference| / derived float32 bound (<= 1 passes)."""
    from tests.tolerances import U32, adamw_param_atol, clipped_atol

    ref_params = dict(ref.model.named_parameters())
    width = batch["sample_prompt_ids"].shape[1] + batch["completion_ids"].shape[1]
    tol = mags.tolerances(seq_len=width, partials=partials, named=list(ref_params.items()), grad_norm=grad_norm)
    atol = clipped_atol(tol, {n: p.grad for n, p in ref_params.items()}, grad_norm=grad_norm, max_norm=max_norm)
    group = ref.optimizer.param_groups[0]
    b1, b2 = group["betas"]
    over = {"grad": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0, "param": 0.0}

    def ratio(a, b, bound) -> float:
        return float(((a.double() - b.double()).abs() / bound.double()).nan_to_num(posinf=1e30).max())

    for local, p in trainer.model.named_parameters():
        name = trainer.stage.names[local]
        q, d = ref_params[name], atol[name]
        state, mine = ref.optimizer.state[q], trainer.optimizer.state[p]
        over["grad"] = max(over["grad"], ratio(p.grad, q.grad, d))
        over["exp_avg"] = max(over["exp_avg"], ratio(mine["exp_avg"], state["exp_avg"], (1 - b1) * d + 2 * U32 * state["exp_avg"].abs()))
        v_tol = (1 - b2) * (2 * q.grad.abs() + d) * d + 4 * U32 * state["exp_avg_sq"]
        over["exp_avg_sq"] = max(over["exp_avg_sq"], ratio(mine["exp_avg_sq"], state["exp_avg_sq"], v_tol))
        bound = adamw_param_atol(d, state["exp_avg"], state["exp_avg_sq"], q, step=1, lr=group["lr"], betas=tuple(group["betas"]), eps=group["eps"])
        over["param"] = max(over["param"], ratio(p, q.detach(), bound))
    return {f"{k}_over_bound": v for k, v in over.items()}


def _stage_tensors(program) -> dict:
    return {program.trainer.stage.names[k]: v.detach().clone() for k, v in program.trainer.model.state_dict().items()}


def _step_job(out: str, family: str, directory: str, micro: int) -> int:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from flowrl.operators.losses import combined_rewards, loss_advantages
    from flowrl.operators.trainer import Trainer
    from flowrl.runtime.backends.torchrun.pp_policy import PipelinePolicy
    from flowrl.runtime.backends.torchrun.rank_programs import RankContext, rank_program, set_context
    from flowrl.runtime.checkpointing.sharded_state import read_state
    from flowrl.runtime.parallel.distributed import shard_by_groups
    from flowrl.runtime.programs.nodes import ProgramEnv, SharedTransports
    from flowrl.runtime.weights.edges import transport_specs
    from tests.runtime.test_fsdp import _batch
    from tests.tolerances import GradientMagnitudes, TokenTerms, grad_norm_atol, rollout_logprob_atol

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    pp, dp = 2, world // 2
    mesh = DeviceMesh("cpu", torch.arange(world).reshape(pp, dp, 1), mesh_dim_names=("pp", "dp", "tp"))
    group = dist.new_group(list(range(world)))
    graph = pp_graph(micro_batch_size=micro, model=_model(family, directory), lr=1e-2, grad_clip=0.01)
    node, loss = graph.node("policy"), graph.loss_of("policy")
    batch = _batch(family, directory, 0)
    padded = msgspec.structs.replace(node, optimizer=msgspec.structs.replace(node.optimizer, packing=False))
    ref = Trainer(padded, loss)
    temperature = float(batch["sampling_temperature"][0])
    logprob_tol = rollout_logprob_atol(ref.model, batch, temperature=temperature)
    reference_logprobs = ref._logprobs(batch, grad=False)
    terms = TokenTerms(reference_logprobs, batch["behaviour_logprobs"], batch["completion_mask"], logprob_tol=logprob_tol,
                       advantages=loss_advantages(loss.loss, combined_rewards(loss.loss, batch), batch))  # fmt: skip
    with GradientMagnitudes(ref.model) as mags:
        ref_metrics = ref.train_step(batch)
    specs = transport_specs(graph, str(Path(out) / f"run{rank}"))
    transports = SharedTransports(specs)
    ranks = tuple(range(world))
    set_context(RankContext(rank=rank, world=world, ranks={"policy": ranks}, programs={}, groups={"policy": group}, meshes={"policy": mesh}))
    env = ProgramEnv(transports=specs, seed=0, weight_timeout_s=30.0)
    program = rank_program(graph.node("policy"), graph, env, transports)
    assert isinstance(program, PipelinePolicy)
    # the forward-only pass (the proximal log-probs of a batch with several updates), from the initial weights
    proximal = program.trainer._logprobs(batch, grad=False)
    mask = batch["completion_mask"]
    result: dict = {"rank": rank, "stage": program.stage_index, "names": sorted(program.trainer.stage.names.values()),
                    "whole_names": program.whole_names}  # fmt: skip
    if program.stage_index == pp - 1:
        result["proximal_over_bound"] = float(((proximal - reference_logprobs).abs() * mask).max()) / logprob_tol
    _, info = program.step(0, batch if rank == 0 else {}, 0)
    sizes = [int(part["completion_mask"].shape[0]) for part in shard_by_groups(batch, dp)]
    partials = 2 * sum(-(-n // micro) if micro else 1 for n in sizes)  # micro-batches of every dp part, x2: a tied head's two copies
    result.update(_bounds(program.trainer, ref, mags, batch, ref_metrics["policy/grad_norm"], partials=partials, max_norm=0.01))
    if rank == 0:
        width = batch["sample_prompt_ids"].shape[1] + batch["completion_ids"].shape[1]
        unclipped = mags.tolerances(seq_len=width, partials=partials, grad_norm=ref_metrics["policy/grad_norm"])
        expected = ref_metrics["loss"]
        if dp > 1:  # the row's loss is the dp ranks' losses averaged by their samples (reduce_metrics, as data-parallel replicas report it)
            parts = shard_by_groups(batch, dp)
            expected = sum(n * Trainer(padded, loss).train_step(part)["loss"] for n, part in zip(sizes, parts)) / sum(sizes)
        result.update(
            loss=info["loss"], ref_loss=expected, loss_atol=terms.atol(), grad_norm=info["policy/grad_norm"],
            ref_grad_norm=ref_metrics["policy/grad_norm"], grad_norm_atol=grad_norm_atol(unclipped, ref_metrics["policy/grad_norm"]),
            updates_keys_equal=set(ref_metrics) <= set(info),
        )  # fmt: skip
    # pp 2 -> one process: the stages' checkpoint read whole here equals the stages' tensors bit for bit
    ck = Path(out) / "policy-policy.dcp"
    program.save(str(ck))
    dist.barrier()
    mine = _stage_tensors(program)
    one = Trainer(padded, loss)
    one.load_state(read_state(ck))
    whole = dict(one.model.state_dict())
    moments = {program.trainer.stage.names[local]: program.trainer.optimizer.state[p] for local, p in program.trainer.model.named_parameters()}
    one_params = dict(one.model.named_parameters())
    result["resumed_in_one_process_equal"] = all(torch.equal(whole[k], v) for k, v in mine.items()) and all(
        torch.equal(one.optimizer.state[one_params[k]][m], s[m]) for k, s in moments.items() if k in one_params for m in ("exp_avg", "exp_avg_sq")
    )
    # one process -> pp 2: a one-file state into fresh stages (other initial weights: only the state can make them equal)
    if rank == 0:
        torch.save(one.state(), Path(out) / "one.pt")
    dist.barrier()
    fresh = rank_program(msgspec.structs.replace(graph.node("policy")), graph, env, transports)
    with torch.no_grad():
        for p in fresh.trainer.model.parameters():
            p.add_(1.0)
    fresh.load(str(Path(out) / "one.pt"))
    again = _stage_tensors(fresh)
    fresh_params = dict(fresh.trainer.model.named_parameters())
    result["one_process_state_in_stages_equal"] = all(torch.equal(again[k], v) for k, v in mine.items()) and all(
        torch.equal(fresh.trainer.optimizer.state[fresh_params[local]][m], program.trainer.optimizer.state[p][m])
        for local, p in program.trainer.model.named_parameters() for m in ("exp_avg", "exp_avg_sq")
    )
    result["resumed_version"] = fresh.trainer.version
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    set_context(None)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _run_job(out: str) -> int:
    """``pp_iterations_graph`` for 3 steps at k = 0 on place.json; the generator rank hashes the newest version it fetched."""
    from tests.runtime.test_torchrun import _run_and_hash_generator_weights

    return _run_and_hash_generator_weights(pp_iterations_graph(), Path(out), metrics="m.jsonl")


if __name__ == "__main__":  # a rank: ends without interpreter teardown (see rank_exit)
    from flowrl.runtime.backends.torchrun.rank_exit import end_rank_process

    if sys.argv[1] == "step":
        end_rank_process(_step_job(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])))
    if sys.argv[1] == "run":
        end_rank_process(_run_job(sys.argv[2]))
    raise SystemExit(f"unknown mode {sys.argv[1]!r}")
