"""The Hugging Face example: a small Llama-architecture model learns to copy digits from a prompt file.

Everything it uses is built in code and shipped as plain files in ``flowrl/examples/assets/hf_copy``
(regenerate them with ``python -m flowrl.examples.hf_copy DIR [HEADS] [--force]``; a test checks the shipped files equal
what this module builds):

- ``config.json``: a ``LlamaConfig`` of ~90K parameters (2 layers, width 64), initialised with
  seeded random weights (``HFModelConfig(init="random")``), since there is nothing to download;
- ``tokenizer.json`` and friends: a word-level tokenizer built with ``tokenizers`` (32 words:
  specials, digits, a few words), saved with ``PreTrainedTokenizerFast.save_pretrained``;
- ``prompts.jsonl``: rows ``{"prompt": "copy 3 1 4 :", "answer": "3 1 4"}``.

The reward is a text scorer, ``reward(prompt, completion, answer)``: the fraction of answer words
the completion has in the right place, over the longer of the two (so rambling costs).

Example:
    >>> reward("copy 3 1 4 :", "3 1 4", answer="3 1 4")
    1.0
    >>> reward("copy 3 1 4 :", "3 9", answer="3 1 4")
    0.3333333333333333
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

from flowrl.data.files import write_jsonl
from flowrl.examples.assets_cli import main
from flowrl.graph.builder import GraphBuilder
from flowrl.graph.configs import HFModelConfig
from flowrl.graph.engines import Engine
from flowrl.graph.ir import Graph

__all__ = ["ASSETS", "WORDS", "build_hf_copy", "reward", "build_tokenizer", "build_config", "make_prompts", "write_assets"]

#: The shipped files (config, tokenizer, prompts).
ASSETS = Path(__file__).parent / "assets" / "hf_copy"

#: The vocabulary, in id order: pad, bos, eos, unk, the digits, then words.
WORDS: tuple[str, ...] = (
    "<pad>", "<s>", "</s>", "<unk>", *"0123456789",
    "copy", "repeat", "the", "digits", "please", ":", "=", "and", "then", "stop",
    "a", "b", "c", "d", "e", "f", "g", "h",
)  # fmt: skip


def build_hf_copy(
    *,
    max_staleness: int = 1,
    model_dir: str | Path = ASSETS,
    data: str | Path | None = None,
    engine: Engine = "builtin",
    lora: dict[str, Any] | None = None,
    lr: float = 2e-3,
) -> Graph:
    """prompts.jsonl -> gen -> reward (text) -> aipo -> policy, with a Llama-architecture model from ``model_dir``.

    Args:
        max_staleness: the weight edge's bound k.
        model_dir: the model directory (config and tokenizer); the shipped one has no weights, so
            the model starts from seeded random weights.
        data: the prompt file; defaults to ``prompts.jsonl`` in the shipped assets.
        engine: the generator's engine; ``"vllm"`` on a CPU needs a head size of 32 or more, so a
            directory written with ``write_assets(DIR, heads=2)`` rather than the shipped one (4 heads of 16).
        lora: train LoRA adapters instead of the model (``LoraConfig``'s fields, e.g.
            ``dict(r=8, alpha=16, target_modules=["q_proj", "v_proj"])``; ``flowrl.models.lora``).
        lr: the policy's learning rate.
    """
    model = HFModelConfig(path=str(model_dir), init="random", seed=0)
    b = GraphBuilder("hf_copy", model=model)
    prompts = b.source("prompts", data=str(data or ASSETS / "prompts.jsonl"), prompt_field="prompt", batch_size=16)
    gen = b.generator("gen", prompts, n_samples=8, max_new_tokens=5, temperature=1.0, engine=engine)
    score = b.scorer("reward", gen, fn="flowrl.examples.hf_copy:reward", inputs="text")
    aipo = b.loss("aipo", gen, score, objective="aipo", rho=4.0, normalize_std=True)
    policy = b.policy("policy", aipo, lr=lr, lora=lora)
    b.weights(policy, gen, max_staleness=max_staleness)
    return b.build()


def reward(prompt: str, completion: str, answer: str) -> float:
    """Positional match of ``completion``'s words against ``answer``'s, over the longer length."""
    got, want = completion.split(), answer.split()
    if not want:
        return float(not got)
    return sum(g == w for g, w in zip(got, want)) / max(len(got), len(want))


def build_tokenizer() -> Any:
    """The word-level tokenizer, as a ``transformers.PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>", padding_side="left"
    )


def build_config(*, heads: int = 4) -> Any:
    """The model's ``LlamaConfig`` (random weights come from ``HFModelConfig(init="random", seed=...)``).

    ``heads`` splits the width 64 into attention heads (4 of 16, shipped; 2 of 32 for vLLM's CPU
    kernels, which take head sizes of 32 and more); the parameter count is the same.
    """
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(WORDS), hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=heads, max_position_embeddings=64, tie_word_embeddings=True, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip


def make_prompts(n: int = 512, *, seed: int = 0, n_digits: int = 3) -> list[dict[str, str]]:
    """``n`` rows ``{"prompt": "copy D D D :", "answer": "D D D"}`` drawn with ``seed``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        digits = " ".join(rng.choice("0123456789") for _ in range(n_digits))
        rows.append({"prompt": f"copy {digits} :", "answer": digits})
    return rows


def write_assets(directory: str | Path, *, heads: int = 4) -> Path:
    """Write config (``build_config(heads=heads)``), tokenizer and prompts into ``directory``
    (created; existing files replaced)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = build_config(heads=heads)
    config.save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    write_jsonl(out / "prompts.jsonl", make_prompts())
    return out


if __name__ == "__main__":  # python -m flowrl.examples.hf_copy DIR [HEADS]
    raise SystemExit(main(sys.argv[1:], write_assets, prog="python -m flowrl.examples.hf_copy", what="the example's config, tokenizer and prompts", heads=4))
