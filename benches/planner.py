"""Planner figures, printed as JSON: search time, LlamaRL-style sync vs async predictions, calibrated CPU predictions.

Run: ``.venv/bin/python benches/planner.py [--repeats 3] [--skip-calibrate]``

1. ``search_time``: wall and CPU time of ``plan_graph`` (search, both families, plus the
   colocated baseline) for the 5-node default pipeline on 64, 1024 and 10,000 H100s, best of
   ``--repeats`` (the CPU time shows what other load on a shared machine adds to the wall time).
2. ``llamarl``: Llama-3 8B / 70B / 405B pipelines on 1024 H100s (128 hosts x 8), workload
   ``LLM_DEFAULTS`` (256 prompts x 8 samples, 512 prompt + 2048 generated tokens = 5.2M tokens per
   step), generator weights in bf16 and in fp8 (LlamaRL's choice): the synchronous colocated
   baseline on every device against the best asynchronous placement (k = 1), and why.
3. ``cpu_calibrated``: this machine measured (``flowrl calibrate``), then the default example's
   predicted step, synchronous (colocated, k = 0) and asynchronous (disaggregated, k = 1), to set
   against what ``flowrl run --plan`` measures.
"""

from __future__ import annotations

import argparse
import json
import time

from flowrl.examples import build_example
from flowrl.planners.calibrate import calibrated_cluster, measure
from flowrl.planners.modelspec import model_preset
from flowrl.planners.plan import Plan, plan_graph
from flowrl.planners.workload import LLM_DEFAULTS


def _sides(plan: Plan) -> dict[str, float]:
    kinds = {n: p.kind for n, p in plan.placements.items()}
    return {
        "generate_s": round(sum(p.time_s for n, p in plan.placements.items() if kinds[n] == "generator"), 4),
        "train_s": round(sum(p.time_s for n, p in plan.placements.items() if kinds[n] in ("policy", "reference")), 4),
        "weight_sync_s": round(sum(s.time_s for s in plan.weight_syncs), 4),
    }


def search_times(repeats: int) -> list[dict]:
    graph = build_example("llamarl")
    rows = []
    for cluster in ("64xH100", "1024xH100", "1250x8xH100"):
        for model in ("llama3-8b", "llama3-70b"):
            best = best_cpu = float("inf")
            for _ in range(repeats):
                t0, c0 = time.perf_counter(), time.process_time()
                plan = plan_graph(graph, cluster, model=model_preset(model), gen_precision="bfloat16")
                best = min(best, time.perf_counter() - t0)
                best_cpu = min(best_cpu, time.process_time() - c0)
            rows.append(
                {
                    "devices": plan.cluster_spec.n_devices,
                    "cluster": cluster,
                    "model": model,
                    "nodes": len(graph),
                    "search_s": round(best, 3),
                    "search_cpu_s": round(best_cpu, 3),
                    "placements_estimated": plan.search.evaluated,
                    "infeasible": plan.search.infeasible,
                    "placement": str(plan),
                }
            )
    return rows


def llamarl_table() -> list[dict]:
    graph = build_example("llamarl")
    rows = []
    for model in ("llama3-8b", "llama3-70b", "llama3-405b"):
        for precision in ("bfloat16", "float8"):
            best = plan_graph(graph, "1024xH100", model=model_preset(model), gen_precision=precision)
            base = plan_graph(graph, "1024xH100", model=model_preset(model), gen_precision="bfloat16", strategy="colocated", max_staleness=0)
            rows.append(
                {
                    "model": model,
                    "cluster": "1024xH100",
                    "generator_precision": precision,
                    "baseline": {"placement": str(base), "sync_step_s": round(base.sync_step_s, 2), **_sides(base)},
                    "best": {
                        "placement": str(best),
                        "family": best.family,
                        "async_step_s": round(best.async_step_s, 2),
                        "sync_step_s_same_placement": round(best.sync_step_s, 2),
                        **_sides(best),
                        "bottleneck": best.bottleneck,
                    },
                    "speedup_vs_sync_colocated_bf16": round(base.sync_step_s / best.async_step_s, 2),
                }
            )
    return rows


def cpu_calibrated() -> dict:
    m = measure()
    cluster = calibrated_cluster(m)
    graph = build_example("llamarl")
    sync = plan_graph(graph, cluster, strategy="colocated", max_staleness=0)
    asyn = plan_graph(graph, cluster, strategy="disaggregated", max_staleness=1)
    best = plan_graph(graph, cluster)
    return {
        "measured": {
            "matmul_gflops_per_core": round(m.matmul_flops / 1e9, 1),
            "copy_gb_per_s": round(m.copy_bandwidth / 1e9, 2),
            "op_overhead_us": round(m.op_overhead_s * 1e6, 2),
            "cores": m.cores,
        },
        "workload": sync.workload.short(),
        "sync_colocated_k0": {"placement": str(sync), "step_s": round(sync.step_s, 4), **_sides(sync)},
        "async_disaggregated_k1": {"placement": str(asyn), "step_s": round(asyn.step_s, 4), **_sides(asyn)},
        "search_best_k1": {"placement": str(best), "step_s": round(best.step_s, 4), "family": best.family},
        "compare_with": "flowrl calibrate -o cpu.json; flowrl plan --cluster cpu.json --strategy colocated --max-staleness 0 -o sync.json; "
        "flowrl run --plan sync.json --max-staleness 0 (and the same with --strategy disaggregated, k=1): measured / predicted step",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-calibrate", action="store_true")
    args = parser.parse_args()
    out = {
        "workload": {**json.loads(json.dumps(LLM_DEFAULTS, default=lambda s: {f: getattr(s, f) for f in s.__struct_fields__})), "tokens_per_step": LLM_DEFAULTS.tokens_per_step},
        "search_time": search_times(args.repeats),
        "llamarl": llamarl_table(),
    }
    if not args.skip_calibrate:
        out["cpu_calibrated"] = cpu_calibrated()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
