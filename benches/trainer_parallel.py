"""Trainer layouts on CPU ranks: one process, FSDP2 dp = 2, tp = 2 and pp = 2, each a torchrun job through
flowrl's own path (``flowrl run GRAPH --backend torchrun --plan placement.json``), beside the planner's
prediction for the same layout.

The graph is the HF example's (its prompts; 2 prompts x 4 samples x ``--new-tokens`` new tokens a step,
AIPO; a reward hashed from each completion's text, ``REWARD``, since the copy reward of a random model
is 0 everywhere) on a Qwen2.5-0.5B-shaped model (hidden 896, 14 heads of 64, 2 KV heads, MLP 4864, 320-token
vocabulary, ``--layers`` decoder layers, float32, random weights, seed 0): the built-in generator on rank
0, the policy on rank 1 (``one``) or ranks 1-2 (the others), ``max_staleness=0`` so that the policy
trains alone while the generator waits. The layouts (``LAYOUTS``):

- ``one``: ``{"gen": [0], "policy": [1]}``;
- ``dp2``: ``{"gen": [0], "policy": [1, 2]}`` with ``sharding="fsdp"`` (FSDP2 over the two ranks);
- ``tp2``: ``{"gen": [0], "policy": {"ranks": [1, 2], "mesh": {"tp": 2}}}``;
- ``pp2``: ``{"gen": [0], "policy": {"ranks": [1, 2], "mesh": {"pp": 2}}}``, micro-batches of
  ``--pp-micro-batch`` sequences (the pipeline's micro-batches are the trainer's).

What ran is read from the run, not assumed: ``ran`` is what the run's first metrics row reports of its
meshes (any key naming a mesh, layout or role), else ``"not reported"``; and each rank's peak RSS is
set beside the one-process policy rank's (``rss_says``: a tp or pp rank holds about half the weights,
gradients and AdamW states, a data-parallel replica all of them). A layout the runtime refuses (a mesh axis it
cannot run) is printed with its error, and the others go on.

Prints one JSON object: per layout, the measured step (the interval between rows, median of the
steps after the first), ``train_s``, ``gen_s``, ``sync_s`` and ``idle_s`` (medians), the first step's
loss, gradient norm and entropy and their differences from ``one``'s (the same samples: the generator
runs the same initial weights),
peak RSS per rank (``VmHWM``, GiB), and the planner's prediction: ``flowrl plan``'s estimate of the
same placement on this CPU calibrated right before (``flowrl calibrate``'s pass rate at width 896 and
gloo's rate by size; one device per rank, on the cores measured), its step and policy parts
(``compute``, ``tp_comm``, ``pp_comm``, ``bubble``, ``dp_comm``, ``optimizer``), and predicted /
measured for the step and each part the run measures (goal 0.77-1.3).

``planned`` is issue 42's Done-when: ``flowrl plan graph.py --cluster cpu.json --emit launch`` (this CPU
calibrated, ``--ranks`` ranks; ``--emit`` plans for torchrun) picks the layout it finds fastest among
those the runtime runs, and ``bash launch/host0.sh`` runs it; the row says what it picked, what ran
and predicted / measured.

Run: python benches/trainer_parallel.py [--layers 4] [--steps 4] [--layouts one,dp2,tp2,pp2,planned] [--calibration FILE]
(about 1-2 minutes a layout on 2 cores at 4 layers, ~2 GB a policy rank).
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
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benches"))

GRAPH = '''
"""The HF example's task on a Qwen2.5-0.5B-shaped model: built-in generator, a policy laid out by the placement file."""
from flowrl import GraphBuilder
from flowrl.examples.hf_copy import ASSETS
from flowrl.graph.configs import HFModelConfig


def build_graph():
    b = GraphBuilder("trainer_parallel", model=HFModelConfig(path={model!r}, init="random", seed=0))
    prompts = b.source("prompts", data=str(ASSETS / "prompts.jsonl"), prompt_field="prompt", batch_size=2)
    gen = b.generator("gen", prompts, n_samples=4, max_new_tokens={new_tokens}, temperature=1.0)
    score = b.scorer("reward", gen, fn="bench_reward:reward", inputs="text")
    aipo = b.loss("aipo", gen, score, objective="aipo", rho=4.0)
    policy = b.policy("policy", aipo, lr=1e-5, sharding={sharding!r}, micro_batch_size={micro_batch})
    b.weights(policy, gen, max_staleness=0)
    return b.build()
'''

#: the scorer (a module beside the graph): the copy task's reward is 0 for every sample of a random
#: model, so no gradient would move and the first step's loss and gradient norm would be 0 in every
#: layout; a reward that differs between samples, and is the same for the same text in every run, is not
REWARD = '''
"""A reward that differs between samples and is the same for the same text in every run."""
import zlib


def reward(prompt: str, completion: str, answer: str) -> float:
    return zlib.crc32(completion.encode()) % 1000 / 1000
'''

#: layout -> (placement file, the policy's sharding, micro-batch: 0 or "pp"); the planner is given the
#: same placement (``placement.forms.decode_placement``'s string form, e.g. ``gen:d1@0 | policy:t2@1-2``)
LAYOUTS: dict[str, tuple[dict, str, str | int]] = {
    "one": ({"gen": [0], "policy": [1]}, "replicate", 0),
    "dp2": ({"gen": [0], "policy": [1, 2]}, "fsdp", 0),
    "tp2": ({"gen": [0], "policy": {"ranks": [1, 2], "mesh": {"tp": 2}}}, "replicate", 0),
    "pp2": ({"gen": [0], "policy": {"ranks": [1, 2], "mesh": {"pp": 2}}}, "replicate", "pp"),
}


def strategy(placement: dict, graph) -> str:
    """The planner's form of a placement file (``gen:d1@0 | policy:t2@1-2``)."""
    from flowrl.placement.forms import decode_placement

    return str(decode_placement(json.dumps(placement).encode(), graph, where="trainer_parallel"))
#: the policy's parts the planner prices
PARTS = ("compute", "tp_comm", "pp_comm", "bubble", "dp_comm", "optimizer")
#: a policy rank's peak RSS over the one-process rank's below which it holds a shard (FSDP2 dp=2 ran at
#: 0.75, tp and pp meshes run as replicas at 1.05-1.06: 4 layers, 2026-12-06)
RSS_SHARDED = 0.85
#: words of a metrics-row key that reports how the run laid its nodes out
LAYOUT_WORDS = ("mesh", "layout", "role", "ranks")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PeakRss:
    """Each torchrun worker's peak RSS (``VmHWM``), by its ``LOCAL_RANK``, sampled while in ``with``."""

    def __init__(self, parent: int, period_s: float = 0.25) -> None:
        self.parent, self.period_s = parent, period_s
        self.peak: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            for pid in _children(self.parent):
                rank, hwm = _rank_and_hwm(pid)
                if rank is not None:
                    self.peak[rank] = max(self.peak.get(rank, 0), hwm)
            self._stop.wait(self.period_s)


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return out


def _rank_and_hwm(pid: int) -> tuple[int | None, int]:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        rank = next((int(e.split(b"=", 1)[1]) for e in env if e.startswith(b"LOCAL_RANK=")), None)
        hwm = next(int(ln.split()[1]) * 1024 for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError):
        return None, 0
    return rank, hwm


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 3) if values else float("nan")


def _ran(first_row: dict) -> dict | str:
    """What the run's first row says of its layout: its keys naming a mesh, a layout or a role."""
    found = {k: v for k, v in first_row.items() if any(w in k.lower() for w in LAYOUT_WORDS)}
    return found or "not reported"


def _calibrate(path: str | None):
    """This CPU's measurements (``flowrl calibrate --gloo``'s, at width 896: gloo's rates and the split
    passes' efficiencies); with ``path``, read from it when it exists, else measured and written there."""
    import msgspec

    from flowrl.calibration.gloo_rate import measure_gloo, with_gloo
    from flowrl.calibration.measure import Measurements, measure
    from flowrl.calibration.rank_passes import RankShape, measure_rank_passes, with_rank_passes

    if path and Path(path).is_file():
        return msgspec.json.decode(Path(path).read_bytes(), type=Measurements)
    m = with_gloo(measure(widths=(896,)), measure_gloo())
    # the split passes at the bench's policy: the 0.5B shape (14 heads, 2 kv heads, MLP 4864), 8 sequences of ~29 tokens
    m = with_rank_passes(m, measure_rank_passes(RankShape(width=896, heads=14, kv_heads=2, ffn=4864, rows=8, tokens=29)))
    if path:
        Path(path).write_bytes(msgspec.json.encode(m))
    return m


def _predict(graph_file: Path, m, placement: dict, devices: int) -> dict:
    from flowrl.calibration.measure import calibrated_cluster
    from flowrl.errors import FlowrlError
    from flowrl.graph.refs import load_file_module
    from flowrl.planners.plan import plan_graph

    graph = load_file_module(graph_file).build_graph()
    try:
        plan = plan_graph(graph, calibrated_cluster(m, cores=devices), strategy=strategy(placement, graph), max_staleness=0, backend="torchrun")
    except FlowrlError as exc:
        return {"refused": str(exc)}
    policy = plan.placements["policy"]
    return {
        "placement": str(plan),
        "step_s": round(plan.step_s, 3),
        "nodes_s": {n: round(p.time_s, 3) for n, p in plan.placements.items()},
        "policy_parts_s": {k: round(policy.breakdown.get(k, 0.0), 4) for k in PARTS},
        "policy_notes": list(policy.notes),
        "policy_gib_per_rank": round(policy.memory.total / 2**30, 2),
        "sync_s": round(sum(s.time_s for s in plan.weight_syncs), 3),
    }


def write_job(work: Path, graph: str, placement: dict) -> None:
    """``work`` (created) with the job's ``graph.py``, ``place.json`` and reward module, importable here too."""
    work.mkdir()
    (work / "graph.py").write_text(graph)
    (work / "place.json").write_text(json.dumps(placement))
    (work / "bench_reward.py").write_text(REWARD)
    if str(work) not in sys.path:  # the planner builds the graph here, which names the scorer's module
        sys.path.insert(0, str(work))


def run_job(work: Path, ranks: int, steps: int, timeout: float) -> dict:
    """``flowrl run graph.py --backend torchrun --plan place.json`` on ``ranks`` ranks in ``work`` (the
    graph, placement and reward module written there): ``{"rows", "wall_s", "peak_rss" (rank -> bytes),
    "load"}`` (the 1-minute load at start), or ``{"failed", "stderr_tail"}``. Shared with ``moe_layouts.py``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(ROOT), str(work), *filter(None, [os.environ.get("PYTHONPATH")]))), "OMP_NUM_THREADS": "1", "FLOWRL_DIST_TIMEOUT_S": "600"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "-m", "flowrl", "run", "graph.py", "--backend", "torchrun",
           "--plan", "place.json", "--steps", str(steps), "--metrics", "m.jsonl", "--quiet"]  # fmt: skip
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with PeakRss(proc.pid) as rss:
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()  # torchrun's own process: it ends its workers
            _, err = proc.communicate()
            return {"failed": f"took over {timeout} s", "stderr_tail": err[-2000:]}
    wall = time.monotonic() - t0
    metrics = work / "m.jsonl"
    if proc.returncode != 0 or not metrics.is_file():
        tail = [ln for ln in err.splitlines() if ln.strip()][-12:]
        return {"failed": f"exit {proc.returncode}", "stderr_tail": "\n".join(tail)}
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {"rows": rows, "wall_s": wall, "peak_rss": dict(rss.peak), "load": load}


def _run_layout(name: str, tmp: Path, model: Path, args, m) -> dict:
    placement, sharding, micro = LAYOUTS[name]
    micro_batch = args.pp_micro_batch if micro == "pp" else micro
    work = tmp / name
    write_job(work, GRAPH.format(model=str(model), new_tokens=args.new_tokens, sharding=sharding, micro_batch=micro_batch), placement)
    ranks = max(max(v if isinstance(v, list) else v["ranks"]) for v in placement.values()) + 1
    predicted = _predict(work / "graph.py", m, placement, ranks)
    job = run_job(work, ranks, args.steps, args.timeout)
    if "failed" in job:
        return {"placement": placement, **job, "predicted": predicted}
    rows, wall, rss, load = job["rows"], job["wall_s"], job["peak_rss"], job["load"]
    steady = rows[1:] or rows
    measured = {k: _median([float(r[k]) for r in steady]) for k in ("train_s", "gen_s", "sync_s", "idle_s")}
    measured["step_s"] = _median([b["time_s"] - a["time_s"] for a, b in zip(rows, rows[1:])] or [rows[0]["time_s"]])
    result = {
        "placement": placement,
        "ran": _ran(rows[0]),
        "steps": len(rows),
        "wall_s": round(wall, 1),
        "measured": measured,
        "first_loss": rows[0]["loss"],
        "first_grad_norm": rows[0].get("policy/grad_norm"),
        "first_entropy": rows[0].get("policy/entropy"),
        "peak_rss_gib_by_rank": {str(r): round(b / 2**30, 2) for r, b in sorted(rss.items())},
        "predicted": predicted,
        "loadavg_1m": [round(load, 2), round(os.getloadavg()[0], 2)],
    }
    if "step_s" in predicted:
        result["predicted_over_measured"] = {
            "step": round(predicted["step_s"] / measured["step_s"], 2) if measured["step_s"] else None,
            "train": round(predicted["nodes_s"]["policy"] / measured["train_s"], 2) if measured["train_s"] else None,
            "gen": round(predicted["nodes_s"]["gen"] / measured["gen_s"], 2) if measured["gen_s"] else None,
        }
    return result


def _run_planned(tmp: Path, model: Path, args, m) -> dict:
    """The Done-when of issue 42: ``flowrl plan graph.py --cluster <this CPU calibrated, --ranks ranks> --emit launch``
    picks the layout its search finds fastest among those that run under torchrun, then the emitted
    ``launch/host0.sh`` runs it here; its rows are set beside the plan's prediction."""
    from flowrl.calibration.measure import calibrated_cluster
    from flowrl.planners.cluster import cluster_to_json
    from flowrl.planners.plan import load_plan

    work = tmp / "planned"
    work.mkdir()
    (work / "graph.py").write_text(GRAPH.format(model=str(model), new_tokens=args.new_tokens, sharding="replicate", micro_batch=args.pp_micro_batch))
    (work / "bench_reward.py").write_text(REWARD)
    (work / "cpu.json").write_bytes(cluster_to_json(calibrated_cluster(m, cores=args.ranks)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(ROOT), str(work), *filter(None, [os.environ.get("PYTHONPATH")]))), "OMP_NUM_THREADS": "1", "FLOWRL_DIST_TIMEOUT_S": "600"}
    plan_cmd = [sys.executable, "-m", "flowrl", "plan", "graph.py", "--cluster", "cpu.json", "--emit", "launch"]
    planned = subprocess.run(plan_cmd, cwd=work, env=env, capture_output=True, text=True, timeout=300)
    if planned.returncode != 0:
        return {"failed": f"flowrl plan exit {planned.returncode}", "stderr_tail": planned.stderr[-2000:]}
    plan = load_plan(work / "launch" / "plan.json")
    policy = plan.placements["policy"]
    predicted = {
        "placement": str(plan), "step_s": round(plan.step_s, 3), "nodes_s": {n: round(p.time_s, 3) for n, p in plan.placements.items()},
        "policy_parts_s": {k: round(policy.breakdown.get(k, 0.0), 4) for k in PARTS},
        "runners_up": [f"{a.placement} ({a.step_s:.3g} s)" for a in plan.alternatives][:6],
    }
    load = os.getloadavg()[0]
    proc = subprocess.run(["bash", "launch/host0.sh", "--steps", str(args.steps), "--metrics", "m.jsonl", "--quiet"], cwd=work, env=env,
                          capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0 or not (work / "m.jsonl").is_file():
        return {"predicted": predicted, "failed": f"exit {proc.returncode}", "stderr_tail": proc.stderr[-2000:]}
    rows = [json.loads(line) for line in (work / "m.jsonl").read_text().splitlines()]
    steady = rows[1:] or rows
    measured = {k: _median([float(r[k]) for r in steady]) for k in ("train_s", "gen_s", "sync_s", "idle_s")}
    measured["step_s"] = _median([b["time_s"] - a["time_s"] for a, b in zip(rows, rows[1:])] or [rows[0]["time_s"]])
    return {
        "command": " ".join(plan_cmd[2:]) + f" && bash launch/host0.sh --steps {args.steps}",
        "predicted": predicted,
        "ran": _ran(rows[0]),
        "measured": measured,
        "predicted_over_measured": {
            "step": round(predicted["step_s"] / measured["step_s"], 2) if measured["step_s"] else None,
            "train": round(predicted["nodes_s"]["policy"] / measured["train_s"], 2) if measured["train_s"] else None,
            "gen": round(predicted["nodes_s"]["gen"] / measured["gen_s"], 2) if measured["gen_s"] else None,
        },
        "loadavg_1m": [round(load, 2), round(os.getloadavg()[0], 2)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the 0.5B shape")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--pp-micro-batch", type=int, default=2, help="sequences per pipeline micro-batch (pp2)")
    parser.add_argument("--layouts", default=",".join((*LAYOUTS, "planned")), help=f"comma-separated among {', '.join(LAYOUTS)}, planned")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a layout's run may take")
    parser.add_argument("--calibration", default=None, help="a file of this CPU's measurements: read if it exists, else measured and written")
    parser.add_argument("--ranks", type=int, default=3, help="ranks of the planned layout ('planned': flowrl plan --emit, then the emitted launch)")
    args = parser.parse_args()
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    unknown = [x for x in layouts if x not in LAYOUTS and x != "planned"]
    if unknown or not layouts or args.steps < 2 or args.layers < 2:
        parser.error(f"--layouts among {', '.join(LAYOUTS)} (got {unknown or 'none'}), --steps >= 2, --layers >= 2 (a pp2 stage each)")
    from weight_sync import write_model_dir

    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        model = write_model_dir(tmp / "qwen05", layers=args.layers)
        load = os.getloadavg()[0]
        m = _calibrate(args.calibration)
        results = {name: _run_planned(tmp, model, args, m) if name == "planned" else _run_layout(name, tmp, model, args, m) for name in layouts}
    one = results.get("one", {})
    one_rss = one.get("peak_rss_gib_by_rank", {}).get("1")
    for name, r in results.items():
        for key in ("first_loss", "first_grad_norm", "first_entropy"):  # the same samples: equal within float32 rounding
            if r.get(key) is not None and one.get(key) is not None:
                r[f"{key}_minus_one"] = r[key] - one[key]
        if one_rss and "peak_rss_gib_by_rank" in r:  # a tp or pp rank holds about half of what the one-process rank does
            ratios = [round(r["peak_rss_gib_by_rank"][k] / one_rss, 2) for k in ("1", "2") if k in r["peak_rss_gib_by_rank"]]
            r["policy_rss_over_one"] = ratios
            if name != "one":
                r["rss_says"] = "each policy rank holds less than one process: sharded" if max(ratios) < RSS_SHARDED else "each policy rank holds as much as one process: whole replicas"
    print(json.dumps({
        "model": f"Qwen2.5-0.5B-shaped, {args.layers} layers (fp32), 2 prompts x 4 samples x {args.new_tokens} tokens, max_staleness 0",
        "calibrated": {"train_gflops_at_896": round(m.cpu.train_flops_by_width[-1][1] / 1e9, 2),
                       **{f"{name}_gb_per_s_by_mib": {f"{n / 2**20:g}": round(r / 1e9, 3) for n, r in getattr(m.cpu, field)}
                          for name, field in (("gather", "gloo_by_bytes"), ("all_reduce", "gloo_all_reduce_by_bytes"), ("send", "gloo_send_by_bytes"))},
                       "decode_rows_fraction": [[r, round(f, 3)] for r, f in m.cpu.decode_rows_fraction],
                       **{k: round(getattr(m.cpu, k), 3) for k in ("tp_train_efficiency", "tp_decode_efficiency", "pp_train_efficiency")}},
        "layouts": results,
        "loadavg_1m_at_start": round(load, 2),
        "cpus": os.cpu_count(),
    }, indent=1))


if __name__ == "__main__":
    main()
