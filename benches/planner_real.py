"""Predicted against measured at real size on this CPU: a Qwen2.5-0.5B-shaped model, each engine, each backend.

The model is ``benches/weight_sync.py``'s (Qwen2.5-0.5B's shape: hidden 896, 24 layers, 14 heads, 2 KV
heads, MLP 4864, tied embeddings; a 320-token vocabulary: ~358M parameters, float32, built from a
config with random weights; ``--layers N`` keeps the shape with N layers where memory is short). The
task is the HF example's (copy a word, its prompt file): 2 prompts x 4 samples x ``--new-tokens`` (24)
new tokens a step, AIPO, max_staleness ``--k`` (1).

For each engine (``--engines``: ``builtin``, ``vllm``), right before its runs: ``flowrl calibrate
--graph``'s measurements (``measure()``: every core at once, median, with the pass rates measured at
the graph's model width too, ``flowrl.calibration.needs``; for a vLLM generator also vLLM's decode
speed-up and weight-sync rate at the model's shape, ``flowrl.calibration.vllm_rates``) and the plan
``flowrl plan`` makes of the graph on that calibrated CPU (the prompt length read from the graph's
prompt file, as ``flowrl plan`` reads it; the completions at their limit: a random model rarely
stops); then, for each backend (``--backends``: ``local``, threads in this process; ``process``, an
OS process per executor, whose weights go over shared memory: its graph's weight edge says
``shm``, so the plan prices the two copies that backend makes; ``torchrun``, a job of one rank per
plan device started as ``torchrun -m flowrl run GRAPH --backend torchrun --plan PLAN``, its weight
edge ``collective``: rank to rank), a run with that plan's placement, ``--steps`` steps. Per engine
and backend:

- ``predicted``: the plan's step and its parts: ``generate_s`` (the generator), ``train_s`` (the
  policy), ``sync_s`` (the weight syncs);
- ``measured``: median, min and max over the steps after the first two (warm-up) of the row's
  interval (``step_s``) and its ``gen_s``, ``train_s`` and ``sync_s`` (publish + fetch + load);
- ``ratio``: predicted / median measured, each (goal 0.77-1.3);
- ``predicted_at_measured_lengths``: the same plan at the completion lengths the run drew
  (``flowrl plan --lengths-from`` its metrics), which separates the workload's guess from the cost model;
- the calibration's figures and the 1-minute load before and after.

Prints one JSON object.

    python benches/planner_real.py                          # both engines, local backend, 24 layers, 6 steps (~10 min on 2 cores, ~14 GB with vLLM)
    python benches/planner_real.py --engines builtin --layers 12 --steps 4
    python benches/planner_real.py --backends local,process --layers 6 --steps 4
    python benches/planner_real.py --backends torchrun --layers 6 --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: the sibling benches' helpers

from weight_sync import write_model_dir  # noqa: E402

from flowrl.calibration.measure import calibrated_cluster, measure  # noqa: E402
from flowrl.calibration.needs import calibration_needs  # noqa: E402
from flowrl.calibration.vllm_rates import measure_vllm, with_vllm  # noqa: E402
from flowrl.cli.plan import lengths_from_metrics  # noqa: E402
from flowrl.cli.prompt_lengths import prompt_len_from_file  # noqa: E402
from flowrl.examples.hf_copy import ASSETS  # noqa: E402
from flowrl.graph.builder import GraphBuilder  # noqa: E402
from flowrl.graph.configs import HFModelConfig  # noqa: E402
from flowrl.graph.ir import Graph  # noqa: E402
from flowrl.planners.plan import Plan, plan_graph, save_plan  # noqa: E402
from flowrl.planners.workload import workload_from_graph  # noqa: E402
from flowrl.runtime.config import RunConfig  # noqa: E402
from flowrl.runtime.run import run_graph  # noqa: E402

import msgspec  # noqa: E402


def build_graph(model_dir: Path, engine: str, new_tokens: int, k: int, transport: str = "inprocess") -> Graph:
    """The HF example's task on the model in ``model_dir``: ``engine``'s generator, a replicated policy,
    weights over ``transport``."""
    b = GraphBuilder("real_size", model=HFModelConfig(path=str(model_dir), init="random", seed=0))
    prompts = b.source("prompts", data=str(ASSETS / "prompts.jsonl"), prompt_field="prompt", batch_size=2)
    gen = b.generator("gen", prompts, n_samples=4, max_new_tokens=new_tokens, temperature=1.0, engine=engine)
    score = b.scorer("reward", gen, fn="flowrl.examples.hf_copy:reward", inputs="text")
    aipo = b.loss("aipo", gen, score, objective="aipo", rho=4.0)
    policy = b.policy("policy", aipo, lr=1e-5)
    b.weights(policy, gen, max_staleness=k, transport=transport)
    return b.build()


def _parts(plan: Plan) -> dict[str, float]:
    kinds = {n: p.kind for n, p in plan.placements.items()}
    part = lambda *wanted: sum(p.time_s for n, p in plan.placements.items() if kinds[n] in wanted)  # noqa: E731
    return {
        "step_s": plan.step_s,
        "gen_s": part("generator"),
        "train_s": part("policy", "reference"),
        "sync_s": sum(s.time_s for s in plan.weight_syncs),
    }


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


#: The weight edge's transport per backend: what that backend runs (the process backend turns
#: ``inprocess``, which cannot cross processes, into ``shm``), so the plan prices what runs.
TRANSPORTS = {"local": "inprocess", "process": "shm", "torchrun": "collective"}


def calibrate(graph: Graph) -> tuple[object, dict]:
    """``flowrl calibrate --graph``'s measurements for ``graph`` and what they say, in a dict."""
    needs = calibration_needs(graph)
    m = measure(widths=needs.widths)
    vllm = None
    if needs.vllm_model is not None:
        vllm = measure_vllm(needs.vllm_model, rows=needs.vllm_rows, new_tokens=needs.vllm_new_tokens)
        m = with_vllm(m, vllm)
    dev = calibrated_cluster(m).device
    width = needs.widths[-1]
    return m, {
        f"gflops_per_core_at_width_{width}": {kind: round(dev.flops_at(width, kind) / 1e9, 1) for kind in ("forward", "decode", "train")},
        "widths_measured": [w for w, _ in m.cpu.train_flops_by_width],
        "thread_speedup": round(m.cpu.thread_speedup, 2),
        "gen_thread_speedup": round(m.cpu.gen_thread_speedup, 2),
        "shared_slowdown": round(m.cpu.shared_slowdown, 2),
        "decode_step_overhead_us": round(m.cpu.decode_step_overhead_s * 1e6, 1),
        **({"vllm_decode_speedup": round(vllm.decode_speedup, 2), "vllm_sync_gb_per_s": round(vllm.sync_bandwidth / 1e9, 3)} if vllm else {}),
        "cores": m.cores,
    }


#: A rare abort of torchrun jobs on this machine outside flowrl's Python (tests/runtime/test_torchrun.py).
CXX_ABORT = "terminate called without an active exception"


def _torchrun_rows(graph: Graph, plan_path: Path, metrics: Path, plan: Plan, args: argparse.Namespace, graph_path: Path) -> list[dict]:
    """``flowrl run --backend torchrun`` of ``graph`` with the plan, one rank per plan device, in a
    torchrun job of its own; its metrics rows."""
    import socket
    import subprocess

    from flowrl.graph.serialize import to_json

    graph_path.write_text(to_json(graph))
    ranks = 1 + max(d for p in plan.placements.values() for d in p.devices)
    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{port}", "-m", "flowrl", "run", str(graph_path), "--backend", "torchrun",
        "--plan", str(plan_path), "--steps", str(args.steps), "--max-staleness", str(args.k), "--metrics", str(metrics), "--quiet",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0 and CXX_ABORT in proc.stderr:  # tests/runtime/test_torchrun.py's rare abort: once more, said
        print(f"a torchrun rank aborted in C++ ({CXX_ABORT}); running the job once more", file=sys.stderr, flush=True)
        metrics.unlink(missing_ok=True)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"torchrun job failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def one_run(model_dir: Path, engine: str, backend: str, m: object, args: argparse.Namespace, folder: Path) -> dict:
    """Plan ``engine``'s graph on the calibrated CPU ``m``, run it on ``backend``, compare."""
    graph = build_graph(model_dir, engine, args.new_tokens, args.k, TRANSPORTS[backend])
    load_before = os.getloadavg()[0]
    cluster = calibrated_cluster(m)
    prompt_len, prompt_len_from = prompt_len_from_file(graph) or (None, None)
    workload = workload_from_graph(graph, prompt_len=prompt_len, prompt_len_from=prompt_len_from)
    strategy = "disaggregated" if args.k else "colocated"
    plan = plan_graph(graph, cluster, strategy=strategy, max_staleness=args.k, workload=workload)
    name = f"{engine}-{backend}"
    save_plan(plan, str(folder / f"{name}.plan.json"))
    metrics = folder / f"{name}.metrics.jsonl"
    config = RunConfig(steps=args.steps, max_staleness=args.k, metrics=str(metrics), progress=False, backend=backend)
    if backend == "torchrun":
        rows = _torchrun_rows(graph, folder / f"{name}.plan.json", metrics, plan, args, folder / f"{name}.graph.json")
    else:
        rows = run_graph(graph, plan.placement(source=f"plan:{folder / f'{name}.plan.json'}"), config).rows
    steady = rows[2:] or rows
    measured = {key: _spread([float(r[key]) for r in steady]) for key in ("gen_s", "train_s", "sync_s")}
    measured["step_s"] = _spread([b["time_s"] - a["time_s"] for a, b in zip(rows[1:], rows[2:])] or [rows[-1]["time_s"]])
    lengths = lengths_from_metrics(str(metrics))
    at_lengths = plan_graph(graph, cluster, strategy=strategy, max_staleness=args.k, workload=msgspec.structs.replace(workload, lengths=lengths))
    predicted, predicted_drawn = _parts(plan), _parts(at_lengths)
    return {
        "placement": str(plan),
        "transport": TRANSPORTS[backend],
        "workload": workload.short(),
        "prompt_len_from": prompt_len_from,
        "predicted": {k: round(v, 3) for k, v in predicted.items()},
        "measured": measured,
        "ratio": {k: round(predicted[k] / measured[k]["median"], 2) if measured[k]["median"] > 0 else None for k in predicted},
        "predicted_at_measured_lengths": {**{k: round(v, 3) for k, v in predicted_drawn.items()}, "mean_completion": round(lengths.mean, 2)},
        "ratio_at_measured_lengths": {k: round(predicted_drawn[k] / measured[k]["median"], 2) if measured[k]["median"] > 0 else None for k in predicted},
        "steps": len(rows),
        "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="builtin,vllm", help="comma-separated: builtin, vllm (default: both)")
    parser.add_argument("--layers", type=int, default=24, help="transformer blocks of the 0.5B shape (default: 24, all of them)")
    parser.add_argument("--steps", type=int, default=6, help="steps of each run; the first two are warm-up (default: 6)")
    parser.add_argument("--new-tokens", type=int, default=24, help="max_new_tokens (default: 24)")
    parser.add_argument("--k", type=int, default=1, help="max_staleness: 0 colocated, else disaggregated (default: 1)")
    parser.add_argument("--backends", default="local", help="comma-separated: local, process, torchrun (default: local)")
    args = parser.parse_args()
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    backends = [e.strip() for e in args.backends.split(",") if e.strip()]
    unknown = sorted(set(engines) - {"builtin", "vllm"}) + sorted(set(backends) - set(TRANSPORTS))
    if unknown or not engines or not backends or args.layers < 1 or args.steps < 3:
        parser.error(f"--engines takes builtin and vllm, --backends local, process and torchrun (unknown: {unknown}); --layers >= 1; --steps >= 3 (two are warm-up)")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model_dir = write_model_dir(folder / "qwen05", layers=args.layers)
        out: dict = {
            "model": f"Qwen2.5-0.5B-shaped, {args.layers} of 24 layers, vocabulary 320, float32, random weights",
            "task": f"2 prompts x 4 samples x {args.new_tokens} new tokens, AIPO, k = {args.k}",
            "cpus": os.cpu_count(),
        }
        for engine in engines:
            print(f"{engine}: calibrating", file=sys.stderr, flush=True)
            load_before = os.getloadavg()[0]
            m, calibrated = calibrate(build_graph(model_dir, engine, args.new_tokens, args.k))
            out[engine] = {"calibrated": {**calibrated, "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)]}}
            for backend in backends:
                print(f"{engine}, {backend} backend: planning, running {args.steps} steps", file=sys.stderr, flush=True)
                out[engine][backend] = one_run(model_dir, engine, backend, m, args, folder)
                print(json.dumps({engine: {backend: out[engine][backend]}}), file=sys.stderr, flush=True)  # figures as soon as they exist
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
