"""Peak memory of an FSDP policy's initialisation per rank: the whole model on every rank, then
broadcast and sharded (``--mode whole``, what ``ShardedPolicy`` did before; for LoRA until 2026-11-27),
against the meta-device build that materialises only each rank's rows (``--mode meta``,
``flowrl.runtime.parallel.fsdp_init``).

Each mode runs in its own ``torchrun`` job (2 gloo ranks by default), so each rank's peak RSS
(``ru_maxrss``) is that mode's alone; printed per rank: RSS after the imports, the peak during the
initialisation, and the difference. The model is a Hugging Face Llama of about 110M parameters
(hidden 768, 12 layers, MLP 2048, vocabulary 32000, tied head; 440 MB in float32) with
``init="random"``, or ``--init pretrained`` from safetensors written once; ``--lora`` adds LoRA
adapters (r=8 on q_proj and v_proj) to it.

    python benches/fsdp_init_memory.py [--ranks 2] [--init random|pretrained] [--layers 12] [--lora]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _mb(kb: int) -> float:
    return kb / 1024.0


def _rss_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _job(mode: str, directory: str, init: str, out: str, lora: str = "") -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from flowrl.graph.configs import HFModelConfig, LoraConfig, OptimizerConfig
    from flowrl.graph.nodes import LossNode, PolicyNode
    from flowrl.operators.trainer import Trainer
    from flowrl.runtime.parallel.fsdp import shard_trainer_
    from flowrl.runtime.parallel.fsdp_init import meta_build

    import transformers  # noqa: F401  (imported before the baseline, as in a run)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = DeviceMesh("cpu", torch.arange(world), mesh_dim_names=("dp",))
    adapters = LoraConfig(r=8, alpha=16, target_modules=("q_proj", "v_proj")) if lora else None
    model_config = HFModelConfig(path=directory, init=init, seed=0, lora=adapters)  # type: ignore[arg-type]
    node = PolicyNode(name="policy", model=model_config, optimizer=OptimizerConfig(sharding="fsdp"))
    loss = LossNode(name="aipo")
    dist.barrier()
    base = _rss_kb()
    if mode == "whole":  # ShardedPolicy before: every rank builds the whole model, the lead's is broadcast
        trainer = Trainer(node, loss)
        with torch.no_grad():
            for p in trainer.model.parameters():
                dist.broadcast(p.data, src=0)
        shard_trainer_(trainer, mesh)
    else:
        model, source = meta_build(node.model)
        trainer = Trainer(node, loss, model=model)
        shard_trainer_(trainer, mesh, source=source)
    dist.barrier()
    row = {
        "rank": rank,
        "base_mb": _mb(base),
        "peak_mb": _mb(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss),
        "after_mb": _mb(_rss_kb()),
        "local_params": sum(p.to_local().numel() for p in trainer.model.parameters()),
    }
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def _write_dir(directory: Path, layers: int, weights: bool) -> int:
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=layers, num_attention_heads=12,
        num_key_value_heads=12, max_position_embeddings=512, tie_word_embeddings=True,
    )
    with torch.device("meta"):
        n = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    if weights:
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(directory))
    else:
        config.save_pretrained(str(directory))
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--init", choices=("random", "pretrained"), default="random")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--lora", action="store_true", help="LoRA adapters (r=8 on q_proj, v_proj) on the model")
    parser.add_argument("--job", nargs="+", metavar="ARG", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        _job(*args.job)
        return
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "llama"
        n = _write_dir(directory, args.layers, args.init == "pretrained")
        print(f"HF Llama {n / 1e6:.1f}M parameters ({n * 4 / 2**20:.0f} MB float32), init={args.init}, lora={args.lora}, {args.ranks} gloo ranks")
        for mode in ("whole", "meta"):
            out = Path(tmp) / f"{mode}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks), "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", "127.0.0.1:0", str(Path(__file__).resolve()), "--job", mode, str(directory), args.init, str(out)] + (["lora"] if args.lora else [])
            env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode:
                sys.exit(proc.stderr[-3000:])
            for row in json.loads(out.read_text()):
                print(f"{mode:5s} rank {row['rank']}: RSS after imports {row['base_mb']:7.1f} MB, peak during init {row['peak_mb']:7.1f} MB "
                      f"(+{row['peak_mb'] - row['base_mb']:6.1f}), after {row['after_mb']:7.1f} MB; holds {row['local_params'] / 1e6:.1f}M parameters")


if __name__ == "__main__":
    main()
