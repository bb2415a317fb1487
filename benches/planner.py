"""Planner figures as JSON: predictions set against measurements here and against LlamaRL's published results.

Run: ``python benches/planner.py [--example llamarl] [--steps 30] [--skip-measure] [--trace-dir DIR]``

1. ``cpu_predicted_vs_measured``: the example (``--example``, default ``llamarl``; the long-tail
   task's example once it exists) on this machine. Its workload is measured first: a short run
   with a metrics file gives the completion lengths (``completion_len_hist``), the task's prompts
   their mean length. Then for sync k = 0 (colocated), async k = 1 and k = 2 (disaggregated), each
   right after its own ``flowrl calibrate`` spec (``measure()``: every core at once, median; the
   load of a shared machine drifts within minutes, and the 1-minute load average is printed): the plan's predicted
   step, the runtime's measured step (median step interval after warm-up, same process, same
   run of this bench) and predicted / measured (goal 0.77-1.3). ``--trace-dir`` writes each
   pair's predicted and measured Chrome traces, to open side by side in Perfetto.
2. ``llamarl``: LlamaRL's three settings (Llama-3 8B, 70B, 405B on 1024 H100s; workload below):
   the synchronous baseline system (``flowrl.planners.baseline.SYNC_BASELINE``) on all devices and
   on its best subset, flowrl's best asynchronous plan, the speedup and what each mechanism adds
   (``mechanisms``: each row adds one to the previous one), beside LlamaRL's published figures.
3. ``weight_sync``: predicted weight sync (fp8 generator: quantization + transfer) beside LlamaRL's
   reported 1.15 s (70B) and about 2 s (405B).
4. ``peers``: other published asynchronous results on their own settings (``planner_peers.py``,
   which states what it assumes): verl's fully_async_policy, AReaL's Table 1 (1.5B-32B), NeMo-RL's
   one-step-off DeepSeek-V3; each row the published speedup, the predicted one and their ratio.
   ``llamarl_workload_sweep``: LlamaRL's 70B and 405B over completion limits and prompts a step, and
   the point closest to each published speedup, with its step times against the published ones.
5. ``search_time``: CPU seconds (``time.process_time``) of ``plan_graph`` on 1024 and 131,072 H100s
   (goals: < 1 s and < 10 s), best of ``--repeats``.

The LlamaRL workload (``LLAMARL_WORKLOAD``): LlamaRL trains on math-reasoning prompts with long
chain-of-thought completions; its paper's exact batch and length settings are not in the corpora
this bench was written against, so the workload is an assumption stated here, not fitted: 256
prompts x 8 samples (the group sizes GRPO-style recipes use), 512-token prompts, completions of
at most 4096 tokens with a long tail: a mean of half the limit, 5% running to the limit. The
baseline generates lock-step (every batch waits for its longest completion); flowrl generates
continuously, in flight across steps, with fp8 weights, as LlamaRL does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import msgspec

from flowrl.examples import build_example
from flowrl.graph.ir import Graph
from flowrl.operators.tasks import make_task
from flowrl.planners.baseline import SYNC_BASELINE, plan_baseline
from flowrl.calibration.measure import calibrated_cluster, measure
from flowrl.planners.cluster import parse_cluster
from flowrl.planners.estimate.common import Context
from flowrl.cli.plan import lengths_from_metrics
from flowrl.planners.lengths import mean_and_tail
from flowrl.modelspec import model_from_config, model_preset
from flowrl.planners.plan import Plan, plan_graph, save_plan
from flowrl.planners.search import Candidate, resolve_roles
from flowrl.planners.timeline import predicted_trace
from flowrl.planners.tuning import make_tuning
from flowrl.planners.workload import Workload, workload_from_graph
from flowrl.runtime.config import RunConfig
from flowrl.runtime.run import run_graph
from planner_peers import peers_table  # beside this file (python benches/planner.py puts benches/ on the path)

#: LlamaRL's published step times (seconds): synchronous DeepSpeed-Chat-like baseline and LlamaRL.
PUBLISHED = {
    "llama3-8b": {"sync_s": 22.45, "async_s": 8.90, "speedup": 2.52},
    "llama3-70b": {"sync_s": 82.32, "async_s": 20.67, "speedup": 3.98},
    "llama3-405b": {"sync_s": 635.8, "async_s": 59.5, "speedup": 10.7},
}
#: LlamaRL's reported weight-sync times (seconds).
PUBLISHED_SYNC = {"llama3-70b": 1.15, "llama3-405b": 2.0}

#: The LlamaRL workload assumed (module docstring).
LLAMARL_WORKLOAD = Workload(
    prompts_per_step=256,
    samples_per_prompt=8,
    prompt_len=512,
    gen_len=4096,
    lengths=mean_and_tail(mean=2048, max_len=4096, tail_frac=0.05),
)
LLAMARL_CLUSTER = "1024xH100"


# -- 1. predicted against measured, here ---------------------------------------------------------
def _with_batching(graph: Graph, batching: str | None) -> Graph:
    """``graph`` with its generators' ``sampling.batching`` set to ``batching`` (None: unchanged), so
    the run measured is the one the prediction assumes."""
    if batching is None:
        return graph
    nodes = [
        msgspec.structs.replace(n, sampling=msgspec.structs.replace(n.sampling, batching=batching)) if n.kind == "generator" else n  # type: ignore[union-attr]
        for n in graph.nodes
    ]
    return Graph(msgspec.structs.replace(graph.spec, nodes=nodes))


def _span_medians(trace: str) -> dict[str, float]:
    """Median seconds of each span name in a runtime trace (Chrome trace JSON)."""
    with open(trace, "rb") as f:
        events = msgspec.json.decode(f.read())["traceEvents"]
    spans: dict[str, list[float]] = {}
    for e in events:
        if e.get("ph") == "X":
            spans.setdefault(e["name"], []).append(e["dur"] / 1e6)
    return {name: statistics.median(v) for name, v in spans.items()}


def _measured_workload(graph: Graph, steps: int, batching: str | None, folder: str) -> tuple[Workload, dict[str, float], float]:
    """From a short real run of the example: its workload (completion lengths, mean prompt length)
    and the host costs of its scorer and source per sample and per prompt (``Tuning`` overrides:
    these are the graph's own functions, not the machine's)."""
    metrics, trace = os.path.join(folder, "warmup.jsonl"), os.path.join(folder, "warmup.trace.json")
    t0 = time.perf_counter()
    run_graph(graph, RunConfig(steps=steps, metrics=metrics, trace=trace, progress=False))
    warm_s = time.perf_counter() - t0
    lengths = lengths_from_metrics(metrics)
    source = graph.nodes_of_kind("source")[0].source  # type: ignore[union-attr]
    task = make_task(source.task or "add", source.seed)
    n = source.batch_size * steps
    prompt_len = max(1, round(sum(len(task.prompt(i)) for i in range(n)) / n))
    workload = workload_from_graph(graph, prompt_len=prompt_len, lengths=lengths, batching=batching)
    spans = _span_medians(trace)
    host = {"scorer_s_per_sample": spans.get("score", 0.0) / workload.sequences, "source_s_per_prompt": spans.get("prompts", 0.0) / workload.prompts_per_step}
    return workload, host, warm_s


def _measured_step(plan: Plan, graph: Graph, k: int, steps: int, folder: str, label: str, trace_dir: str | None) -> dict:
    path = os.path.join(folder, f"{label}.json")
    save_plan(plan, path)
    trace = os.path.join(trace_dir or folder, f"{label}.measured.json")
    result = run_graph(graph, plan.placement(source=f"plan:{path}"), RunConfig(steps=steps, max_staleness=k, progress=False, trace=trace))
    if trace_dir:
        predicted_trace(plan, steps=steps).save(os.path.join(trace_dir, f"{label}.predicted.json"))
    times = [row["time_s"] for row in result.rows]
    skip = min(5, len(times) // 3)
    intervals = [b - a for a, b in zip(times, times[1:])][skip:]
    step = statistics.median(intervals)
    spans = _span_medians(trace)
    kinds = {n: p.kind for n, p in plan.placements.items()}

    def predicted(*wanted: str) -> float:
        return sum(p.time_s for n, p in plan.placements.items() if kinds[n] in wanted)

    # per component: the plan's time beside the median span of the measured run (the measured
    # spans include any slowdown from what ran beside them)
    components = {
        "generate_s": (predicted("generator"), spans.get("generate", 0.0)),
        "score_s": (predicted("scorer"), spans.get("score", 0.0)),
        "train_s": (predicted("policy", "reference"), spans.get("train", 0.0)),
        "weight_sync_s": (sum(s.time_s for s in plan.weight_syncs), spans.get("weight publish", 0.0) + spans.get("weight fetch", 0.0)),
    }
    return {
        "placement": str(plan),
        "predicted_step_s": round(plan.step_s, 4),
        "measured_step_s": round(step, 4),
        "predicted_over_measured": round(plan.step_s / step, 2),
        "within_0.77_1.3": 0.77 <= plan.step_s / step <= 1.3,
        **{name: {"predicted": round(p, 4), "measured_median": round(m, 4)} for name, (p, m) in components.items()},
    }


def cpu_predicted_vs_measured(example: str, steps: int, batching: str | None, trace_dir: str | None) -> dict:
    graph = _with_batching(build_example(example), batching)
    with tempfile.TemporaryDirectory() as folder:
        workload, host, warm_s = _measured_workload(graph, max(3, steps // 5), batching, folder)
        out: dict = {"example": example, "workload": workload.short(), "steps": steps, "host_costs_measured": {k: f"{v * 1e6:.1f} us" for k, v in host.items()}}
        for label, strategy, k in (("sync_k0", "colocated", 0), ("async_k1", "disaggregated", 1), ("async_k2", "disaggregated", 2)):
            # calibrated right before each run: on a shared machine the load drifts within minutes
            load_before = os.getloadavg()[0]
            m = measure()
            plan = plan_graph(graph, calibrated_cluster(m), strategy=strategy, max_staleness=k, workload=workload, **host)
            out[label] = _measured_step(plan, graph, k, steps, folder, label, trace_dir)
            width = model_from_config(graph.nodes_of_kind("policy")[0].model).dim  # type: ignore[union-attr]
            dev = plan.cluster_spec.device
            out[label]["calibrated"] = {
                f"gflops_per_core_at_width_{width}": {kind: round(dev.flops_at(width, kind) / 1e9, 1) for kind in ("forward", "decode", "train")},
                "thread_speedup": round(m.cpu.thread_speedup, 2),
                "gen_thread_speedup": round(m.cpu.gen_thread_speedup, 2),
                "shared_slowdown": round(m.cpu.shared_slowdown, 2),
                "decode_step_overhead_us": round(m.cpu.decode_step_overhead_s * 1e6, 1),
                "slot_row_overhead_us": round(m.cpu.slot_row_overhead_s * 1e6, 2),
                "matmul_gflops_per_core": round(m.matmul_flops / 1e9, 1),
                "copy_gb_per_s": round(m.copy_bandwidth / 1e9, 2),
                "op_overhead_us": round(m.op_overhead_s * 1e6, 2),
                "cores": m.cores,
                "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            }
    return out


# -- 2. and 3. LlamaRL's settings -----------------------------------------------------------------
def _sides(c: Candidate, gens: tuple[str, ...]) -> dict[str, float]:
    return {
        "generate_s": round(sum(c.estimates[n].time_s for n in gens), 2),
        "train_s": round(sum(e.time_s for n, e in c.estimates.items() if n not in gens and c.layout.get(n)), 2),
        "weight_sync_s": round(sum(s.time_s for s in c.syncs), 3),
    }


def _plan(graph: Graph, model: str, **kwargs) -> Plan:
    return plan_graph(graph, LLAMARL_CLUSTER, model=model_preset(model), **kwargs)


def llamarl_table() -> list[dict]:
    """Per model: the baseline, flowrl's best, the speedup and each mechanism's share (module docstring)."""
    graph = build_example("llamarl")
    rows = []
    for model in PUBLISHED:
        base_ctx = Context(cluster=parse_cluster(LLAMARL_CLUSTER), workload=LLAMARL_WORKLOAD, tuning=make_tuning())
        base = plan_baseline(graph, base_ctx, model=model_preset(model), system=SYNC_BASELINE)
        gens = resolve_roles(graph, base_ctx, model_preset(model)).gens
        baseline_s = base.all_devices.steps.sync_step_s if base.all_devices else None
        # each mechanism added to the previous row; the last row is flowrl's plan
        steps = [("baseline: shared layout, gather sync, recompute, bf16, lock-step", baseline_s)]
        lockstep = msgspec.structs.replace(LLAMARL_WORKLOAD, batching="lockstep")
        continuous = msgspec.structs.replace(LLAMARL_WORKLOAD, batching="continuous")
        sep = _plan(graph, model, workload=lockstep, gen_precision="bfloat16", max_staleness=0, recompute_logprobs=True)
        steps.append(("+ separate parallelism per phase, reshard sync (best sync plan, k=0)", sep.sync_step_s))
        norecompute = _plan(graph, model, workload=lockstep, gen_precision="bfloat16", max_staleness=0)
        steps.append(("+ no log-prob recompute (AIPO uses mu's)", norecompute.sync_step_s))
        fp8 = _plan(graph, model, workload=lockstep, gen_precision="float8", max_staleness=0)
        steps.append(("+ fp8 generator (quantized)", fp8.sync_step_s))
        cont = _plan(graph, model, workload=continuous, gen_precision="float8", max_staleness=0)
        steps.append(("+ continuous batching (long tail removed within a step)", cont.sync_step_s))
        best = _plan(graph, model, workload=continuous, gen_precision="float8", max_staleness=1)
        steps.append(("+ asynchronous k=1: generation, training and weight sync overlapped (flowrl's plan)", best.step_s))
        mechanisms = []
        for (name, t), (_, prev) in zip(steps[1:], steps):
            mechanisms.append({"mechanism": name, "step_s": round(t, 2), "x_vs_previous": round(prev / t, 2) if prev and t else None})
        speedup = baseline_s / best.step_s if baseline_s else None
        pub = PUBLISHED[model]
        rows.append(
            {
                "model": model,
                "cluster": LLAMARL_CLUSTER,
                "baseline": {
                    "system": SYNC_BASELINE.name,
                    "placement": base.all_devices.short() if base.all_devices else None,
                    "sync_step_s": round(baseline_s, 2) if baseline_s else None,
                    **(_sides(base.all_devices, gens) if base.all_devices else {}),
                    "best_subset_sync_step_s": round(base.best_subset.steps.sync_step_s, 2) if base.best_subset else None,
                    "best_subset_devices": base.best_subset.split.gen_count if base.best_subset and base.best_subset.split else None,
                    "problem": base.problem,
                },
                "flowrl": {
                    "placement": str(best),
                    "family": best.family,
                    "async_step_s": round(best.async_step_s, 2),
                    "bottleneck": best.bottleneck,
                },
                "predicted_speedup": round(speedup, 2) if speedup else None,
                "predicted_speedup_vs_best_subset_baseline": round(base.best_subset.steps.sync_step_s / best.step_s, 2) if base.best_subset else None,
                "published": pub,
                "speedup_within_2x_of_published": bool(speedup and pub["speedup"] / 2 <= speedup <= pub["speedup"] * 2),
                "mechanisms": mechanisms,
            }
        )
    return rows


#: The workload sweep for LlamaRL's 70B and 405B (``llamarl_workload_sweep``): completions' limit and prompts a step.
SWEEP_GEN_LENS = (512, 1024, 2048, 4096)
SWEEP_PROMPTS = (256, 1024)


def llamarl_workload_sweep(models: tuple[str, ...] = ("llama3-70b", "llama3-405b")) -> list[dict]:
    """Which workload reproduces LlamaRL's 70B and 405B speedups, if any: the baseline (all devices) and
    flowrl's best asynchronous step over ``SWEEP_GEN_LENS`` x ``SWEEP_PROMPTS`` (8 samples a prompt,
    512-token prompts, a mean of half the limit with 5% at it, as ``LLAMARL_WORKLOAD``), and the point
    closest to the published speedup with its step times beside the published ones."""
    graph = build_example("llamarl")
    rows = []
    for model in models:
        points = []
        for gen_len in SWEEP_GEN_LENS:
            for prompts in SWEEP_PROMPTS:
                work = msgspec.structs.replace(
                    LLAMARL_WORKLOAD, prompts_per_step=prompts, gen_len=gen_len, lengths=mean_and_tail(mean=gen_len / 2, max_len=gen_len, tail_frac=0.05)
                )
                ctx = Context(cluster=parse_cluster(LLAMARL_CLUSTER), workload=work, tuning=make_tuning())
                base = plan_baseline(graph, ctx, model=model_preset(model), system=SYNC_BASELINE).all_devices
                best = _plan(graph, model, workload=msgspec.structs.replace(work, batching="continuous"), gen_precision="float8", max_staleness=1)
                if base is None:
                    continue
                sync_s = base.steps.sync_step_s
                points.append({"gen_len": gen_len, "prompts": prompts, "baseline_s": round(sync_s, 1), "async_s": round(best.step_s, 1), "speedup": round(sync_s / best.step_s, 2)})
        pub = PUBLISHED[model]
        closest = min(points, key=lambda p: abs(p["speedup"] / pub["speedup"] - 1))
        rows.append(
            {
                "model": model,
                "published": pub,
                "points": points,
                "max_predicted_speedup": max(p["speedup"] for p in points),
                "closest_to_published_speedup": closest,
                "closest_baseline_over_published": round(closest["baseline_s"] / pub["sync_s"], 2),
                "closest_async_over_published": round(closest["async_s"] / pub["async_s"], 2),
            }
        )
    return rows


def weight_sync_table() -> list[dict]:
    graph = build_example("llamarl")
    rows = []
    for model, reported in PUBLISHED_SYNC.items():
        best = _plan(graph, model, workload=msgspec.structs.replace(LLAMARL_WORKLOAD, batching="continuous"), gen_precision="float8")
        s = best.weight_syncs[0]
        rows.append({"model": model, "predicted_s": round(s.time_s, 3), "llamarl_reported_s": reported, "predicted_over_reported": round(s.time_s / reported, 2), "how": s.note})
    return rows


# -- 4. search time -------------------------------------------------------------------------------
def search_times(repeats: int) -> list[dict]:
    graph = build_example("llamarl")
    rows = []
    for cluster, goal in (("1024xH100", 1.0), ("16384x8xH100", 10.0)):
        for model in ("llama3-8b", "llama3-70b", "llama3-405b"):
            best_cpu = best_wall = float("inf")
            for _ in range(repeats):
                t0, c0 = time.perf_counter(), time.process_time()
                plan = plan_graph(graph, cluster, model=model_preset(model), workload=LLAMARL_WORKLOAD, gen_precision="float8")
                best_cpu = min(best_cpu, time.process_time() - c0)
                best_wall = min(best_wall, time.perf_counter() - t0)
            rows.append(
                {
                    "devices": plan.cluster_spec.n_devices,
                    "model": model,
                    "search_cpu_s": round(best_cpu, 3),
                    "search_wall_s": round(best_wall, 3),
                    "goal_cpu_s": goal,
                    "placements_estimated": plan.search.evaluated,
                    "placement": str(plan),
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--example", default="llamarl", help="the built-in example measured on this machine (default: llamarl)")
    parser.add_argument("--steps", type=int, default=30, help="trainer steps of each measured run (default: 30)")
    parser.add_argument("--batching", choices=("lockstep", "continuous"), help="the generator's batching the prediction assumes (default: the graph's)")
    parser.add_argument("--repeats", type=int, default=1, help="search timings: best of this many (default: 1)")
    parser.add_argument("--trace-dir", help="write predicted and measured Chrome traces of each measured run here")
    parser.add_argument("--skip-measure", action="store_true", help="leave out the runs on this machine")
    parser.add_argument("--skip-search", action="store_true", help="leave out the search timings")
    args = parser.parse_args()
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
    out: dict = {
        "llamarl_workload": {**msgspec.to_builtins(LLAMARL_WORKLOAD), "short": LLAMARL_WORKLOAD.short()},
        "llamarl": llamarl_table(),
        "weight_sync": weight_sync_table(),
        "llamarl_workload_sweep": llamarl_workload_sweep(),
        "peers": peers_table(),
    }
    if not args.skip_search:
        out["search_time"] = search_times(args.repeats)
    if not args.skip_measure:
        out["cpu_predicted_vs_measured"] = cpu_predicted_vs_measured(args.example, args.steps, args.batching, args.trace_dir)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
