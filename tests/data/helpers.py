"""Helpers of the data tests: a small word-level tokenizer saved as a Hugging Face directory, and prompt files."""

from __future__ import annotations

from flowrl.data import files
from pathlib import Path

import pytest

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
WORDS = ["user", "assistant", "system", "what", "is", "the", "answer", "plus", "one", "two", "three", "four",
         "1", "2", "3", "4", "5", "6", "7", "8", "9", "0", "?", "."]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant{% endif %}"
)


def word_tokenizer(directory: Path, *, chat_template: str | None = CHAT_TEMPLATE, bos: bool = False) -> Path:
    """A WordLevel tokenizer over ``SPECIALS + WORDS`` (28 ids) saved with ``save_pretrained`` into ``directory``.

    With ``bos`` every encoded text starts with ``<s>`` (as Llama's tokenizer does).
    """
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    if bos:
        core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    if chat_template:
        tok.chat_template = chat_template
    tok.save_pretrained(str(directory))
    return directory


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    return files.write_jsonl(path, rows)


def model_config():
    """A built-in model whose 32-id vocabulary covers the word tokenizer's 28 ids."""
    from flowrl.graph.configs import ModelConfig

    return ModelConfig(vocab_size=32, dim=32, n_layers=1, n_heads=2, n_kv_heads=2, max_seq_len=24)


def data_graph(data: str, tokenizer: str, *, scorer: str = "flowrl.operators.tasks:copy_reward", inputs: str = "ids",
               batched: bool = False, k: int = 0, eos: int = 2, batching: str = "lockstep", **source: object):
    """The LlamaRL pipeline on a prompt file, the built-in model, a word tokenizer (``eos``: its ``</s>`` id),
    the generator batching in lock step or continuously (``batching``)."""
    from flowrl.graph.builder import GraphBuilder

    b = GraphBuilder("data", model=model_config())
    source.setdefault("batch_size", 3)
    prompts = b.source("prompts", data=data, tokenizer=tokenizer, **source)
    gen = b.generator("gen", prompts, n_samples=2, max_new_tokens=4, stop_tokens=(eos,), batching=batching)
    reward = b.scorer("reward", gen, fn=scorer, inputs=inputs, batched=batched)
    loss = b.loss("aipo", gen, reward)
    policy = b.policy("policy", loss, lr=1e-3)
    b.weights(policy, gen, max_staleness=k)
    return b.build()
