"""The weight-sync group's pure parts: bucket plans and the digests vLLM's weights must have.

With vLLM (one engine shared with the engine's other tests): ``tests/operators/test_vllm_engine.py``
(a sync in many buckets bit for bit through vLLM's kernels, a failed sync, the file route) and
``tests/runtime/test_vllm_torchrun.py`` (a tied model, from FSDP2 shards under torchrun).
"""

from __future__ import annotations

import torch

from flowrl.operators.engines.vllm_sync import bucket_plan, expected_digests


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


def test_a_tensor_parallel_workers_part_of_each_tensor_is_cut_as_vllm_cuts_it():
    from flowrl.operators.engines.vllm_sync import TPShard, tp_part

    t = torch.arange(24.0).reshape(6, 4)
    one, two = TPShard(rank=0, size=2, heads=2, kv_heads=1), TPShard(rank=1, size=2, heads=2, kv_heads=1)
    assert torch.equal(tp_part("l.q_proj.weight", t, two), t[3:])  # query heads split by rows
    assert torch.equal(tp_part("l.k_proj.weight", t, one), t) and torch.equal(tp_part("l.k_proj.weight", t, two), t)  # 1 kv head on 2 workers: both hold it
    kv2 = TPShard(rank=1, size=2, heads=4, kv_heads=2)
    assert torch.equal(tp_part("l.v_proj.bias", torch.arange(4.0), kv2), torch.arange(2.0, 4.0))
    assert torch.equal(tp_part("l.down_proj.weight", t, two), t[:, 2:])  # row-parallel: input columns
    assert torch.equal(tp_part("l.o_proj.bias", t[0], two), t[0])  # its bias whole on every worker
    assert torch.equal(tp_part("model.norm.weight", t[0], two), t[0])
    vocab = torch.arange(100.0).reshape(100, 1)  # padded to 128: 64 rows a worker, the second holds rows 64-99
    assert torch.equal(tp_part("model.embed_tokens.weight", vocab, two), vocab[64:])
    small = torch.arange(20.0).reshape(20, 1)  # padded to 64: the first worker holds every row, the second none
    assert tp_part("lm_head.weight", small, one).shape[0] == 20 and tp_part("lm_head.weight", small, two).shape[0] == 0
    assert torch.equal(tp_part("l.gate_proj.weight", t, TPShard()), t)  # no tensor parallelism: the whole tensor
