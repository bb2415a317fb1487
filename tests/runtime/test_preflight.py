"""run_graph refuses a graph that cannot fit in memory before allocating anything."""

from __future__ import annotations

import msgspec
import pytest

from flowrl.errors import ConfigError
from flowrl.examples.llamarl import build_llamarl
from flowrl.graph.ir import Graph
from flowrl.runtime.config import RunConfig
from flowrl.runtime.preflight import check_fits_in_memory
from flowrl.runtime.run import run_graph
from flowrl.runtime.synthetic import synthetic_programs


def _huge_vocab() -> Graph:
    g = build_llamarl()
    nodes = tuple(
        msgspec.structs.replace(n, model=msgspec.structs.replace(n.model, vocab_size=2**36)) if hasattr(n, "model") else n
        for n in g.nodes
    )
    return Graph(msgspec.structs.replace(g.spec, nodes=nodes))


def test_run_graph_refuses_a_graph_too_big_for_this_machine():
    with pytest.raises(ConfigError, match=r"node 'gen' \(generator\) needs at least .* GiB"):
        run_graph(_huge_vocab(), RunConfig(steps=1))


def test_the_default_example_fits_and_synthetic_programs_are_skipped():
    check_fits_in_memory(build_llamarl(), memory_bytes=2**30)
    g = _huge_vocab()
    check_fits_in_memory(g, memory_bytes=2**30, skip=frozenset(synthetic_programs(g)))
    with pytest.raises(ConfigError, match=r"node .* needs at least .* more than the 0.000977 GiB"):
        check_fits_in_memory(build_llamarl(), memory_bytes=2**20)


def test_an_hf_model_too_big_for_this_machine_is_refused_before_it_is_built(tmp_path):
    """A Hugging Face directory whose config describes a 405B-shaped model: refused from its config.json
    (no weights read, nothing allocated); the HF example itself fits."""
    import json

    from flowrl.examples.hf_copy import ASSETS, build_hf_copy

    big = tmp_path / "big"
    big.mkdir()
    config = json.loads((ASSETS / "config.json").read_text())
    config.update(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128, num_key_value_heads=8, vocab_size=128256)
    config.pop("head_dim", None)  # the small model's head width would stay (transformers reads it): 16384 / 128 it is
    (big / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (big / name).write_bytes((ASSETS / name).read_bytes())
    check_fits_in_memory(build_hf_copy(), memory_bytes=2**30)
    with pytest.raises(ConfigError, match=r"node 'gen' \(generator\) needs at least .* GiB \(vocab_size=128256, dim=16384, n_layers=126, max_seq_len=64, 4.04e\+11 parameters"):
        run_graph(build_hf_copy(model_dir=big), RunConfig(steps=1))
