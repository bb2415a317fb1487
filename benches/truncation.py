"""What pi's top-k/top-p truncation costs the trainer: ``kept_logprobs`` per setting against the untruncated
``log_softmax`` and against a full-vocabulary sort (how top-p was computed before), as JSON.

    python benches/truncation.py [--rows 2048] [--vocab 32000] [--repeats 5]

Logits are a mixture like a language model's next-token distributions: a share of rows (``--flat``)
are flat (Gaussian, a top-p nucleus of thousands of tokens), the others peaked (1-20 tokens lifted
far above a Gaussian background, a nucleus of tens). The JSON gives the nucleus sizes. Times are
medians of ``--repeats`` interleaved runs, forward and backward (the trainer needs both), on this
machine's threads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from flowrl.operators.logprobs import kept_logprobs


def _full_sort(logits: torch.Tensor, tokens: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p by sorting the whole vocabulary (the generator's computation before the windows)."""
    ordered, order = logits.sort(dim=-1, descending=True)
    probs = torch.softmax(ordered, dim=-1)
    before = probs.cumsum(-1) - probs
    ordered = ordered.masked_fill(before >= top_p, float("-inf"))
    masked = torch.empty_like(logits).scatter_(-1, order, ordered)
    return torch.log_softmax(masked, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--flat", type=float, default=0.1, help="share of flat rows (default 0.1)")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(args.rows, args.vocab, generator=gen) * 2.0
    peaked = torch.rand(args.rows, generator=gen) >= args.flat
    for i in peaked.nonzero().flatten().tolist():
        lifted = torch.randint(0, args.vocab, (int(torch.randint(1, 21, (), generator=gen)),), generator=gen)
        base[i, lifted] += torch.empty(len(lifted)).uniform_(14.0, 20.0, generator=gen)
    base[~peaked] *= 0.5
    tokens = torch.randint(0, args.vocab, (args.rows,), generator=gen)
    probs = torch.softmax(base, dim=-1).sort(dim=-1, descending=True).values
    nucleus = ((probs.cumsum(-1) - probs) < 0.95).sum(-1).float()
    cases = {
        "off": lambda z: kept_logprobs(z, tokens),
        "top_k=50": lambda z: kept_logprobs(z, tokens, top_k=50),
        "top_p=0.95": lambda z: kept_logprobs(z, tokens, top_p=0.95),
        "top_k=50,top_p=0.95": lambda z: kept_logprobs(z, tokens, top_k=50, top_p=0.95),
        "top_p=0.95 full sort": lambda z: _full_sort(z, tokens, 0.95),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, fn in cases.items():
            z = base.clone().requires_grad_(True)
            start = time.perf_counter()
            out = fn(z)
            torch.where(torch.isneginf(out), 0.0, out).sum().backward()
            times[name].append(time.perf_counter() - start)
    off = statistics.median(times["off"])
    print(json.dumps({
        "rows": args.rows, "vocab": args.vocab, "threads": torch.get_num_threads(), "repeats": args.repeats, "flat_share": args.flat,
        "nucleus_0.95_tokens": {q: float(nucleus.quantile(v)) for q, v in (("p10", 0.1), ("median", 0.5), ("p90", 0.9), ("max", 1.0))},
        "median_s": {name: round(statistics.median(t), 4) for name, t in times.items()},
        "x_untruncated": {name: round(statistics.median(t) / off, 2) for name, t in times.items()},
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
