"""Generation: tokens per second of batched sampling with the KV cache against without it, same tokens out.

For each model, batch size and completion length it samples the same prompts twice with the same
seed, once decoding with the KV cache and once re-running the whole sequence every step, checks that
both produce the same tokens (and log-probs within float rounding), and reports tokens per second,
the speedup of the cache, and the share of the time spent outside the model's forward pass
(sampling, masks, bookkeeping). Stopping is disabled (a stop id outside the vocabulary) so every
row decodes the full length.

Prints one JSON object.

    python benches/generation.py                 # tiny (the example model) and small
    python benches/generation.py --models big    # ~100M parameters, small batch (slow on a CPU)
    python benches/generation.py --hf [ARGS]     # a Hugging Face Llama: flowrl vs transformers' generate()
                                                 # (benches/hf_generation.py, ARGS are its own)
    python benches/generation.py --longtail [ARGS]  # the long-tail task: continuous vs lock-step batching,
                                                 # tokens/s and slot utilisation (benches/longtail_generation.py)
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from flowrl.graph.configs import ModelConfig, SamplingConfig
from flowrl.graph.nodes import GeneratorNode
from flowrl.operators.generation import Generator
from flowrl.models.families.builtin.model import count_parameters
from flowrl.operators.source import pad_left
from flowrl.operators.tasks import make_task

MODELS = {
    "tiny": ModelConfig(vocab_size=16, dim=64, n_layers=2, n_heads=4, n_kv_heads=4, max_seq_len=96),
    "small": ModelConfig(vocab_size=16, dim=256, n_layers=4, n_heads=8, n_kv_heads=2, max_seq_len=96),
    "big": ModelConfig(vocab_size=16, dim=768, n_layers=14, n_heads=12, n_kv_heads=4, ffn_dim=2048, max_seq_len=96),
}
#: (batch size in samples, completion length) per model
GRID = {
    "tiny": [(1, 16), (16, 16), (64, 16), (256, 16), (16, 64), (64, 64)],
    "small": [(1, 16), (16, 16), (64, 16), (16, 64), (64, 64)],
    "big": [(4, 16), (4, 32)],
}


class ForwardTimer:
    """Accumulates wall time spent inside ``model.forward`` through forward hooks."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.total = 0.0
        self._start = 0.0
        model.register_forward_pre_hook(self._pre)
        model.register_forward_hook(self._post)

    def _pre(self, module, args) -> None:
        self._start = time.perf_counter()

    def _post(self, module, args, output) -> None:
        self.total += time.perf_counter() - self._start


def prompts(n: int) -> dict[str, torch.Tensor]:
    task = make_task("add", 0)  # prompts of 5 to 9 tokens: left padding is exercised
    ids, lens = pad_left([task.prompt(i) for i in range(n)], 0)
    return {"prompt_ids": ids, "prompt_lens": lens, "prompt_index": torch.arange(n)}


def measure(model: ModelConfig, batch: int, length: int, use_kv_cache: bool, repeats: int) -> tuple[dict, dict[str, torch.Tensor]]:
    node = GeneratorNode(
        name="gen",
        model=model,
        sampling=SamplingConfig(n_samples=1, max_new_tokens=length, stop_tokens=(10**6,), use_kv_cache=use_kv_cache),
    )
    gen = Generator(node, seed=0)
    timer = ForwardTimer(gen.model)
    batch_in = prompts(batch)
    gen.generate(batch_in)  # warm-up
    best, out, forward, spent = float("inf"), {}, 0.0, 0.0
    for _ in range(repeats):
        if spent > 5.0:  # enough for slow points (the uncached long runs)
            break
        timer.total = 0.0
        start = time.perf_counter()
        out = gen.generate(batch_in)
        wall = time.perf_counter() - start
        spent += wall
        if wall < best:
            best, forward = wall, timer.total
    tokens = int(out["completion_mask"].sum())
    return {"seconds": round(best, 5), "tokens_per_s": round(tokens / best, 1), "outside_forward_share": round(1 - forward / best, 3)}, out


def main() -> None:
    if "--hf" in sys.argv[1:]:  # the Hugging Face comparison lives in its own script
        import hf_generation  # benches/ is on sys.path when a bench runs as a script

        sys.argv = [a for a in sys.argv if a != "--hf"]
        hf_generation.main()
        return
    if "--longtail" in sys.argv[1:]:  # so does the long-tail (continuous batching) comparison
        import longtail_generation

        sys.argv = [a for a in sys.argv if a != "--longtail"]
        longtail_generation.main()
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["tiny", "small"], choices=sorted(MODELS))
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point, fewer past 5 s (the fastest is kept)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    result = {"bench": "generation", "threads": args.threads, "models": {}}
    for name in args.models:
        config = MODELS[name]
        from flowrl.models.families.builtin.model import Transformer

        entry = {"shape": config.short(), "parameters": count_parameters(Transformer(config)), "points": []}
        for batch, length in GRID[name]:
            cached, out_c = measure(config, batch, length, True, args.repeats)
            plain, out_p = measure(config, batch, length, False, args.repeats)
            same = bool(torch.equal(out_c["completion_ids"], out_p["completion_ids"]))
            max_dlp = float((out_c["behaviour_logprobs"] - out_p["behaviour_logprobs"]).abs().max())
            point = {
                "batch": batch,
                "new_tokens": length,
                "kv_cache": cached,
                "no_cache": plain,
                "cache_speedup": round(plain["seconds"] / cached["seconds"], 2),
                "same_tokens": same,
                "max_logprob_diff": max_dlp,
            }
            entry["points"].append(point)
            print(f"[{name}] batch {batch:4d} len {length:3d}: cache {cached['tokens_per_s']:9.0f} tok/s, "
                  f"no cache {plain['tokens_per_s']:9.0f} tok/s, x{point['cache_speedup']}, same={same}", file=sys.stderr, flush=True)
        result["models"][name] = entry
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
