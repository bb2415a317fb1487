"""The planner's prediction for a published asynchronous-RL result, on its published setting (issue 34, item 6).

``peers_table()`` rows: the setting as published, what this bench assumes where the source is silent,
the planner's synchronous and asynchronous steps, and the predicted speedup beside the published one.

verl ``fully_async_policy`` (verl's docs/advance/fully_async.md, "Asynchronous Training on 7B Model"):
Qwen2.5-Math-7B, DAPO, 128 H20s, 512 prompts x 16 responses a step, responses of at most 28K tokens,
vLLM + FSDP2. Colocated synchronous step 356.30 s (gen 177.85, old_log_prob 53.92, update_actor
113.81); fully async on 64 + 64 cards, k = 0.5 staleness with partial rollouts, 150.63 s a step;
total-time speedups 2.35-2.67x. Assumed here: an H20 is an H100 with 148 TFLOP/s (bf16), 96 GB and
4.0 TB/s (NVIDIA's data sheet figures; the same links); the model is ``qwen2.5-7b``'s shape (the Math
model's own context is 4K: its 28K rollouts extend it); prompts of 256 tokens; responses with a mean
of half the limit and 5% running to it (the LlamaRL rows' assumption: the docs give no lengths),
and a second row with a mean of 2K tokens, fitted to their update_actor time;
ZeRO-3 for FSDP2; the synchronous step recomputes log-probs (its ``old_log_prob`` column) with the
generator batching continuously (vLLM) and waiting for the step's longest response; the asynchronous
step reads the rollout's log-probs (``use_rollout_log_probs``) at k = 1 (the planner's k is an
integer; 0.5 with partial rollouts lies between 0 and 1).

AReaL (arXiv 2505.24298, section 6 and appendix B; the paper is the repository's assets/paper.pdf):
R1-Distilled-Qwen 1.5B and 7B (math, 16 and 24 nodes, 250 PPO steps) and 14B and 32B (code, 32 and 48
nodes, 80 and 60 steps) on 8-GPU H800 nodes (NVLink within a node, RoCE at 3.2 Tb/s a node between
them), 512 prompts x 16 answers a step, prompts of at most 1,024 tokens, answers of at most 27,648,
a decoupled PPO objective (a proximal policy's log-probs computed by a forward pass) in 4 minibatches,
maximum staleness 8 (math) or 4 (code), three quarters of the devices generating. Table 1's training
hours against its synchronous variant of AReaL on the same nodes: 41.0 -> 14.8 h (1.5B, the 2.77x),
57.7 -> 25.4 (7B), 48.8 -> 21.9 (14B), 51.1 -> 31.1 (32B); a step is the hours over the steps.
Assumed: an H800 is the H100 preset with NVLink at 400 GB/s (200 GB/s a direction; its compute,
memory and NIC as the H100's); the shapes are the ``qwen2.5-*`` presets of those sizes (the distilled
models are Qwen2.5's); prompts of 256 tokens; answers with a mean of half the limit, 5% at it (the
paper gives no lengths); the synchronous variant colocated, generation continuous within a step;
the asynchronous one at k = the staleness, generators on the first three quarters with the tensor
parallelism that predicts fastest (the paper does not say), the trainer ZeRO-3 on the rest; both
recompute log-probs (the proximal policy's); one optimizer step a batch (the 4 minibatches' optimizer
steps are not priced: under 1% of a step at these sizes).

NeMo-RL v0.6 (``docs/about/performance-summary.md``, "H100 BF16 Benchmarks"; recipes
``grpo-deepseek-v3-64n8g.yaml`` and ``grpo-deepseek-v3-64n8g-async-1off.yaml``): GRPO on
OpenMathInstruct-2, DeepSeek-V3, 32 prompts x 16 generations, sequences of at most 1,536 tokens, an
average generated sequence of 697 (on policy) and 710 (one step off) tokens, bf16, Megatron-core
training, vLLM generation at TP 32; on policy, colocated on 512 H100s, 111 s a step; one step off,
generation on 256 and training (PP 16, EP 16) on the other 256, 64.1 s a step (1.73x). Assumed: prompts
of 128 tokens (the "average generated sequence" read as prompt + response, so a mean response of
570-580; responses of at most 1,536 - 128 tokens, 5% at it); the ``deepseek-v3`` preset (a mixture of
experts: ``flowrl.modelspec``), its trainer's experts split over its data-parallel ranks (the
planner's expert parallelism: 32 on the colocated d32p16, 16 on d16p16, the recipes' EP 16), ZeRO-3
for the rest; the generator's experts sharded by its tensor parallelism (vLLM at TP 32); both steps recompute
log-probs (NeMo-RL's step time includes its "policy logprobs"); published layouts: synchronous
``gen:d16t32 | policy:d32p16`` on all 512, asynchronous ``gen:d8t32`` on 256 and ``policy:d16p16``
on the other 256, k = 1.
"""

from __future__ import annotations

import msgspec

from flowrl.errors import PlanError
from flowrl.examples import build_example
from flowrl.modelspec import model_preset
from flowrl.planners.cluster import DEVICE_PRESETS, ClusterSpec
from flowrl.planners.lengths import mean_and_tail
from flowrl.planners.plan import plan_graph
from flowrl.planners.workload import Workload

__all__ = ["H20", "H800", "VERL_MEANS", "AREAL_RUNS", "verl_workload", "areal_workload", "nemo_rl_workload", "peers_table"]

#: An H20 as assumed (module docstring): the H100 preset with the H20's compute, memory and bandwidth.
H20 = msgspec.structs.replace(
    DEVICE_PRESETS["H100"], name="H20", peak_flops=148e12, peak_flops_8bit=296e12, memory_bytes=96 * 10**9, memory_bandwidth=4.0e12
)
#: An H800 as assumed (module docstring): the H100 preset with NVLink at 400 GB/s (200 a direction).
H800 = msgspec.structs.replace(DEVICE_PRESETS["H100"], name="H800", intra_host_bandwidth=200e9)
VERL_MAX_RESPONSE = 28 * 1024
#: Mean response lengths tried: half the limit (the assumption) and 2K tokens, what the published
#: update_actor time (113.81 s) implies at the planner's training MFU (a fit to their figure, not a prediction).
VERL_MEANS = {"assumed: half the limit": VERL_MAX_RESPONSE / 2, "fitted: 2K, from their update_actor time": 2048.0}


def verl_workload(mean: float) -> Workload:
    """verl's step with responses of mean ``mean`` tokens, 5% of them at the 28K limit."""
    return Workload(
        prompts_per_step=512,
        samples_per_prompt=16,
        prompt_len=256,
        gen_len=VERL_MAX_RESPONSE,
        lengths=mean_and_tail(mean=mean, max_len=VERL_MAX_RESPONSE, tail_frac=0.05),
        batching="continuous",
    )


def _verl_row(lengths: str, mean: float) -> dict:
    graph = build_example("llamarl")
    cluster = ClusterSpec(name="16x8xH20", hosts=16, devices_per_host=8, device=H20)
    common = {"model": model_preset("qwen2.5-7b"), "workload": verl_workload(mean), "gen_precision": "bfloat16", "zero_stage": 3}
    sync = plan_graph(graph, cluster, strategy="colocated", max_staleness=0, recompute_logprobs=True, **common)
    best = plan_graph(graph, cluster, max_staleness=1, recompute_logprobs=False, **common)
    theirs = plan_graph(graph, cluster, strategy="gen:d64@0-63 | policy:d64@64-127", max_staleness=1, recompute_logprobs=False, **common)
    published_sync, published_async = 356.30, 150.63

    def side(plan, name: str) -> float:
        return round(plan.placements[name].time_s, 1)

    return {
        "system": "verl fully_async_policy",
        "setting": "Qwen2.5-Math-7B, DAPO, 128 H20, 512 prompts x 16, responses <= 28K tokens",
        "assumed": "H20 = 148 TFLOP/s, 96 GB, 4.0 TB/s; qwen2.5-7b shape; 256-token prompts; 5% of responses at 28K; "
        "ZeRO-3; sync: colocated, recompute; async: k = 1, rollout log-probs",
        "response_lengths": f"{lengths}: mean {mean:.0f} tokens",
        "published": {"sync_step_s": published_sync, "async_step_s": published_async, "step_speedup": round(published_sync / published_async, 2),
                      "total_time_speedup": "2.35-2.67"},
        "predicted_sync": {"placement": str(sync), "step_s": round(sync.sync_step_s, 1), "generate_s": side(sync, "gen"), "train_s": side(sync, "policy")},
        "predicted_async_best": {"placement": str(best), "step_s": round(best.step_s, 1), "generate_s": side(best, "gen"), "train_s": side(best, "policy")},
        "predicted_async_64_64": {"placement": str(theirs), "step_s": round(theirs.step_s, 1), "generate_s": side(theirs, "gen"), "train_s": side(theirs, "policy")},
        "predicted_speedup": round(sync.sync_step_s / best.step_s, 2),
        "predicted_speedup_64_64": round(sync.sync_step_s / theirs.step_s, 2),
        "predicted_over_published_speedup_64_64": round(sync.sync_step_s / theirs.step_s / (published_sync / published_async), 2),
        "predicted_over_published_sync": round(sync.sync_step_s / published_sync, 2),
        "predicted_over_published_async_64_64": round(theirs.step_s / published_async, 2),
    }


def _sides(plan) -> dict:
    """A plan's placement, step and its generator's and trainer's seconds."""
    return {"placement": str(plan), "step_s": round(plan.step_s, 1), "generate_s": round(plan.placements["gen"].time_s, 1),
            "train_s": round(plan.placements["policy"].time_s, 1), "weight_sync_s": round(sum(s.time_s for s in plan.weight_syncs), 2)}  # fmt: skip


def _ratios(published_sync: float, published_async: float, sync_s: float, async_s: float) -> dict:
    """The published and predicted speedups and the predicted / published ratios (of the speedup and each step)."""
    published, predicted = published_sync / published_async, sync_s / async_s
    return {
        "published_speedup": round(published, 2),
        "predicted_speedup": round(predicted, 2),
        "predicted_over_published_speedup": round(predicted / published, 2),
        "predicted_over_published_sync_step": round(sync_s / published_sync, 2),
        "predicted_over_published_async_step": round(async_s / published_async, 2),
    }


#: AReaL's Table 1 (module docstring): preset, 8-GPU nodes, PPO steps, staleness, synchronous / asynchronous hours.
AREAL_RUNS = {
    "1.5B math": ("qwen2.5-1.5b", 16, 250, 8, 41.0, 14.8),
    "7B math": ("qwen2.5-7b", 24, 250, 8, 57.7, 25.4),
    "14B code": ("qwen2.5-14b", 32, 80, 4, 48.8, 21.9),
    "32B code": ("qwen2.5-32b", 48, 60, 4, 51.1, 31.1),
}
AREAL_MAX_ANSWER = 27648


def areal_workload(mean: float = AREAL_MAX_ANSWER / 2, tail_frac: float = 0.05) -> Workload:
    """AReaL's step: 512 prompts x 16 answers of at most 27,648 tokens, of mean ``mean`` with
    ``tail_frac`` of them at the limit (assumed: half the limit, 5%)."""
    return Workload(
        prompts_per_step=512, samples_per_prompt=16, prompt_len=256, gen_len=AREAL_MAX_ANSWER,
        lengths=mean_and_tail(mean=mean, max_len=AREAL_MAX_ANSWER, tail_frac=tail_frac), batching="continuous",
    )  # fmt: skip


def _areal_row(run: str, mean: float = AREAL_MAX_ANSWER / 2, tail_frac: float = 0.05) -> dict:
    preset, nodes, steps, k, sync_h, async_h = AREAL_RUNS[run]
    graph, model = build_example("llamarl"), model_preset(preset)
    n = nodes * 8
    cluster = ClusterSpec(name=f"{nodes}x8xH800", hosts=nodes, devices_per_host=8, device=H800)
    common = {"model": model, "workload": areal_workload(mean, tail_frac), "gen_precision": "bfloat16", "zero_stage": 3, "recompute_logprobs": True}
    sync = plan_graph(graph, cluster, strategy="colocated", max_staleness=0, **common)
    best = plan_graph(graph, cluster, max_staleness=k, **common)
    gens = n * 3 // 4
    theirs = []  # three quarters generating: the paper gives no tensor parallelism, so the fastest that fits
    for tp in (t for t in (1, 2, 4, 8) if model.n_heads % t == 0):
        try:
            theirs.append(plan_graph(graph, cluster, strategy=f"gen:d{gens // tp}t{tp}@0-{gens - 1} | policy:d{n - gens}@{gens}-{n - 1}", max_staleness=k, **common))
        except PlanError:
            continue  # does not fit
    split = min(theirs, key=lambda p: p.step_s)
    published_sync, published_async = sync_h * 3600 / steps, async_h * 3600 / steps
    return {
        "system": f"AReaL {run}",
        "setting": f"R1-Distilled-Qwen {run.split()[0]}, {n} H800 ({nodes} nodes), 512 prompts x 16, answers <= 27,648 tokens, "
        f"staleness {k}, {steps} PPO steps; sync: synchronous AReaL on the same nodes",
        "assumed": "H800 = H100 with 400 GB/s NVLink; qwen2.5 shape; 256-token prompts; "
        "sync colocated, continuous within a step; async 3/4 generating, trainer ZeRO-3; both recompute (proximal log-probs)",
        "response_lengths": f"mean {mean:.0f} tokens, {tail_frac:.0%} at 27,648",
        "published": {"sync_hours": sync_h, "async_hours": async_h, "sync_step_s": round(published_sync, 1), "async_step_s": round(published_async, 1)},
        "predicted_sync": _sides(sync) | {"step_s": round(sync.sync_step_s, 1)},
        "predicted_async_best": _sides(best),
        "predicted_async_three_quarters_generating": _sides(split),
        **_ratios(published_sync, published_async, sync.sync_step_s, split.step_s),
        "predicted_speedup_best_placement": round(sync.sync_step_s / best.step_s, 2),
    }


NEMO_MAX_SEQUENCE, NEMO_PROMPT = 1536, 128


def nemo_rl_workload() -> Workload:
    """NeMo-RL's DeepSeek-V3 step: 32 prompts x 16, sequences <= 1,536 tokens averaging ~700 (prompt assumed 128)."""
    answer_max = NEMO_MAX_SEQUENCE - NEMO_PROMPT
    return Workload(
        prompts_per_step=32, samples_per_prompt=16, prompt_len=NEMO_PROMPT, gen_len=answer_max,
        lengths=mean_and_tail(mean=704 - NEMO_PROMPT, max_len=answer_max, tail_frac=0.05), batching="continuous",
    )  # fmt: skip


def _nemo_rl_row() -> dict:
    graph, cluster = build_example("llamarl"), "512xH100"
    common = {"model": model_preset("deepseek-v3"), "workload": nemo_rl_workload(), "gen_precision": "bfloat16", "zero_stage": 3, "recompute_logprobs": True}
    sync = plan_graph(graph, cluster, strategy="gen:d16t32@0-511 | policy:d32p16@0-511", max_staleness=0, **common)
    sync_best = plan_graph(graph, cluster, strategy="colocated", max_staleness=0, **common)
    theirs = plan_graph(graph, cluster, strategy="gen:d8t32@0-255 | policy:d16p16@256-511", max_staleness=1, **common)
    best = plan_graph(graph, cluster, max_staleness=1, **common)
    published_sync, published_async = 111.0, 64.1
    return {
        "system": "NeMo-RL v0.6, one step off",
        "setting": "DeepSeek-V3 (671B, 37B active), GRPO, 512 H100, 32 prompts x 16, sequences <= 1,536 tokens (mean ~700), bf16",
        "assumed": "128-token prompts, responses mean 576, 5% at 1,408; experts split over the trainer's dp ranks, ZeRO-3 for the rest; both recompute log-probs; "
        "published layouts: sync gen d16t32 | policy d32p16 colocated, async gen d8t32 on 256 | policy d16p16 on 256",
        "published": {"sync_step_s": published_sync, "async_step_s": published_async},
        "predicted_sync_published_layout": _sides(sync) | {"step_s": round(sync.sync_step_s, 1)},
        "predicted_sync_best_colocated": _sides(sync_best) | {"step_s": round(sync_best.sync_step_s, 1)},
        "predicted_async_published_layout": _sides(theirs),
        "predicted_async_best": _sides(best),
        **_ratios(published_sync, published_async, sync.sync_step_s, theirs.step_s),
        "predicted_speedup_best_placements": round(sync_best.sync_step_s / best.step_s, 2),
    }


def peers_table() -> list[dict]:
    """One row per published system and setting (module docstring)."""
    rows = [_verl_row(lengths, mean) for lengths, mean in VERL_MEANS.items()]
    rows += [_areal_row(run) for run in AREAL_RUNS]
    rows.append(_nemo_rl_row())
    return rows


if __name__ == "__main__":
    import json

    print(json.dumps(peers_table(), indent=2))
