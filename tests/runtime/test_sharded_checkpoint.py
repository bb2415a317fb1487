"""Sharded checkpoints of an FSDP2 policy (``flowrl.runtime.checkpointing.sharded_state``): each rank writes its shards,
any dp size reads them, every reader consolidates them.

One torchrun job (3 ranks, gloo; ``python tests/runtime/test_sharded_checkpoint.py reshard OUT FAMILY DIR``)
writes, besides each sharded state, the gathered one-file state of the same trainer (``fsdp.full_state``)
as the reference:

- ``dp2``: a policy sharded over ranks 0-1 after one step, saved (``dp2.dcp``, ``dp2.pt``);
- ``dp3-from-dp2``: a fresh policy over ranks 0-2 (other initial weights) that loads ``dp2.dcp``;
  after a step of its own it saves ``dp3.dcp`` / ``dp3.pt``;
- ``dp2-from-dp3``: a fresh policy over ranks 0-1 that loads ``dp3.dcp``;
- ``dp1``: one process (rank 0, a replicated ``Trainer``) resumes ``dp2.dcp`` consolidated, steps, and
  writes the one-file format; ``dp3-from-dp1``: a fresh policy over ranks 0-2 that loads it.

The tests compare the gathered states, read ``dp1`` (one process: ``read_state`` and a replicated
``Trainer``), look at which rank's file holds each chunk, export, and refuse what cannot be loaded.
"""

from __future__ import annotations

import json
import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch

from flowrl.errors import CheckpointError

from tests.runtime.test_torchrun import _torchrun  # the jobs run with PYTHONPATH=ROOT (see _torchrun)

THIS = Path(__file__).resolve()


@pytest.fixture(scope="module", params=["builtin", pytest.param("lora", marks=pytest.mark.slow), pytest.param("llama", marks=pytest.mark.slow)])
def job(request, tmp_path_factory):
    """The reshard job's directory and family (``lora``: adapters on a Qwen2 model, its base sharded
    too; ``llama``: a Hugging Face Llama with a tied head, two names for one parameter)."""
    family, directory = request.param, ""
    if family != "builtin":
        from tests.hf_fixtures import make_hf_dir

        kind = "qwen2" if family == "lora" else family
        directory = str(make_hf_dir(tmp_path_factory.mktemp(kind), kind, tie=family == "llama"))
    out = tmp_path_factory.mktemp(f"reshard-{family}")
    proc = _torchrun(3, [str(THIS), "reshard", str(out), family, directory], out, retry_cxx_abort=True)  # see CXX_ABORT
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, family


def _same(a, b, where="state") -> None:
    """``a`` and ``b`` equal exactly: tensors by value and dtype, containers element by element."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(map(str, a)) == sorted(map(str, b)), (where, sorted(map(str, a)), sorted(map(str, b)))
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=True)


# -- another dp size: equal to the gathered state, exactly -------------------------------------------
@pytest.mark.parametrize(
    ("loaded", "saved"), [("dp3-from-dp2", "dp2"), ("dp2-from-dp3", "dp3"), ("dp3-from-dp1", "dp1")], ids=["dp2-to-dp3", "dp3-to-dp2", "dp1-to-dp3"]
)
def test_a_sharded_state_resumes_on_another_dp_size_equal_to_the_gathered_state(job, loaded, saved):
    """A fresh sharded policy (other initial weights) that loads the shards of another dp size holds,
    gathered, exactly what the writer held: weights, AdamW's moments and steps, param groups, version."""
    out, _ = job
    want = _load(out / f"{saved}.pt")
    assert int(want["version"]) == (1 if saved == "dp2" else 2) and want["optimizer"]["state"]  # dp3, dp1: a step after loading dp2
    _same(_load(out / f"{loaded}.pt"), want)


@pytest.mark.parametrize("saved", ["dp2", "dp3"])
def test_a_sharded_state_read_in_one_process_equals_the_gathered_state(job, saved):
    """dp 1: ``read_state`` consolidates the shards without a process group into the one-file format,
    and a one-process (replicated) trainer loads it and holds the same state."""
    from flowrl.graph.nodes import LossNode
    from flowrl.operators.trainer import Trainer
    from flowrl.runtime.checkpointing.sharded_state import read_state

    from tests.runtime.test_fsdp import _policy

    out, family = job
    want = _load(out / f"{saved}.pt")
    state = read_state(out / f"{saved}.dcp")
    _same(state, want)
    directory = json.loads((out / "job.json").read_text())["directory"]
    one = Trainer(_policy(family, directory, "replicate"), LossNode(name="aipo"))
    one.load_state(state)
    _same(one.state(), want)


def test_each_rank_writes_only_its_own_shards(job):
    """No rank holds or writes the full state: every chunk of a sharded tensor is in the file of the
    rank that holds those rows (``torch.chunk`` over dp), and each rank's file holds 1/dp of the
    tensors' bytes plus DCP's framing of each item (a ``torch.save`` per tensor: measured ~1.6 KB,
    large beside this tiny model's 24 KB shards) and the replicated scalars written once (AdamW's
    steps, the param groups)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from flowrl.runtime.checkpointing.sharded_index import read_metadata as _read_metadata

    out, _ = job
    for name, dp in (("dp2", 2), ("dp3", 3)):
        path = out / f"{name}.dcp"
        metadata = _read_metadata(path)
        files = sorted(f.name for f in path.glob("*.distcp"))
        assert files == [f"__{i}_0.distcp" for i in range(dp)], files
        sharded = 0
        for key, meta in metadata.state_dict_metadata.items():
            if not isinstance(meta, TensorStorageMetadata) or len(meta.size) == 0:
                continue
            rows = [len(c) for c in torch.chunk(torch.empty(meta.size[0], device="meta"), dp)]
            starts = [sum(rows[:i]) for i in range(len(rows))]
            chunks = [c for c in meta.chunks if c.sizes[0] > 0]  # a rank without rows (2 LoRA rows over 3) writes an empty one
            assert sorted(c.offsets[0] for c in chunks) == starts, key  # one chunk per rank holding rows
            for chunk in chunks:
                from torch.distributed.checkpoint.metadata import MetadataIndex

                where = metadata.storage_data[MetadataIndex(key, chunk.offsets)].relative_path
                assert where == f"__{starts.index(chunk.offsets[0])}_0.distcp", (key, chunk, where)
            sharded += meta.size.numel() * meta.properties.dtype.itemsize
        items = {f: sum(1 for s in metadata.storage_data.values() if s.relative_path == f) for f in files}
        for f in files:
            size = (path / f).stat().st_size
            assert size < sharded / dp * 1.05 + 2048 * items[f], (f, size, sharded, items[f])  # 1/dp (+ rows' rounding) + framing


def test_a_rank_whose_host_lacks_the_checkpoint_folder_fails_every_rank_of_the_save_and_the_load(job):
    """Each rank raises (a save: DCP gathers the failure of its planning step; a load: the ranks agree
    on their checks first), none waits in a collective, and nothing is written on the host that
    lacks the folder."""
    out, _ = job
    said = [(out / f"unseen-{rank}.txt").read_text() for rank in (0, 1)]
    assert all("does not exist on this rank's host" in s and "--checkpoint-dir must be a directory every rank sees" in s for s in said), said
    assert not (out / "not-on-this-host").exists()
    loading = [(out / f"unseen-load-{rank}.txt").read_text() for rank in (0, 1)]
    assert loading[0].startswith("CheckpointError: policy 'policy': 1 other rank(s) of the policy cannot load sharded checkpoint"), loading
    assert loading[1].startswith("CheckpointError: sharded checkpoint") and "does not exist on this rank's host" in loading[1], loading


# -- the readers ---------------------------------------------------------------------------------------
def _step_dir(root: Path, state: Path, graph=None) -> Path:
    """A checkpoint directory as ``CheckpointWriter`` lays it out, holding ``state`` (a file or a sharded
    directory) and, given one, the graph that wrote it."""
    from flowrl.graph.serialize import to_json
    from flowrl.runtime.checkpointing.store import GRAPH_FILE, graph_fingerprint

    step = root / "step-00000001"
    step.mkdir(parents=True)
    target = step / ("policy-policy.dcp" if state.is_dir() else "policy-policy.pt")
    (shutil.copytree if state.is_dir() else shutil.copy)(state, target)
    fingerprint = graph_fingerprint(graph) if graph is not None else "x"
    meta = {"version": 1, "data_position": 0, "graph": "g", "graph_sha256": fingerprint, "files": {"policy": target.name}}
    (step / "meta.json").write_text(json.dumps(meta))
    if graph is not None:
        (step / GRAPH_FILE).write_text(to_json(graph))
    (root / "LATEST").write_text(step.name)
    return root


def test_flowrl_export_of_a_sharded_checkpoint_equals_the_export_of_its_one_file_checkpoint(job, tmp_path):
    pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from flowrl.cli.main import main

    out, _ = job
    for kind, state in (("dcp", out / "dp2.dcp"), ("pt", out / "dp2.pt")):
        assert main(["export", str(_step_dir(tmp_path / f"ck-{kind}", state)), "-o", str(tmp_path / f"hf-{kind}")]) == 0
    a, b = load_file(tmp_path / "hf-dcp" / "model.safetensors"), load_file(tmp_path / "hf-pt" / "model.safetensors")
    _same(a, b)
    assert (tmp_path / "hf-dcp" / "config.json").read_text() == (tmp_path / "hf-pt" / "config.json").read_text()


def test_flowrl_sample_and_eval_load_a_sharded_checkpoints_weights(job, tmp_path):
    """``load_policy`` (``flowrl sample`` / ``eval``): the generator gets the consolidated weights."""
    from flowrl.examples.llamarl import build_llamarl
    from flowrl.runtime.evaluation.policy_samples import load_policy

    out, family = job
    if family != "builtin":
        pytest.skip("the built-in example's graph holds the built-in policy")
    policy = load_policy(_step_dir(tmp_path / "ck", out / "dp2.dcp", graph=build_llamarl()))
    want = _load(out / "dp2.pt")
    targets = policy.generator.weight_targets()
    assert policy.version == 1 and targets
    for name, t in targets.items():
        assert torch.equal(t, want["model"][name]), name


def test_a_one_file_checkpoint_still_reads(job, tmp_path):
    from flowrl.runtime.checkpointing.store import read_policy_state

    out, _ = job
    _same(read_policy_state(_step_dir(tmp_path, out / "dp2.pt")), _load(out / "dp2.pt"))


# -- what cannot be loaded: refused before any work, naming the fix ---------------------------------------
def _broken(job, tmp_path, how: str) -> Path:
    out, _ = job
    path = tmp_path / "policy-policy.dcp"
    tmp_path.mkdir(exist_ok=True)
    shutil.copytree(out / "dp2.dcp", path)
    if how == "no-index":  # killed before DCP's last write
        (path / ".metadata").unlink()
    elif how == "missing-rank":  # written on two hosts without a shared directory
        (path / "__1_0.distcp").unlink()
    elif how == "cut-short":  # a copy that did not finish
        data = (path / "__1_0.distcp").read_bytes()
        (path / "__1_0.distcp").write_bytes(data[: len(data) // 2])
    elif how == "poisoned":
        class Evil:
            def __reduce__(self):
                return (exec, ("open(%r, 'w').write('ran')" % str(tmp_path / "ran"),))

        (path / ".metadata").write_bytes(pickle.dumps(Evil()))
    return path


@pytest.mark.parametrize(
    ("how", "match"),
    [
        ("no-index", r"is incomplete \(no .metadata: its save did not finish\); resume from an intact checkpoint"),
        ("missing-rank", r"lacks shard files \['__1_0.distcp'\] of the 2 ranks that wrote it \(dp=2; rank\(s\) 1's, holding chunks of \d+ tensors such as 'model\..*a directory every rank sees"),
        ("cut-short", r"has shard files cut short \(__1_0.distcp has \d+ bytes of \d+; dp=2; rank\(s\) 1's, .* a copy that did not finish"),
        ("poisoned", r"has an unreadable index .metadata \(UnpicklingError: builtins.exec is not part of a checkpoint's index\)"),
    ],
    ids=["no-index", "missing-rank", "cut-short", "poisoned"],
)
def test_a_sharded_state_that_cannot_be_read_is_refused_naming_the_fix(job, tmp_path, how, match):
    from flowrl.runtime.checkpointing.sharded_state import read_state

    with pytest.raises(CheckpointError, match=match):
        read_state(_broken(job, tmp_path, how))
    assert not (tmp_path / "ran").exists()


def test_flowrl_export_of_a_checkpoint_missing_a_ranks_shards_is_refused_naming_them(job, tmp_path, capsys):
    """No traceback, nothing written: the message names the missing file, its rank and what it held."""
    from flowrl.cli.main import main

    ck = tmp_path / "ck"
    _step_dir(ck, _broken(job, tmp_path / "broken", "missing-rank"))
    capsys.readouterr()
    assert main(["export", str(ck), "-o", str(tmp_path / "hf")]) == 2
    err = " ".join(capsys.readouterr().err.split())  # the CLI wraps its message
    assert "lacks shard files ['__1_0.distcp'] of the 2 ranks that wrote it (dp=2; rank(s) 1's" in err, err
    assert "flowrl export takes a step-* directory" in err and "Traceback" not in err and not (tmp_path / "hf").exists()
    shutil.rmtree(ck / "step-00000001" / "policy-policy.dcp")  # every rank's shards gone: the one meta.json lists is named
    assert main(["export", str(ck), "-o", str(tmp_path / "hf")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "lacks ['policy-policy.dcp'], which its meta.json lists" in err and "Traceback" not in err, err


def test_a_sharded_state_of_another_model_is_refused_before_any_work(job):
    """The check every rank runs before DCP's first collective (``load_sharded``), on a one-process trainer here."""
    from flowrl.graph.configs import ModelConfig
    from flowrl.graph.nodes import LossNode, PolicyNode
    from flowrl.operators.trainer import Trainer
    from flowrl.runtime.checkpointing.sharded_state import check_sharded

    out, family = job
    if family != "builtin":
        pytest.skip("the built-in model's config is changed here")
    other = Trainer(PolicyNode(name="policy", model=ModelConfig(vocab_size=16, dim=32, n_layers=1, n_heads=4, n_kv_heads=2)), LossNode(name="aipo"))
    with pytest.raises(CheckpointError, match=r"policy 'policy': sharded checkpoint .* holds a model with a different config .*resume with the model description that wrote it"):
        check_sharded(out / "dp2.dcp", other)


def test_a_checkpoint_whose_sharded_save_did_not_finish_is_never_committed(job, tmp_path):
    """A kill inside DCP's save leaves a state without its index: the commit refuses it, no ``step-*``
    appears and LATEST keeps naming the previous checkpoint."""
    from flowrl.runtime.checkpointing.store import CheckpointMeta, CheckpointWriter

    writer = CheckpointWriter(tmp_path / "ck")
    staging = writer.staging(2)
    shutil.copytree(_broken(job, tmp_path, "no-index"), staging / "policy-policy.dcp")
    meta = CheckpointMeta(version=2, data_position=0, graph="g", graph_sha256="x", files={"policy": "policy-policy.dcp"})
    with pytest.raises(CheckpointError, match=r"checkpoint state file 'policy-policy.dcp' was not written"):
        writer.commit(staging, meta)
    shutil.rmtree(staging / "policy-policy.dcp")
    shutil.copytree(_broken(job, tmp_path / "b", "missing-rank"), staging / "policy-policy.dcp")  # a rank's file on another host's disk
    with pytest.raises(CheckpointError, match=r"lacks shard files \['__1_0.distcp'\]"):
        writer.commit(staging, meta)
    assert not list((tmp_path / "ck").glob("step-*")) and not (tmp_path / "ck" / "LATEST").exists()
    out, _ = job
    staging = writer.staging(3)
    shutil.copytree(out / "dp2.dcp", staging / "policy-policy.dcp")
    final = writer.commit(staging, CheckpointMeta(version=3, data_position=0, graph="g", graph_sha256="x", files={"policy": "policy-policy.dcp"}))
    assert (tmp_path / "ck" / "LATEST").read_text() == final.name and (final / "policy-policy.dcp" / ".metadata").is_file()


@pytest.mark.slow  # CI time (a torchrun job); test_a_checkpoint_whose_sharded_save_did_not_finish_is_never_committed checks the commit's refusal
def test_a_kill_inside_a_sharded_save_leaves_the_previous_checkpoint_as_the_newest(tmp_path):
    """2 ranks commit a sharded checkpoint of version 1, then the lead is SIGKILLed inside the save of
    version 2 after every rank wrote its shards and before DCP's index: LATEST still names version 1,
    which reads whole; the half-written state never became a ``step-*``, and the next writer sweeps it."""
    from flowrl.runtime.checkpointing.store import CheckpointWriter, latest_checkpoint
    from flowrl.runtime.checkpointing.sharded_state import read_state

    proc = _torchrun(2, [str(THIS), "kill", str(tmp_path)], tmp_path)
    assert proc.returncode != 0 and (tmp_path / "killing").is_file(), proc.stderr[-3000:]
    ck = tmp_path / "ck"
    assert [p.name for p in ck.glob("step-*")] == ["step-00000001"] and latest_checkpoint(ck) == ck / "step-00000001"
    assert int(read_state(ck / "step-00000001" / "policy-policy.dcp")["version"]) == 1
    (orphan,) = ck.glob(".step-00000002.tmp-*")
    assert sorted(p.name for p in (orphan / "policy-policy.dcp").iterdir()) == ["__0_0.distcp", "__1_0.distcp"]
    CheckpointWriter(ck).staging(3)
    assert not orphan.exists()


def hf_copy_fsdp():
    """The Hugging Face example (a prompt file, so it can be evaluated) with its policy sharded, at k = 0."""
    from flowrl.examples.hf_copy import ASSETS
    from flowrl.graph.builder import GraphBuilder
    from flowrl.graph.configs import HFModelConfig

    b = GraphBuilder("hf_copy_fsdp", model=HFModelConfig(path=str(ASSETS), init="random", seed=0))
    prompts = b.source("prompts", data=str(ASSETS / "prompts.jsonl"), prompt_field="prompt", batch_size=16)
    gen = b.generator("gen", prompts, n_samples=8, max_new_tokens=5, temperature=1.0)
    score = b.scorer("reward", gen, fn="flowrl.examples.hf_copy:reward", inputs="text")
    aipo = b.loss("aipo", gen, score, objective="aipo", rho=4.0, normalize_std=True)
    policy = b.policy("policy", aipo, lr=2e-3, sharding="fsdp")
    b.weights(policy, gen, max_staleness=0)
    return b.build()


@pytest.mark.slow  # CI time (a torchrun run and two CLI readers, ~70 s)
def test_a_torchrun_run_with_an_fsdp_policy_evaluates_and_its_sharded_checkpoints_read_through_the_cli(tmp_path, capsys):
    """``--eval-every`` saves the sharded policy (each rank its shards) and evaluates it consolidated; the
    run's checkpoints are sharded; ``flowrl eval`` of the last one gives the run's own evaluation of
    that version, and ``flowrl export`` writes a directory transformers loads."""
    from flowrl.examples.hf_copy import ASSETS

    from tests.runtime.test_torchrun import _rows

    held = [line for line in (ASSETS / "prompts.jsonl").read_text().splitlines() if line.strip()][:12]
    (tmp_path / "held.jsonl").write_text("\n".join(held) + "\n")
    (tmp_path / "place.json").write_text(json.dumps({"gen": [0], "policy": [1, 2]}))
    proc = _torchrun(3, ["-m", "flowrl", "run", "tests.runtime.test_sharded_checkpoint:hf_copy_fsdp", "--backend", "torchrun",
                         "--plan", "place.json", "--steps", "4", "--eval-every", "2", "--eval-data", "held.jsonl", "--quiet",
                         "--metrics", "m.jsonl", "--checkpoint-dir", "ck", "--checkpoint-every", "2"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(tmp_path / "m.jsonl")
    assert [r.get("eval/version") for r in rows] == [None, 2, None, 4]
    assert sorted(p.name for p in (tmp_path / "ck" / "step-00000004").iterdir()) == ["graph.json", "meta.json", "policy-policy.dcp"]
    from flowrl.cli.main import main

    capsys.readouterr()
    assert main(["eval", str(tmp_path / "ck"), "--data", str(tmp_path / "held.jsonl"), "--json"]) == 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert figures["policy_version"] == 4 and figures["greedy_reward_mean"] == pytest.approx(rows[3]["eval/greedy_reward_mean"], abs=1e-9), (figures, rows[3])
    transformers = pytest.importorskip("transformers")
    assert main(["export", str(tmp_path / "ck"), "-o", str(tmp_path / "hf")]) == 0
    transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True)


# -- the job (run under torchrun) -------------------------------------------------------------------------
def _reshard_job(out: str, family: str, directory: str) -> int:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from flowrl.graph.nodes import LossNode
    from flowrl.operators.trainer import Trainer
    from flowrl.runtime.parallel.distributed import shard_by_groups
    from flowrl.runtime.parallel.fsdp import full_state, load_full_state, shard_trainer_, token_scale
    from flowrl.runtime.checkpointing.sharded_state import load_sharded, read_state, save_sharded

    from tests.runtime.test_fsdp import _batch, _policy

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    meshes = {dp: DeviceMesh("cpu", torch.arange(dp), mesh_dim_names=("dp",)) for dp in (2, 3)}  # every rank creates both
    loss = LossNode(name="aipo")
    batches = [_batch(family, directory, s) for s in (0, 1)]

    def sharded(dp: int, seed: int) -> Trainer:
        torch.manual_seed(seed)
        trainer = Trainer(_policy(family, directory, "fsdp"), loss)
        shard_trainer_(trainer, meshes[dp])
        return trainer

    def step(trainer: Trainer, dp: int, batch: dict) -> None:
        shard = shard_by_groups(batch, dp)[rank]
        trainer.loss_scale = token_scale(dp, float(shard["completion_mask"].sum()), float(batch["completion_mask"].sum()))
        trainer.train_step(shard)

    def gathered(trainer: Trainer, name: str) -> None:
        state = full_state(trainer)  # the reference: the same trainer's state gathered to its lead
        if state is not None:
            torch.save(state, Path(out) / f"{name}.pt")

    if rank < 2:
        two = sharded(2, 0)
        step(two, 2, batches[0])
        save_sharded(two, Path(out) / "dp2.dcp", group=meshes[2].get_group())
        gathered(two, "dp2")
    dist.barrier()
    three = sharded(3, 99)  # other initial weights: only the checkpoint can make them equal
    load_sharded(three, Path(out) / "dp2.dcp", group=meshes[3].get_group())
    gathered(three, "dp3-from-dp2")
    step(three, 3, batches[1])
    save_sharded(three, Path(out) / "dp3.dcp", group=meshes[3].get_group())
    gathered(three, "dp3")
    dist.barrier()
    if rank < 2:
        again = sharded(2, 7)
        load_sharded(again, Path(out) / "dp3.dcp", group=meshes[2].get_group())
        gathered(again, "dp2-from-dp3")
    if rank == 0:  # dp 1: one process resumes dp 2's shards, steps on the whole batch, writes the one-file format
        one = Trainer(_policy(family, directory, "replicate"), loss)
        one.load_state(read_state(Path(out) / "dp2.dcp"))
        one.train_step(batches[1])
        torch.save(one.state(), Path(out) / "dp1.pt")
    dist.barrier()
    back = sharded(3, 5)  # and back to dp 3 from the one-file state (ShardedPolicy.load's other branch)
    load_full_state(back, torch.load(Path(out) / "dp1.pt", weights_only=True, map_location="cpu", mmap=True))
    gathered(back, "dp3-from-dp1")
    if rank < 2:  # rank 1's host lacks the folder (several hosts, no shared filesystem): both ranks raise
        folder = Path(out) / ("not-on-this-host" if rank == 1 else ".")
        try:
            save_sharded(again, folder / "unseen.dcp", group=meshes[2].get_group())
            said = "saved"
        except Exception as exc:  # noqa: BLE001 - what each rank raised, for the test
            said = f"{type(exc).__name__}: {exc}"
        Path(out, f"unseen-{rank}.txt").write_text(said)
        try:  # and loading: rank 1's host lacks the checkpoint
            load_sharded(again, Path(out) / ("dp3.dcp" if rank == 0 else "not-on-this-host/dp3.dcp"), group=meshes[2].get_group())
            said = "loaded"
        except Exception as exc:  # noqa: BLE001 - what each rank raised, for the test
            said = f"{type(exc).__name__}: {exc}"
        Path(out, f"unseen-load-{rank}.txt").write_text(said)
    if rank == 0:
        Path(out, "job.json").write_text(json.dumps({"directory": directory}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _kill_job(out: str) -> int:
    """Version 1 committed; the lead killed inside version 2's save, before DCP writes its index."""
    import os
    import signal

    import torch.distributed as dist
    import torch.distributed.checkpoint.filesystem as dcp_files
    from torch.distributed.device_mesh import init_device_mesh

    from flowrl.graph.nodes import LossNode
    from flowrl.operators.trainer import Trainer
    from flowrl.runtime.checkpointing.store import CheckpointMeta, CheckpointWriter
    from flowrl.runtime.parallel.fsdp import shard_trainer_
    from flowrl.runtime.checkpointing.sharded_state import save_sharded

    from tests.runtime.test_fsdp import _policy

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    trainer = Trainer(_policy("builtin", "", "fsdp"), LossNode(name="aipo"))
    shard_trainer_(trainer, mesh)
    for p in trainer.model.parameters():  # AdamW's state, as after a step
        p.grad = torch.ones_like(p)
    trainer.optimizer.step()
    writer = CheckpointWriter(Path(out) / "ck")
    for version in (1, 2):
        trainer.version = version
        staging = [writer.staging(version) if rank == 0 else None]
        dist.broadcast_object_list(staging, src=0)  # test plumbing: the controller's staging folder
        if version == 2 and rank == 0:
            def killed(self, metadata, results):  # DCP's coordinator, about to write the index
                Path(out, "killing").write_text("")
                os.kill(os.getpid(), signal.SIGKILL)

            dcp_files.FileSystemWriter.finish = killed
        save_sharded(trainer, staging[0] / "policy-policy.dcp", group=mesh.get_group())
        dist.barrier()
        if rank == 0:
            writer.commit(staging[0], CheckpointMeta(version=version, data_position=0, graph="g", graph_sha256="x", files={"policy": "policy-policy.dcp"}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":  # a rank: ends without interpreter teardown (see rank_exit)
    from flowrl.runtime.backends.torchrun.rank_exit import end_rank_process

    if sys.argv[1] == "kill":
        end_rank_process(_kill_job(sys.argv[2]))
    if sys.argv[1] == "reshard":
        end_rank_process(_reshard_job(sys.argv[2], sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else ""))
    raise SystemExit(f"unknown mode {sys.argv[1]!r}")
