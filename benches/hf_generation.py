"""Generation of a Hugging Face Llama: flowrl's generator against ``transformers``' own ``generate()``.

Both sample the same left-padded prompts (64 prompts x 8 samples = 512 rows, prompts of 8 to 24
tokens) for exactly 128 new tokens (the model has no end token, so no row stops early) at
temperature 1 with no top-k/top-p, from the same random weights (a ~30M-parameter Llama built from
a config in a temporary directory: nothing is downloaded). It reports tokens per second of each and
their ratio, and where flowrl's time goes (the model's forward passes vs sampling and bookkeeping),
each the best of ``--repeats`` timed runs after one warm-up, with the spread of the runs.

Prints one JSON object.

    python benches/hf_generation.py                          # the issue's settings (~2-4 min on 2 cores)
    python benches/hf_generation.py --prompts 8 --new-tokens 32 --repeats 1   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

from flowrl.graph.configs import HFModelConfig, SamplingConfig
from flowrl.graph.nodes import GeneratorNode
from flowrl.operators.generation import Generator


def write_model(directory: str, *, layers: int, dim: int, vocab: int) -> int:
    """A Llama config (random weights come from HFModelConfig(init="random")) and a tokenizer with
    no end token into ``directory``; returns the parameter count."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=dim, intermediate_size=int(dim * 8 / 3) // 64 * 64, num_hidden_layers=layers,
        num_attention_heads=dim // 64, num_key_value_heads=dim // 64, max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    config.save_pretrained(directory)
    core = Tokenizer(models.WordLevel({"<pad>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, vocab)}}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>").save_pretrained(directory)
    with torch.device("meta"):
        return sum(p.numel() for p in LlamaForCausalLM(config).parameters())


def make_prompts(n: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(8, 25, (n,), generator=g)
    ids = torch.zeros(n, int(lens.max()), dtype=torch.int64)
    for i, length in enumerate(lens.tolist()):
        ids[i, ids.shape[1] - length :] = torch.randint(2, vocab, (length,), generator=g)
    return ids, lens


class ForwardTimer:
    """Wall time inside ``module.forward``, through hooks."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.total, self._start = 0.0, 0.0
        module.register_forward_pre_hook(lambda *_: setattr(self, "_start", time.perf_counter()))
        module.register_forward_hook(lambda *_: setattr(self, "total", self.total + time.perf_counter() - self._start))


def timed(fn, repeats: int) -> tuple[list[float], object]:
    fn()  # warm-up
    walls, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        walls.append(time.perf_counter() - start)
    return walls, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import GenerationConfig

    with tempfile.TemporaryDirectory() as directory:
        params = write_model(directory, layers=args.layers, dim=args.dim, vocab=args.vocab)
        node = GeneratorNode(
            name="gen",
            model=HFModelConfig(path=directory, init="random", seed=0),
            sampling=SamplingConfig(n_samples=args.samples, max_new_tokens=args.new_tokens),
        )
        gen = Generator(node, seed=0)
        ids, lens = make_prompts(args.prompts, args.vocab)
        batch = {"prompt_ids": ids, "prompt_lens": lens, "prompt_index": torch.arange(args.prompts)}
        timer = ForwardTimer(gen.model)

        def flowrl_generate():
            timer.total = 0.0
            return gen.generate(batch)

        hf = gen.model.hf  # the same weights, called through transformers' own generate()
        rows, row_lens = ids.repeat_interleave(args.samples, 0), lens.repeat_interleave(args.samples, 0)
        mask = (torch.arange(ids.shape[1])[None, :] >= (ids.shape[1] - row_lens)[:, None]).long()
        config = GenerationConfig(
            do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens, pad_token_id=0, eos_token_id=None,
        )  # fmt: skip

        def hf_generate():
            with torch.no_grad():
                return hf.generate(input_ids=rows, attention_mask=mask, generation_config=config)

        flowrl_walls, out = timed(flowrl_generate, args.repeats)
        forward_s = timer.total
        hf_walls, hf_out = timed(hf_generate, args.repeats)
    tokens = int(out["completion_mask"].sum())
    hf_tokens = int(hf_out.shape[0] * (hf_out.shape[1] - rows.shape[1]))
    best, hf_best = min(flowrl_walls), min(hf_walls)
    result = {
        "bench": "hf_generation",
        "model": {"family": "llama", "parameters": params, "layers": args.layers, "dim": args.dim, "vocab": args.vocab},
        "rows": int(rows.shape[0]),
        "new_tokens": args.new_tokens,
        "threads": args.threads,
        "load_1min": round(os.getloadavg()[0], 2),
        "flowrl": {"tokens": tokens, "seconds": [round(w, 3) for w in flowrl_walls], "tokens_per_s": round(tokens / best, 1),
                   "forward_share_last_run": round(forward_s / flowrl_walls[-1], 3)},
        "transformers_generate": {"tokens": hf_tokens, "seconds": [round(w, 3) for w in hf_walls], "tokens_per_s": round(hf_tokens / hf_best, 1)},
        "ratio_flowrl_over_hf": round((tokens / best) / (hf_tokens / hf_best), 3),
    }  # fmt: skip
    print(json.dumps(result, indent=1))
    print(f"flowrl {result['flowrl']['tokens_per_s']:.0f} tok/s vs generate() {result['transformers_generate']['tokens_per_s']:.0f} tok/s: "
          f"x{result['ratio_flowrl_over_hf']}", file=sys.stderr)  # fmt: skip


if __name__ == "__main__":
    main()
