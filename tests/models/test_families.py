"""Every family of ``FAMILIES`` through build, weight shapes, a tp=2 split and an export, and a new
family as one module plus one entry.

A family added to the table is walked here with no change to this file: the built-in one from a
tiny ``ModelConfig``, a Hugging Face one from a tiny directory of its ``model_type``
(``tests/hf_fixtures.py``, random weights).
"""

from __future__ import annotations

import importlib
import re
import pkgutil
from pathlib import Path

import msgspec
import pytest
import torch

import flowrl.models.families as families_pkg
from flowrl.graph.configs import AnyModelConfig, HFModelConfig, ModelConfig
from flowrl.models.causal_lm import CausalLM, weight_dict
from flowrl.models.hf_export import export_hf
from flowrl.models.families import FAMILIES, hf_family_names
from flowrl.models.family import ModelFamily
from flowrl.models.registry import build_model, family_of, meta_model, model_tokens, weight_shapes
from flowrl.placement.resharding import local_slice
from flowrl.runtime.parallel.tensor_parallel import param_splits, shard_model_, tp_param_layouts
from tests.hf_fixtures import make_hf_dir
from tests.tolerances import logit_atol

transformers = pytest.importorskip("transformers")


def tiny_config(family: ModelFamily, tmp_path: Path) -> AnyModelConfig:
    """A tiny model description of ``family`` (random weights; GQA, an uneven SwiGLU split)."""
    if family.description == "builtin":
        return ModelConfig(vocab_size=16, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=44, max_seq_len=32, tie_embeddings=False)
    return HFModelConfig(path=str(make_hf_dir(tmp_path / family.name, family.name, weights=False)), init="random", seed=3)


def walk(family: ModelFamily, tmp_path: Path) -> None:
    """Build, weight shapes, a tp=2 split and reassembly, tp=1 sharding, export and reload with equal logits."""
    config = tiny_config(family, tmp_path)
    assert family_of(config) is family

    # build: a CausalLM whose weights weight_shapes (the meta model) names exactly
    model = build_model(config)
    assert isinstance(model, CausalLM)
    weights = weight_dict(model)
    assert weight_shapes(config) == {n: (tuple(t.shape), t.dtype) for n, t in weights.items()}
    assert list(weight_dict(meta_model(config))) == list(weights)
    assert model_tokens(config).eos_ids

    # tp split: every weight has a layout; two shards reassemble into the weight; every table row is used
    splits = param_splits(config)
    assert list(splits) == list(weights)
    assert {"column", "row"} <= set(splits.values()), f"{family.name}: its split table splits nothing"
    for pattern, _ in family.split_table:
        assert any(re.fullmatch(pattern, n) for n in weights), f"{family.name}: split row {pattern!r} matches no weight"
    layouts = tp_param_layouts(config, (0, 1))
    for name, full in weights.items():
        again = torch.full_like(full, float("nan"))
        for rank in (0, 1):
            again[local_slice(layouts[name], full.shape, rank)] = full[local_slice(layouts[name], full.shape, rank)]
        assert torch.equal(again, full), f"{family.name}: the two {splits[name]} shards of {name} do not make the weight"

    ids = torch.tensor([[1, 4, 5, 13, 6, 14, 3, 9, 2], [1, 7, 7, 13, 8, 14, 12, 2, 0]])
    with torch.no_grad():
        logits = model(ids)
        # tp=1 sharding swaps every split layer for its parallel one (each must be an nn.Linear): same logits
        sharded = shard_model_(build_model(config), (0,), 0, None)
        atol = logit_atol(model, ids)  # float32 rounding of two evaluations (tests/tolerances.py)
        torch.testing.assert_close(sharded(ids), logits, rtol=0, atol=atol)

    # export: transformers loads the directory back as the family's class, with the same logits
    state = {"model_config": msgspec.to_builtins(config), "model": weights}
    out = export_hf(state, tmp_path / f"{family.name}-export")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True, dtype=torch.float32)
    assert type(hf).__name__ == family.hf_architecture
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, logits, rtol=0, atol=atol)
    assert transformers.AutoTokenizer.from_pretrained(str(out)).pad_token_id == model_tokens(config).pad_id


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_family_builds_shards_and_exports(name, tmp_path):
    walk(FAMILIES[name], tmp_path)


def test_every_family_module_has_its_entry():
    """A family module under ``flowrl/models/families/`` whose ``FAMILY`` is not in the table would be dead code."""
    declared = {}
    for info in pkgutil.iter_modules(families_pkg.__path__):
        module = importlib.import_module(f"{families_pkg.__name__}.{info.name}")
        if isinstance(getattr(module, "FAMILY", None), ModelFamily):
            declared[module.FAMILY.name] = module.FAMILY
    assert declared == FAMILIES


def test_a_family_is_one_module_and_one_entry(monkeypatch, tmp_path):
    """``tests/models/family_module.py`` (Mistral on the Llama-style adapter) plus one entry in
    ``FAMILIES``: its directories are accepted, built, split, exported and reloaded."""
    from tests.models.family_module import FAMILY

    config = HFModelConfig(path=str(make_hf_dir(tmp_path / "m", "mistral", weights=False)), init="random")
    with pytest.raises(Exception, match=re.escape(f"model_type 'mistral'; flowrl trains the families {hf_family_names()}")):
        build_model(config)
    monkeypatch.setitem(FAMILIES, FAMILY.name, FAMILY)
    walk(FAMILY, tmp_path)
