"""The examples' shipped files are what their modules build in code (config, tokenizer, prompts)."""

from __future__ import annotations

import json

import pytest

from flowrl.examples import hf_agent, hf_copy, qwen_math


def _config(path):
    config = json.loads(path.read_text())
    config.pop("transformers_version", None)  # written by whichever transformers saved it
    return config


def test_hf_copy_assets_are_built_by_its_module(tmp_path):
    pytest.importorskip("transformers")
    hf_copy.write_assets(tmp_path)
    shipped = hf_copy.ASSETS
    assert _config(tmp_path / "config.json") == _config(shipped / "config.json")
    assert (tmp_path / "prompts.jsonl").read_text() == (shipped / "prompts.jsonl").read_text()
    built, ours = json.loads((tmp_path / "tokenizer.json").read_text()), json.loads((shipped / "tokenizer.json").read_text())
    assert built["model"] == ours["model"] and built["added_tokens"] == ours["added_tokens"]
    assert list(ours["model"]["vocab"]) == list(hf_copy.WORDS)


def test_hf_agent_assets_are_built_by_its_module(tmp_path):
    pytest.importorskip("transformers")
    hf_agent.write_assets(tmp_path)
    shipped = hf_agent.ASSETS
    assert _config(tmp_path / "config.json") == _config(shipped / "config.json")
    assert _config(shipped / "config.json")["num_attention_heads"] == 2  # heads of 32: vLLM's CPU kernels take them
    assert (tmp_path / "prompts.jsonl").read_text() == (shipped / "prompts.jsonl").read_text()
    built, ours = json.loads((tmp_path / "tokenizer.json").read_text()), json.loads((shipped / "tokenizer.json").read_text())
    assert built["model"] == ours["model"] and built["decoder"] == ours["decoder"]
    assert list(ours["model"]["vocab"]) == list(hf_agent.WORDS)


def test_qwen_math_assets_are_built_by_its_module(tmp_path):
    qwen_math.write_assets(tmp_path)
    shipped = qwen_math.ASSETS
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads((shipped / "config.json").read_text()) == qwen_math.QWEN_CONFIG
    assert (tmp_path / "math.jsonl").read_text() == (shipped / "math.jsonl").read_text()
