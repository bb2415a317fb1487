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

Also the trainer's work while a write is in flight: a forward and backward of a ``--tokens``-token
sequence, timed alone and during a background write (``step_s_idle`` / ``step_s_during_write``: what
the write costs training in CPU and memory bandwidth beyond the stall). Prints one JSON object; the
load average is in it (``uptime``).

    python benches/checkpoint_stall.py [--layers 4] [--repeats 3] [--tokens 16] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _policy(layers: int):
    import msgspec
    import torch

    from flowrl.graph.builder import GraphBuilder
    from flowrl.graph.configs import ModelConfig
    from flowrl.modelspec import model_preset
    from flowrl.runtime.programs import PolicyProgram, SharedTransports

    spec = model_preset("qwen2.5-0.5b")
    model = ModelConfig(vocab_size=spec.vocab_size, dim=spec.dim, n_layers=layers, n_heads=spec.n_heads, n_kv_heads=spec.n_kv_heads,
                        ffn_dim=spec.ffn_dim, tie_embeddings=spec.tie_embeddings, max_seq_len=256, seed=0)  # fmt: skip
    b = GraphBuilder("checkpoint_stall", model=model)
    gen = b.generator("gen", b.source("prompts", task="copy", batch_size=1), n_samples=2, max_new_tokens=4)
    score = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    policy = b.policy("policy", b.loss("aipo", gen, score), lr=1e-5)
    b.weights(policy, gen)
    graph = b.build()
    program = PolicyProgram(graph.node("policy"), graph.node("aipo"), graph, SharedTransports(()))
    trainer = program.trainer
    for p in trainer.model.parameters():  # AdamW's moments, as after a step
        p.grad = torch.full_like(p, 1e-3)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    numel = sum(p.numel() for p in trainer.model.parameters())
    return graph, program, numel, msgspec.to_builtins(model)


def _train_step(trainer, tokens: int) -> float:
    import torch

    ids = torch.randint(0, trainer.node.model.vocab_size, (1, tokens))
    t0 = time.perf_counter()
    trainer.model(ids).float().logsumexp(-1).mean().backward()
    trainer.optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory, removed after)")
    args = p.parse_args()

    import torch

    from flowrl.runtime.checkpointing.checkpointer import Checkpointer
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.ledger import PromptLedger

    load_before = os.getloadavg()
    graph, program, numel, model = _policy(args.layers)
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
    print(json.dumps({
        "bench": "checkpoint_stall",
        "model": {"shape": "qwen2.5-0.5b", "layers": args.layers, "of_layers": 24, "parameters": numel, "dtype": "float32"},
        "checkpoint_mb": r(state_bytes / max(files, 1) / 2**20),
        "repeats": args.repeats,
        "sync": {"stall_s": r(sync_s), "all_s": [r(x) for x in stalls["sync"]]},
        "async": {"stall_s": r(async_s), "first_stall_s": r(stalls["async"][0]), "all_s": [r(x) for x in stalls["async"]],
                  "write_s": r(statistics.median(writes[1:]))},
        "async_over_sync": r(async_s / sync_s),
        "goal": "async stall <= 0.10 x sync",
        "step_s_idle": r(statistics.median(idle)), "step_s_during_write": r(statistics.median(during)) if during else None,
        "steps_during_writes": len(during),
        "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
        "load_avg_before": [round(x, 2) for x in load_before], "load_avg_after": [round(x, 2) for x in os.getloadavg()],
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
