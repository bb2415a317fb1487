"""Trainer tokens/s with sequence packing (``OptimizerConfig.packing``) against padded micro-batches, as JSON.

    python benches/packing.py [--context 128] [--samples 32] [--micro-batch 8] [--repeats 5] [--threads 1]

Two length mixes of ``--samples`` sequences (prompt + completion) in a context of ``--context`` tokens:
``long-tail`` (lengths drawn log-normal, scaled to a mean of 20% of the context, the longest at 100%,
one at the context in every micro-batch of ``--micro-batch``) and ``equal`` (every sequence half the
context). Two models: the built-in transformer and a Qwen2 model built from a config (random
weights, no download). One ``Trainer.train_step`` (AIPO, ``micro_batch_size`` as given) per timing;
the variants (model x mix x padded/packed) are interleaved within each repeat, after one warm-up
step each. Tokens/s counts real tokens (prompt + completion) per second of ``train_step``; the
speedup is packed / padded per repeat. ``positions`` is what each layout computes: the padded
micro-batches' rows x width, the packed rows x their length (``flowrl.operators.packing``). The
machine's load (``os.getloadavg``) is printed before and after. One torch thread by default: on a
shared, loaded machine more threads than free cores slow every variant by an order of magnitude.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from flowrl.graph.configs import HFModelConfig, ModelConfig, OptimizerConfig
from flowrl.graph.nodes import LossNode, PolicyNode
from flowrl.operators.packing import pack_rows
from flowrl.operators.trainer import Trainer

VOCAB = 2048


def _lengths(mix: str, samples: int, context: int, micro: int, gen: torch.Generator) -> list[int]:
    """Sequence lengths (prompt + completion) of ``mix``."""
    if mix == "equal":
        return [context // 2] * samples
    draws = torch.empty(samples).log_normal_(0.0, 1.0, generator=gen)
    target = 0.2 * context * samples - context * (samples // micro)  # the full-length ones take their share first
    rest = [i for i in range(samples) if i % micro]
    scale = target / float(draws[rest].sum())
    out = [context if i % micro == 0 else int(min(context - 1, max(8, round(float(draws[i]) * scale)))) for i in range(samples)]
    shuffled: list[int] = []  # one full-length sequence in each micro-batch, at a random place in it
    for b in range(0, samples, micro):
        block = out[b : b + micro]
        shuffled += [block[i] for i in torch.randperm(len(block), generator=gen).tolist()]
    return shuffled


def _batch(lengths: list[int], prompt: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A rollout with ``prompt``-token prompts and completions making up ``lengths``; two samples a group."""
    S, C = len(lengths), max(lengths) - prompt
    comp = [n - prompt for n in lengths]
    return {
        "sample_prompt_ids": torch.randint(3, VOCAB, (S, prompt), generator=gen),
        "sample_prompt_lens": torch.full((S,), prompt),
        "completion_ids": torch.randint(3, VOCAB, (S, C), generator=gen),
        "completion_mask": torch.arange(C)[None, :] < torch.tensor(comp)[:, None],
        "behaviour_logprobs": -torch.rand(S, C, generator=gen) - 7.0,
        "group_ids": torch.arange(S) // 2,
        "rewards": torch.randn(S, generator=gen),
    }


def _positions(lengths: list[int], prompt: int, micro: int) -> dict[str, int]:
    """Positions each layout computes over the batch (the trainer's micro-batches, the last token dropped)."""
    padded = packed = 0
    for b in range(0, len(lengths), micro):
        n = [x - 1 for x in lengths[b : b + micro]]
        width = max(n)
        padded += len(n) * width
        packed += min(len(pack_rows(n, capacity=width)) * width, len(n) * width)
    return {"padded": padded, "packed": packed}


def _qwen2_dir(root: Path, dim: int, layers: int, context: int) -> str:
    from transformers import Qwen2Config

    Qwen2Config(
        vocab_size=VOCAB, hidden_size=dim, intermediate_size=3 * dim, num_hidden_layers=layers, num_attention_heads=dim // 32,
        num_key_value_heads=dim // 64, max_position_embeddings=context, tie_word_embeddings=True,
    ).save_pretrained(root)
    return str(root)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    load_before = os.getloadavg()
    gen = torch.Generator().manual_seed(0)
    mixes = {mix: _lengths(mix, args.samples, args.context, args.micro_batch, gen) for mix in ("long-tail", "equal")}
    batches = {mix: _batch(lengths, args.prompt, gen) for mix, lengths in mixes.items()}
    tmp = tempfile.TemporaryDirectory()
    models = {
        "builtin": ModelConfig(vocab_size=VOCAB, dim=args.dim, n_layers=args.layers, n_heads=args.dim // 32, n_kv_heads=args.dim // 64,
                               max_seq_len=args.context),
        "qwen2": HFModelConfig(path=_qwen2_dir(Path(tmp.name), args.dim, args.layers, args.context), init="random"),
    }  # fmt: skip
    trainers = {
        (name, packing): Trainer(
            PolicyNode(name="policy", model=model, optimizer=OptimizerConfig(micro_batch_size=args.micro_batch, packing=packing)),
            LossNode(name="aipo"),
        )
        for name, model in models.items()
        for packing in (False, True)
    }
    variants = [(name, mix, packing) for name in models for mix in mixes for packing in (False, True)]
    for name, mix, packing in variants:  # warm-up
        trainers[name, packing].train_step(batches[mix])
    seconds: dict[tuple[str, str, bool], list[float]] = {v: [] for v in variants}
    for _ in range(args.repeats):
        for v in variants:
            name, mix, packing = v
            start = time.perf_counter()
            trainers[name, packing].train_step(batches[mix])
            seconds[v].append(time.perf_counter() - start)
    out: dict[str, object] = {
        "settings": {k: getattr(args, k) for k in ("context", "samples", "micro_batch", "prompt", "dim", "layers", "repeats")},
        "threads": torch.get_num_threads(),
        "load_before": [round(x, 2) for x in load_before],
    }
    for name in models:
        for mix, lengths in mixes.items():
            tokens = sum(lengths)
            rate = {p: [tokens / s for s in seconds[name, mix, p]] for p in (False, True)}
            ratio = [b / a for a, b in zip(seconds[name, mix, True], seconds[name, mix, False])]
            out[f"{name}/{mix}"] = {
                "lengths": {"mean": round(statistics.mean(lengths), 1), "max": max(lengths), "mean_frac": round(statistics.mean(lengths) / args.context, 3)},
                "positions": _positions(lengths, args.prompt, args.micro_batch),
                "padded_tokens_per_s": [round(x) for x in (min(rate[False]), statistics.median(rate[False]), max(rate[False]))],
                "packed_tokens_per_s": [round(x) for x in (min(rate[True]), statistics.median(rate[True]), max(rate[True]))],
                "speedup": [round(x, 2) for x in (min(ratio), statistics.median(ratio), max(ratio))],
            }
    out["load_after"] = [round(x, 2) for x in os.getloadavg()]
    tmp.cleanup()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
