"""Bad Hugging Face model descriptions: each a ConfigError naming the thing and the fix, before any work."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from flowrl.errors import ConfigError
from flowrl.graph.configs import HFModelConfig
from flowrl.graph.nodes import GeneratorNode
from flowrl.models import build_model
from flowrl.models.registry import model_tokens
from flowrl.operators.generation import Generator
from tests.hf_fixtures import make_hf_dir

pytest.importorskip("transformers")


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _no_config(d):
    (d / "config.json").unlink()


def _no_weights(d):
    for f in d.glob("*.safetensors"):
        f.unlink()


def _gpt2(d):
    raw = json.loads((d / "config.json").read_text())
    raw["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(raw))


def _no_tokenizer(d):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (d / name).unlink()


def _tokenizer_config_only(d):
    (d / "tokenizer.json").unlink()  # tokenizer_config.json names a class but no vocabulary is left


CASES = [
    ("no-config", _no_config, {}, r"has no config.json .*save_pretrained"),
    ("no-weights", _no_weights, {}, r'holds no weights .*init="random"'),
    ("unsupported-family", _gpt2, {}, r"model_type 'gpt2'; flowrl trains the families \['llama', 'qwen2', 'qwen3', 'qwen3_moe', 'qwen2_moe'\]"),
]


@pytest.mark.parametrize(("mutate", "kw", "match"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_model_directory(hf_llama_dir, tmp_path, mutate, kw, match):
    d = _copy(hf_llama_dir, tmp_path / "m")
    mutate(d)
    with pytest.raises(ConfigError, match=match):
        build_model(HFModelConfig(path=str(d), **kw))


@pytest.mark.parametrize(
    ("mutate", "present"),
    [(_no_tokenizer, "['config.json', 'generation_config.json', 'model.safetensors']"),
     (_tokenizer_config_only, "['config.json', 'generation_config.json', 'model.safetensors', 'tokenizer_config.json']")],
    ids=["no-tokenizer", "tokenizer-config-only"],
)
def test_a_model_directory_without_tokenizer_files_says_so(hf_llama_dir, tmp_path, mutate, present):
    """Before: transformers built an empty tokenizer from config.json's model type, and the run failed later
    with 'encodes to no tokens' or 'no chat template'."""
    d = _copy(hf_llama_dir, tmp_path / "m")
    mutate(d)
    message = rf"tokenizer: no tokenizer files in '{d}' \(files there: {re.escape(present)}\); .*or name the directory that holds them with tokenizer='DIR'"
    with pytest.raises(ConfigError, match=message):
        model_tokens(HFModelConfig(path=str(d)))
    assert model_tokens(HFModelConfig(path=str(d), tokenizer=str(hf_llama_dir))).pad_id == 0  # the way out the message names


def test_random_init_needs_no_weights(hf_llama_dir, tmp_path):
    d = _copy(hf_llama_dir, tmp_path / "m")
    _no_weights(d)
    assert build_model(HFModelConfig(path=str(d), init="random")).vocab_size == 100


@pytest.mark.parametrize(
    ("path", "match"),
    [("Qwen/Qwen2.5-0.5B-Instruct", r"looks like a Hugging Face hub id.*--local-dir"), ("/no/such/model", r"does not exist")],
    ids=["hub-id", "missing"],
)
def test_hub_ids_and_missing_paths(path, match):
    with pytest.raises(ConfigError, match=match):
        build_model(HFModelConfig(path=path))


def test_tokenizer_larger_than_the_embeddings(tmp_path, hf_llama_dir):
    transformers = pytest.importorskip("transformers")
    from tests.hf_fixtures import hf_config

    d = make_hf_dir(tmp_path / "m", "llama")
    transformers.AutoModelForCausalLM.from_config(hf_config("llama", vocab=20)).save_pretrained(str(d))
    with pytest.raises(ConfigError, match=r"the tokenizer has \d+ tokens but the model's embedding has 20 rows"):
        Generator(GeneratorNode(name="gen", model=HFModelConfig(path=str(d))))


def test_missing_transformers_gives_the_install_hint(hf_llama_dir, monkeypatch):
    import flowrl.models.local as local

    def no_transformers(name):
        raise ImportError(name)

    monkeypatch.setattr(local.importlib, "import_module", no_transformers)
    with pytest.raises(ConfigError, match=r"needs the 'transformers' package: pip install 'flowrl\[hf\]'"):
        build_model(HFModelConfig(path=str(hf_llama_dir)))


@pytest.mark.parametrize(
    ("key", "value", "model_type"),
    [("mlp_only_layers", [1], "qwen3_moe"), ("decoder_sparse_step", 2, "qwen3_moe"), ("mlp_only_layers", [0], "qwen2_moe"), ("model_type", "mixtral", "")],
)
def test_a_moe_config_flowrl_cannot_read_is_refused_by_name_before_any_work(request, tmp_path, key, value, model_type):
    """Dense blocks among a Qwen MoE's sparse ones (transformers builds them; the planner counts neither
    and no test runs them), and an MoE family flowrl has no row for: refused naming the key and the family."""
    d = _copy(request.getfixturevalue(f"hf_{model_type or 'qwen3_moe'}_dir"), tmp_path / "m")
    raw = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**raw, key: value}))
    if key == "model_type":
        match = r"model_type 'mixtral'; flowrl trains the families \[.*'qwen3_moe', 'qwen2_moe'\]"
    else:
        default = [] if key == "mlp_only_layers" else 1
        match = re.escape(f"has {key}={value!r}; flowrl reads a {model_type} ({'Qwen3MoeForCausalLM' if model_type == 'qwen3_moe' else 'Qwen2MoeForCausalLM'}) directory only with {key}={default!r}")
    with pytest.raises(ConfigError, match=match):
        build_model(HFModelConfig(path=str(d)))
