"""An FSDP2 policy's checkpoint, sharded (each rank writes its shards) against gathered (the one-file format):
extra memory per rank while saving, bytes each rank writes, seconds.

``torchrun`` ranks (gloo, CPU) shard a built-in transformer with ``flowrl.runtime.parallel.fsdp.shard_trainer_``
and fill AdamW's moments with one step; then, alternating, ``--repeats`` times each:

- ``sharded``: ``flowrl.runtime.checkpointing.sharded_state.save_sharded`` (torch.distributed.checkpoint, what
  ``ShardedPolicy.save`` does);
- ``gathered``: ``flowrl.runtime.parallel.fsdp.full_state`` to the lead, which ``torch.save``s it (the one-file
  format an FSDP policy wrote before sharded checkpoints; what a replicated policy writes).

Per rank it reports the peak resident memory above the resident memory just before the save
(``VmHWM`` after resetting it through ``/proc/self/clear_refs``; glibc's mmap threshold is fixed at
64 KiB, ``MALLOC_MMAP_THRESHOLD_``, so freed tensors leave RSS and the next ones are counted), the
bytes it wrote and the seconds, against the full training state (parameters + AdamW's two moments)
in bytes. Prints JSON.

    python benches/sharded_checkpoint.py [--dp 2] [--dim 512] [--layers 8] [--vocab 32000] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve()


def _status(field: str) -> int:
    """A ``/proc/self/status`` memory field in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def _job(out: str, dim: int, layers: int, vocab: int, repeats: int) -> int:
    import shutil

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from flowrl.graph.configs import ModelConfig, OptimizerConfig
    from flowrl.graph.nodes import LossNode, PolicyNode
    from flowrl.operators.trainer import Trainer
    from flowrl.runtime.parallel.fsdp import full_state, shard_trainer_
    from flowrl.runtime.checkpointing.sharded_state import save_sharded

    dist.init_process_group("gloo")
    rank, dp = dist.get_rank(), dist.get_world_size()
    config = ModelConfig(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=8, n_kv_heads=8, max_seq_len=64, tie_embeddings=False)
    trainer = Trainer(PolicyNode(name="policy", model=config, optimizer=OptimizerConfig(sharding="fsdp")), LossNode(name="aipo"))
    mesh = init_device_mesh("cpu", (dp,), mesh_dim_names=("dp",))
    shard_trainer_(trainer, mesh)
    params = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    for p in params:  # AdamW's moments, filled (one step on a constant gradient)
        p.grad = torch.full_like(p, 1e-3)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.version = 1
    full_bytes = 3 * sum(p.numel() * p.element_size() for p in params)  # parameters + exp_avg + exp_avg_sq, whole
    group = mesh.get_group()
    resettable = _reset_peak()
    rows: list[dict] = []
    for r in range(repeats):
        for method in ("sharded", "gathered"):
            target = Path(out) / f"{method}-{r}"
            dist.barrier()
            _reset_peak()
            before = _status("VmRSS")
            start = time.perf_counter()
            if method == "sharded":
                save_sharded(trainer, target, group=group)
                written = sum(f.stat().st_size for f in target.glob(f"__{rank}_*.distcp"))
            else:
                state = full_state(trainer)
                written = 0
                if state is not None:
                    torch.save(state, target.with_suffix(".pt"))
                    written = target.with_suffix(".pt").stat().st_size
                del state
            seconds = time.perf_counter() - start
            peak = _status("VmHWM") - before
            rows.append({"method": method, "repeat": r, "rank": rank, "peak_extra_bytes": peak, "written_bytes": written, "seconds": seconds})
            dist.barrier()
            if rank == 0:
                shutil.rmtree(target, ignore_errors=True)
                target.with_suffix(".pt").unlink(missing_ok=True)
    every: list = [None] * dp
    dist.all_gather_object(every, rows)  # bench plumbing: plain dicts
    if rank == 0:
        flat = [row for rank_rows in every for row in rank_rows]
        summary = {}
        for method in ("sharded", "gathered"):
            mine = [row for row in flat if row["method"] == method]
            summary[method] = {
                "peak_extra_bytes_per_rank": [max(r["peak_extra_bytes"] for r in mine if r["rank"] == k) for k in range(dp)],
                "written_bytes_per_rank": [max(r["written_bytes"] for r in mine if r["rank"] == k) for k in range(dp)],
                "seconds": sorted(max(r["seconds"] for r in mine if r["repeat"] == k) for k in range(repeats)),
            }
            summary[method]["peak_extra_over_full_state"] = max(summary[method]["peak_extra_bytes_per_rank"]) / full_bytes
        result = {"dp": dp, "model": {"dim": dim, "layers": layers, "vocab": vocab}, "full_state_bytes": full_bytes,
                  "peak_reset": resettable, **summary}
        Path(out, "result.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="flowrl-sharded-ckpt-") as out:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "MALLOC_MMAP_THRESHOLD_": "65536"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.dp), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", str(THIS), "--job", out,
               str(args.dim), str(args.layers), str(args.vocab), str(args.repeats)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(proc.stderr[-4000:])
        print(json.dumps(json.loads(Path(out, "result.json").read_text()), indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--job":
        from flowrl.runtime.backends.torchrun.rank_exit import end_rank_process  # a rank: no interpreter teardown (rank_exit)

        end_rank_process(_job(sys.argv[2], *(int(a) for a in sys.argv[3:7])))
    main()
