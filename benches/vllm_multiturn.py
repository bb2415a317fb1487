"""Multi-turn episodes on vLLM with and without prefix reuse across turns: seconds per episode.

Two vLLM engines on the same model (a Qwen2 built from a config with random weights: hidden 512,
8 layers, 8 heads of 64, 2 KV heads; the HF example's word-level tokenizer, no chat template), one
with vLLM's automatic prefix caching and one without, take rounds in turn (``--rounds``, interleaved
so machine load hits both alike). A round is one batch of episodes
(``flowrl.operators.engines.vllm_multiturn.VLLMMultiTurn``): ``--prompts`` prompts of ``--prompt-len``
tokens, ``--n`` samples each, ``--turns`` model turns of ``--max-new`` tokens, each answered with an
observation of ``OBS_LEN`` (64) tokens. Every turn's prompt is the sample's whole sequence so far; with
the cache, vLLM prefills only what its cached blocks do not cover.

Prints one JSON object: per setting the seconds per episode of each round (batch seconds / episodes),
their median and range, the median per model turn, vLLM's cached fraction of prompted tokens, tokens per episode; ``saved_frac``
(1 - cached median / uncached median); the machine's load (``os.getloadavg``) before and after.

Run: python benches/vllm_multiturn.py [--rounds 3] [--prompts 4] [--n 2] [--turns 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: Words of each observation (a tool's output).
OBS_LEN = 64


class LongObservation:
    """Answers each model turn with ``OBS_LEN`` words of the tokenizer's vocabulary (a tool's output)."""

    def reset(self, row: dict[str, Any]) -> None:
        return None

    def step(self, action: str) -> tuple[str, float, dict]:
        return " ".join(["a"] * OBS_LEN), 0.0, {}


def write_model_dir(path: Path, max_len: int) -> Path:
    from transformers import Qwen2Config

    from flowrl.examples.hf_copy import build_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=max_len, tie_word_embeddings=True, architectures=["Qwen2ForCausalLM"],
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(path)  # fmt: skip
    tokenizer.save_pretrained(path)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--n", type=int, default=2)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-new", type=int, default=16)
    args = p.parse_args()

    from flowrl.graph.configs import HFModelConfig, SamplingConfig
    from flowrl.graph.envs import EnvConfig
    from flowrl.graph.nodes import GeneratorNode
    from flowrl.operators.engines.vllm_engine import VLLMGenerator
    from flowrl.operators.engines.vllm_multiturn import VLLMMultiTurn

    max_len = args.prompt_len + args.turns * (args.max_new + OBS_LEN) + 64
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        model = HFModelConfig(path=str(write_model_dir(Path(tmp) / "m", max_len)), init="random", seed=0)
        sampling = SamplingConfig(n_samples=args.n, max_new_tokens=args.max_new)
        env = EnvConfig(env=f"{Path(__file__).resolve()}:LongObservation", max_turns=args.turns, max_env_tokens=OBS_LEN + 8)
        node = GeneratorNode(name="gen", model=model, sampling=sampling, engine="vllm", env=env)
        engines = {"prefix_cache": VLLMGenerator(node, seed=0, prefix_caching=True), "no_prefix_cache": VLLMGenerator(node, seed=0, prefix_caching=False)}
        try:
            runners = {name: VLLMMultiTurn(gen, node) for name, gen in engines.items()}
            g = torch.Generator().manual_seed(0)
            figures: dict[str, dict[str, list[float]]] = {name: {"s_per_episode": [], "cached_frac": [], "tokens_per_episode": []} for name in runners}
            for r in range(args.rounds + 1):  # round 0 warms each engine up and is not counted
                ids = torch.randint(4, 20, (args.prompts, args.prompt_len), generator=g)
                ids[:, 0] = 1
                prompts = {"prompt_ids": ids, "prompt_lens": torch.full((args.prompts,), args.prompt_len),
                           "prompt_index": torch.arange(r * args.prompts, (r + 1) * args.prompts)}
                for name, runner in runners.items():
                    engines[name].llm.reset_prefix_cache()  # no round starts from another round's blocks
                    t0 = time.perf_counter()
                    out, metrics = runner.generate(prompts)
                    seconds = time.perf_counter() - t0
                    episodes = out["completion_ids"].shape[0]
                    if r == 0:
                        continue
                    figures[name]["s_per_episode"].append(seconds / episodes)
                    figures[name]["cached_frac"].append(metrics["env/cached_prompt_frac"])
                    figures[name]["tokens_per_episode"].append(float(out["completion_lens"].float().mean()) + args.prompt_len)
        finally:
            for gen in engines.values():
                gen.close()
    summary: dict[str, Any] = {}
    for name, f in figures.items():
        s = f["s_per_episode"]
        summary[name] = {"s_per_episode": s, "median": statistics.median(s), "range": [min(s), max(s)],
                         "s_per_turn": statistics.median(s) / args.turns,
                         "cached_frac": statistics.median(f["cached_frac"]), "tokens_per_episode": statistics.median(f["tokens_per_episode"])}
    summary["saved_frac"] = 1 - summary["prefix_cache"]["median"] / summary["no_prefix_cache"]["median"]
    summary["settings"] = vars(args)
    summary["load"] = {"before": load_before, "after": os.getloadavg()}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
