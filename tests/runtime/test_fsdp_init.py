"""An FSDP policy built on the meta device (``flowrl.runtime.parallel.fsdp_init``): its shards are the whole model's, bit for bit.

The reference is what every rank did before: build the whole model (``build_model``, LoRA adapters
added), broadcast, and keep ``torch.chunk(p, dp)[rank]``; a LoRA policy read from weight files grows
a rank's resident memory by its shards, one parameter and the adapters, never by the whole model.
Pure parts run in this process (row ranges, each source's rows for dp 1-3, buffers); ``test_a_sharded_policy_starts_from_the_whole_models_shards`` builds a real
``ShardedPolicy`` on 2 torchrun ranks (gloo) per model (``python tests/runtime/test_fsdp_init.py init OUT DIR``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from flowrl.errors import FlowrlError
from flowrl.graph.configs import HFModelConfig, LoraConfig, ModelConfig

from tests.runtime.test_torchrun import _torchrun  # the jobs run with PYTHONPATH=ROOT

ROOT = Path(__file__).resolve().parents[2]
THIS = Path(__file__).resolve()

#: case -> (family, tie, hidden, init); "builtin" is flowrl's own model (vocabulary 15 rows: uneven chunks)
CASES = {
    "builtin": ("builtin", True, 0, ""),
    "llama-pretrained-tied": ("llama", True, 32, "pretrained"),
    "qwen2-pretrained-untied-biases": ("qwen2", False, 48, "pretrained"),
    "llama-random": ("llama", True, 32, "random"),
    "qwen2-random": ("qwen2", False, 48, "random"),
    "qwen3-random": ("qwen3", True, 32, "random"),
    "qwen3_moe-pretrained": ("qwen3_moe", True, 32, "pretrained"),  # stacked experts from per-expert files
    "qwen2_moe-random": ("qwen2_moe", False, 32, "random"),
    "qwen2-random-lora": ("qwen2", False, 48, "random"),
    "llama-pretrained-tied-lora": ("llama", True, 32, "pretrained"),
}
#: the LoRA cases' adapters (on two projections of every layer; r=2 rows: uneven chunks over dp 3)
LORA = {"r": 2, "alpha": 4, "target_modules": ("q_proj", "v_proj")}


def _config(case: str, root: Path):
    from tests.hf_fixtures import make_hf_dir

    family, tie, hidden, init = CASES[case]
    if family == "builtin":
        return ModelConfig(vocab_size=15, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, seed=5)
    directory = root / f"{family}-{tie}-{hidden}"
    if not (directory / "config.json").exists():
        make_hf_dir(directory, family, tie=tie, hidden=hidden)
    lora = LoraConfig(**LORA, seed=11) if case.endswith("-lora") else None  # type: ignore[arg-type]
    return HFModelConfig(path=str(directory), init=init, seed=3, lora=lora)  # type: ignore[arg-type]


#: bytes a rank's resident memory may grow by beyond its shards, one whole parameter and the adapters
#: while a sharded policy starts (the interpreter's and allocator's own: modules, FSDP's bookkeeping)
PEAK_SLACK = 16 * 2**20


def _peak_config(root: Path):
    """A LoRA policy from weight files large enough (75 MB) that a rank's peak memory shows whether it held
    the whole model: Qwen2, hidden 1024, two layers (its largest parameter 8 MB)."""
    from tests.hf_fixtures import make_hf_dir

    directory = root / "qwen2-peak"
    if not (directory / "config.json").exists():
        make_hf_dir(directory, "qwen2", tie=False, hidden=1024)
    return HFModelConfig(path=str(directory), init="pretrained", seed=3, lora=LoraConfig(**LORA, seed=11))  # type: ignore[arg-type]


def _vm(field: str) -> int:
    """This process's ``field`` (``VmRSS``, ``VmHWM``) from /proc/self/status, in bytes."""
    import re

    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024  # type: ignore[union-attr]


def _whole(config):
    """The reference: the whole model as one process builds it (``build_model``, then its LoRA adapters)."""
    from flowrl.models.lora import add_adapters
    from flowrl.models.registry import build_model

    model = build_model(config)
    add_adapters(model, config)
    return model


def _chunk(t: torch.Tensor, dp: int, index: int) -> torch.Tensor:
    chunks = torch.chunk(t.detach(), dp)
    return chunks[index] if index < len(chunks) else t.detach()[:0]


def test_row_ranges_are_torch_chunks():
    from flowrl.runtime.parallel.fsdp_init import row_range

    for rows in range(0, 9):
        for dp in range(1, 5):
            ranges = [row_range(rows, dp, i) for i in range(dp)]
            assert [stop - start for start, stop in ranges] == [len(_chunk(torch.arange(rows), dp, i)) for i in range(dp)]
            assert ranges[0][0] == 0 and ranges[-1][1] == rows


@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_gets_the_rows_of_the_whole_model(case, tmp_path_factory):
    pytest.importorskip("transformers")
    from flowrl.runtime.parallel.fsdp_init import meta_build, row_range

    if case.endswith("-lora"):
        pytest.importorskip("peft")
    config = _config(case, tmp_path_factory.getbasetemp() / "fsdp_init")
    whole = _whole(config)
    params, buffers = dict(whole.named_parameters()), dict(whole.named_buffers())
    for dp in (2, 3):
        for index in range(dp):
            model, source = meta_build(config)
            assert all(p.is_meta for p in model.parameters())
            assert sorted(dict(model.named_buffers())) == sorted(buffers)
            assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())  # rotary tables as built
            wanted = {n: row_range(p.shape[0], dp, index) for n, p in model.named_parameters()}
            got = dict(source(wanted))
            assert sorted(got) == sorted(params)
            for name, rows in got.items():
                assert rows.dtype == torch.float32 and torch.equal(rows, _chunk(params[name], dp, index)), (name, dp, index)


def test_a_parameter_the_hf_init_leaves_unset_is_refused(tmp_path):
    pytest.importorskip("transformers")
    from flowrl.runtime.parallel.fsdp_init import meta_build, row_range

    model, source = meta_build(_config("llama-random", tmp_path))
    model.model.norm.register_parameter("extra", torch.nn.Parameter(torch.empty(4, device="meta")))  # no _init_weights sets it
    wanted = {n: row_range(p.shape[0], 2, 0) for n, p in model.named_parameters()}
    with pytest.raises(FlowrlError, match=r"model.norm.extra: transformers' _init_weights of .*RMSNorm leaves it \(partly\) unset"):
        dict(source(wanted))


def test_the_meta_build_patches_only_its_own_thread():
    import threading

    from flowrl.runtime.parallel.fsdp_init import _ParamsOnMeta

    other: dict[str, torch.nn.Module] = {}
    with _ParamsOnMeta():
        thread = threading.Thread(target=lambda: other.update(linear=torch.nn.Linear(2, 2)))  # another node's program on the rank
        thread.start()
        thread.join()
        mine = torch.nn.Linear(2, 2)
    assert mine.weight.is_meta and not other["linear"].weight.is_meta
    assert not torch.nn.Linear(2, 2).weight.is_meta  # restored


def test_a_sharded_policy_starts_from_the_whole_models_shards(tmp_path):
    pytest.importorskip("transformers")
    for case in CASES:
        _config(case, tmp_path)  # the directories, written once here
    _peak_config(tmp_path)
    out = tmp_path / "out.json"
    proc = _torchrun(2, [str(THIS), "init", str(out), str(tmp_path)], cwd=tmp_path, retry_cxx_abort=True)  # see CXX_ABORT
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    peaks = result.pop("peak")
    assert sorted(result) == sorted(CASES)
    for case, ranks in result.items():
        assert ranks["0"]["mismatched"] == [] and ranks["1"]["mismatched"] == [], case
        assert ranks["0"]["params"] > 0 and ranks["0"]["params"] + ranks["1"]["params"] == ranks["0"]["whole"], case
        assert ranks["0"]["buffers_equal"] and ranks["1"]["buffers_equal"], case
        assert not ranks["0"]["broadcasts"], case  # nothing was broadcast at init
    for rank, peak in peaks.items():  # a LoRA policy from weight files: a rank's shards, one parameter, the adapters
        bound = peak["whole"] / 2 + peak["largest"] + peak["adapters"] + PEAK_SLACK
        assert peak["peak_rss"] < bound < peak["whole"], (rank, peak)


# -- the job (under torchrun) --------------------------------------------------------------------------
def _graph(config):
    from flowrl.graph.builder import GraphBuilder

    b = GraphBuilder("fsdp_init", model=config)
    prompts = b.source("prompts", task="copy", batch_size=4)
    gen = b.generator("gen", prompts, n_samples=2, max_new_tokens=3, temperature=1.0)
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    loss = b.loss("aipo", gen, reward, objective="aipo")
    policy = b.policy("policy", loss, lr=1e-3, sharding="fsdp")
    b.weights(policy, gen)
    return b.build()


def _init_job(out: str, root: str) -> int:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from flowrl.runtime.backends.torchrun import rank_programs
    from flowrl.runtime.backends.torchrun.rank_programs import RankContext, ShardedPolicy
    from flowrl.host import release_freed_memory
    from flowrl.runtime.parallel.fsdp_init import meta_build

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = DeviceMesh("cpu", torch.tensor([0, 1]), mesh_dim_names=("dp",))
    rank_programs.set_context(RankContext(rank=rank, world=2, ranks={"policy": (0, 1)}, programs={}))
    broadcasts = []
    original = dist.broadcast
    dist.broadcast = lambda *a, **k: broadcasts.append(1) or original(*a, **k)  # type: ignore[assignment]
    result = {}
    for case in CASES:
        config = _config(case, Path(root))
        graph = _graph(config)
        broadcasts.clear()
        policy = ShardedPolicy(graph.node("policy"), graph, None, group=mesh.get_group(), ranks=(0, 1), mesh=mesh)  # type: ignore[arg-type]
        whole = _whole(config)  # the reference: the whole model, chunked
        ref_params, ref_buffers = dict(whole.named_parameters()), dict(whole.named_buffers())
        mine = dict(policy.trainer.model.named_parameters())
        mismatched = [n for n, p in mine.items() if not torch.equal(p.to_local(), _chunk(ref_params[n], 2, rank))]
        mismatched += sorted(set(ref_params) ^ set(mine))
        result[case] = {
            "mismatched": mismatched,
            "params": sum(p.to_local().numel() for p in mine.values()),
            "whole": sum(p.numel() for p in ref_params.values()),
            "buffers_equal": all(torch.equal(b, ref_buffers[n]) for n, b in policy.trainer.model.named_buffers()),
            "broadcasts": len(broadcasts),
        }
    config = _peak_config(Path(root))  # after the cases: every module it needs is imported already
    graph = _graph(config)
    meta, _ = meta_build(config)
    shapes = {n: p.numel() * 4 for n, p in meta.named_parameters()}  # float32
    del meta
    release_freed_memory()
    before = _vm("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts at the current RSS
    policy = ShardedPolicy(graph.node("policy"), graph, None, group=mesh.get_group(), ranks=(0, 1), mesh=mesh)  # type: ignore[arg-type]
    peak = {
        "peak_rss": _vm("VmHWM") - before,
        "whole": sum(shapes.values()),
        "largest": max(shapes.values()),
        "adapters": sum(v for n, v in shapes.items() if ".lora_" in n),
    }
    del policy
    everyone = [None, None]
    dist.all_gather_object(everyone, (result, peak))
    if rank == 0:
        merged = {case: {str(r): everyone[r][0][case] for r in (0, 1)} for case in CASES}
        Path(out).write_text(json.dumps({**merged, "peak": {str(r): everyone[r][1] for r in (0, 1)}}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":  # a rank: ends without interpreter teardown (see rank_exit)
    from flowrl.runtime.backends.torchrun.rank_exit import end_rank_process

    if sys.argv[1] == "init":
        end_rank_process(_init_job(sys.argv[2], sys.argv[3]))
    raise SystemExit(f"unknown mode {sys.argv[1]!r}")
