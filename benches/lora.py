"""A LoRA policy learns: rank-r adapters on the HF example's copy task, against the same steps training
the whole model, with the bytes each weight sync moves.

The model directory is built in code beside the example's tokenizer and prompts
(``flowrl.examples.hf_copy``): ``--family qwen2``, a 2-layer Qwen2 of hidden 128 (4 heads of 32, which
vLLM's CPU kernels take; untied), or ``--family llama``, the example's ~90K-parameter Llama. LoRA
adapts a model that already does something: with ``--warmup N`` a base model is made first (N steps of
full-model training from the seeded random weights, exported with ``flowrl.models.hf_export.export_hf``),
and both runs start from it (``--warmup 0``: from the random weights). Then ``build_hf_copy(lora=...)``
runs ``--steps`` steps with the built-in (or ``--engine vllm``) generator; ``--full`` adds the same
steps training the whole model. Prints JSON: each run's reward curve (means over windows of
``--window`` steps), ``sync/bytes`` (what one publish puts on the weight edge), wall-clock seconds,
and the ratio of bytes per sync.

    python benches/lora.py [--family llama] [--warmup 100] [--steps 150] [--rank 8] [--lr 3e-3] [--full] [--engine vllm]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def model_dir(out: Path, family: str = "qwen2") -> Path:
    """The example's tokenizer and prompts with its ~90K-parameter Llama (``family="llama"``) or a
    2-layer Qwen2 of hidden 128 (4 heads of 32, untied)."""
    from transformers import Qwen2Config

    from flowrl.examples.hf_copy import WORDS, write_assets

    write_assets(out)
    if family == "llama":
        return out
    Qwen2Config(
        vocab_size=len(WORDS), hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    ).save_pretrained(out)  # fmt: skip
    return out


def pretrained(graph, path: Path):
    """``graph`` with every Hugging Face model loading the weights in ``path``."""
    import msgspec

    from flowrl.graph.configs import HFModelConfig
    from flowrl.graph.ir import Graph

    nodes = []
    for node in graph.nodes:
        model = getattr(node, "model", None)
        if isinstance(model, HFModelConfig):
            node = msgspec.structs.replace(node, model=msgspec.structs.replace(model, path=str(path), init="pretrained"))
        nodes.append(node)
    return Graph(msgspec.structs.replace(graph.spec, nodes=tuple(nodes)))


def run(model_dir: Path, *, steps: int, lora: dict | None, lr: float, engine: str, window: int, init: str = "pretrained", ckpt: Path | None = None) -> dict:
    from flowrl.examples.hf_copy import build_hf_copy
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.run import run_graph

    graph = build_hf_copy(model_dir=model_dir, lora=lora, lr=lr, engine=engine, data=model_dir / "prompts.jsonl")
    if init == "pretrained":
        graph = pretrained(graph, model_dir)
    start = time.perf_counter()
    rows = run_graph(graph, RunConfig(steps=steps, progress=False, checkpoint_dir=str(ckpt) if ckpt else None)).rows
    rewards = [r["reward_mean"] for r in rows]
    curve = [round(sum(rewards[i : i + window]) / len(rewards[i : i + window]), 3) for i in range(0, len(rewards), window)]
    return {"lr": lr, "reward_curve": curve, "sync_bytes": rows[-1]["sync/bytes"], "wall_s": round(time.perf_counter() - start, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--warmup", type=int, default=60, help="full-model steps from random weights that make the base model")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--full-lr", type=float, default=2e-3)
    p.add_argument("--window", type=int, default=10)
    p.add_argument("--full", action="store_true", help="also train the whole model (bytes per sync and curve to compare)")
    p.add_argument("--engine", default="builtin", choices=["builtin", "vllm"])
    p.add_argument("--family", default="qwen2", choices=["qwen2", "llama"])
    args = p.parse_args()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora = dict(r=args.rank, alpha=2 * args.rank, target_modules=targets)
    with tempfile.TemporaryDirectory() as tmp:
        from flowrl.models.hf_export import export_hf
        from flowrl.runtime.checkpointing.store import read_policy_state

        random_dir = model_dir(Path(tmp) / args.family, args.family)
        out = {"model": {"qwen2": "qwen2 2x128 (4 heads)", "llama": "hf_copy's llama 2x64"}[args.family], "steps": args.steps, "engine": args.engine, "lora": lora}
        base_dir, init = random_dir, "random"
        if args.warmup:
            out["warmup_run"] = run(random_dir, steps=args.warmup, lora=None, lr=args.full_lr, engine="builtin", window=args.window,
                                    init="random", ckpt=Path(tmp) / "ckpt")  # fmt: skip
            base_dir, init = export_hf(read_policy_state(Path(tmp) / "ckpt"), Path(tmp) / "base"), "pretrained"
            (base_dir / "prompts.jsonl").write_bytes((random_dir / "prompts.jsonl").read_bytes())
        out["lora_run"] = run(base_dir, steps=args.steps, lora=lora, lr=args.lr, engine=args.engine, window=args.window, init=init)
        if args.full:
            out["full_run"] = run(base_dir, steps=args.steps, lora=None, lr=args.full_lr, engine=args.engine, window=args.window, init=init)
            out["bytes_ratio"] = round(out["full_run"]["sync_bytes"] / out["lora_run"]["sync_bytes"], 1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
