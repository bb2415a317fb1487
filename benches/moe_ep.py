"""Step time and peak RSS per rank of a mixture-of-experts policy at ep = 2 against FSDP2 alone, 2 torchrun ranks, as JSON.

    python benches/moe_ep.py [--hidden 128] [--layers 4] [--experts 8] [--top-k 2] [--samples 16] [--repeats 5]

The Qwen3-MoE of ``benches/moe_throughput.py`` (built from a config, random weights), trained as a
2-rank ``ShardedPolicy`` trains it: started on the meta device, FSDP2 over both ranks, and at ep = 2 each
rank holding half of every block's experts with tokens exchanged by all-to-all
(``flowrl.runtime.parallel.expert_parallel``). Each layout is its own torchrun job of 2 gloo ranks (so a
rank's peak RSS, ``ru_maxrss``, is that layout's); per job one warm-up ``Trainer.train_step`` then
``--repeats`` timed ones, each rank training on its half of the same batch (whole prompt groups), as
the policy program splits it. Printed: the median step seconds (the slower rank's per step) and each
rank's peak RSS per layout, their ratios, and the machine's load before and after (the 2 ranks share
this machine's cores with whatever else runs). Entry point for another harness: ``run(parse([...]))``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-width", type=int, default=64)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args(argv)


def _rank(layout: str, directory: str, out: str, args: argparse.Namespace) -> None:
    """One rank of one layout's job: its step times and peak RSS, to ``out/rank-N.json``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    import moe_throughput
    from flowrl.graph.configs import HFModelConfig, OptimizerConfig
    from flowrl.graph.nodes import LossNode, PolicyNode
    from flowrl.models.families import FAMILIES
    from flowrl.operators.trainer import Trainer
    from flowrl.runtime.parallel.distributed import shard_by_groups
    from flowrl.runtime.parallel.expert_parallel import shard_experts_
    from flowrl.runtime.parallel.fsdp import shard_trainer_, token_scale
    from flowrl.runtime.parallel.fsdp_init import meta_build

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = DeviceMesh("cpu", torch.tensor([0, 1]), mesh_dim_names=("dp",))
    node = PolicyNode(name="policy", model=HFModelConfig(path=directory, init="random"), optimizer=OptimizerConfig(lr=1e-4, sharding="fsdp"))
    model, source = meta_build(node.model)
    trainer = Trainer(node, LossNode(name="aipo"), model=model)
    ignored = shard_experts_(trainer.model, mesh, FAMILIES["qwen3_moe"].stacked) if layout == "ep2" else None
    shard_trainer_(trainer, mesh, source=source, ignored=ignored)
    batch = moe_throughput._batch(args.samples, torch.Generator().manual_seed(0))
    part = shard_by_groups(batch, 2)[rank]
    trainer.loss_scale = token_scale(2, float(part["completion_mask"].sum()), float(batch["completion_mask"].sum()))
    times = []
    for i in range(args.repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        trainer.train_step(dict(part))
        took = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the step ends when the slower rank's does
        if i:
            times.append(float(took))
    Path(out, f"rank-{rank}.json").write_text(json.dumps({"step_s": times, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(args: argparse.Namespace) -> dict:
    """Both layouts' jobs, then the figures of the module docstring."""
    sys.path.insert(0, str(HERE))
    import moe_throughput

    load_before = os.getloadavg()
    layouts: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        directory = moe_throughput._directory(Path(tmp), "qwen3_moe", args)
        for layout in ("fsdp", "ep2"):
            out = Path(tmp) / layout
            out.mkdir()
            flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()]
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", __file__, "--rank-of", layout, str(directory), str(out), *flags]
            env = {**os.environ, "PYTHONPATH": f"{ROOT}:{HERE}", "OMP_NUM_THREADS": str(args.threads)}
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            if proc.returncode != 0:
                raise SystemExit(f"the {layout} job failed:\n{proc.stderr[-3000:]}")
            ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in (0, 1)]
            layouts[layout] = {"step_s_median": statistics.median(ranks[0]["step_s"]), "peak_rss_mib": [r["peak_rss_mib"] for r in ranks]}
    return {
        "bench": "moe_ep",
        "shape": {"hidden": args.hidden, "layers": args.layers, "experts": args.experts, "top_k": args.top_k, "expert_width": args.expert_width,
                  "samples": args.samples, "ranks": 2, "threads_per_rank": args.threads},  # fmt: skip
        "layouts": layouts,
        "ep2_over_fsdp_step_s": layouts["ep2"]["step_s_median"] / layouts["fsdp"]["step_s_median"],
        "ep2_over_fsdp_peak_rss": [e / f for e, f in zip(layouts["ep2"]["peak_rss_mib"], layouts["fsdp"]["peak_rss_mib"])],
        "load_before": load_before,
        "load_after": os.getloadavg(),
    }


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-of":  # a rank of one layout's job
        sys.path.insert(0, str(HERE))
        layout, directory, out = sys.argv[2:5]
        _rank(layout, directory, out, parse(sys.argv[5:]))
    else:
        print(json.dumps(run(parse()), indent=2))
