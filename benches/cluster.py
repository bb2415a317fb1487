"""The cluster layout on this CPU: a 3-rank torchrun job (vLLM generator on rank 0, FSDP2 policy on ranks
1-2) on a Qwen2.5-0.5B-shaped model, its step time split, and the planner's prediction for the same layout.

The model is ``benches/weight_sync.py``'s (358M parameters, built from a config with random weights);
the task is the HF example's (copy a word) with 2 prompts x 4 samples x 24 new tokens per step, k = 1.
Weights take the direct route (``flowrl/runtime/weights/direct_route.py``): the policy's FSDP2 ranks
gather each bucket and send it straight into vLLM's worker over the weight-sync group; rank 0 only
coordinates and holds no staging copy. The planner prices the same route (``planners/estimate/direct.py``)
and the policy as torchrun runs it: two one-thread processes, each half the batch at the one-core rate,
their gathers and reduce-scatters over gloo, not overlapped (3 ranks and vLLM's worker on 2 cores).

Prints one JSON object:
- ``measured``: per step (median and range over the steps after the first two: vLLM's start and
  the first updates are warm-up) ``step_s`` (the interval between rows), ``gen_s``, ``train_s``,
  ``sync_s`` (the generator's wait for and load of new weights into vLLM) and
  ``idle_s``, as the metrics rows give them; peak RSS per rank is not sampled here
  (``weight_sync.py``'s FSDP cases sample every rank's, per phase);
- ``predicted``: ``flowrl plan`` of the same graph on a CPU calibrated right before the run
  (``flowrl calibrate --graph``: the model's width, vLLM's own decode and sync rates and gloo's collective rate
  between two processes, ``flowrl.calibration.gloo_rate``) with the same placement (``gen:d1@0 | policy:d2@1-2``), its step and its
  parts, and predicted / measured (goal 0.77-1.3). The plan has 3 devices, one per rank, on this
  machine's cores (``calibrated_cluster(m, cores=3)``: ``CpuTerms.host_cores`` = the cores measured):
  with 3 ranks on 2 cores, meshes busy together time-share them (``schedule.shared_step_s``).

``predicted_over_measured_parts`` sets each predicted part beside its measured median: ``gen_s`` (the
generator node's time), ``train_s`` (the policy's), ``sync_s`` (the weight edge's) and ``idle_s`` (the
trainer's wait for its batch: the predicted step minus the policy's time).

``--layers N`` keeps the 0.5B shape with N decoder layers (less memory and time: 6 layers, ~110M parameters).

Run: python benches/cluster.py [--steps 8] [--layers 24]   (24 layers: about 10 minutes on 2 cores; peak memory ~20 GB: vLLM's worker 6.4 GB, each policy rank 4.5-4.7 GB)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benches"))

#: The layout's graph file (also ``weight_sync_fsdp.py``'s): the HF example's task on a Qwen2.5-0.5B-shaped
#: model, a vLLM generator and an FSDP2 policy; ``name``, ``model``, ``max_new_tokens`` and ``transport``.
GRAPH = '''
"""The HF example's task, a Qwen2.5-0.5B-shaped model: vLLM generator, FSDP2 policy."""
from flowrl import GraphBuilder
from flowrl.examples.hf_copy import ASSETS
from flowrl.graph.configs import HFModelConfig


def build_graph():
    b = GraphBuilder({name!r}, model=HFModelConfig(path={model!r}, init="random", seed=0))
    prompts = b.source("prompts", data=str(ASSETS / "prompts.jsonl"), prompt_field="prompt", batch_size=2)
    gen = b.generator("gen", prompts, n_samples=4, max_new_tokens={max_new_tokens}, temperature=1.0, engine="vllm")
    score = b.scorer("reward", gen, fn="flowrl.examples.hf_copy:reward", inputs="text")
    aipo = b.loss("aipo", gen, score, objective="aipo", rho=4.0)
    policy = b.policy("policy", aipo, lr=1e-5, sharding="fsdp")
    b.weights(policy, gen, transport={transport!r}, max_staleness=1)
    return b.build()
'''

STRATEGY = "gen:d1@0 | policy:d2@1-2"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def _predict(graph_file: Path) -> dict:
    """The planner's step for STRATEGY on this CPU calibrated now (``flowrl calibrate``'s measurements)
    as a 3-device cluster: one device per rank, on the cores measured (more ranks than cores time-share them)."""
    from flowrl.calibration.gloo_rate import measure_gloo, with_gloo
    from flowrl.calibration.measure import calibrated_cluster, measure
    from flowrl.calibration.needs import calibration_needs
    from flowrl.calibration.vllm_rates import measure_vllm, with_vllm
    from flowrl.graph.refs import load_file_module
    from flowrl.planners.plan import plan_graph

    graph = load_file_module(graph_file).build_graph()
    needs = calibration_needs(graph)  # as `flowrl calibrate --graph`: the model's width, vLLM's own rates, gloo's (FSDP2)
    m = measure(widths=needs.widths)
    if needs.gloo:  # before vLLM, whose processes take a while to leave
        m = with_gloo(m, measure_gloo())
    if needs.vllm_model is not None:
        m = with_vllm(m, measure_vllm(needs.vllm_model, rows=needs.vllm_rows, new_tokens=needs.vllm_new_tokens))
    plan = plan_graph(graph, calibrated_cluster(m, cores=3), strategy=STRATEGY, max_staleness=1)
    return {
        "calibrated": {"vllm_decode_speedup": round(m.cpu.vllm_decode_speedup, 2), "vllm_sync_gb_per_s": round(m.cpu.vllm_sync_bandwidth / 1e9, 3),
                       "gloo_gb_per_s_by_mib": {f"{n / 2**20:g}": round(r / 1e9, 3) for n, r in m.cpu.gloo_by_bytes}, "train_gflops_at_width": round(m.cpu.train_flops_by_width[-1][1] / 1e9, 2)},
        "placement": str(plan),
        "step_s": round(plan.step_s, 3),
        "sync_step_s": round(plan.sync_step_s, 3),
        "nodes_s": {n: round(p.time_s, 3) for n, p in plan.placements.items()},
        "policy_parts_s": {k: round(v, 3) for k, v in plan.placements["policy"].breakdown.items() if v},
        "syncs": [{"transport": sy.transport, "time_s": round(sy.time_s, 3), "note": sy.note} for sy in plan.weight_syncs],
        "bottleneck": plan.bottleneck,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--layers", type=int, default=24, help="decoder layers of the 0.5B shape (fewer: less memory)")
    args = parser.parse_args()
    if args.steps < 3 or args.layers < 1:
        parser.error(f"--steps ({args.steps}) must be >= 3 (the first two are warm-up) and --layers ({args.layers}) >= 1")
    from weight_sync import write_model_dir

    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLOWRL_DIST_TIMEOUT_S": "600"}
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        model = write_model_dir(tmp_path / "qwen05", layers=args.layers)
        (tmp_path / "graph.py").write_text(GRAPH.format(name="cluster_bench", model=str(model), max_new_tokens=24, transport="inprocess"))
        (tmp_path / "place.json").write_text(json.dumps({"gen": [0], "policy": [1, 2]}))
        load_before = os.getloadavg()[0]
        predicted = _predict(tmp_path / "graph.py")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "-m", "flowrl", "run", "graph.py", "--backend", "torchrun",
               "--plan", "place.json", "--steps", str(args.steps), "--metrics", "m.jsonl", "--quiet"]
        run = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
        if run.returncode != 0:
            sys.exit(f"the torchrun job failed:\n{run.stderr[-4000:]}")
        rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    steady = rows[2:] or rows
    measured = {key: _spread([float(r[key]) for r in steady]) for key in ("gen_s", "train_s", "sync_s", "idle_s") if key in steady[0]}
    # a row's time_s is the run's clock at that step's end: the step is the interval between rows
    measured["step_s"] = _spread([b["time_s"] - a["time_s"] for a, b in zip(rows[1:], rows[2:])] or [rows[-1]["time_s"]])
    step_s = predicted["step_s"]
    parts = {
        "gen_s": predicted["nodes_s"].get("gen", 0.0),
        "train_s": predicted["nodes_s"].get("policy", 0.0),
        "sync_s": sum(sy["time_s"] for sy in predicted["syncs"]),
        "idle_s": max(step_s - predicted["nodes_s"].get("policy", 0.0), 0.0),
    }
    out = {
        "model": f"Qwen2.5-0.5B-shaped, {args.layers} layers (fp32), 2 prompts x 4 samples x 24 tokens, k = 1",
        "layout": STRATEGY,
        "steps": len(rows),
        "measured": measured,
        "reward_mean_first_last": [round(rows[0]["reward_mean"], 3), round(rows[-1]["reward_mean"], 3)],
        "predicted": predicted,
        "predicted_over_measured": round(step_s / measured["step_s"]["median"], 2),
        "predicted_over_measured_parts": {
            k: {"predicted": round(v, 3), "measured": measured[k]["median"], "ratio": round(v / measured[k]["median"], 2) if measured[k]["median"] else None}
            for k, v in parts.items() if k in measured
        },
        "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "cpus": os.cpu_count(),
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
