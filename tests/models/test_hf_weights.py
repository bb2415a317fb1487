"""HF weights keyed by Hugging Face names travel through every transport into the HF model bit for bit."""

from __future__ import annotations

import uuid

import pytest
import torch

from flowrl.graph.nodes import LossNode
from flowrl.models import weight_dict
from flowrl.operators.generation import Generator
from flowrl.operators.trainer import Trainer
from flowrl.runtime.transports.file import FileTransport
from flowrl.runtime.transports.inprocess import InProcessTransport
from flowrl.runtime.transports.shm import SharedMemoryTransport
from tests.models.helpers import hf_generator_node, hf_policy_node, hf_reference_model, left_padded, reference_logprobs
from tests.runtime.transports.conformance import same_bytes
from tests.tolerances import rollout_logprob_atol

pytest.importorskip("transformers")


def _inprocess(tmp_path):
    t = InProcessTransport()
    return t, t


def _shm(tmp_path):
    name = f"flowrl-test-{uuid.uuid4().hex[:12]}"
    return SharedMemoryTransport(name, create=True), SharedMemoryTransport(name, create=False)


def _file(tmp_path):
    return FileTransport(str(tmp_path / "w")), FileTransport(str(tmp_path / "w"))


@pytest.mark.parametrize("open_pair", [_inprocess, _shm, _file], ids=["inprocess", "shm", "file"])
def test_trained_hf_weights_reach_the_generator_bit_for_bit(hf_dir, tmp_path, open_pair):
    trainer = Trainer(hf_policy_node(hf_dir), LossNode(name="aipo"))
    with torch.no_grad():
        for p in trainer.model.parameters():  # weights no generator holds yet
            p.add_(torch.randn_like(p) * 0.01)
    gen = Generator(hf_generator_node(hf_dir), seed=0)
    writer, reader = open_pair(tmp_path)
    try:
        writer.publish(trainer.weights(), 3)
        assert reader.fetch_into(gen.weight_targets()) == 3
    finally:
        for t in {id(writer): writer, id(reader): reader}.values():
            getattr(t, "close", lambda: None)()
    for name, t in trainer.weights().items():
        assert same_bytes(gen.weight_targets()[name], t), name
    for name, t in gen.model.state_dict().items():  # tied views included
        assert same_bytes(t, trainer.model.state_dict()[name]), name
    # and the generator now samples from the trained model: its log-probs are the HF model's with those weights
    ref = hf_reference_model(hf_dir)
    ref.load_state_dict(trainer.model.state_dict())
    gen.version = 3
    out = gen.generate(left_padded([[1, 5, 6], [1, 7]]))
    with torch.no_grad():
        torch.testing.assert_close(out["behaviour_logprobs"], reference_logprobs(ref, out), rtol=0, atol=rollout_logprob_atol(ref, out))


def test_tied_embeddings_travel_once(hf_llama_dir, hf_qwen2_dir):
    tied = Trainer(hf_policy_node(hf_llama_dir), LossNode(name="aipo")).weights()
    untied = Trainer(hf_policy_node(hf_qwen2_dir), LossNode(name="aipo")).weights()
    assert "model.embed_tokens.weight" in tied and "lm_head.weight" not in tied
    assert "lm_head.weight" in untied
    assert all(not n.startswith("hf.") for n in tied)  # Hugging Face names, no adapter prefix
    model = Trainer(hf_policy_node(hf_llama_dir), LossNode(name="aipo")).model
    assert sum(t.numel() for t in weight_dict(model).values()) == sum(p.numel() for p in model.parameters())


def test_weight_shapes_from_the_meta_device_match_the_trainers_weights(hf_dir):
    from flowrl.models.registry import weight_shapes

    weights = Trainer(hf_policy_node(hf_dir), LossNode(name="aipo")).weights()
    shapes = weight_shapes(hf_policy_node(hf_dir).model)
    assert shapes == {n: (tuple(t.shape), t.dtype) for n, t in weights.items()}
