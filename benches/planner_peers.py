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

AReaL (arXiv 2505.24298, up to 2.77x) and NeMo-RL (one step off, DeepSeek-V3 on 512 H100s, 111 s ->
64 s) are not here yet: their settings were not retrieved with enough detail, and DeepSeek-V3 is a
mixture of experts, which the planner's dense ``ModelSpec`` does not model.
"""

from __future__ import annotations

import msgspec

from flowrl.examples import build_example
from flowrl.modelspec import model_preset
from flowrl.planners.cluster import DEVICE_PRESETS, ClusterSpec
from flowrl.planners.lengths import mean_and_tail
from flowrl.planners.plan import plan_graph
from flowrl.planners.workload import Workload

__all__ = ["H20", "VERL_MEANS", "verl_workload", "peers_table"]

#: An H20 as assumed (module docstring): the H100 preset with the H20's compute, memory and bandwidth.
H20 = msgspec.structs.replace(
    DEVICE_PRESETS["H100"], name="H20", peak_flops=148e12, peak_flops_8bit=296e12, memory_bytes=96 * 10**9, memory_bandwidth=4.0e12
)
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
        "predicted_over_published_sync": round(sync.sync_step_s / published_sync, 2),
        "predicted_over_published_async_64_64": round(theirs.step_s / published_async, 2),
    }


def peers_table() -> list[dict]:
    """One row per published system (module docstring)."""
    return [_verl_row(lengths, mean) for lengths, mean in VERL_MEANS.items()]


if __name__ == "__main__":
    import json

    print(json.dumps(peers_table(), indent=2))
