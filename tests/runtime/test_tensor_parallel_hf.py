"""Tensor parallelism of Hugging Face Llama-family models: tp logits, cached decoding and sampling equal the
full model's, shards are the layouts' slices, the collective edge gives each rank exactly its shards,
the ParallelGenerator program matches one process, and a torchrun job stays on-policy.

The multi-rank tests start this module as worker processes (``python -m tests.runtime.test_tensor_parallel_hf
RANK WORLD INIT_FILE OUT_DIR``, one gloo group, as tests/runtime/test_tensor_parallel.py does); the model
directories are built by the test and named in ``OUT_DIR/../dirs.json``. Each rank writes its findings as
JSON; the tests read them. Models: a Llama with attention and MLP biases (the row-parallel ``o_proj`` /
``down_proj`` biases must be added once, not tp times) and an uneven MLP split (45 = 23 + 22), a Qwen2
(q/k/v biases, untied head) and a Qwen3 (per-head ``q_norm`` / ``k_norm``); every bias and norm is
perturbed away from transformers' zero / one initialisation so that a wrong split shows.
"""

from __future__ import annotations

import datetime
import json
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

from flowrl.errors import ConfigError
from flowrl.graph.configs import HFModelConfig, ModelConfig
from flowrl.placement.resharding import local_shape, local_slice
from flowrl.runtime.parallel.tensor_parallel import check_tp, param_splits, shard_hf_, shard_transformer_, tp_param_layouts
from tests.runtime.helpers import compare_draws, continuous_draws, draws_logprob_atol, edge_shard_shapes, generator_rank_program, launch_ranks
from tests.tolerances import graph_logprob_atol, ratio_atol, rollout_logprob_atol

GEN_SEED = 7
#: case -> (family, hf_config overrides): what each tiny directory holds.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-bias-uneven": ("llama", {"attention_bias": True, "mlp_bias": True, "intermediate_size": 45}),
    "qwen2": ("qwen2", {"tie_word_embeddings": False, "hidden_size": 48, "intermediate_size": 96}),
    "qwen3": ("qwen3", {}),
}


def make_case_dir(path: Path, case: str) -> Path:
    """A tiny model directory of ``case`` (tokenizer from ``make_hf_dir``, weights with perturbed biases and norms)."""
    from tests.hf_fixtures import hf_config, make_hf_dir

    transformers = pytest.importorskip("transformers")
    family, overrides = CASES[case]
    make_hf_dir(path, family, weights=False)  # the tokenizer (and a config overwritten below)
    config = hf_config(family)
    for key, value in overrides.items():
        setattr(config, key, value)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        model = transformers.AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias") or "norm" in name:
                    p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def _hf(path: str, **kw: Any) -> HFModelConfig:
    return HFModelConfig(path=path, max_seq_len=64, **kw)


# --- worker side ---------------------------------------------------------------------------------


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def _padded_batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Three left-padded prompts of lengths 7, 4, 1 and their real-token mask."""
    ids = torch.randint(3, vocab, (3, 7), generator=torch.Generator().manual_seed(5))
    valid = torch.arange(7)[None, :] >= torch.tensor([0, 3, 6])[:, None]
    return ids.masked_fill(~valid, 0), valid


def _logits_diffs(full: Any, tp: Any, steps: int = 3) -> dict[str, float]:
    """Max |full - tp| of the logits: padded prefill into a cache, cached decode steps, uncached recompute."""
    ids, valid_p = _padded_batch(full.vocab_size)
    B, Tp = ids.shape
    valid = torch.cat([valid_p, torch.ones(B, steps, dtype=torch.bool)], dim=1)
    caches = [m.new_cache(B, Tp + steps) for m in (full, tp)]
    lf, lt = (m(ids, valid=valid[:, :Tp], cache=c) for m, c in zip((full, tp), caches))
    out = {"prefill": _max_diff(lf, lt)}
    seq, decode, uncached = ids, 0.0, 0.0
    for t in range(steps):
        token = lf[:, -1].argmax(-1)  # the full model's choice feeds both
        seq = torch.cat([seq, token[:, None]], dim=1)
        end = Tp + t + 1
        lf, lt = (m(token[:, None], valid=valid[:, :end], cache=c) for m, c in zip((full, tp), caches))
        decode = max(decode, _max_diff(lf, lt))
        uf, ut = (m(seq, valid=valid[:, :end]) for m in (full, tp))
        uncached = max(uncached, _max_diff(uf, ut))
    kv_heads = [layer.keys.shape[1] for layer in caches[1].layers]
    out.update(decode=decode, uncached=uncached, cache_kv_heads=max(kv_heads), scale=float(lf.abs().max()))
    return out


def _check_model(rank: int, ranks: tuple[int, ...], group: Any, dirs: dict[str, str]) -> dict[str, Any]:
    from flowrl.models.causal_lm import weight_dict
    from flowrl.models.hf import HFCausalLM
    from flowrl.models.registry import build_model

    result: dict[str, Any] = {}
    for case, path in dirs.items():
        config = _hf(path)
        full = build_model(config).eval().requires_grad_(False)
        tp = shard_hf_(build_model(config).eval().requires_grad_(False), ranks, rank, group)
        layouts = tp_param_layouts(config, ranks)
        full_w, local = weight_dict(full), weight_dict(tp)
        result[case] = {
            "names_match": sorted(local) == sorted(full_w) == sorted(layouts),
            "shards_equal": {
                n: bool(torch.equal(local[n], full_w[n][local_slice(layouts[n], full_w[n].shape, rank)]))
                and tuple(local[n].shape) == local_shape(layouts[n], full_w[n].shape, rank)
                for n in full_w
            },
            "is_hf": isinstance(tp, HFCausalLM),
            "class": type(tp).__name__,
            "float32": _logits_diffs(full, tp),
            "kv_heads": int(full.hf.config.num_key_value_heads),
        }
    return result


def _check_generate(rank: int, ranks: tuple[int, ...], group: Any, dirs: dict[str, str]) -> dict[str, Any]:
    """``Generator.generate`` on the tp model draws the full model's tokens (same seed), cache on and off."""
    from flowrl.graph.configs import SamplingConfig
    from flowrl.graph.nodes import GeneratorNode
    from flowrl.operators.generation import Generator

    result: dict[str, Any] = {}
    ids, valid = _padded_batch(40)
    prompts = {"prompt_ids": ids, "prompt_lens": valid.sum(1), "prompt_index": torch.tensor([40, 41, 42])}
    for case in ("llama-bias-uneven", "qwen2"):
        for cache in (True, False):
            sampling = SamplingConfig(n_samples=3, max_new_tokens=6, use_kv_cache=cache)
            node = GeneratorNode(name="gen", model=_hf(dirs[case]), sampling=sampling)
            full, tp = Generator(node, seed=GEN_SEED), Generator(node, seed=GEN_SEED)
            shard_hf_(tp.model, ranks, rank, group)
            a, b = full.generate(prompts), tp.generate(prompts)
            result[f"{case}/{'cache' if cache else 'no-cache'}"] = {
                "tokens_equal": bool(torch.equal(a["completion_ids"], b["completion_ids"])),
                "mask_equal": bool(torch.equal(a["completion_mask"], b["completion_mask"])),
                "logprob_diff": _max_diff(a["behaviour_logprobs"], b["behaviour_logprobs"]),
                "logprob_atol": rollout_logprob_atol(full.model, a, temperature=sampling.temperature),
            }
    return result


def _check_continuous(rank: int, ranks: tuple[int, ...], group: Any, dirs: dict[str, str]) -> dict[str, Any]:
    """Continuous batching (``SlotBatcher``) on the tp HF model draws the full model's tokens: 6 prompts of
    lengths 1..7, 2 samples each, through 3 slots (refills spliced into the local heads' cache), stop
    tokens ending completions at varied lengths."""
    from flowrl.graph.configs import SamplingConfig
    from flowrl.graph.nodes import GeneratorNode
    from flowrl.operators.generation import Generator

    result: dict[str, Any] = {}
    for case in ("llama-bias-uneven", "qwen2"):
        sampling = SamplingConfig(n_samples=2, max_new_tokens=8, batching="continuous", stop_tokens=(3, 7, 11))
        node = GeneratorNode(name="gen", model=_hf(dirs[case]), sampling=sampling)
        full, tp = Generator(node, seed=GEN_SEED), Generator(node, seed=GEN_SEED)
        shard_hf_(tp.model, ranks, rank, group)
        gen = torch.Generator().manual_seed(9)
        prompts = [torch.randint(3, 40, (n,), generator=gen).tolist() for n in (5, 2, 7, 1, 4, 3)]
        a = continuous_draws(full, prompts, n=2, slots=3, seed=GEN_SEED)
        b = continuous_draws(tp, prompts, n=2, slots=3, seed=GEN_SEED)
        result[case] = {**compare_draws(a, b), "logprob_atol": draws_logprob_atol(full.model, prompts, a, temperature=sampling.temperature)}
    return result


def hf_graph(model_dir: str, prompts_file: str) -> Any:
    """prompts file -> gen -> text reward -> aipo -> policy, an HF model, weights over files."""
    from flowrl.graph.builder import GraphBuilder

    b = GraphBuilder("tphf", model=_hf(model_dir))
    prompts = b.source("prompts", data=prompts_file, prompt_field="prompt", batch_size=4)
    gen = b.generator("gen", prompts, n_samples=2, max_new_tokens=4)
    score = b.scorer("reward", gen, fn="flowrl.examples.hf_copy:reward", inputs="text")
    aipo = b.loss("aipo", gen, score, objective="aipo")
    policy = b.policy("policy", aipo, lr=1e-3)
    b.weights(policy, gen, transport="file", max_staleness=1)
    return b.build()


def _check_program(rank: int, world: int, out_dir: Path, dirs: dict[str, str]) -> dict[str, Any]:
    """The ``ParallelGenerator`` of an HF graph through ``rank_program``: two versions published over
    files (the staging path), against one process's generator; the collective edge's layout gives this
    rank exactly the shapes of its shards."""
    import torch.distributed as dist

    from flowrl.models.causal_lm import weight_dict
    from flowrl.models.registry import build_model
    from flowrl.operators.generation import Generator
    from flowrl.operators.source import PromptSource

    graph = hf_graph(dirs["llama-bias-uneven"], dirs["prompts"])
    node = graph.node("gen")
    ranks = tuple(range(world))
    result: dict[str, Any] = {}
    with generator_rank_program(graph, rank, world, 1, out_dir / "run", seed=GEN_SEED) as (program, transports, group):
        result["class"] = type(program).__name__
        result["sharded"] = program.sharded
        mine, params = edge_shard_shapes(graph, world, 1, rank)
        result["edge_gives_shards"] = mine == {n: tuple(t.shape) for n, t in program.local_weight_targets().items()}
        result["some_split"] = any(tuple(s) != tuple(params[n]["shape"]) for n, s in mine.items())
        layouts = tp_param_layouts(node.model, ranks)
        source = PromptSource(graph.node("prompts"))
        for version in (1, 2):
            state = weight_dict(build_model(_hf(dirs["llama-bias-uneven"], init="random", seed=50 + version)))
            if rank == 0:
                transports.writer("policy", "gen").publish(state, version)
            dist.barrier(group=group)
            prompts = source.next_batch()
            out, info = program.step(version, prompts if rank == 0 else {}, min_version=version)
            local = program.local_weight_targets()
            step: dict[str, Any] = {
                "version": program.generator.version,
                "shards_equal": all(torch.equal(t, state[n][local_slice(layouts[n], state[n].shape, rank)]) for n, t in local.items()),
            }
            if rank == 0:
                ref = Generator(node, seed=GEN_SEED)
                ref.load_weights(state, version)
                want = ref.generate(prompts)
                step.update(
                    tokens_equal=bool(torch.equal(out["completion_ids"], want["completion_ids"])),
                    logprob_diff=_max_diff(out["behaviour_logprobs"], want["behaviour_logprobs"]),
                    logprob_atol=rollout_logprob_atol(ref.model, want, temperature=node.sampling.temperature),
                    rollout_version=int(out["rollout_version"]),
                )
            result[f"v{version}"] = step
    return result


def _worker_main(argv: list[str]) -> None:
    import torch.distributed as dist

    rank, world, init, out_dir = int(argv[0]), int(argv[1]), argv[2], Path(argv[3])
    dirs = json.loads((out_dir.parent / "dirs.json").read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    ranks = tuple(range(world))
    models = {c: dirs[c] for c in CASES}
    checks = {
        "model": lambda: _check_model(rank, ranks, dist.group.WORLD, models),
        "generate": lambda: _check_generate(rank, ranks, dist.group.WORLD, dirs),
        "continuous": lambda: _check_continuous(rank, ranks, dist.group.WORLD, dirs),
        "program": lambda: _check_program(rank, world, out_dir, dirs),
    }
    result: dict[str, Any] = {}
    for name, check in checks.items():
        try:
            result[name] = check()
        except Exception:  # noqa: BLE001 - reported to the test
            result[name] = {"error": traceback.format_exc()}
        dist.barrier()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


# --- test side -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def case_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Every case's directory, and a prompts file (``prompts``)."""
    root = tmp_path_factory.mktemp("tphf_models")
    dirs = {case: str(make_case_dir(root / case, case)) for case in CASES}
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"copy {i} {i + 1} =", "answer": f"{i} {i + 1}"}) + "\n" for i in range(8)))
    return {**dirs, "prompts": str(prompts)}


@pytest.fixture(scope="module")
def tp2(tmp_path_factory: pytest.TempPathFactory, case_dirs: dict[str, str]) -> dict[int, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("tphf2")
    (tmp / "dirs.json").write_text(json.dumps(case_dirs))
    results, logs = launch_ranks("tests.runtime.test_tensor_parallel_hf", 2, tmp, 180)
    missing = [r for r in range(2) if r not in results]
    assert not missing, f"ranks {missing} wrote no result; output:\n" + "\n".join(logs)
    return results


def _results(run: dict[int, dict[str, Any]], check: str) -> list[Any]:
    out = [run[r][check] for r in sorted(run)]
    errors = [r["error"] for r in out if isinstance(r, dict) and "error" in r]
    assert not errors, "\n".join(errors)
    return out


def test_tp2_hf_logits_with_and_without_the_kv_cache_equal_the_full_models(tp2):
    for rank_result in _results(tp2, "model"):
        for case, entry in rank_result.items():
            assert entry["class"] == "TensorParallelHFCausalLM" and entry["is_hf"], case
            assert entry["names_match"], case
            assert all(entry["shards_equal"].values()), (case, [n for n, ok in entry["shards_equal"].items() if not ok])
            diffs = entry["float32"]
            for path in ("prefill", "decode", "uncached"):
                assert diffs[path] <= 1e-5 * max(1.0, diffs["scale"]), (case, path, diffs)
            assert diffs["cache_kv_heads"] == entry["kv_heads"] // 2, (case, diffs)  # the cache holds local kv heads only


def test_tp2_hf_generate_draws_the_full_models_tokens(tp2):
    for rank_result in _results(tp2, "generate"):
        for path, entry in rank_result.items():
            assert entry["tokens_equal"] and entry["mask_equal"], path
            assert entry["logprob_diff"] <= entry["logprob_atol"], (path, entry["logprob_diff"], entry["logprob_atol"])


def test_tp2_hf_continuous_batching_draws_the_full_models_tokens(tp2):
    for rank_result in _results(tp2, "continuous"):
        for case, entry in rank_result.items():
            assert entry["keys_equal"] and entry["tokens_equal"] and entry["completions"] == 12, (case, entry)
            assert entry["logprob_diff"] <= entry["logprob_atol"], (case, entry["logprob_diff"], entry["logprob_atol"])
            assert entry["splices"] is True and entry["full_splices"] is True, (case, entry)  # refills were spliced, not merged
            assert len(entry["lengths"]) > 1, (case, entry["lengths"])  # stop tokens ended completions at varied lengths


def test_tp2_hf_generator_program_gets_exactly_its_shards_and_matches_one_process(tp2):
    for rank, res in enumerate(_results(tp2, "program")):
        assert res["class"] == "ParallelGenerator" and res["sharded"] and res["edge_gives_shards"] and res["some_split"], res
        for version in (1, 2):
            step = res[f"v{version}"]
            assert step["version"] == version and step["shards_equal"], (rank, step)
            if rank == 0:
                assert step["tokens_equal"] and step["logprob_diff"] <= step["logprob_atol"] and step["rollout_version"] == version, step


@pytest.mark.slow
def test_torchrun_hf_job_with_a_tensor_parallel_generator_stays_on_policy(tmp_path):
    """hf_copy with gen tp2 on ranks 0-1 (plan ``gen:t2@0-1``), policy on rank 2, k=0: its weight edge is the
    collective transport laid out with ``tp_param_layouts`` by HF names, so each generator rank receives
    only its shards. Every rollout is sampled with the policy's current weights, so the AIPO ratio stays 1."""
    pytest.importorskip("transformers")
    from flowrl.examples.hf_copy import build_hf_copy
    from flowrl.planners.plan import plan_graph, save_plan
    from tests.runtime.test_torchrun import _rows, _torchrun

    save_plan(plan_graph(build_hf_copy(max_staleness=0), "cpu:3", strategy="gen:t2@0-1 | policy:d1@2"), tmp_path / "plan.json")
    proc = _torchrun(3, ["-m", "flowrl", "run", "hf_copy", "--backend", "torchrun", "--plan", "plan.json",
                         "--steps", "3", "--quiet", "--metrics", "m.jsonl", "--max-staleness", "0"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(tmp_path / "m.jsonl")
    assert [(r["policy_version"], r["rollout_version"]) for r in rows] == [(1, 0), (2, 1), (3, 2)]
    tol = ratio_atol(graph_logprob_atol(build_hf_copy(max_staleness=0), steps=3))  # float32 rounding (tests/tolerances.py)
    assert all(abs(r["aipo/ratio_max"] - 1.0) < tol and abs(r["aipo/ratio_mean"] - 1.0) < tol for r in rows), (rows, tol)


# --- one process: names, layouts, errors ---------------------------------------------------------

#: (case, parameter name, split): the split table as the layouts apply it.
SPLITS = [
    ("llama-bias-uneven", "model.layers.0.self_attn.q_proj.weight", "column"),
    ("llama-bias-uneven", "model.layers.1.self_attn.k_proj.bias", "column"),
    ("llama-bias-uneven", "model.layers.0.self_attn.o_proj.weight", "row"),
    ("llama-bias-uneven", "model.layers.0.self_attn.o_proj.bias", "replicated"),
    ("llama-bias-uneven", "model.layers.1.mlp.up_proj.bias", "column"),
    ("llama-bias-uneven", "model.layers.1.mlp.down_proj.weight", "row"),
    ("llama-bias-uneven", "model.layers.1.mlp.down_proj.bias", "replicated"),
    ("llama-bias-uneven", "model.embed_tokens.weight", "replicated"),
    ("qwen2", "model.layers.0.self_attn.v_proj.bias", "column"),
    ("qwen2", "lm_head.weight", "replicated"),
    ("qwen2", "model.norm.weight", "replicated"),
    ("qwen3", "model.layers.0.self_attn.q_norm.weight", "replicated"),
    ("qwen3", "model.layers.0.mlp.gate_proj.weight", "column"),
]


@pytest.mark.parametrize("case, name, split", SPLITS, ids=[f"{c}:{n.removeprefix('model.')}" for c, n, _ in SPLITS])
def test_split_table_by_hf_names(case_dirs, case, name, split):
    splits = param_splits(_hf(case_dirs[case]))
    assert splits[name] == split


@pytest.mark.parametrize("case", list(CASES))
def test_hf_layouts_name_every_weight_and_each_rank_holds_exactly_its_shard(case_dirs, case):
    """Sharding in one process (no forward, so no group is used): every rank's shard shapes are the layouts'
    local shapes, the shards tile the full weights, and the layouts name exactly ``weight_dict``'s names."""
    from flowrl.models.causal_lm import weight_dict
    from flowrl.models.registry import build_model, weight_shapes

    config = _hf(case_dirs[case])
    layouts = tp_param_layouts(config, (4, 5))
    full = weight_dict(build_model(config))
    assert list(layouts) == list(weight_shapes(config)) == list(full)
    shards = [weight_dict(shard_hf_(build_model(config), (4, 5), r, object())) for r in (4, 5)]
    for name, tensor in full.items():
        got = [s[name] for s in shards]
        assert [tuple(g.shape) for g in got] == [local_shape(layouts[name], tensor.shape, r) for r in (4, 5)], name
        split = param_splits(config)[name]
        want = [tensor, tensor] if split == "replicated" else list(torch.tensor_split(tensor, [got[0].shape[split == "row"]], dim=int(split == "row")))
        assert all(torch.equal(g, w) for g, w in zip(got, want)), name


def test_hf_tp1_sharding_changes_nothing(case_dirs):
    from flowrl.models.hf import HFCausalLM
    from flowrl.models.registry import build_model

    config = _hf(case_dirs["qwen2"])
    full, tp = build_model(config).eval(), shard_hf_(build_model(config).eval(), (0,), 0, None)
    assert isinstance(tp, HFCausalLM) and type(tp).__name__ == "TensorParallelHFCausalLM"
    ids = torch.randint(3, 40, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(full(ids), tp(ids))


def test_hf_tp_errors(case_dirs):
    from flowrl.models.registry import build_model
    from flowrl.models.families.builtin.model import Transformer

    config = _hf(case_dirs["llama-bias-uneven"])  # 4 query heads, 2 kv heads
    match = r"tp=4 must divide num_key_value_heads=2 \(llama config.json num_attention_heads=4, num_key_value_heads=2\)"
    with pytest.raises(ConfigError, match=match):
        check_tp(config, 4)
    with pytest.raises(ConfigError, match=match):
        tp_param_layouts(config, (0, 1, 2, 3))
    model = build_model(config)
    with pytest.raises(ConfigError, match=match):
        shard_hf_(model, (0, 1, 2, 3), 0, object())
    with pytest.raises(ConfigError, match=r"needs their process group \(got group=None\)"):
        shard_hf_(model, (0, 1), 0, None)
    shard_hf_(model, (0,), 0, None)
    with pytest.raises(ConfigError, match="already tensor-parallel"):
        shard_hf_(model, (0,), 0, None)
    with pytest.raises(ConfigError, match="shard_hf_ shards an HFCausalLM, got Transformer"):
        shard_hf_(Transformer(ModelConfig()), (0,), 0, None)
    with pytest.raises(ConfigError, match="shard_transformer_ shards the built-in Transformer, got HFCausalLM"):
        shard_transformer_(build_model(config), (0,), 0, None)


if __name__ == "__main__":  # a worker rank
    from flowrl.runtime.backends.torchrun.rank_exit import end_rank_process  # no interpreter teardown (rank_exit)

    _worker_main(sys.argv[1:])
    end_rank_process(0)
