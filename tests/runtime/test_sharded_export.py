"""``flowrl export`` of a sharded (FSDP2, torchrun) run's checkpoint, through the user's path: a LoRA
policy on a Hugging Face model with a tied head (the frozen head is the embedding under a second
name), sharded over 2 ranks, checkpointed, exported from one process with no process group and
loaded by transformers; its logits are the trained policy's. The same checkpoint resumes on its ranks,
and so does one written before the fix (which stored the tied head beside the adapters).

Any layout: one 2-rank job (``python tests/runtime/test_sharded_export.py layouts OUT MODEL_DIR``) saves a
policy split as tensor parallelism and as a 2-stage pipeline split it, in the format
``flowrl.runtime.checkpointing.sharded_state`` states; each reads and exports in one process as the
one-process state does, and each layout loads the other's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import msgspec
import pytest
import torch

from tests.runtime.test_torchrun import _rows, _torchrun

LORA = dict(r=2, alpha=4, target_modules=["q_proj", "v_proj"])
PLACE = {"policy": [0, 1], "gen": [0, 1]}  # 2 ranks, the generator beside the policy's shards


def tied_lora_graph(model_dir: str):
    """prompts -> gen -> reward -> aipo -> policy: LoRA on ``model_dir`` (tied head), FSDP2, k = 0."""
    from flowrl.graph.builder import GraphBuilder
    from flowrl.graph.configs import HFModelConfig

    b = GraphBuilder("lora_tied_fsdp", model=HFModelConfig(path=model_dir, init="random", seed=0))
    prompts = b.source("prompts", task="copy", batch_size=4)
    gen = b.generator("gen", prompts, n_samples=2, max_new_tokens=4, temperature=1.0)
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    aipo = b.loss("aipo", gen, reward, objective="aipo", rho=4.0)
    policy = b.policy("policy", aipo, lr=5e-2, lora=LORA, sharding="fsdp")
    b.weights(policy, gen, max_staleness=0)
    return b.build()


def _run(tmp_path: Path, ck: str, steps: int, *extra: str):
    proc = _torchrun(2, ["-m", "flowrl", "run", "graph.json", "--backend", "torchrun", "--plan", "place.json", "--steps", str(steps),
                         "--quiet", "--metrics", f"{ck}.jsonl", "--checkpoint-dir", ck, *extra], tmp_path, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _rows(tmp_path / f"{ck}.jsonl")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-step run of ``tied_lora_graph`` on 2 ranks, checkpointed at its end (``ck``)."""
    pytest.importorskip("peft")
    from flowrl.graph.serialize import to_json

    from tests.hf_fixtures import make_hf_dir

    model_dir = make_hf_dir(tmp_path_factory.mktemp("qwen2-tied"), "qwen2", tie=True)
    tmp = tmp_path_factory.mktemp("run")
    graph = tied_lora_graph(str(model_dir))
    (tmp / "graph.json").write_text(to_json(graph))
    (tmp / "place.json").write_text(json.dumps(PLACE))
    rows = _run(tmp, "ck", 2)
    assert [r["policy_version"] for r in rows] == [1, 2]
    return tmp, graph


def _adapters() -> list[str]:
    return sorted(f"model.layers.{i}.self_attn.{m}.lora_{ab}.weight" for i in range(2) for m in LORA["target_modules"] for ab in "AB")


def _one_process(graph, state):
    """The trained policy in one process: the graph's policy (replicated), the checkpoint's state loaded."""
    from flowrl.graph.nodes import PolicyNode
    from flowrl.operators.trainer import Trainer

    node = graph.node("policy")
    node = msgspec.structs.replace(node, optimizer=msgspec.structs.replace(node.optimizer, sharding="replicate"))
    assert isinstance(node, PolicyNode)
    trainer = Trainer(node, graph.node("aipo"))
    trainer.load_state(state)
    return trainer


def test_flowrl_export_of_a_sharded_lora_policy_with_a_tied_head_gives_the_trained_policys_logits(run, capsys):
    """Before the fix the save stored the tied frozen head (``lm_head.weight``, the embedding's second
    name, which torch's ``ignore_frozen_params`` misses) as an adapter, and the export refused it. The
    checkpoint now holds the adapters only; the export merges them (peft's ``merge_and_unload``) into
    the description's base, and transformers' forward of it equals the one-process policy's (peft's
    unmerged ``W0 x + s B A x``) within float32 rounding of the two (``logit_atol``, the adapters' rank
    a reduction more per adapted layer)."""
    transformers = pytest.importorskip("transformers")
    from flowrl.cli.main import main
    from flowrl.runtime.checkpointing.sharded_index import read_metadata
    from flowrl.runtime.checkpointing.store import read_policy_state

    from tests.tolerances import logit_atol

    tmp, graph = run
    (dcp,) = (tmp / "ck").glob("step-*/policy-policy.dcp")
    saved = sorted(k.removeprefix("model.").replace(".default.weight", ".weight") for k in read_metadata(dcp).state_dict_metadata if k.startswith("model."))
    assert saved == _adapters()  # no frozen base weight, the tied head included
    state = read_policy_state(tmp / "ck")
    assert sorted(state["model"]) == _adapters() and int(state["version"]) == 2
    assert all(bool(t.abs().sum() > 0) for n, t in state["model"].items() if ".lora_B." in n)  # trained: B moved from 0, a real merge
    capsys.readouterr()
    assert main(["export", str(tmp / "ck"), "-o", str(tmp / "hf")]) == 0, capsys.readouterr().err
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp / "hf"), local_files_only=True, dtype=torch.float32)
    assert model.config.tie_word_embeddings and not any("lora" in n for n in model.state_dict())
    trainer = _one_process(graph, state)
    ids = torch.tensor([[1, 5, 6, 7, 8, 9, 2], [1, 12, 30, 4, 3, 3, 3]])
    with torch.no_grad():
        want = trainer.model(ids, valid=torch.ones_like(ids, dtype=torch.bool))
        got = model(input_ids=ids).logits
        base = transformers.AutoModelForCausalLM.from_pretrained(str(graph.node("policy").model.path), local_files_only=True, dtype=torch.float32)
        untrained = base(input_ids=ids).logits
    atol = logit_atol(model, list(ids), extra=[LORA["r"]] * 2 * len(LORA["target_modules"]))
    torch.testing.assert_close(got, want, rtol=0, atol=atol)
    assert float((untrained - want).abs().max()) > 10 * atol  # the adapters' effect is far above the tolerance: it is checked
    peft = pytest.importorskip("peft")  # --adapter: peft's directory of the same adapters, over the base
    assert main(["export", str(tmp / "ck"), "-o", str(tmp / "adapter"), "--adapter"]) == 0, capsys.readouterr().err
    with torch.no_grad():
        adapted = peft.PeftModel.from_pretrained(base, str(tmp / "adapter"))(input_ids=ids).logits
    torch.testing.assert_close(adapted, want, rtol=0, atol=atol)


def test_an_export_whose_adapters_do_not_fit_the_description_names_them(tmp_path):
    from flowrl.errors import ConfigError
    from flowrl.graph.configs import HFModelConfig, LoraConfig
    from flowrl.models.lora import merged_model

    from tests.hf_fixtures import make_hf_dir

    pytest.importorskip("peft")
    config = HFModelConfig(path=str(make_hf_dir(tmp_path, "qwen2", tie=True)), init="random", seed=0, lora=LoraConfig(**LORA))
    weights = {n: torch.zeros((2, 32) if ".lora_A." in n else (32, 2)) for n in _adapters()}  # v_proj's B is [16, 2]
    weights["lm_head.weight"] = torch.zeros(100, 32)  # what the sharded save stored before the fix
    with pytest.raises(ConfigError, match=r"do not fit .*: not adapters of it \['lm_head.weight'\]; shapes \(saved, wanted\) \[\('model.layers.0.self_attn.v_proj.lora_B.weight', \(\(32, 2\), \(16, 2\)\)\)"):
        merged_model(config, weights)


@pytest.mark.slow  # CI time (a torchrun run): the next test resumes the older format through the same load
def test_the_sharded_lora_checkpoint_resumes_on_its_ranks(run):
    tmp, _ = run
    shutil.copytree(tmp / "ck", tmp / "again")
    rows = _run(tmp, "again", 3, "--resume")
    assert [r["policy_version"] for r in rows][-1:] == [3]


def test_a_lora_checkpoint_that_stored_the_tied_head_still_reads_and_resumes(run, tmp_path):
    """The format before the fix: the tied head (a frozen base weight, the description's own) beside
    the adapters. ``read_state`` drops it, and a sharded policy resumes from it."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from flowrl.runtime.checkpointing.sharded_state import INFO_FILE, _consolidated, read_state

    tmp, graph = run
    shutil.copytree(tmp / "ck", tmp / "old")
    (path,) = (tmp / "old").glob("step-*/policy-policy.dcp")
    saved = _consolidated(path)
    head = load_file(Path(graph.node("policy").model.path) / "model.safetensors")["model.embed_tokens.weight"]
    saved["model"]["lm_head.weight"] = head  # as the save before the fix wrote it
    info = (path / INFO_FILE).read_bytes()
    shutil.rmtree(path)
    dcp.save(saved, checkpoint_id=str(path), no_dist=True)
    (path / INFO_FILE).write_bytes(info)
    state = read_state(path)
    assert sorted(state["model"]) == _adapters()
    rows = _run(tmp, "old", 3, "--resume")
    assert [r["policy_version"] for r in rows][-1:] == [3]


# -- any layout: a checkpoint in the format's keys, however its ranks split the tensors, exports alike ----
@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """One 2-rank job (``python tests/runtime/test_sharded_export.py layouts OUT MODEL_DIR``): a full-weight
    Qwen2 policy saved by ``save_sharded`` as a tensor-parallel policy holds it (q/k/v, gate/up by rows,
    o/down by columns, the rest on both ranks) and as a 2-stage pipeline does (each rank its own layers,
    under the whole model's names), after one AdamW step each; and the same step in one process."""
    pytest.importorskip("transformers")
    from tests.hf_fixtures import make_hf_dir

    model_dir = make_hf_dir(tmp_path_factory.mktemp("qwen2"), "qwen2", tie=False)
    out = tmp_path_factory.mktemp("layouts")
    proc = _torchrun(2, [str(Path(__file__).resolve()), "layouts", str(out), str(model_dir)], out, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, model_dir


@pytest.mark.parametrize("layout", ["tp", "pp"])
def test_a_tensor_or_pipeline_parallel_checkpoint_reads_and_exports_as_the_one_process_state(layouts, layout, tmp_path):
    """Read in one process with no process group, the state equals the one-process trainer's after the
    same step exactly (weights, AdamW's moments and steps numbered in the model's order, groups), and
    ``flowrl export`` writes the same safetensors as the export of that one-file state."""
    from safetensors.torch import load_file

    from flowrl.cli.main import main
    from flowrl.runtime.checkpointing.sharded_index import read_metadata
    from flowrl.runtime.checkpointing.sharded_state import read_state

    from tests.runtime.test_sharded_checkpoint import _same, _step_dir

    layouts, _ = layouts
    path = layouts / f"{layout}.dcp"
    want = torch.load(layouts / "one.pt", weights_only=True)
    files = {s.relative_path for s in read_metadata(path).storage_data.values()}
    assert files == {"__0_0.distcp", "__1_0.distcp"}  # both ranks wrote their part
    assert json.loads((path / "policy.json").read_text())["mesh"] == {layout: 2}
    _same(read_state(path), want)
    weights = read_state(path, optimizer=False)  # what flowrl export reads: AdamW's moments are not
    assert "optimizer" not in weights and sorted(weights["model"]) == sorted(want["model"])
    assert main(["export", str(_step_dir(tmp_path / "ck", path)), "-o", str(tmp_path / "hf")]) == 0
    assert main(["export", str(_step_dir(tmp_path / "ck-one", layouts / "one.pt")), "-o", str(tmp_path / "hf-one")]) == 0
    _same(load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "hf-one" / "model.safetensors"))


def test_a_tensor_parallel_policy_resumes_a_pipeline_parallel_checkpoint_and_back_exactly(layouts):
    """``load_sharded`` across layouts: each rank of a tp = 2 policy reads its rows and columns of the
    pp = 2 checkpoint, each stage of a pp = 2 policy its layers of the tp = 2 one; every parameter and
    AdamW moment held equals the one-process state after the same step, exactly."""
    out, _ = layouts
    for rank in (0, 1):
        loaded = json.loads((out / f"loaded-{rank}.json").read_text())
        assert loaded["tp-from-pp"] == {"max_diff": 0.0, "params": 27, "version": 1}, loaded  # every parameter (2 layers x 12 + embed, norm, head)
        assert loaded["pp-from-tp"]["max_diff"] == 0.0 and loaded["pp-from-tp"]["version"] == 1, loaded
    assert sorted(json.loads((out / f"loaded-{r}.json").read_text())["pp-from-tp"]["params"] for r in (0, 1)) == [13, 14]  # each stage its part


def test_a_pipeline_stage_checks_the_whole_models_checkpoint_it_loads_its_part_of(layouts):
    """``check_sharded`` (every rank's check before ``load_sharded``) on a stage's trainer: the other
    stage's tensors are the whole model's, not a sign of another model; a tensor of no model is refused."""
    from flowrl.errors import CheckpointError
    from flowrl.graph.nodes import LossNode
    from flowrl.operators.trainer import Trainer
    from flowrl.runtime.checkpointing.sharded_state import check_sharded

    out, model_dir = layouts
    trainer = Trainer(_layouts_node(str(model_dir)), LossNode(name="aipo"))
    _pipeline_stage(trainer.model, 1)
    assert check_sharded(out / "pp.dcp", trainer).mesh == {"pp": 2}
    trainer.model.model.layers[1].add_module("extra", torch.nn.Linear(2, 2, bias=False))  # a tensor the checkpoint lacks
    with pytest.raises(CheckpointError, match=r"\(pp=2\) cannot be resharded into this policy: tensors \(saved shape, now\) \{'model.layers.1.extra.weight'"):
        check_sharded(out / "pp.dcp", trainer)


def _layouts_node(model_dir: str):
    from flowrl.graph.configs import HFModelConfig, OptimizerConfig
    from flowrl.graph.nodes import PolicyNode

    return PolicyNode(name="policy", model=HFModelConfig(path=model_dir, init="random", seed=3), optimizer=OptimizerConfig(lr=1e-2))


def _pipeline_stage(model, rank: int) -> None:
    """``model`` as stage ``rank`` of 2 holds it: rank 0 the embeddings and the first half of the layers,
    rank 1 the rest, the final norm and the head; each layer keeps its whole-model index."""
    from torch import nn

    layers = model.model.layers
    for i in range(len(layers)):
        if (i < len(layers) // 2) != (rank == 0):
            layers[i] = nn.Identity()
    if rank == 0:
        model.model.norm, model.lm_head = nn.Identity(), nn.Identity()
    else:
        model.model.embed_tokens = nn.Identity()


def _layouts_job(out: str, model_dir: str) -> int:
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from flowrl.graph.nodes import LossNode
    from flowrl.operators.trainer import Trainer, learning_rate
    from flowrl.runtime.checkpointing.sharded_state import load_sharded, save_sharded

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    node = _layouts_node(model_dir)

    def stepped(split) -> Trainer:
        trainer = Trainer(node, LossNode(name="aipo"))
        split(trainer.model)
        params = [p for p in trainer.model.parameters() if p.requires_grad]
        opt = node.optimizer
        trainer.optimizer = torch.optim.AdamW(params, lr=learning_rate(opt, 0), betas=opt.betas, weight_decay=opt.weight_decay)
        for p in params:  # a gradient that differs by element, the same wherever the element is held
            p.grad = torch.cos(p.detach() * 7.0)
        trainer.optimizer.step()
        trainer.version = 1
        return trainer

    def tensor_parallel(model: nn.Module) -> None:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        plan = {}
        for i in range(len(model.model.layers)):
            for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
                plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
            for name in ("self_attn.o_proj", "mlp.down_proj"):
                plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
        parallelize_module(model, mesh, plan)

    splits = {"tp": tensor_parallel, "pp": lambda model: _pipeline_stage(model, rank)}
    for layout, split in splits.items():
        save_sharded(stepped(split), Path(out) / f"{layout}.dcp", group=dist.group.WORLD, mesh={layout: 2})
    one = stepped(lambda model: None)
    if rank == 0:
        torch.save(one.state(), Path(out) / "one.pt")
    dist.barrier()
    want = {n: (p.detach(), one.optimizer.state[p]) for n, p in one.model.named_parameters()}
    diffs = {}
    for layout, other in (("tp", "pp"), ("pp", "tp")):  # each layout loads the other's checkpoint
        fresh = stepped(splits[layout])  # then other weights and moments: only the checkpoint makes them equal
        with torch.no_grad():
            for p in fresh.model.parameters():
                p.mul_(-3.0)
                for value in fresh.optimizer.state[p].values():
                    value.mul_(5.0).add_(1.0)
        load_sharded(fresh, Path(out) / f"{other}.dcp", group=dist.group.WORLD)
        full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731 - collective for DTensors, in the same order on every rank
        worst, held = 0.0, 0
        for name, p in fresh.model.named_parameters():
            weight, moments = want[name]
            mine = fresh.optimizer.state[p]
            pairs = [(full(p.detach()), weight)] + [(full(mine[k]), moments[k]) for k in ("exp_avg", "exp_avg_sq", "step")]
            worst = max([worst] + [float((a - b).abs().max()) for a, b in pairs])
            held += 1
        diffs[f"{layout}-from-{other}"] = {"max_diff": worst, "params": held, "version": fresh.version}
    Path(out, f"loaded-{rank}.json").write_text(json.dumps(diffs))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":  # a rank: ends without interpreter teardown (see rank_exit)
    import sys

    from flowrl.runtime.backends.torchrun.rank_exit import end_rank_process

    torch.set_num_threads(1)
    if sys.argv[1] == "layouts":
        end_rank_process(_layouts_job(sys.argv[2], sys.argv[3]))
    raise SystemExit(f"unknown mode {sys.argv[1]!r}")
