"""GPU smoke run: every path of flowrl that fits one GPU, end to end, within a few minutes.

Each case trains the ``hf_copy`` example (its files written with 2 attention heads of 32, a head size
every vLLM attention backend takes) for ``--steps`` steps with ``device="cuda"`` and reports the
generator's tokens/s (completion tokens over the time spent generating), the mean step time after
``--warmup`` steps, the largest staleness seen and the reward at the start and the end:

- ``builtin-local``: the built-in engine, every node a thread of one process;
- ``builtin-process``: one process per node (models on the GPU in each, weights over ``cuda_ipc``
  or the default transport);
- ``lora-local``: a LoRA policy (peft), adapters only over the weight edge;
- ``builtin-torchrun``: a one-rank torchrun job (``torchrun --nproc-per-node 1``: every node on rank
  0, ``cuda:LOCAL_RANK``, process groups on NCCL); a second rank would need a second GPU;
- ``vllm-local``: the vLLM engine (skipped with the reason where vLLM is not installed), weights
  into vLLM over the weight-sync group.

A case that fails is reported with its error, not hidden. Without CUDA it prints a JSON object
saying so and exits 0 (a skip); ``--device cpu`` runs the same cases on the CPU (to check the
script itself where no GPU is lent).

Prints one JSON object.

    python benches/gpu_smoke.py                          # 40 steps per case
    python benches/gpu_smoke.py --steps 10 --cases vllm-local
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CASES = ("builtin-local", "builtin-process", "lora-local", "builtin-torchrun", "vllm-local")
LORA = dict(r=4, alpha=8, target_modules=["q_proj", "v_proj"])


def _summary(case: str, rows: list[dict], wall: float, warmup: int) -> dict:
    steady = rows[warmup:] or rows
    tokens = sum(r.get("aipo/tokens", 0.0) for r in steady)
    gen_s = sum(r["gen_s"] for r in steady)
    rewards = [r["reward_mean"] for r in rows]
    return {
        "case": case,
        "steps": len(rows),
        "wall_s": round(wall, 2),
        "step_s_mean": round(sum(r["time_s"] for r in steady) / len(steady), 4),
        "gen_tokens_per_s": round(tokens / gen_s, 1) if gen_s else None,
        "max_staleness_seen": max(r["staleness"] for r in rows),
        "reward_first_10": round(sum(rewards[:10]) / len(rewards[:10]), 3),
        "reward_last_10": round(sum(rewards[-10:]) / len(rewards[-10:]), 3),
    }


def run_in_process(case: str, directory: str, *, steps: int, warmup: int, k: int, device: str) -> dict:
    from flowrl.examples.hf_copy import build_hf_copy
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.run import run_graph

    engine = "vllm" if case.startswith("vllm") else "builtin"
    lora = LORA if case.startswith("lora") else None
    backend = case.rsplit("-", 1)[1]
    graph = build_hf_copy(model_dir=directory, engine=engine, max_staleness=k, lora=lora)  # type: ignore[arg-type]
    start = time.perf_counter()
    result = run_graph(graph, RunConfig(steps=steps, device=device, backend=backend, progress=False))
    return _summary(case, result.rows, time.perf_counter() - start, warmup)


def run_torchrun(case: str, directory: str, *, steps: int, warmup: int, k: int, device: str) -> dict:
    """``flowrl run hf_copy --model DIR --backend torchrun`` as one torchrun rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "-m", "flowrl", "run", "hf_copy", "--model", directory,
               "--backend", "torchrun", "--device", device, "--steps", str(steps), "--max-staleness", str(k),
               "--metrics", "m.jsonl", "--quiet"]
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=tmp, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=600)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"torchrun exited {proc.returncode}: {proc.stderr[-2000:]}")
        rows = [json.loads(line) for line in Path(tmp, "m.jsonl").read_text().splitlines()]
    return _summary(case, rows, wall, warmup)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the means (start-up, first weight load)")
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the same cases on the CPU (checks this script)")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"bench": "gpu_smoke", "skipped": "no CUDA device: run this where a GPU is lent (torch.cuda.is_available() is False)"}))
        return
    from flowrl.examples.hf_copy import write_assets

    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "none (--device cpu)"
    out: dict = {"bench": "gpu_smoke", "gpu": gpu, "torch": torch.__version__, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        directory = str(write_assets(os.path.join(tmp, "hf_copy"), heads=2))
        for case in args.cases:
            if case.startswith("vllm") and importlib.util.find_spec("vllm") is None:
                out["runs"].append({"case": case, "skipped": "vLLM is not installed here: pip install 'flowrl[vllm]'"})
                continue
            if case.startswith("lora") and importlib.util.find_spec("peft") is None:
                out["runs"].append({"case": case, "skipped": "peft is not installed here: pip install 'flowrl[lora]'"})
                continue
            run = run_torchrun if case.endswith("torchrun") else run_in_process
            try:
                out["runs"].append(run(case, directory, steps=args.steps, warmup=args.warmup, k=args.max_staleness, device=args.device))
            except Exception as exc:  # report it and go on to the other cases
                out["runs"].append({"case": case, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=3)})
            print(json.dumps(out["runs"][-1]), file=sys.stderr)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
