"""``flowrl export`` of a sharded (FSDP2, torchrun) run's checkpoint, through the user's path: a LoRA
policy on a Hugging Face model with a tied head (the frozen head is the embedding under a second
name), sharded over 2 ranks, checkpointed, exported from one process with no process group and
loaded by transformers; its logits are the trained policy's. The same checkpoint resumes on its ranks,
and so does one written before the fix (which stored the tied head beside the adapters).
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
    from flowrl.runtime.checkpointing.sharded_state import _read_metadata
    from flowrl.runtime.checkpointing.store import read_policy_state

    from tests.tolerances import logit_atol

    tmp, graph = run
    (dcp,) = (tmp / "ck").glob("step-*/policy-policy.dcp")
    saved = sorted(k.removeprefix("model.").replace(".default.weight", ".weight") for k in _read_metadata(dcp).state_dict_metadata if k.startswith("model."))
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
