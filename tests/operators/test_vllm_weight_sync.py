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


def test_a_bucket_received_into_one_buffer_gives_back_each_tensor_bit_for_bit():
    from flowrl.operators.engines.vllm_worker import _ALIGN, bucket_nbytes, bucket_views

    torch.manual_seed(0)
    sent = {  # odd sizes and mixed dtypes: each view must start aligned and overlap no other
        "model.embed_tokens.weight": torch.randn(7, 5),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(3).to(torch.bfloat16),
        "model.layers.0.mlp.gate_proj.weight": torch.randn(4, 3).to(torch.float16),
        "model.norm.weight": torch.randn(1),
        "step": torch.tensor([3], dtype=torch.int64),
    }
    bucket = [(n, list(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in sent.items()]
    buffer = torch.full((bucket_nbytes(bucket),), 0xAB, dtype=torch.uint8)
    views = bucket_views(buffer, bucket)
    assert [n for n, _ in views] == list(sent)
    for (name, view), t in zip(views, sent.values()):
        assert view.dtype == t.dtype and view.shape == t.shape and view.is_contiguous() and view.data_ptr() % _ALIGN == 0
        view.copy_(t)  # what the group's broadcast does: writes the sender's bytes into the view
    spans = sorted((v.data_ptr(), v.data_ptr() + v.numel() * v.element_size()) for _, v in views)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:])) and spans[-1][1] <= buffer.data_ptr() + buffer.numel()
    for (name, view), t in zip(bucket_views(buffer, bucket), sent.values()):  # read back through fresh views, as vLLM does
        assert torch.equal(view.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name


def test_a_kept_buffer_is_received_into_again_only_when_no_view_of_it_is_alive():
    from flowrl.operators.engines.vllm_worker import _AHEAD, _BufferPool

    pool = _BufferPool("cpu")
    first = pool.take(1000)
    view = first[:10]  # a layer vLLM has not completed yet holds a tensor of the bucket
    second = pool.take(1000)
    assert second.data_ptr() != first.data_ptr()  # in use: not handed out again
    del view
    assert pool.take(800).data_ptr() == first.data_ptr()  # free again, and large enough
    assert pool.take(5000).numel() == 5000 and pool.allocated == 3  # no kept buffer holds 5000 bytes: a new one
    held = [pool.take(1000)[:1] for _ in range(_AHEAD + 2)]  # each taken buffer stays in use
    assert len({v.data_ptr() for v in held}) == _AHEAD + 2  # none handed out twice
    assert pool.allocated == 3 + (_AHEAD + 2) - 3 and len(pool._kept) == _AHEAD + 1  # the kept ones first, then new ones, not kept
    del held
    assert {pool.take(1000).data_ptr() for _ in range(3)} <= {b.data_ptr() for b, _ in pool._kept}  # reused once free
