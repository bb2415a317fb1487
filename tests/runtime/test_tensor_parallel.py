"""Tensor parallelism of the built-in model: TP logits and sampling equal the full model's, shards are the
layouts' slices, the ParallelGenerator program matches a one-process generator, and bad tp sizes
are clear errors.

The multi-rank tests start this module as worker processes (``python -m tests.runtime.test_tensor_parallel
RANK WORLD INIT_FILE OUT_DIR``, one gloo group over a FileStore, as tests/runtime/test_collective.py
does). Each rank runs every check and writes its findings as JSON (no pickle); the tests read them. A
run that does not finish in time is killed and fails. 2 ranks by default (tp=2), plus one torchrun job
of the default example whose generator is tensor-parallel (plan ``gen:t2@0-1 | policy:d1@2``, weights
over the collective transport, shard by shard); ``--runslow`` adds 4 ranks
(tp=4 for the model checks, a dp2 x tp2 mesh for the program).
"""

from __future__ import annotations

import datetime
import json
import math
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from flowrl.errors import ConfigError
from flowrl.graph.builder import GraphBuilder
from flowrl.graph.configs import ModelConfig
from flowrl.graph.nodes import GeneratorNode
from flowrl.models.families.builtin.model import Transformer, attention_mask, positions_from_valid
from flowrl.placement.resharding import local_shape, local_slice
from flowrl.runtime.parallel.tensor_parallel import (
    TensorParallelTransformer,
    check_tp,
    copy_local_shards_,
    param_splits,
    shard_transformer_,
    tp_param_layouts,
    tp_rows,
)
from tests.runtime.helpers import compare_draws, continuous_draws, draws_logprob_atol, edge_shard_shapes, generator_rank_program, launch_ranks
from tests.tolerances import graph_logprob_atol, logit_atol, ratio_atol, rollout_logprob_atol


#: Model shapes the checks run: grouped-query attention, an uneven SwiGLU split (45 = 23 + 22 over tp2,
#: 12 + 12 + 12 + 9 over tp4), an untied output head; and the tied default-like shape.
CONFIGS: dict[str, ModelConfig] = {
    "gqa-untied-uneven": ModelConfig(vocab_size=24, dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=45,
                                     tie_embeddings=False, max_seq_len=32, seed=3),
    "tied": ModelConfig(vocab_size=16, dim=32, n_layers=2, n_heads=4, n_kv_heads=4, max_seq_len=32, seed=1),
}
GEN_SEED = 11


def tp_graph(**sampling: Any):
    """A pipeline whose generator can run tp2 and tp4 (8 query, 4 kv heads), weights over files;
    ``sampling``: more ``SamplingConfig`` fields of the generator (e.g. continuous batching)."""
    b = GraphBuilder("tp", model=ModelConfig(vocab_size=16, dim=64, n_layers=2, n_heads=8, n_kv_heads=4, max_seq_len=32))
    prompts = b.source("prompts", task="copy", batch_size=5)
    gen = b.generator("gen", prompts, n_samples=3, max_new_tokens=5, **sampling)
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    aipo = b.loss("aipo", gen, reward, objective="aipo")
    policy = b.policy("policy", aipo, lr=1e-3)
    b.weights(policy, gen, transport="file", max_staleness=1)
    return b.build()


# --- worker side ---------------------------------------------------------------------------------


def _padded_batch(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Three left-padded prompts of lengths 7, 4, 1 and their real-token mask."""
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(1, config.vocab_size, (3, 7), generator=gen)
    valid = torch.arange(7)[None, :] >= torch.tensor([0, 3, 6])[:, None]
    return ids.masked_fill(~valid, 0), valid


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def _logits_diffs(full: Transformer, tp: Transformer, steps: int = 3) -> dict[str, float]:
    """Max |full - tp| of the logits: causal prefill, padded prefill, cached decode, uncached decode."""
    config = full.config
    ids, valid_p = _padded_batch(config)
    B, Tp = ids.shape
    valid = torch.cat([valid_p, torch.ones(B, steps, dtype=torch.bool)], dim=1)
    pos = positions_from_valid(valid)
    out = {"causal": _max_diff(full(ids), tp(ids))}
    caches = [m.new_cache(B, Tp + steps) for m in (full, tp)]
    lf, lt = (m(ids, positions=pos[:, :Tp], attn_mask=attention_mask(valid, 0, Tp), cache=c) for m, c in zip((full, tp), caches))
    out["prefill"] = _max_diff(lf, lt)
    seq = ids
    decode, uncached = 0.0, 0.0
    for t in range(steps):
        token = lf[:, -1].argmax(-1)  # the full model's choice feeds both
        seq = torch.cat([seq, token[:, None]], dim=1)
        end = Tp + t + 1
        lf, lt = (m(token[:, None], positions=pos[:, end - 1 : end], attn_mask=attention_mask(valid, end - 1, 1), cache=c)
                  for m, c in zip((full, tp), caches))
        decode = max(decode, _max_diff(lf, lt))
        uf, ut = (m(seq, positions=pos[:, :end], attn_mask=attention_mask(valid, 0, end)) for m in (full, tp))
        uncached = max(uncached, _max_diff(uf, ut))
    out.update(decode=decode, uncached=uncached, cache_kv_heads=int(caches[1].k[0].shape[1]), scale=float(lf.abs().max()))
    if next(full.parameters()).dtype == torch.float32:  # the rows as computed: whole (causal) and their real tokens (masked paths)
        rows = [seq[b] for b in range(B)] + [seq[b][valid[b]] for b in range(B)]
        out["atol"] = logit_atol(full, rows)
    return out


def _check_model(rank: int, ranks: tuple[int, ...], group: Any) -> dict[str, Any]:
    """(a) logits, (c) shards, reloading shards from another full state, in float32 and bfloat16."""
    result: dict[str, Any] = {}
    for name, config in CONFIGS.items():
        full = Transformer(config).eval().requires_grad_(False)
        tp = shard_transformer_(Transformer(config).eval().requires_grad_(False), ranks, rank, group)
        layouts = tp_param_layouts(config, ranks)
        full_state, local = full.state_dict(), tp.state_dict()
        shards = {
            n: bool(torch.equal(local[n], full_state[n][local_slice(layouts[n], full_state[n].shape, rank)]))
            and tuple(local[n].shape) == local_shape(layouts[n], full_state[n].shape, rank)
            for n in full_state
        }
        entry: dict[str, Any] = {
            "names_match": sorted(local) == sorted(full_state) == sorted(layouts),
            "shards_equal": shards,
            "class": type(tp).__name__,
            "float32": _logits_diffs(full, tp),
        }
        other = Transformer(msgspec_replace(config, seed=config.seed + 100)).eval().requires_grad_(False)
        copy_local_shards_(local, other.state_dict(), ranks, rank, config)
        entry["reloaded"] = _logits_diffs(other, tp)
        full16 = Transformer(config).to(torch.bfloat16).eval().requires_grad_(False)
        tp16 = shard_transformer_(Transformer(config).to(torch.bfloat16).eval().requires_grad_(False), ranks, rank, group)
        entry["bfloat16"] = _logits_diffs(full16, tp16)
        result[name] = entry
    return result


def msgspec_replace(config: ModelConfig, **changes: Any) -> ModelConfig:
    import msgspec

    return msgspec.structs.replace(config, **changes)


def _check_generate(rank: int, ranks: tuple[int, ...], group: Any) -> dict[str, Any]:
    """(b) ``Generator.generate`` on the TP model draws the tokens of the full model (same seed)."""
    from flowrl.graph.configs import SamplingConfig
    from flowrl.operators.generation import Generator

    result: dict[str, Any] = {}
    config = CONFIGS["gqa-untied-uneven"]
    ids, valid = _padded_batch(config)
    prompts = {"prompt_ids": ids, "prompt_lens": valid.sum(1), "prompt_index": torch.tensor([40, 41, 42])}
    for cache in (True, False):
        node = GeneratorNode(name="gen", model=config, sampling=SamplingConfig(n_samples=4, max_new_tokens=8, use_kv_cache=cache))
        full, tp = Generator(node, seed=GEN_SEED), Generator(node, seed=GEN_SEED)
        shard_transformer_(tp.model, ranks, rank, group)
        a, b = full.generate(prompts), tp.generate(prompts)
        result["cache" if cache else "no-cache"] = {
            "tokens_equal": bool(torch.equal(a["completion_ids"], b["completion_ids"])),
            "mask_equal": bool(torch.equal(a["completion_mask"], b["completion_mask"])),
            "logprob_diff": _max_diff(a["behaviour_logprobs"], b["behaviour_logprobs"]),
            "logprob_atol": rollout_logprob_atol(full.model, a, temperature=node.sampling.temperature),
            "tokens": b["completion_ids"].tolist(),
        }
    return result


def _check_program(rank: int, world: int, dp: int, out_dir: Path) -> dict[str, Any]:
    """The ``ParallelGenerator`` through ``rank_program``: two versions published over files, the
    merged rollout against one process's generator (per replica part, merged the same way)."""
    import torch.distributed as dist

    from flowrl.operators.generation import Generator
    from flowrl.operators.source import PromptSource
    from flowrl.runtime.parallel.distributed import merge_rollouts, split_prompts

    graph = tp_graph()
    node = graph.node("gen")
    ranks = tuple(range(world))
    result: dict[str, Any] = {}
    with generator_rank_program(graph, rank, world, dp, out_dir / "run", seed=GEN_SEED) as (program, transports, group):
        result["class"] = type(program).__name__
        result["sharded"] = program.sharded
        # the collective transport's generator layout (weights.py) gives this rank exactly its shards
        mine, _ = edge_shard_shapes(graph, world, dp, rank)
        layouts = tp_param_layouts(node.model, ranks, dp=dp)
        result["layouts_match"] = mine == {n: tuple(t.shape) for n, t in program.local_weight_targets().items()}
        source = PromptSource(graph.node("prompts"))
        for version in (1, 2):
            state = Transformer(msgspec_replace(node.model, seed=50 + version)).state_dict()
            if rank == 0:
                transports.writer("policy", "gen").publish(state, version)
            dist.barrier(group=group)
            prompts = source.next_batch()  # every rank advances its source alike; only the lead's batch is used
            out, info = program.step(version, prompts if rank == 0 else {}, min_version=version)
            local = program.local_weight_targets()
            step: dict[str, Any] = {
                "version": program.generator.version,
                "shards_equal": all(torch.equal(t, state[n][local_slice(layouts[n], state[n].shape, rank)]) for n, t in local.items()),
                "targets_are_shards": program.generator.weight_targets() is local,
            }
            if rank == 0:
                ref = Generator(node, seed=GEN_SEED)
                ref.load_weights(state, version)
                want = merge_rollouts([ref.generate(p) for p in split_prompts(prompts, dp)])
                step.update(
                    keys_equal=sorted(out) == sorted(want),
                    tokens_equal=bool(torch.equal(out["completion_ids"], want["completion_ids"])),
                    groups_equal=bool(torch.equal(out["group_ids"], want["group_ids"])),
                    logprob_diff=_max_diff(out["behaviour_logprobs"], want["behaviour_logprobs"]),
                    logprob_atol=rollout_logprob_atol(ref.model, want, temperature=node.sampling.temperature),
                    rollout_version=int(out["rollout_version"]),
                    info_version=int(info["version"]),
                    samples=int(out["completion_ids"].shape[0]),
                )
            else:
                step["empty"] = out == {} and info == {}
            result[f"v{version}"] = step
    return result


def _check_splice(rank: int, ranks: tuple[int, ...], group: Any) -> dict[str, Any]:
    """``splice_cache`` of the tp model: a rank's cache after prefill and splice is its kv heads of the
    full model's cache after the same prefill and splice (every layer, keys and values)."""
    config = CONFIGS["gqa-untied-uneven"]
    full = Transformer(config).eval().requires_grad_(False)
    tp = shard_transformer_(Transformer(config).eval().requires_grad_(False), ranks, rank, group)
    ids, valid = _padded_batch(config)  # 3 rows, 7 columns
    part_ids = torch.randint(1, config.vocab_size, (2, 4), generator=torch.Generator().manual_seed(8))
    part_valid = torch.ones(2, 4, dtype=torch.bool)
    source, rows, start = torch.tensor([1, 0]), torch.tensor([2, 0]), 3
    caches = {}
    for name, model in (("full", full), ("tp", tp)):
        cache, part = model.new_cache(3, 12), model.new_cache(2, 4)
        model(ids, valid=valid, cache=cache)
        before = [k.clone() for k in cache.k]
        model(part_ids, valid=part_valid, cache=part)
        took = model.splice_cache(cache, part, source, rows, start)
        caches[name] = (cache, part, before, took)
    (cf, _, _, took_f), (ct, pt, before_t, took_t) = caches["full"], caches["tp"]
    local = config.n_kv_heads // len(ranks)
    heads = slice(ranks.index(rank) * local, (ranks.index(rank) + 1) * local)
    return {
        "took": bool(took_f and took_t),
        "local_heads": int(ct.k[0].shape[1]),
        "k_diff": max(_max_diff(ct.k[i], cf.k[i][:, heads]) for i in range(config.n_layers)),
        "v_diff": max(_max_diff(ct.v[i], cf.v[i][:, heads]) for i in range(config.n_layers)),
        # the spliced slots hold the part's rows; the row left out is untouched
        "spliced": all(torch.equal(ct.k[i][rows, :, start:7], pt.k[i][source, :, :4]) for i in range(config.n_layers)),
        "untouched": all(torch.equal(ct.k[i][1], before_t[i][1]) for i in range(config.n_layers)),
        "changed": any(not torch.equal(ct.k[i][2], before_t[i][2]) for i in range(config.n_layers)),
    }


def _check_continuous(rank: int, ranks: tuple[int, ...], group: Any) -> dict[str, Any]:
    """Continuous batching (``SlotBatcher``) on the tp model draws the full model's tokens: 6 prompts of
    lengths 1..7, 2 samples each, through 3 slots (refills spliced from staged prefills), stop tokens
    ending completions at varied lengths."""
    from flowrl.graph.configs import SamplingConfig
    from flowrl.operators.generation import Generator

    config = CONFIGS["gqa-untied-uneven"]
    sampling = SamplingConfig(n_samples=2, max_new_tokens=8, batching="continuous", stop_tokens=(3, 7, 11))
    node = GeneratorNode(name="gen", model=config, sampling=sampling)
    full, tp = Generator(node, seed=GEN_SEED), Generator(node, seed=GEN_SEED)
    shard_transformer_(tp.model, ranks, rank, group)
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(1, config.vocab_size, (n,), generator=gen).tolist() for n in (5, 2, 7, 1, 4, 3)]
    a = continuous_draws(full, prompts, n=2, slots=3, seed=GEN_SEED)
    b = continuous_draws(tp, prompts, n=2, slots=3, seed=GEN_SEED)
    return {**compare_draws(a, b), "tokens": b["tokens"], "logprob_atol": draws_logprob_atol(full.model, prompts, a, temperature=sampling.temperature)}


def _read_ahead(batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Source batches as one continuous generator's inputs (``Controller._read_ahead``: real tokens, left-padded)."""
    from flowrl.operators.source import pad_left

    prompts = [ids[ids.shape[0] - n :].tolist() for b in batches for ids, n in zip(b["prompt_ids"], b["prompt_lens"].tolist())]
    ids, lens = pad_left(prompts, 0)
    return {"prompt_ids": ids, "prompt_lens": lens, "prompt_index": torch.cat([b["prompt_index"] for b in batches])}


def _check_program_continuous(rank: int, world: int, out_dir: Path) -> dict[str, Any]:
    """The ``ParallelGenerator`` of a continuous-batching generator (k=1, 4 slots for 5 prompts x 3
    samples a step) against one process's ``ContinuousRollouts``: the controller hands it 2 batches
    of prompts at step 1 and 1 at step 2, versions 1 and 2 published over files before each; then an
    in-flight poll takes version 3 on every tp rank together."""
    import torch.distributed as dist

    from flowrl.operators.generation import Generator
    from flowrl.operators.source import PromptSource
    from flowrl.runtime.programs.continuous import ContinuousRollouts

    graph = tp_graph(batching="continuous", slots=4)
    node = graph.node("gen")
    layouts = tp_param_layouts(node.model, tuple(range(world)))
    result: dict[str, Any] = {}
    with generator_rank_program(graph, rank, world, 1, out_dir / "run-continuous", seed=GEN_SEED) as (program, transports, group):
        ref = Generator(node, seed=GEN_SEED)
        ref_rollouts = ContinuousRollouts(ref, group_count=5, k=1)
        source = PromptSource(graph.node("prompts"))
        states = {v: Transformer(msgspec_replace(node.model, seed=50 + v)).state_dict() for v in (1, 2, 3)}
        for version, batches in ((1, 2), (2, 1)):
            if rank == 0:
                transports.writer("policy", "gen").publish(states[version], version)
            dist.barrier(group=group)
            prompts = _read_ahead([source.next_batch() for _ in range(batches)])
            out, info = program.step(version, prompts if rank == 0 else {}, min_version=version - 1)
            step: dict[str, Any] = {"version": program.generator.version}
            if rank == 0:
                ref.load_weights(states[version], version)
                ref_rollouts.add_prompts(prompts)
                want, want_info = ref_rollouts.next_batch(version)
                same = lambda key: key in out and bool(torch.equal(out[key], want[key]))  # noqa: E731 - never raises: rank 1 waits in the next barrier
                step.update(
                    keys_equal=sorted(out) == sorted(want),
                    tokens_equal=same("completion_ids"),
                    mask_equal=same("completion_mask"),
                    index_equal=same("prompt_index"),
                    versions_equal=same("token_versions"),
                    logprob_diff=_max_diff(out["behaviour_logprobs"], want["behaviour_logprobs"]) if same("completion_mask") else float("inf"),
                    logprob_atol=rollout_logprob_atol(ref.model, want, temperature=node.sampling.temperature),
                    samples=int(out["completion_ids"].shape[0]),
                    lengths=sorted(set(out["completion_mask"].sum(1).tolist())),
                    info_version=int(info["version"]),
                    slots_info={k: v for k, v in info.items() if k.startswith("slots/")},
                    want_slots_info={k: v for k, v in want_info.items() if k.startswith("slots/")},
                )
            else:
                step["empty"] = out == {} and info == {}
            result[f"v{version}"] = step
        batcher = getattr(program._continuous, "batcher", None)  # None: the program did not batch continuously
        result["batcher"] = {c: getattr(batcher, c, None) for c in ("splices", "prefills", "compactions", "steps")}
        if rank == 0:
            transports.writer("policy", "gen").publish(states[3], 3)
        dist.barrier(group=group)
        program._poll()  # what ContinuousRollouts calls between decode steps of an in_flight edge
        local = program.local_weight_targets()
        result["poll"] = {
            "version": program.generator.version,
            "shards_equal": all(torch.equal(t, states[3][n][local_slice(layouts[n], states[3][n].shape, rank)]) for n, t in local.items()),
        }
    return result


def _worker_main(argv: list[str]) -> None:
    import torch.distributed as dist

    rank, world, init, out_dir = int(argv[0]), int(argv[1]), argv[2], Path(argv[3])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    ranks = tuple(range(world))
    checks: dict[str, Callable[[], Any]] = {
        "model": lambda: _check_model(rank, ranks, dist.group.WORLD),
        "generate": lambda: _check_generate(rank, ranks, dist.group.WORLD),
        "program": lambda: _check_program(rank, world, 2 if world == 4 else 1, out_dir),
        "splice": lambda: _check_splice(rank, ranks, dist.group.WORLD),
        "continuous": lambda: _check_continuous(rank, ranks, dist.group.WORLD),
        "program_continuous": lambda: _check_program_continuous(rank, world, out_dir),
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


def _launch(world: int, tmp: Path, timeout_s: float = 120) -> dict[int, dict[str, Any]]:
    """Run ``world`` worker ranks; every rank must write its result."""
    results, logs = launch_ranks("tests.runtime.test_tensor_parallel", world, tmp, timeout_s)
    missing = [r for r in range(world) if r not in results]
    assert not missing, f"ranks {missing} wrote no result; output:\n" + "\n".join(logs)
    return results


@pytest.fixture(scope="module")
def tp2(tmp_path_factory) -> dict[int, dict[str, Any]]:
    return _launch(2, tmp_path_factory.mktemp("tp2"))


@pytest.fixture(scope="module")
def tp4(tmp_path_factory) -> dict[int, dict[str, Any]]:
    return _launch(4, tmp_path_factory.mktemp("tp4"))


def _results(run: dict[int, dict[str, Any]], check: str) -> list[Any]:
    out = [run[r][check] for r in sorted(run)]
    errors = [r["error"] for r in out if isinstance(r, dict) and "error" in r]
    assert not errors, "\n".join(errors)
    return out


def _assert_model(run: dict[int, dict[str, Any]]) -> None:
    for rank_result in _results(run, "model"):
        for name, entry in rank_result.items():
            assert entry["class"] == "TensorParallelTransformer"
            assert entry["names_match"], name
            assert all(entry["shards_equal"].values()), (name, [n for n, ok in entry["shards_equal"].items() if not ok])
            for what in ("float32", "reloaded"):
                diffs = entry[what]
                for path in ("causal", "prefill", "decode", "uncached"):
                    assert diffs[path] <= diffs["atol"], (name, what, path, diffs)
            tp = len(run)
            assert entry["float32"]["cache_kv_heads"] == CONFIGS[name].n_kv_heads // tp  # the cache holds local heads only
            bf = entry["bfloat16"]  # no float32 bound applies (CONTRIBUTING item 5): a margin of ~25 bfloat16 unit roundoffs of the logits' scale
            for path in ("causal", "prefill", "decode", "uncached"):
                assert bf[path] <= 0.05 * max(1.0, bf["scale"]), (name, path, bf)


def _assert_generate(run: dict[int, dict[str, Any]]) -> None:
    results = _results(run, "generate")
    for rank_result in results:
        for path, entry in rank_result.items():
            assert entry["tokens_equal"] and entry["mask_equal"], path
            assert entry["logprob_diff"] <= entry["logprob_atol"], (path, entry["logprob_diff"], entry["logprob_atol"])
    assert all(r["cache"]["tokens"] == results[0]["cache"]["tokens"] for r in results)  # every tp rank drew the same


def _assert_program(run: dict[int, dict[str, Any]], samples: int) -> None:
    results = _results(run, "program")
    for rank, res in enumerate(results):
        assert res["class"] == "ParallelGenerator" and res["sharded"] and res["layouts_match"]
        for version in (1, 2):
            step = res[f"v{version}"]
            assert step["version"] == version and step["shards_equal"] and step["targets_are_shards"], (rank, step)
            if rank == 0:
                assert step["keys_equal"] and step["tokens_equal"] and step["groups_equal"], step
                assert step["logprob_diff"] <= step["logprob_atol"] and step["rollout_version"] == step["info_version"] == version, step
                assert step["samples"] == samples
            else:
                assert step["empty"], (rank, step)


def _assert_continuous(run: dict[int, dict[str, Any]]) -> None:
    tp = len(run)
    for rank, res in enumerate(_results(run, "splice")):
        assert res["took"] and res["local_heads"] == CONFIGS["gqa-untied-uneven"].n_kv_heads // tp, (rank, res)
        assert res["k_diff"] <= 1e-5 and res["v_diff"] <= 1e-5, (rank, res)  # this rank's heads of the full cache
        assert res["spliced"] and res["untouched"] and res["changed"], (rank, res)
    results = _results(run, "continuous")
    for rank, res in enumerate(results):
        assert res["keys_equal"] and res["tokens_equal"] and res["logprob_diff"] <= res["logprob_atol"], (rank, res)
        assert res["completions"] == 12 and len(res["lengths"]) > 1, res  # more completions than slots, varied lengths
        assert res["splices"] and res["full_splices"] and res["prefills"] >= 2, res  # refills were spliced, not merged
        assert [res[c] for c in ("prefills", "compactions", "steps")] == [res[f"full_{c}"] for c in ("prefills", "compactions", "steps")], res
    assert all(r["tokens"] == results[0]["tokens"] for r in results)  # every tp rank drew the same
    programs = _results(run, "program_continuous")
    for rank, res in enumerate(programs):
        for version in (1, 2):
            step = res[f"v{version}"]
            assert step["version"] == version, (rank, step)
            if rank == 0:
                assert step["keys_equal"] and step["tokens_equal"] and step["mask_equal"] and step["index_equal"], step
                assert step["versions_equal"] and step["logprob_diff"] <= step["logprob_atol"] and step["samples"] == 5 * 3, step
                assert step["slots_info"] and step["slots_info"] == step["want_slots_info"], step
            else:
                assert step["empty"], (rank, step)
        assert res["batcher"]["splices"] and res["batcher"]["prefills"] >= 2, res["batcher"]
        assert res["poll"] == {"version": 3, "shards_equal": True}, (rank, res["poll"])
    assert len({json.dumps(r["batcher"]) for r in programs}) == 1  # the tp ranks ran the same decode steps


def test_tp2_logits_equal_the_full_model_and_shards_are_the_layout_slices(tp2):
    _assert_model(tp2)


def test_tp2_generate_draws_the_full_models_tokens(tp2):
    _assert_generate(tp2)


def test_tp2_generator_program_matches_one_process(tp2):
    _assert_program(tp2, samples=5 * 3)


def test_tp2_continuous_batching_splices_local_heads_and_matches_one_process(tp2):
    """Continuous batching with tp=2: splices copy each rank's kv heads, refills and all; the tp model
    draws the full model's tokens; the program delivers what one process's ContinuousRollouts does
    (not every read-ahead prompt in lock step), and takes in-flight weights on both ranks together."""
    _assert_continuous(tp2)


@pytest.mark.slow
def test_tp4_model_generate_and_dp2_tp2_program(tp4):
    _assert_model(tp4)
    _assert_generate(tp4)
    _assert_program(tp4, samples=5 * 3)
    _assert_continuous(tp4)



@pytest.mark.slow  # CI time: a 3-rank job, ~15 s; the tp2 shards and logits are checked by the module's tp2 tests
def test_torchrun_job_with_a_tensor_parallel_generator_stays_on_policy(tmp_path):
    """The default example with gen tp2 on ranks 0-1 (plan ``gen:t2@0-1``), policy on rank 2, k=0. Its weight
    edge is the collective transport laid out with ``tp_param_layouts``, so each generator rank receives
    only its shards, in place. Every rollout is sampled with the policy's current weights, so the AIPO
    ratio pi/mu is 1 up to float rounding at every step (a stale or misplaced shard moves it away from 1).
    The staging path (a transport that delivers the full state) runs in the program check above."""
    from flowrl.examples.llamarl import build_llamarl
    from flowrl.planners.plan import plan_graph, save_plan
    from tests.runtime.test_torchrun import _rows, _torchrun

    save_plan(plan_graph(build_llamarl(), "cpu:3", strategy="gen:t2@0-1 | policy:d1@2"), tmp_path / "plan.json")
    proc = _torchrun(3, ["-m", "flowrl", "run", "llamarl", "--backend", "torchrun",
                         "--plan", "plan.json", "--steps", "3", "--quiet", "--metrics", "m.jsonl", "--max-staleness", "0"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(tmp_path / "m.jsonl")
    assert [(r["policy_version"], r["rollout_version"]) for r in rows] == [(1, 0), (2, 1), (3, 2)]
    assert all(r["samples"] == 16 * 16 for r in rows)
    tol = ratio_atol(graph_logprob_atol(build_llamarl(), steps=3))  # float32 rounding (tests/tolerances.py)
    assert all(abs(r["aipo/ratio_max"] - 1.0) < tol and abs(r["aipo/ratio_mean"] - 1.0) < tol for r in rows), (rows, tol)


# --- one process: names, layouts, errors ---------------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
def test_layouts_name_every_parameter_of_the_full_model(name):
    config = CONFIGS[name]
    full = Transformer(config)
    layouts = tp_param_layouts(full, (2, 3))
    assert list(layouts) == list(full.state_dict()) == list(param_splits(config))
    # column-parallel projections split dim 0 (whole heads), row-parallel dim 1; everything else whole
    wk = layouts["layers.0.attention.wk.weight"]
    head = config.head_dim
    assert local_slice(wk, (config.n_kv_heads * head, config.dim), 3)[0] == slice(config.n_kv_heads // 2 * head, config.n_kv_heads * head)
    assert local_slice(layouts["layers.1.feed_forward.w2.weight"], (config.dim, config.hidden_dim), 2)[1] == slice(0, -(-config.hidden_dim // 2))
    assert local_shape(layouts["tok_embeddings.weight"], (config.vocab_size, config.dim), 3) == (config.vocab_size, config.dim)


def test_dp_layouts_replicate_tp_shards_across_replicas():
    config = CONFIGS["tied"]
    layouts = tp_param_layouts(config, (4, 5, 6, 7), dp=2)
    shape = (config.dim, config.dim)
    wq = layouts["layers.0.attention.wq.weight"]
    assert local_slice(wq, shape, 4) == local_slice(wq, shape, 6) != local_slice(wq, shape, 5)
    assert local_slice(layouts["norm.weight"], (config.dim,), 7) == (slice(0, config.dim),)


def test_tp1_sharding_changes_nothing():
    config = CONFIGS["gqa-untied-uneven"]
    full = Transformer(config).eval()
    tp = shard_transformer_(Transformer(config).eval(), (0,), 0, None)
    assert isinstance(tp, TensorParallelTransformer)
    ids = torch.randint(0, config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(full(ids), tp(ids))


@pytest.mark.parametrize(
    "config, tp, match",
    [
        (ModelConfig(dim=64, n_heads=4, n_kv_heads=2), 4, r"tp=4 must divide n_kv_heads=2 \(ModelConfig n_heads=4, n_kv_heads=2\)"),
        (ModelConfig(dim=48, n_heads=6, n_kv_heads=6), 4, r"tp=4 must divide n_heads=6 and n_kv_heads=6"),
        (ModelConfig(dim=64, n_heads=4, n_kv_heads=4), 0, r"tp=0 must be an integer >= 1"),
    ],
    ids=["kv-heads", "both-heads", "zero"],
)
def test_tp_sizes_that_do_not_split_whole_heads_are_config_errors(config, tp, match):
    with pytest.raises(ConfigError, match=match):
        check_tp(config, tp)
    if tp > 0:
        with pytest.raises(ConfigError, match=match):
            tp_param_layouts(config, tuple(range(tp)))
        with pytest.raises(ConfigError, match=match):
            shard_transformer_(Transformer(config), tuple(range(tp)), 0, object())


def test_bad_sharding_calls_are_config_errors():
    config = CONFIGS["tied"]
    with pytest.raises(ConfigError, match=r"rank 5 is not in the tp group \[0, 1\]"):
        shard_transformer_(Transformer(config), (0, 1), 5, object())
    with pytest.raises(ConfigError, match=r"needs their process group \(got group=None\)"):
        shard_transformer_(Transformer(config), (0, 1), 0, None)
    model = shard_transformer_(Transformer(config), (0,), 0, None)
    with pytest.raises(ConfigError, match="already tensor-parallel"):
        shard_transformer_(model, (0,), 0, None)
    with pytest.raises(ConfigError, match=r"dp=3 must be an integer >= 1 dividing len\(ranks\)=4"):
        tp_param_layouts(config, (0, 1, 2, 3), dp=3)
    with pytest.raises(ConfigError, match="wants a ModelConfig or a Transformer"):
        tp_param_layouts("llama", (0, 1))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="missing"):
        copy_local_shards_({"x": torch.zeros(1)}, Transformer(config).state_dict(), (0,), 0, config)


def test_tp_rows_put_the_tp_axis_innermost():
    assert tp_rows([4, 5, 6, 7], ("dp", "tp"), (2, 2)) == [(4, 5), (6, 7)]
    assert tp_rows([4, 5, 6, 7], ("tp", "dp"), (2, 2)) == [(4, 6), (5, 7)]  # tp is the outer axis of this mesh
    assert tp_rows([3, 1], ("tp",), (2,)) == [(3, 1)]
    with pytest.raises(ConfigError, match="holding its 3 ranks"):
        tp_rows([0, 1, 2], ("dp", "tp"), (2, 2))
    with pytest.raises(ConfigError, match="mesh of dp and tp axes"):
        tp_rows([0, 1], ("dp",), (2,))


def test_a_generator_mesh_with_pipeline_stages_is_refused():
    from flowrl.runtime.backends.torchrun.rank_programs import ParallelGenerator, RankContext, set_context

    class Mesh:  # the two attributes the program reads before touching a process group
        mesh_dim_names = ("pp", "dp", "tp")
        mesh = torch.arange(4).reshape(2, 1, 2)

    graph = tp_graph()
    set_context(RankContext(rank=0, world=4, ranks={"gen": (0, 1, 2, 3)}, programs={}))
    try:
        with pytest.raises(ConfigError, match=r"generator 'gen': .*mesh of dp and tp axes.*\{'pp': 2\} must be 1: re-plan with pp=1"):
            ParallelGenerator(graph.node("gen"), graph, None, None, group=None, ranks=(0, 1, 2, 3), mesh=Mesh())  # type: ignore[arg-type]
    finally:
        set_context(None)


class _Mesh:
    """The two attributes of a ``DeviceMesh`` the program reads before touching a process group."""

    def __init__(self, names: tuple[str, ...], shape: tuple[int, ...]) -> None:
        self.mesh_dim_names, self.mesh = names, torch.arange(math.prod(shape)).reshape(shape)


@pytest.mark.parametrize(
    "mesh, match",
    [
        (_Mesh(("dp", "tp"), (2, 2)), r"mesh \{'dp': 2, 'tp': 2\} makes 2 replicas \[\[0, 1\], \[2, 3\]\]"),
        (None, r"mesh \{'dp': 4\} makes 4 replicas"),
    ],
    ids=["dp2-tp2", "dp4"],
)
def test_continuous_batching_on_several_generator_replicas_is_refused(mesh, match):
    from flowrl.runtime.backends.torchrun.rank_programs import ParallelGenerator, RankContext, set_context

    graph = tp_graph(batching="continuous")
    set_context(RankContext(rank=0, world=4, ranks={"gen": (0, 1, 2, 3)}, programs={}))
    try:
        with pytest.raises(ConfigError, match=rf"generator 'gen': batching='continuous' runs on one replica .*{match}.*dp=1.*batching='lockstep'"):
            ParallelGenerator(graph.node("gen"), graph, None, None, group=None, ranks=(0, 1, 2, 3), mesh=mesh)  # type: ignore[arg-type]
    finally:
        set_context(None)


if __name__ == "__main__":  # a worker rank
    from flowrl.runtime.backends.torchrun.rank_exit import end_rank_process  # no interpreter teardown (rank_exit)

    _worker_main(sys.argv[1:])
    end_rank_process(0)
