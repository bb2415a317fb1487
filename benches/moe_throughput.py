"""Trainer tokens/s of a mixture-of-experts model against a dense model of the same active parameters, as JSON.

    python benches/moe_throughput.py [--hidden 128] [--layers 4] [--experts 8] [--top-k 2] [--samples 16] [--repeats 5] [--threads 1]

Two Hugging Face models built from configs (random weights, no download), one process: a Qwen3-MoE
(``--experts`` routed experts of width ``--expert-width``, top-``--top-k``, every block sparse) and a
dense Qwen3 whose MLP is ``top_k * expert_width`` wide, so a token goes through the same number of
MLP parameters in both (the router's ``hidden x experts`` aside). The same batch (``--samples``
sequences of a 32-token prompt and a 32-token completion, AIPO, packing as the default decides) is
one ``Trainer.train_step`` per timing; the two models alternate within each repeat, after one warm-up
step each. Tokens/s counts real tokens (prompt + completion) per second of ``train_step``. The MoE
step also computes the experts' load metrics (``flowrl.operators.router_load``), which are part of
what a MoE policy costs. The machine's load (``os.getloadavg``) is printed before and after: on a
shared machine the absolute figures move with it, the ratio less.
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

from flowrl.graph.configs import HFModelConfig, OptimizerConfig
from flowrl.graph.nodes import LossNode, PolicyNode
from flowrl.operators.trainer import Trainer

VOCAB = 512


def _directory(root: Path, family: str, args: argparse.Namespace) -> Path:
    """A config-only directory of ``family`` (``qwen3_moe`` or the dense ``qwen3``) and a word tokenizer."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    common = dict(vocab_size=VOCAB, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=args.hidden // 4, max_position_embeddings=256, tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(num_experts=args.experts, num_experts_per_tok=args.top_k, moe_intermediate_size=args.expert_width,
                                             intermediate_size=args.top_k * args.expert_width, decoder_sparse_step=1, mlp_only_layers=[], **common)  # fmt: skip
    else:
        config = transformers.Qwen3Config(intermediate_size=args.top_k * args.expert_width, **common)
    d = root / family
    d.mkdir()
    config.save_pretrained(str(d))
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>").save_pretrained(str(d))
    return d


def _batch(samples: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    prompt, completion = 32, 32
    return {
        "sample_prompt_ids": torch.randint(3, VOCAB, (samples, prompt), generator=gen),
        "sample_prompt_lens": torch.full((samples,), prompt),
        "completion_ids": torch.randint(3, VOCAB, (samples, completion), generator=gen),
        "completion_mask": torch.ones(samples, completion, dtype=torch.bool),
        "behaviour_logprobs": torch.full((samples, completion), -6.0),
        "rewards": torch.randn(samples, generator=gen),
        "group_ids": torch.arange(samples) // 4,
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-width", type=int, default=64)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    """The figures of the module docstring (``benches/moe.py --parts throughput`` reads them too)."""
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    batch = _batch(args.samples, torch.Generator().manual_seed(0))
    tokens = int(batch["sample_prompt_lens"].sum() + batch["completion_mask"].sum())
    with tempfile.TemporaryDirectory() as tmp:
        trainers, params = {}, {}
        for family in ("qwen3_moe", "qwen3"):
            node = PolicyNode(name="policy", model=HFModelConfig(path=str(_directory(Path(tmp), family, args)), init="random"), optimizer=OptimizerConfig(lr=1e-4))
            trainers[family] = Trainer(node, LossNode(name="aipo"))
            params[family] = sum(t.numel() for t in trainers[family].model.parameters())
        times: dict[str, list[float]] = {f: [] for f in trainers}
        last: dict[str, dict[str, float]] = {}
        for family, trainer in trainers.items():
            trainer.train_step(dict(batch))  # warm-up
        for _ in range(args.repeats):
            for family, trainer in trainers.items():
                start = time.perf_counter()
                last[family] = trainer.train_step(dict(batch))
                times[family].append(time.perf_counter() - start)
    moe_mlp_total = args.layers * (3 * args.hidden * args.expert_width * args.experts + args.hidden * args.experts)
    moe_mlp_active = args.layers * (3 * args.hidden * args.expert_width * args.top_k + args.hidden * args.experts)
    out = {
        "bench": "moe_throughput",
        "shape": {"hidden": args.hidden, "layers": args.layers, "experts": args.experts, "top_k": args.top_k, "expert_width": args.expert_width,
                  "dense_width": args.top_k * args.expert_width, "samples": args.samples, "tokens_per_step": tokens, "threads": args.threads},  # fmt: skip
        "params": {"moe_total": params["qwen3_moe"], "moe_active": params["qwen3_moe"] - moe_mlp_total + moe_mlp_active, "dense": params["qwen3"]},
        "step_s_median": {f: statistics.median(t) for f, t in times.items()},
        "tokens_per_s": {f: tokens / statistics.median(t) for f, t in times.items()},
        "moe_over_dense_tokens_per_s": statistics.median(d / m for m, d in zip(times["qwen3_moe"], times["qwen3"])),
        "moe_load_max_over_mean_last_step": last["qwen3_moe"]["moe/load_max_over_mean"],
        "load_before": load_before,
        "load_after": os.getloadavg(),
    }
    return out


if __name__ == "__main__":
    print(json.dumps(run(parse()), indent=2))
