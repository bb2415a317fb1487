"""How long a checkpoint stops the trainer: the synchronous save against the save written behind training.

One process, CPU. A policy of the Qwen2.5-0.5B shape (the ``qwen2.5-0.5b`` preset's: hidden 896, 14
heads of 64, 2 KV heads, MLP 4864, vocabulary 151936, tied embeddings, float32) with ``--layers``
decoder layers (24 is the real model; fewer keep the run within a shared machine's memory: the state
is weights + AdamW's two moments, and the save behind training holds one more copy of it), AdamW's
moments filled by one optimizer step. The run's own path saves it: ``Checkpointer.save`` over a
``PolicyProgram`` into a checkpoint directory, ``--repeats`` times each, alternating:

- ``sync``: ``Checkpointer(background=False)``: the state copied, ``torch.save``d, fsynced, committed
  (``LATEST``) before ``save`` returns; the stall is all of it;
- ``async``: ``Checkpointer(background=True)`` (what a run does): ``save`` returns once the state is
  copied into the CPU buffers kept between checkpoints (``checkpointing.background.stage``); the write
  and commit run on a thread. The stall is ``save``'s time (the previous write done before it, as
  when checkpoints are further apart than a write); ``write_s`` is the thread's time to ``LATEST``.
  The first async save allocates the buffers (``first_stall_s``); the median is over the others.

With ``fsdp2`` in ``--layouts``, the same policy sharded with FSDP2 over 2 gloo ranks (a torchrun job):
``sync`` is ``sharded_state.save_sharded`` (every rank's shards and the index written and fsynced
before it returns, what a rank's ``save`` does), ``async`` is ``snapshot_sharded``'s stall (the
rank's shards copied into the staging buffers it keeps between checkpoints, handed to DCP's
``async_save``) with the write waited for apart (``write_s``); the slowest rank's seconds.

Also the trainer's work while a write is in flight (one process): a forward and backward of a ``--tokens``-token
sequence, timed alone and during a background write (``step_s_idle`` / ``step_s_during_write``: what
the write costs training in CPU and memory bandwidth beyond the stall). Prints one JSON object; the
load average is in it (``uptime``).

    python benches/checkpoint_stall.py [--layers 4] [--repeats 3] [--tokens 16] [--layouts one,fsdp2] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve()
sys.path.insert(0, str(ROOT))


def _graph(layers: int):
    """A graph whose policy has the Qwen2.5-0.5B shape with ``layers`` decoder layers."""
    from flowrl.graph.builder import GraphBuilder
    from flowrl.graph.configs import ModelConfig
    from flowrl.modelspec import model_preset

    spec = model_preset("qwen2.5-0.5b")
    model = ModelConfig(vocab_size=spec.vocab_size, dim=spec.dim, n_layers=layers, n_heads=spec.n_heads, n_kv_heads=spec.n_kv_heads,
                        ffn_dim=spec.ffn_dim, tie_embeddings=spec.tie_embeddings, max_seq_len=256, seed=0)  # fmt: skip
    b = GraphBuilder("checkpoint_stall", model=model)
    gen = b.generator("gen", b.source("prompts", task="copy", batch_size=1), n_samples=2, max_new_tokens=4)
    score = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    policy = b.policy("policy", b.loss("aipo", gen, score), lr=1e-5)
    b.weights(policy, gen)
    return b.build()


def _moments(trainer) -> int:
    """Fill AdamW's moments as after a step; the number of parameters."""
    import torch

    for p in trainer.model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    return sum(p.numel() for p in trainer.model.parameters())


def _policy(layers: int):
    from flowrl.runtime.programs.nodes import PolicyProgram, SharedTransports

    graph = _graph(layers)
    program = PolicyProgram(graph.node("policy"), graph.node("aipo"), graph, SharedTransports(()))
    return graph, program, _moments(program.trainer)


def _train_step(trainer, tokens: int) -> float:
    import torch

    ids = torch.randint(0, trainer.node.model.vocab_size, (1, tokens))
    t0 = time.perf_counter()
    trainer.model(ids).float().logsumexp(-1).mean().backward()
    trainer.optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def _fsdp_job(out: str, layers: int, repeats: int) -> int:
    """A torchrun rank: the policy sharded over the job's ranks, saved ``repeats + 1`` times each way."""
    import msgspec
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from flowrl.operators.trainer import Trainer
    from flowrl.runtime.checkpointing.sharded_state import save_sharded, snapshot_sharded
    from flowrl.runtime.parallel.fsdp import shard_trainer_

    dist.init_process_group("gloo")
    rank, dp = dist.get_rank(), dist.get_world_size()
    graph = _graph(layers)
    node = graph.node("policy")
    node = msgspec.structs.replace(node, optimizer=msgspec.structs.replace(node.optimizer, sharding="fsdp"))
    trainer = Trainer(node, graph.node("aipo"))
    mesh = init_device_mesh("cpu", (dp,), mesh_dim_names=("dp",))
    shard_trainer_(trainer, mesh)
    numel = _moments(trainer)  # the whole model's (a DTensor counts its global shape)
    trainer.version = 1
    group = mesh.get_group()
    buffers: dict = {}  # the staging buffers a rank keeps between checkpoints
    rows: list[tuple[str, float, float]] = []
    for r in range(repeats + 1):
        for mode in ("sync", "async"):
            target = Path(out) / f"{mode}-{r}"
            dist.barrier()
            t0 = time.perf_counter()
            if mode == "sync":
                save_sharded(trainer, target, group=group)
                stall = write = time.perf_counter() - t0
            else:
                finish = snapshot_sharded(trainer, target, group=group, buffers=buffers)  # as ShardedPolicy.snapshot
                stall = time.perf_counter() - t0
                finish()
                write = time.perf_counter() - t0
            rows.append((mode, stall, write))
            dist.barrier()
            if rank == 0:
                shutil.rmtree(target, ignore_errors=True)
    every: list = [None] * dp
    dist.all_gather_object(every, rows)  # bench plumbing: plain tuples
    if rank == 0:
        out_rows = {}
        for mode in ("sync", "async"):
            runs = [[rank_rows[i] for rank_rows in every] for i in range(len(rows)) if rows[i][0] == mode]
            stalls = [max(x[1] for x in run) for run in runs]  # the slowest rank's
            writes = [max(x[2] for x in run) for run in runs]
            out_rows[mode] = {"stall_s": statistics.median(stalls[1:]), "first_stall_s": stalls[0], "all_s": stalls,
                              "write_s": statistics.median(writes[1:])}
        Path(out, "result.json").write_text(json.dumps({"dp": dp, "parameters": numel, **out_rows}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _fsdp(layers: int, repeats: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="flowrl-ckpt-stall-fsdp-") as out:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", str(THIS), "--job", out, str(layers), str(repeats)]  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            return {"error": proc.stderr[-3000:]}
        result = json.loads(Path(out, "result.json").read_text())
    r = lambda x: round(x, 4)  # noqa: E731
    for mode in ("sync", "async"):
        result[mode] = {k: [r(x) for x in v] if isinstance(v, list) else r(v) for k, v in result[mode].items()}
    result["async_over_sync"] = r(result["async"]["stall_s"] / result["sync"]["stall_s"])
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--layouts", default="one,fsdp2", help="one: one process; fsdp2: FSDP2 over 2 torchrun ranks")
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory, removed after)")
    args = p.parse_args()

    import torch

    layouts = args.layouts.split(",")
    load_before = os.getloadavg()
    report: dict = {"bench": "checkpoint_stall"}
    if "one" in layouts:
        report["one"] = _one(args)
    if "fsdp2" in layouts:
        report["fsdp2"] = _fsdp(args.layers, args.repeats)
    report.update(threads_one=torch.get_num_threads(), cpus=os.cpu_count(), load_avg_before=[round(x, 2) for x in load_before],
                  load_avg_after=[round(x, 2) for x in os.getloadavg()], goal="async stall <= 0.10 x sync")  # fmt: skip
    print(json.dumps(report, indent=1))


def _one(args: argparse.Namespace) -> dict:
    """The one-process figures (the module docstring)."""
    from flowrl.runtime.checkpointing.checkpointer import Checkpointer
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.control.ledger import PromptLedger

    graph, program, numel = _policy(args.layers)
    root = Path(args.dir or tempfile.mkdtemp(prefix="flowrl-ckpt-stall-"))
    config = RunConfig(steps=10**6, checkpoint_dir=str(root / "ck"), keep_checkpoints=2)
    sync = Checkpointer(graph, config, {"policy": program}, background=False)
    background = Checkpointer(graph, config, {"policy": program}, background=True)
    stalls: dict[str, list[float]] = {"sync": [], "async": []}
    writes: list[float] = []
    ledger, version = PromptLedger(), 0
    try:
        for _ in range(args.repeats + 1):  # the first async save allocates its buffers: counted apart
            for mode, checkpoints in (("sync", sync), ("async", background)):
                version += 1
                t0 = time.perf_counter()
                checkpoints.save(version, ledger)
                stalls[mode].append(time.perf_counter() - t0)
                checkpoints.wait()
                if mode == "async":
                    writes.append(time.perf_counter() - t0)
        idle = [_train_step(program.trainer, args.tokens) for _ in range(3)]
        during = []
        for _ in range(2):
            version += 1
            background.save(version, ledger)
            t0 = time.perf_counter()
            while background._writes.in_flight:  # steps as long as the write runs
                during.append(_train_step(program.trainer, args.tokens))
                if time.perf_counter() - t0 > 120:
                    break
            background.wait()
        state_bytes = sum(f.stat().st_size for f in (root / "ck").rglob("policy-*.pt"))
        files = len(list((root / "ck").glob("step-*")))
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    r = lambda x: round(x, 4)  # noqa: E731
    sync_s, async_s = statistics.median(stalls["sync"][1:]), statistics.median(stalls["async"][1:])
    return {
        "model": {"shape": "qwen2.5-0.5b", "layers": args.layers, "of_layers": 24, "parameters": numel, "dtype": "float32"},
        "checkpoint_mb": r(state_bytes / max(files, 1) / 2**20),
        "repeats": args.repeats,
        "sync": {"stall_s": r(sync_s), "all_s": [r(x) for x in stalls["sync"]]},
        "async": {"stall_s": r(async_s), "first_stall_s": r(stalls["async"][0]), "all_s": [r(x) for x in stalls["async"]],
                  "write_s": r(statistics.median(writes[1:]))},
        "async_over_sync": r(async_s / sync_s),
        "step_s_idle": r(statistics.median(idle)), "step_s_during_write": r(statistics.median(during)) if during else None,
        "steps_during_writes": len(during),
    }  # fmt: skip


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--job":
        from flowrl.runtime.backends.torchrun.rank_exit import end_rank_process  # a rank: no interpreter teardown (rank_exit)

        end_rank_process(_fsdp_job(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
    main()
