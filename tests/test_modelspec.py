"""Model shapes without weights: hand-counted parameters, FLOPs and KV bytes; presets, HF configs, ModelConfig."""

from __future__ import annotations

import json

import pytest

from flowrl.errors import PlanError
from flowrl.graph.configs import ModelConfig
from flowrl.modelspec import DEFAULT_CONTEXT, MODEL_PRESETS, ModelSpec, model_from_config, model_from_hf_config, model_preset, resolve_model

TINY = ModelSpec(name="tiny", n_layers=2, dim=8, n_heads=2, n_kv_heads=1, ffn_dim=16, vocab_size=10)


def test_tiny_counts_by_hand():
    # per layer: q 8*8 + k,v 2*8*4 + o 8*8 + mlp 3*8*16 + norms 2*8 = 64+64+64+384+16 = 592
    assert TINY.layer_params == 592
    # embedding 10*8, untied head 10*8, final norm 8
    assert TINY.params == 2 * 592 + 160 + 8
    # matmuls a token passes: 2 * (592 - 16) + head 80 = 1232
    assert TINY.matmul_params == 1232
    # forward FLOPs at ctx 5: 2 * 1232 + 4 * 2 * 8 * 5
    assert TINY.forward_flops_per_token(5) == 2464 + 320
    # KV: 2 (k and v) * 2 layers * 1 kv head * head_dim 4 * 2 bytes
    assert TINY.kv_bytes_per_token(2) == 32


@pytest.mark.parametrize(
    "name, billions",
    [("llama3-8b", 8.03), ("llama3-70b", 70.55), ("llama3-405b", 405.85)],
    ids=["8b", "70b", "405b"],
)
def test_presets_match_published_sizes(name, billions):
    assert model_preset(name).params / 1e9 == pytest.approx(billions, abs=0.01)


#: "Number of Parameters" of each model card on the Hugging Face hub. The cards round to 2-3 digits
#: ("1.7B" for 1.72e9: 1.2% off) and Qwen2.5-32B's says 32.5B where its shape counts 32.76e9 (0.8%);
#: the presets also leave out q/k/v biases and q/k norms (< 0.1%): hence 1.5%.
QWEN_CARDS = {
    "qwen2.5-0.5b": 0.49, "qwen2.5-1.5b": 1.54, "qwen2.5-3b": 3.09, "qwen2.5-7b": 7.61, "qwen2.5-14b": 14.7,
    "qwen2.5-32b": 32.5, "qwen2.5-72b": 72.7,
    "qwen3-0.6b": 0.6, "qwen3-1.7b": 1.7, "qwen3-4b": 4.0, "qwen3-8b": 8.2, "qwen3-14b": 14.8, "qwen3-32b": 32.8,
}


@pytest.mark.parametrize(("name", "billions"), list(QWEN_CARDS.items()), ids=list(QWEN_CARDS))
def test_qwen_presets_match_the_model_cards(name, billions):
    assert model_preset(name).params / 1e9 == pytest.approx(billions, rel=0.015)
    assert resolve_model(name.upper()) == MODEL_PRESETS[name]  # 'Qwen3-8B' as the hub spells it works too


def test_qwen3_heads_are_wider_than_dim_over_heads():
    """Qwen3-0.6B: 16 heads of 128 (q is 2048 wide, dim 1024), 8 KV heads: KV bytes and q/o by head_dim, not dim / heads."""
    s = MODEL_PRESETS["qwen3-0.6b"]
    assert (s.head_dim, s.q_dim, s.tie_embeddings) == (128, 2048, True)
    assert s.kv_bytes_per_token(2) == 2 * 28 * 8 * 128 * 2
    assert s.layer_params == 2 * 1024 * 2048 + 2 * 1024 * 8 * 128 + 3 * 1024 * 3072 + 2 * 1024


def test_a_qwen3_config_json_counts_what_transformers_builds():
    """head_dim read from config.json: the count equals the parameters of transformers' own Qwen3 (less its q/k norms)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
    )  # head_dim 16, not 32 / 4
    model = transformers.Qwen3ForCausalLM(config)
    norms = sum(p.numel() for n, p in model.named_parameters() if n.endswith(("q_norm.weight", "k_norm.weight")))
    built = sum(p.numel() for p in model.parameters()) - norms
    assert model_from_hf_config(config.to_dict(), name="q").params == built


def test_preset_shapes_are_the_issue_s():
    s = MODEL_PRESETS["llama3-405b"]
    assert (s.n_layers, s.dim, s.n_heads, s.n_kv_heads, s.ffn_dim, s.vocab_size) == (126, 16384, 128, 8, 53248, 128256)


def test_model_config_dims_and_preset():
    cfg = ModelConfig(vocab_size=16, dim=64, n_layers=2, n_heads=4, n_kv_heads=4)
    spec = model_from_config(cfg)
    assert (spec.n_layers, spec.dim, spec.ffn_dim, spec.vocab_size, spec.tie_embeddings) == (2, 64, cfg.hidden_dim, 16, True)
    assert spec.params == 2 * spec.layer_params + 16 * 64 + 64  # tied: one embedding matrix
    assert model_from_config(ModelConfig(preset="llama3-70b")) == MODEL_PRESETS["llama3-70b"]


def test_hf_config_json(tmp_path):
    folder = tmp_path / "tiny-llama"
    folder.mkdir()
    path = folder / "config.json"
    path.write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2,
        "num_key_value_heads": 1, "intermediate_size": 16, "vocab_size": 10, "tie_word_embeddings": False,
    }))
    spec = model_from_hf_config(path)
    assert spec.params == TINY.params and spec.name == "tiny-llama"
    assert resolve_model(str(path)).params == TINY.params


_HF = {"num_hidden_layers": 1, "hidden_size": 8, "num_attention_heads": 2, "intermediate_size": 4, "vocab_size": 3}


@pytest.mark.parametrize(
    "make, context",
    [
        (lambda: MODEL_PRESETS["llama3-8b"], 8192),
        (lambda: MODEL_PRESETS["llama3-70b"], 8192),
        (lambda: MODEL_PRESETS["llama3-405b"], 131072),
        (lambda: model_from_hf_config({**_HF, "max_position_embeddings": 32768}), 32768),
        (lambda: model_from_hf_config({**_HF, "n_positions": 1024}), 1024),
        (lambda: model_from_hf_config(_HF), DEFAULT_CONTEXT),
        (lambda: model_from_config(ModelConfig(vocab_size=16, dim=64, n_layers=2, n_heads=4, n_kv_heads=4, max_seq_len=96)), 96),
        (lambda: model_from_config(ModelConfig(preset="llama3-8b")), 8192),
    ],
    ids=["8b", "70b", "405b", "hf", "hf-gpt2", "hf-unknown", "model-config", "model-config-preset"],
)
def test_context_comes_from_the_spec(make, context):
    assert make().max_seq_len == context


def test_hf_config_without_kv_heads_uses_attention_heads():
    spec = model_from_hf_config({"num_hidden_layers": 1, "hidden_size": 8, "num_attention_heads": 2, "intermediate_size": 4, "vocab_size": 3})
    assert spec.n_kv_heads == 2


@pytest.mark.parametrize(
    "config, match",
    [
        ({"hidden_size": 8}, r"missing or non-integer 'num_hidden_layers'"),
        ({"num_hidden_layers": 1, "hidden_size": 8, "num_attention_heads": 3, "intermediate_size": 4, "vocab_size": 3}, r"n_heads=3 must divide dim=8"),
        ({"num_hidden_layers": "2", "hidden_size": 8}, r"non-integer 'num_hidden_layers' \(got '2'\)"),
    ],
    ids=["missing", "heads", "string"],
)
def test_bad_hf_configs(config, match):
    with pytest.raises(PlanError, match=match):
        model_from_hf_config(config)


def test_unknown_preset_lists_presets(tmp_path):
    with pytest.raises(PlanError, match=r"unknown model preset 'llama2'; presets: llama3-8b, llama3-70b, llama3-405b"):
        resolve_model("llama2")
    bad = tmp_path / "config.json"
    bad.write_text("[1, 2]")
    with pytest.raises(PlanError, match="holds a list, not a JSON object"):
        resolve_model(str(bad))
