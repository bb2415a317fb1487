"""Mixture-of-experts shapes in the planner: every expert held, the routed ones computed, the touched ones read.

Hand counts from ``flowrl.modelspec``'s docstring on a tiny shape, DeepSeek-V3's published totals,
and the estimates' use of them: FLOPs follow the active parameters, memory and weight sync the
total, a decode step reads ``1 - (1 - k/E)^b`` of the routed experts.
"""

from __future__ import annotations

import msgspec
import pytest

from flowrl.errors import PlanError
from flowrl.modelspec import ModelSpec, model_preset
from flowrl.planners.estimate.generate import estimate_generate
from flowrl.planners.estimate.sync import estimate_sync
from flowrl.planners.estimate.train import estimate_train
from flowrl.planners.parallel import ParallelDims
from flowrl.planners.workload import Workload

from tests.planners.test_estimates import WORK, ctx, device

# 2 blocks, the first dense (MLP 16 wide), the second 4 routed experts of width 4 (top-1) and 1 shared
MOE = ModelSpec(
    name="moe", n_layers=2, dim=8, n_heads=2, n_kv_heads=1, ffn_dim=16, vocab_size=10,
    n_experts=4, experts_per_token=1, expert_ffn_dim=4, shared_experts=1, dense_layers=1,
)  # fmt: skip


def test_tiny_moe_counts_by_hand():
    attn = 8 * 8 + 2 * 8 * 4 + 8 * 8  # q, k, v, o: 192
    dense_mlp = 3 * 8 * 16  # 384
    moe_mlp = 3 * 8 * 4 * (4 + 1) + 8 * 4  # 5 experts of 96, router 32: 512
    active_moe = 3 * 8 * 4 * (1 + 1) + 8 * 4  # the routed one, the shared one, router: 224
    assert MOE.params == 2 * (attn + 16) + dense_mlp + moe_mlp + 2 * 10 * 8 + 8
    assert MOE.matmul_params == 2 * attn + dense_mlp + active_moe + 10 * 8
    assert MOE.routed_expert_params == 4 * 96
    assert MOE.active_ffn_dim == pytest.approx((dense_mlp + active_moe) / (3 * 8 * 2))


def test_deepseek_v3_matches_its_card():
    """671B parameters, 37B active per token (the card's figures, rounded): the embedding counted active."""
    spec = model_preset("deepseek-v3")
    assert spec.params / 1e9 == pytest.approx(671, rel=0.001)
    active = spec.matmul_params + spec.vocab_size * spec.dim  # the head is in matmul_params; the input embedding too
    assert active / 1e9 == pytest.approx(37, rel=0.02)
    assert spec.kv_bytes_per_token(2) == 61 * 576 * 2  # MLA: one 576-wide latent a layer
    assert spec.kv_elems_per_layer(8) == 576  # replicated on every tensor-parallel rank


def test_flops_follow_the_active_experts_memory_all_of_them():
    top2 = msgspec.structs.replace(MOE, experts_per_token=2)
    assert top2.params == MOE.params
    assert top2.matmul_params - MOE.matmul_params == 3 * 8 * 4  # one more expert in the one MoE block
    assert top2.forward_flops_per_token(5) - MOE.forward_flops_per_token(5) == 2 * 3 * 8 * 4


def test_expert_read_fraction():
    assert MOE.expert_read_fraction(1) == pytest.approx(1 / 4)
    assert MOE.expert_read_fraction(2) == pytest.approx(1 - (3 / 4) ** 2)
    assert MOE.expert_read_fraction(1000) == pytest.approx(1.0)
    assert model_preset("llama3-8b").expert_read_fraction(1) == 1.0


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"experts_per_token": 5}, "experts_per_token <= n_experts"),
        ({"expert_ffn_dim": 0}, "expert_ffn_dim >= 1"),
        ({"dense_layers": 2}, "dense_layers < n_layers"),
        ({"n_experts": 0}, "need n_experts >= 1"),
        ({"kv_dim": -1}, "kv_dim=-1 must be >= 0"),
    ],
    ids=["k>E", "no-width", "all-dense", "no-experts", "negative"],
)
def test_bad_moe_shapes_are_refused(bad, match):
    with pytest.raises(PlanError, match=match):
        msgspec.structs.replace(MOE, **bad)


# -- the estimates ------------------------------------------------------------------------------------
def test_training_compute_follows_the_active_parameters():
    """The same tokens through twice the routed experts: compute up by the FLOPs' ratio, weights held the same."""
    top2 = msgspec.structs.replace(MOE, experts_per_token=2)
    one, two = (estimate_train(m, ParallelDims(), range(1), ctx()) for m in (MOE, top2))
    s_bar = WORK.mean_seq_len  # the test device packs sequences (an accelerator's default): the mean length
    ratio = top2.forward_flops_per_token(s_bar / 2) / MOE.forward_flops_per_token(s_bar / 2)
    assert two.breakdown["compute"] / one.breakdown["compute"] == pytest.approx(ratio)
    assert two.memory.weights == one.memory.weights


def test_a_decode_step_reads_the_experts_its_tokens_route_to():
    """Memory-bound decode (slow memory, fast compute) of one sequence: the routed experts read are k/E
    of them; with every expert routed (k = E) the whole model is read."""
    dev = device(memory_bandwidth=1e3, peak_flops=1e18)
    work = Workload(prompts_per_step=1, samples_per_prompt=1, prompt_len=1, gen_len=1)
    every = msgspec.structs.replace(MOE, experts_per_token=4)
    one, all_ = (estimate_generate(m, ParallelDims(), range(1), ctx(dev, work=work)) for m in (MOE, every))
    wb = 2  # bf16 weights
    skipped = MOE.routed_expert_params * (1 - 1 / 4) * wb / 1e3  # the 3 experts of 4 the token does not route to
    assert all_.breakdown["decode_memory"] - one.breakdown["decode_memory"] == pytest.approx(skipped)


def test_weight_sync_moves_every_expert():
    """A sync sends the whole model, every expert: twice the experts, the bytes of the extra experts more."""
    wide = msgspec.structs.replace(MOE, n_experts=8)

    def sync(model: ModelSpec, transport: str):
        return estimate_sync(
            model, src="policy", dst="gen", transport=transport, src_devices=range(2), src_dims=ParallelDims(dp=2),
            dst_devices=range(2, 4), dst_dims=ParallelDims(dp=2), dst_bytes_per_param=2.0, src_bytes_per_param=2.0, ctx=ctx(),
        )  # fmt: skip

    extra = (wide.params - MOE.params) * 2 * 2  # bf16, to 2 generator replicas
    a, b = sync(MOE, "file"), sync(wide, "file")
    assert b.bytes - a.bytes == extra
    # the collective transport lists a block's experts as one MLP of whole columns (sync_params): each
    # model's count may fall short by under one column (3 * h values) a block
    a, b = sync(MOE, "collective"), sync(wide, "collective")
    assert b.bytes - a.bytes == pytest.approx(extra, abs=2 * 3 * 8 * 2 * 2 * 2)


# -- Hugging Face configs --------------------------------------------------------------------------
def _built(model, leave_out: tuple[str, ...] = ()) -> int:
    """Parameters of a transformers model, less those whose names end with ``leave_out``."""
    return sum(p.numel() for n, p in model.named_parameters() if not n.endswith(leave_out))


def test_mixtral_and_qwen3_moe_configs_count_what_transformers_builds():
    transformers = pytest.importorskip("transformers")
    from flowrl.modelspec import model_from_hf_config

    common = dict(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  num_experts_per_tok=2, tie_word_embeddings=False)  # fmt: skip
    mixtral = transformers.MixtralConfig(num_local_experts=4, **common)  # an expert is intermediate_size wide
    spec = model_from_hf_config(mixtral.to_dict(), name="m")
    assert (spec.n_experts, spec.experts_per_token, spec.expert_ffn_dim) == (4, 2, 24)
    assert spec.params == _built(transformers.MixtralForCausalLM(mixtral))
    qwen = transformers.Qwen3MoeConfig(num_experts=4, moe_intermediate_size=8, head_dim=8, **common)
    spec = model_from_hf_config(qwen.to_dict(), name="q")
    assert (spec.n_experts, spec.expert_ffn_dim) == (4, 8)
    assert spec.params == _built(transformers.Qwen3MoeForCausalLM(qwen), leave_out=("q_norm.weight", "k_norm.weight"))


def test_a_deepseek_v3_config_counts_what_transformers_builds():
    """MLA, a shared expert and a leading dense block; the count leaves out the router's score-correction bias (E a block)."""
    transformers = pytest.importorskip("transformers")
    from flowrl.modelspec import model_from_hf_config

    config = transformers.DeepseekV3Config(
        vocab_size=50, hidden_size=16, intermediate_size=24, moe_intermediate_size=8, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        q_lora_rank=12, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1,
        tie_word_embeddings=False,
    )  # fmt: skip
    spec = model_from_hf_config(config.to_dict(), name="ds")
    assert (spec.n_experts, spec.shared_experts, spec.dense_layers, spec.kv_dim) == (4, 1, 1, 8 + 4)
    assert spec.params == _built(transformers.DeepseekV3ForCausalLM(config), leave_out=("e_score_correction_bias",))


def test_a_qwen2_moe_config_counts_its_shared_expert_as_experts_of_the_routed_width():
    """Qwen2-MoE's shared expert 4x the routed width (Qwen1.5-MoE-A2.7B: 5632 = 4 x 1408) counts as 4
    shared experts; the count leaves out its sigmoid gate (``dim`` weights a block)."""
    transformers = pytest.importorskip("transformers")
    from flowrl.modelspec import model_from_hf_config

    config = transformers.Qwen2MoeConfig(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                                         shared_expert_intermediate_size=32, tie_word_embeddings=False)  # fmt: skip
    spec = model_from_hf_config(config.to_dict(), name="q2")
    assert (spec.n_experts, spec.shared_experts, spec.expert_ffn_dim) == (4, 4, 8)
    assert spec.params == _built(transformers.Qwen2MoeForCausalLM(config), leave_out=("shared_expert_gate.weight", "self_attn.q_proj.bias",
                                                                                       "self_attn.k_proj.bias", "self_attn.v_proj.bias"))  # fmt: skip


def test_a_moe_layout_it_cannot_count_is_refused():
    from flowrl.modelspec import model_from_hf_config

    qwen2_moe = {"num_hidden_layers": 2, "hidden_size": 16, "num_attention_heads": 4, "intermediate_size": 24, "vocab_size": 50,
                 "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8, "shared_expert_intermediate_size": 20}  # fmt: skip
    with pytest.raises(PlanError, match="shared_expert_intermediate_size=20 is not a multiple of the expert width 8"):
        model_from_hf_config(qwen2_moe, name="q2")
    with pytest.raises(PlanError, match="decoder_sparse_step=2"):
        model_from_hf_config({**qwen2_moe, "shared_expert_intermediate_size": 0, "decoder_sparse_step": 2}, name="q2")


# -- expert parallelism in training ----------------------------------------------------------------
def test_the_experts_split_over_the_divisors_of_dp_that_divide_them():
    """``expert_splits``: the ep a MoE policy may take on dp ranks (1 for a dense or a LoRA model);
    ``enumerate_dims`` offers each only where ``ep`` is among the node's axes."""
    from flowrl.planners.parallel import enumerate_dims, expert_splits

    assert [expert_splits(MOE, dp) for dp in (1, 2, 3, 4, 6, 8)] == [[1], [1, 2], [1], [1, 2, 4], [1, 2], [1, 2, 4]]
    assert expert_splits(model_preset("llama3-8b"), 8) == [1]
    assert expert_splits(msgspec.structs.replace(MOE, adapter_params=10), 4) == [1]
    assert [d.short() for d in enumerate_dims(4, MOE, axes=frozenset({"dp", "ep"}))] == ["d4", "d4e2", "d4e4"]
    assert [d.short() for d in enumerate_dims(4, MOE, axes=frozenset({"dp"}))] == ["d4"]


@pytest.mark.parametrize(
    "dims, model, match",
    [
        (dict(dp=4, ep=3), MOE, r"ep\(3\) must divide dp\(4\).*pick ep among \[1, 2, 4\]"),
        (dict(dp=8, ep=8), MOE, r"ep\(8\) must divide the routed experts, and moe has 4 experts; pick ep among \[1, 2, 4\]"),
        (dict(dp=2, ep=2), model_preset("llama3-8b"), r"ep\(2\) must divide the routed experts, and llama3-8b is dense \(no experts\); pick ep among \[1\]"),
    ],
    ids=["not-dividing-dp", "more-than-experts", "dense"],
)
def test_an_ep_the_mesh_or_the_model_cannot_take_is_refused_by_name(dims, model, match):
    with pytest.raises(PlanError, match=match):
        ParallelDims(**dims).check(dims["dp"], model)


def test_dims_with_ep_round_trip_their_compact_form():
    assert ParallelDims.parse("d8e4") == ParallelDims(dp=8, ep=4) and ParallelDims(dp=8, ep=4).short() == "d8e4"
    assert ParallelDims.parse(ParallelDims(dp=4, ep=2, tp=2).short()) == ParallelDims(dp=4, ep=2, tp=2)


def _exact(**over):
    from tests.planners.test_estimates import EXACT

    return msgspec.structs.replace(EXACT, **over)


def test_experts_shard_over_their_ranks_not_replicas():
    """dp = ep = 4 under ZeRO-1: the dense weights whole on every rank, a quarter of the experts each;
    at ep = 1 every rank holds every expert (the mesh's ep is what is priced, no implicit split)."""
    dev = device()
    est = estimate_train(MOE, ParallelDims(dp=4, ep=4), range(4), ctx(dev, tuning=_exact(zero_stage=1)))
    dense = MOE.params - MOE.routed_expert_params
    assert est.memory.weights == int(dense * dev.dtype_bytes + MOE.routed_expert_params / 4 * dev.dtype_bytes)
    whole = estimate_train(MOE, ParallelDims(dp=4), range(4), ctx(dev, tuning=_exact(zero_stage=1)))
    assert whole.memory.weights == MOE.params * dev.dtype_bytes and "ep_comm" not in whole.breakdown
    half = estimate_train(MOE, ParallelDims(dp=4, ep=2), range(4), ctx(dev, tuning=_exact(zero_stage=1)))
    assert half.memory.weights == int(dense * dev.dtype_bytes + MOE.routed_expert_params / 2 * dev.dtype_bytes)


def test_zero3_gathers_no_expert_when_every_rank_holds_its_own():
    """ZeRO-3 at dp = ep = 4: the gathers (forward, backward) and the gradient reduce-scatter move the dense part only."""
    from flowrl.planners.estimate.common import Link, all_gather_s

    dev, tuning = device(), _exact(zero_stage=3)
    est = estimate_train(MOE, ParallelDims(dp=4, ep=4), range(4), ctx(dev, tuning=tuning))
    dense, link = MOE.params - MOE.routed_expert_params, Link(dev.intra_host_bandwidth, 0.0)
    # 1 micro-batch a rank (4 sequences over 4 ranks), no checkpointing: 2 gathers, 1 reduce-scatter
    expected = 2 * all_gather_s(dense * dev.dtype_bytes, 4, link) + all_gather_s(dense * tuning.grad_bytes, 4, link)
    assert est.breakdown["dp_comm"] == pytest.approx(expected)


def test_tokens_go_to_their_experts_and_back():
    """One MoE block, one micro-batch of one 4-token sequence a rank: an all-to-all of the tokens each way,
    forward and backward, and the forward's per-expert token counts (``n_experts`` int64s) before them."""
    from flowrl.planners.estimate.common import Link, all_to_all_s

    dev = device()
    est = estimate_train(MOE, ParallelDims(dp=4, ep=4), range(4), ctx(dev))
    tokens = WORK.mean_seq_len  # packed, 1 sequence a micro-batch
    one_way = all_to_all_s(tokens * MOE.experts_per_token * MOE.dim * dev.dtype_bytes, 4, Link(dev.intra_host_bandwidth, 0.0))
    counts = all_to_all_s(MOE.n_experts * 8, 4, Link(dev.intra_host_bandwidth, 0.0))
    assert est.breakdown["ep_comm"] == pytest.approx(2 * 1 * (1 + 1) * one_way + counts)
    assert any("experts split over ep=4: all-to-all at NCCL within a host" in n for n in est.notes)
    dense = estimate_train(model_preset("llama3-8b"), ParallelDims(dp=4), range(4), ctx(device(memory_bytes=10**12)))
    assert "ep_comm" not in dense.breakdown


def test_the_all_to_all_runs_at_this_cpus_measured_rate_on_cpu_ranks_only():
    """On CPU ranks (an FSDP2 policy under torchrun) the all-to-all is priced at ``flowrl calibrate --gloo``'s
    all-to-all rate at its size (``CpuTerms.gloo_all_to_all_by_bytes``), else the gather rate, else
    ``GLOO_BANDWIDTH``, each named in the note; a GPU device with the same CPU figures keeps its link's rate.
    Per MoE layer: the tokens each way forward and backward (4 all-to-alls) and the forward's per-expert
    counts (32 bytes), which with a measured table cost what its smallest size does (gloo's latency)."""
    from flowrl.planners.estimate.common import Link, all_to_all_s
    from flowrl.planners.estimate.train import train_options
    from flowrl.planners.tuning import GLOO_BANDWIDTH

    tokens = 2 * (WORK.mean_seq_len - 1)  # 4 sequences over 2 ranks, one packed micro-batch (packing drops each last token)
    nbytes = tokens * MOE.experts_per_token * MOE.dim * device().dtype_bytes
    measured = ((int(nbytes), 3e6),)

    def ep_comm(dev, sharding="fsdp"):
        opts = train_options(MOE, ParallelDims(dp=2, ep=2), range(2), ctx(dev, tuning=_exact()), sharding=sharding, packing=None)
        est = opts.estimate(opts.options[0])
        return est.breakdown["ep_comm"], next(n for n in est.notes if n.startswith("experts split"))

    cpu = dict(kind="cpu", flops_by_width=((8, 1e11),), train_flops_by_width=((8, 1e11),))
    seconds, note = ep_comm(device(**cpu, gloo_all_to_all_by_bytes=measured, gloo_by_bytes=((int(nbytes), 1e6),)))
    assert seconds == pytest.approx((2 * 2 + 1) * all_to_all_s(nbytes, 2, Link(3e6, 0.0)))  # the counts at the smallest size's time
    assert "gloo all-to-all between CPU ranks, 0.003 GB/s (calibrated: cluster 'c''s CpuTerms.gloo_all_to_all_by_bytes" in note
    seconds, note = ep_comm(device(**cpu, gloo_by_bytes=((int(nbytes), 1e6),)))
    assert seconds == pytest.approx(2 * 2 * all_to_all_s(nbytes, 2, Link(1e6, 0.0)) + all_to_all_s(32, 2, Link(1e6, 0.0))) and "gloo all-gather rate" in note
    seconds, note = ep_comm(device(**cpu))
    uncalibrated = Link(GLOO_BANDWIDTH, 0.0)
    assert seconds == pytest.approx(2 * 2 * all_to_all_s(nbytes, 2, uncalibrated) + all_to_all_s(32, 2, uncalibrated)) and "not calibrated" in note
    gpu = device(gloo_all_to_all_by_bytes=measured)  # CPU figures in a GPU cluster's file price nothing there
    seconds, note = ep_comm(gpu)
    link = Link(1e10, 0.0)
    assert seconds == pytest.approx(2 * 2 * all_to_all_s(tokens * MOE.experts_per_token * MOE.dim * gpu.dtype_bytes, 2, link) + all_to_all_s(32, 2, link))
    assert "NCCL within a host, 10 GB/s (cluster 'c''s X: intra_host_bandwidth 10 GB/s x link_efficiency 1)" in note
