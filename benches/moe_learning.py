"""Does a mixture-of-experts policy learn as a dense one of the same active size does? (issue 43's Done-when)

The ``hf_copy`` pipeline (``flowrl.examples.hf_copy``: copy three digits, reward by matching digits),
its model a Hugging Face directory written here, trained from random weights with GRPO (``--objective``;
the example's own is AIPO) by ``run_graph`` as ``flowrl run --model DIR`` would:

- **dense**: the example's own Llama (2 layers, width 64, 2 heads of 32, MLP 176);
- **moe**: a Qwen3-MoE of the same attention and width, 8 experts of width 88, top-2, every layer
  sparse: a token's active MLP is 2 x 88 = 176, the dense MLP's width.

Each model on the built-in engine (the MoE with ``routing_replay=True``: the trainer routes by the
generator's recorded experts) and on the vLLM engine (weights into vLLM after every step; on a CPU
its MoE kernel's packed experts are rebuilt by flowrl's worker extension), k = 1, seed 0.

Prints one JSON line per run (the reward over the first and the last 10 % of steps, the largest
|log pi - log mu| over the batches drawn by the weights the trainer holds (staleness 0), wall seconds)
and a summary line.

    python benches/moe_learning.py                        # ~80 s at rest: 4 runs
    python benches/moe_learning.py --objective aipo       # the example's own objective
    python benches/moe_learning.py --engines builtin --steps 200
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any


def write_moe_dir(directory: Path) -> Path:
    """The example's directory (tokenizer, prompts) with a Qwen3-MoE config of the dense model's active size."""
    from transformers import Qwen3MoeConfig

    from flowrl.examples.hf_copy import WORDS, write_assets

    write_assets(directory, heads=2)
    config = Qwen3MoeConfig(
        vocab_size=len(WORDS), hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=88, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
        max_position_embeddings=64, tie_word_embeddings=True, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    config.save_pretrained(directory)
    return directory


def graph_for(model_dir: Path, engine: str, *, replay: bool, objective: str = "grpo") -> Any:
    """``build_hf_copy`` on ``model_dir`` with ``engine``, its loss ``objective`` with that objective's
    defaults (the example's own is ``aipo``); the generator records routing when ``replay``."""
    from flowrl.examples.hf_copy import build_hf_copy
    from flowrl.graph.serialize import from_json, to_json

    graph = build_hf_copy(model_dir=model_dir, data=model_dir / "prompts.jsonl", engine=engine)  # type: ignore[arg-type]
    data = json.loads(to_json(graph))
    for node in data["nodes"]:
        if node["name"] == "gen":
            node["routing_replay"] = replay
        if node["kind"] == "loss" and node["loss"]["objective"] != objective:
            node["loss"] = {"objective": objective}
    return from_json(json.dumps(data))


def run(model: str, model_dir: Path, engine: str, steps: int, out: Path, objective: str) -> dict[str, Any]:
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.observe.metrics import read_metrics
    from flowrl.runtime.run import run_graph

    graph = graph_for(model_dir, engine, replay=model == "moe" and engine == "builtin", objective=objective)
    metrics = out / f"{model}-{engine}.jsonl"
    start = time.perf_counter()
    run_graph(graph, RunConfig(steps=steps, seed=0, metrics=str(metrics)))
    wall = time.perf_counter() - start
    rows = read_metrics(metrics)
    tenth = max(len(rows) // 10, 1)
    first = sum(r["reward_mean"] for r in rows[:tenth]) / tenth
    last = sum(r["reward_mean"] for r in rows[-tenth:]) / tenth
    fresh = [r["mismatch/abs_logp_max"] for r in rows if r["staleness"] == 0 and "mismatch/abs_logp_max" in r]  # mu vs pi by the same weights
    return {"model": model, "engine": engine, "objective": objective, "steps": len(rows), "routing_replay": graph.node("gen").routing_replay,
            "reward_first_10pct": round(first, 4), "reward_last_10pct": round(last, 4), "max_abs_logp_mismatch_fresh": round(max(fresh), 7) if fresh else None,
            "wall_s": round(wall, 1)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150, help="trainer steps per run (default 150)")
    parser.add_argument("--engines", nargs="+", default=["builtin", "vllm"], choices=["builtin", "vllm"])
    parser.add_argument("--objective", default="grpo", help="the loss's objective (default grpo; the example's own is aipo)")
    args = parser.parse_args(argv)
    from flowrl.examples.hf_copy import write_assets

    results = []
    with tempfile.TemporaryDirectory(prefix="flowrl-moe-learning-") as tmp:
        root = Path(tmp)
        dirs = {"dense": write_assets(root / "dense", heads=2), "moe": write_moe_dir(root / "moe")}
        for engine in args.engines:
            for model, model_dir in dirs.items():
                results.append(run(model, model_dir, engine, args.steps, root, args.objective))
                print(json.dumps(results[-1]), flush=True)
    gains = {f"{r['model']}-{r['engine']}": round(r["reward_last_10pct"] - r["reward_first_10pct"], 4) for r in results}
    print(json.dumps({"reward_gain": gains}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
