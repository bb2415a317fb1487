"""The examples' shipped files are what their modules build in code (config, tokenizer, prompts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flowrl.examples import assets_cli, hf_agent, hf_copy, qwen_math


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


def _run_module(module: str, *args: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_hf_copy_help_prints_usage_and_writes_nothing(tmp_path):
    proc = _run_module("flowrl.examples.hf_copy", "--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m flowrl.examples.hf_copy [-h] [--force] DIR [HEADS]")
    assert list(tmp_path.iterdir()) == []  # no directory named --help


def test_hf_copy_refuses_a_non_empty_directory_unless_forced(tmp_path, capsys):
    """The refusal through ``python -m`` (its exit status and message); --force and a new directory
    through the same ``main`` in this process (one interpreter start fewer each)."""
    pytest.importorskip("transformers")
    target = tmp_path / "mine"
    target.mkdir()
    (target / "config.json").write_text("{}")
    proc = _run_module("flowrl.examples.hf_copy", str(target), "2", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert f"DIR {target} exists and is not empty (holds config.json); pass --force" in proc.stderr
    assert (target / "config.json").read_text() == "{}"  # untouched
    cli = dict(prog="python -m flowrl.examples.hf_copy", what="the example's config, tokenizer and prompts", heads=4)
    assert assets_cli.main([str(target), "2", "--force"], hf_copy.write_assets, **cli) == 0
    assert json.loads((target / "config.json").read_text())["num_attention_heads"] == 2
    capsys.readouterr()
    assert assets_cli.main([str(tmp_path / "new")], hf_copy.write_assets, **cli) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "new")


def test_asset_writers_refuse_a_file_and_print_usage_on_a_wrong_argument(tmp_path):
    (tmp_path / "f").write_text("x")
    assert assets_cli.refuse_non_empty(tmp_path / "f") == f"DIR {tmp_path / 'f'} is a file; name a directory"
    assert assets_cli.refuse_non_empty(tmp_path / "absent") is None
    assert assets_cli.main([str(tmp_path / "out"), "two"], lambda out, heads: out, prog="p", what="w", heads=4) == 2
    assert not (tmp_path / "out").exists()
