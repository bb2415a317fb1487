"""The quantized generator: tokens per second of int8, int8-bf16 (and float8) against float32, and what it does to learning.

Three parts, one JSON object:

- ``kernels``: one linear layer of the 88M model's MLP shape (768 -> 2048) on ``--rows`` rows:
  float32 ``F.linear`` against the forms a weight-only int8 layer could take (``linear(x, Q) * scale``,
  which ``flowrl.models.quantize`` uses; ``linear(x, Q * scale)``; aten's ``_weight_int8pack_mm`` with
  float32 and with bfloat16 activations), milliseconds per call, best and median of 50.
- ``generation``: the generator (``flowrl.operators.generation``) on the 88M built-in model
  (``benches/generation.py``'s ``big``: 14 layers, dim 768) and on the ~29M Hugging Face Llama of
  ``benches/hf_generation.py`` (8 layers, dim 512, vocabulary 8192, built from a config: nothing is
  downloaded), same prompts and seed in every precision, stopping disabled so every row decodes
  ``--new-tokens``. The precisions are timed interleaved (float32, int8, float32, int8, ...) so a
  change of machine load hits both alike; per precision the seconds of every repeat, tokens/s of the
  best, and the int8/float32 ratio of each repeat pair (min, median, max); for int8 also the bytes
  it keeps (float weights for the transports + quantized buffers) and the seconds one re-quantization
  (after each weight fetch) takes.
- ``learning``: the default example (``flowrl.examples.llamarl``, the copy task, AIPO with rho = 4)
  run by the runtime for ``--steps`` steps per seed at ``--max-staleness`` (0: the quantization is the
  only source of pi != mu), with the generator in float32 and int8 under AIPO, and int8 under
  ``objective="pg"``, plain policy gradient that ignores mu. Per configuration: the final reward
  (mean of the last 20 steps) of each seed, and the run's mean ratio, truncated fraction, largest
  ratio and KL(mu || pi) as AIPO measures them (``pg`` logs the same under ``pg/``).

    python benches/quantized.py                                   # modest: ~3-5 min on a loaded 2-core CPU
    python benches/quantized.py --parts generation --new-tokens 32 --repeats 5
    python benches/quantized.py --parts learning --seeds 0 1 2 3 4 --steps 250 --float8
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

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benches, for their model builders

from hf_generation import make_prompts, write_model  # noqa: E402

from flowrl.graph.configs import HFModelConfig, ModelConfig, SamplingConfig  # noqa: E402
from flowrl.graph.nodes import GeneratorNode  # noqa: E402
from flowrl.models.quantize import quantize_per_channel  # noqa: E402
from flowrl.operators.generation import Generator  # noqa: E402

#: The 88M built-in model (benches/generation.py's "big"): 14 x (1.57M attention + 4.72M MLP) weights.
BIG = ModelConfig(vocab_size=16, dim=768, n_layers=14, n_heads=12, n_kv_heads=4, ffn_dim=2048, max_seq_len=96)


def _ms(fn, repeats: int) -> dict[str, float]:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return {"best": round(min(times) * 1e3, 3), "median": round(statistics.median(times) * 1e3, 3)}


def kernels(rows: int, repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(rows, 768, generator=g), torch.randn(2048, 768, generator=g) * 0.02
    q, scale = quantize_per_channel(w, "int8")
    xb, scale_b = x.bfloat16(), scale.bfloat16()
    forms = {
        "float32_linear": lambda: F.linear(x, w),
        "int8_linear_then_scale (used)": lambda: F.linear(x, q.float()) * scale,
        "int8_dequantize_then_linear": lambda: F.linear(x, q.float() * scale[:, None]),
        "int8pack_mm_float32_activations": lambda: torch._weight_int8pack_mm(x, q, scale),
        "int8pack_mm_bfloat16_activations": lambda: torch._weight_int8pack_mm(xb, q, scale_b),
        "bfloat16_linear": lambda: F.linear(xb, w.bfloat16()),
    }
    return {"shape": [rows, 768, 2048], "ms_per_call": {name: _ms(fn, repeats) for name, fn in forms.items()}}


def _resident_bytes(gen: Generator) -> dict:
    floats = sum(t.numel() * t.element_size() for t in gen.weight_targets().values())
    quantized = sum(b.numel() * b.element_size() for name, b in gen.model.named_buffers() if name.endswith(("qweight", "scale")))
    return {"float_weights": floats, "quantized_buffers": quantized}


def generation(model, prompts: dict, *, samples: int, new_tokens: int, repeats: int, precisions: list[str], stop: tuple[int, ...]) -> dict:
    gens = {
        p: Generator(GeneratorNode(name="gen", model=model, sampling=SamplingConfig(
            n_samples=samples, max_new_tokens=new_tokens, stop_tokens=stop, precision=p)), seed=0)  # type: ignore[arg-type]
        for p in precisions
    }  # fmt: skip
    for gen in gens.values():
        gen.generate(prompts)  # warm-up
    seconds: dict[str, list[float]] = {p: [] for p in precisions}
    tokens: dict[str, int] = {}
    for _ in range(repeats):
        for p, gen in gens.items():
            start = time.perf_counter()
            out = gen.generate(prompts)
            seconds[p].append(time.perf_counter() - start)
            tokens[p] = int(out["completion_mask"].sum())
    parameters = sum(t.numel() for t in gens["float32"].weight_targets().values())  # a tied embedding once
    result: dict = {"parameters": parameters, "rows": int(prompts["prompt_ids"].shape[0]) * samples, "new_tokens": new_tokens}
    for p in precisions:
        result[p] = {"tokens": tokens[p], "seconds": [round(s, 3) for s in seconds[p]], "tokens_per_s_best": round(tokens[p] / min(seconds[p]), 1)}
        if p != "float32":
            result[p]["resident_bytes"] = _resident_bytes(gens[p])
            start = time.perf_counter()
            gens[p].version = gens[p].version  # what every weight fetch costs on top: re-quantize all linear layers
            result[p]["requantize_s"] = round(time.perf_counter() - start, 3)
            pairs = sorted((tokens[p] / s) / (tokens["float32"] / f) for s, f in zip(seconds[p], seconds["float32"]))
            result[f"ratio_{p}_over_float32"] = {"min": round(pairs[0], 3), "median": round(statistics.median(pairs), 3), "max": round(pairs[-1], 3)}
    return result


def _builtin_prompts(n: int) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"prompt_ids": torch.randint(3, 16, (n, 8), generator=g), "prompt_lens": torch.full((n,), 8), "prompt_index": torch.arange(n)}


def learning(configs: list[tuple[str, str]], seeds: list[int], steps: int, max_staleness: int) -> dict:
    from flowrl.examples.llamarl import build_llamarl
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.run import run_graph

    out: dict = {"steps": steps, "max_staleness": max_staleness, "seeds": seeds, "final": "mean reward of the last 20 steps"}
    for precision, objective in configs:
        finals, wall, rows_all = [], 0.0, []
        for seed in seeds:
            graph = build_llamarl(max_staleness=max_staleness, precision=precision, objective=objective)
            start = time.perf_counter()
            result = run_graph(graph, RunConfig(steps=steps, max_staleness=max_staleness, seed=seed, progress=False))
            wall += time.perf_counter() - start
            finals.append(round(statistics.mean(r["reward_mean"] for r in result.rows[-20:]), 4))
            rows_all += result.rows

        def metric(key: str, agg=statistics.mean) -> float:
            values = [v for r in rows_all for k, v in r.items() if k.endswith("/" + key)]
            return agg(values)

        out[f"{precision}+{objective}"] = {
            "final_reward_per_seed": finals,
            "final_reward_mean": round(statistics.mean(finals), 4),
            "final_reward_range": [min(finals), max(finals)],
            "ratio_mean": round(metric("ratio_mean"), 6),
            "ratio_max": round(metric("ratio_max", max), 4),
            "truncated_frac_mean": round(metric("truncated_frac"), 6),
            "kl_mu_pi_mean": float(f"{metric('kl'):.3g}"),
            "wall_s": round(wall, 1),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", default=["kernels", "generation", "learning"], choices=["kernels", "generation", "learning"])
    p.add_argument("--prompts", type=int, default=4, help="prompts per generate call (default 4)")
    p.add_argument("--samples", type=int, default=2, help="samples per prompt (default 2: 8 rows)")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rows", type=int, default=8, help="rows of the kernel comparison")
    p.add_argument("--float8", action="store_true", help="also float8 (e4m3, weight-only) in generation and learning")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--max-staleness", type=int, default=0)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    precisions = ["float32", "int8", "int8-bf16"] + (["float8"] if args.float8 else [])
    result: dict = {"bench": "quantized", "threads": args.threads, "torch": torch.__version__, "load_1min_start": round(os.getloadavg()[0], 2)}
    if "kernels" in args.parts:
        result["kernels"] = kernels(args.rows, 50)
    if "generation" in args.parts:
        common = dict(samples=args.samples, new_tokens=args.new_tokens, repeats=args.repeats, precisions=precisions)
        result["generation"] = {
            "builtin_88M": generation(BIG, _builtin_prompts(args.prompts), stop=(10**6,), **common)
        }
        with tempfile.TemporaryDirectory() as directory:
            write_model(directory, layers=8, dim=512, vocab=8192)
            ids, lens = make_prompts(args.prompts, 8192)
            hf_prompts = {"prompt_ids": ids, "prompt_lens": lens, "prompt_index": torch.arange(args.prompts)}
            model = HFModelConfig(path=directory, init="random", seed=0)
            result["generation"]["hf_llama_29M"] = generation(model, hf_prompts, stop=(), **common)
    if "learning" in args.parts:
        configs = [("float32", "aipo"), ("int8", "aipo"), ("int8", "pg")] + ([("float8", "aipo"), ("float8", "pg")] if args.float8 else [])
        result["learning"] = learning(configs, args.seeds, args.steps, args.max_staleness)
    result["load_1min_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
