"""``export_hf`` / ``flowrl export``: a checkpoint's policy -> a Hugging Face directory -> the same logits."""

from __future__ import annotations

import json

import pytest
import torch

from flowrl.cli.main import main
from flowrl.errors import ConfigError
from flowrl.graph.configs import ModelConfig
from flowrl.graph.nodes import LossNode, PolicyNode
from flowrl.models.hf_export import export_hf
from flowrl.operators.trainer import Trainer
from tests.models.helpers import hf_policy_node
from tests.tolerances import logit_atol

transformers = pytest.importorskip("transformers")


def _trained(trainer: Trainer) -> Trainer:
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(torch.randn_like(p) * 0.02)  # a policy that is not the initial one
    trainer.version = 5
    return trainer


def _checkpoint(tmp_path, trainer: Trainer):
    """A checkpoint directory as CheckpointWriter lays it out (LATEST -> step dir with meta.json + policy file)."""
    step = tmp_path / "ckpt" / "step-00000005"
    step.mkdir(parents=True)
    torch.save(trainer.state(), step / f"policy-{trainer.name}.pt")
    meta = {"version": 5, "data_position": 0, "graph": "g", "graph_sha256": "x", "files": {trainer.name: f"policy-{trainer.name}.pt"}}
    (step / "meta.json").write_text(json.dumps(meta))
    (tmp_path / "ckpt" / "LATEST").write_text("step-00000005")
    return tmp_path / "ckpt"


BUILTIN = [
    ModelConfig(vocab_size=16, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32),
    ModelConfig(vocab_size=16, dim=48, n_layers=1, n_heads=4, n_kv_heads=1, max_seq_len=32, tie_embeddings=False, rope_theta=500.0, norm_eps=1e-6),
]


@pytest.mark.parametrize("config", BUILTIN, ids=["tied-gqa", "untied-mqa-theta500"])
def test_builtin_policy_exports_as_llama_with_the_same_logits(tmp_path, config):
    trainer = _trained(Trainer(PolicyNode(name="policy", model=config), LossNode(name="aipo")))
    assert main(["export", str(_checkpoint(tmp_path, trainer)), "-o", str(tmp_path / "out")]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert type(model).__name__ == "LlamaForCausalLM"
    ids = torch.tensor([[1, 4, 5, 13, 6, 14, 3, 9, 2], [1, 7, 7, 13, 8, 14, 12, 2, 0]])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, trainer.model(ids), rtol=0, atol=logit_atol(trainer.model, ids))
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert tok.encode("<s>12+3=") == [1, 4, 5, 13, 6, 14] and tok.decode([4, 5, 2]) == "12</s>"


def test_hf_policy_exports_with_its_architecture_and_tokenizer(tmp_path, hf_dir):
    trainer = _trained(Trainer(hf_policy_node(hf_dir), LossNode(name="aipo")))
    out = export_hf(trainer.state(), tmp_path / "out")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    ids = torch.tensor([[1, 5, 6, 7, 8, 2]])
    with torch.no_grad():
        want = trainer.model(ids, valid=torch.ones_like(ids, dtype=torch.bool))
        torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=0, atol=logit_atol(model, ids))
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok.eos_token_id == 2 and len(tok) == len(transformers.AutoTokenizer.from_pretrained(str(hf_dir)))


def test_export_refuses_a_non_empty_directory(tmp_path):
    trainer = Trainer(PolicyNode(name="policy", model=BUILTIN[0]), LossNode(name="aipo"))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"exists and is not an empty directory.*--overwrite"):
        export_hf(trainer.state(), tmp_path / "out")
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"
    export_hf(trainer.state(), tmp_path / "out", overwrite=True)
    assert (tmp_path / "out" / "config.json").is_file()


def test_cli_export_of_a_missing_checkpoint_is_a_clear_error(tmp_path, capsys):
    assert main(["export", str(tmp_path / "nope"), "-o", str(tmp_path / "out")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
