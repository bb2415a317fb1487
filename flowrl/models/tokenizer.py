"""Tokenizers of Hugging Face model directories: loading, pad and end-of-sequence ids, chat templates.

``load_tokenizer(path)`` returns a ``transformers`` tokenizer (``PreTrainedTokenizerBase``): the
rest of flowrl uses its ordinary API (``encode``, ``decode``, ``apply_chat_template``,
``eos_token_id``, ``pad_token_id``). A tokenizer without a pad token pads with its end token.
"""

from __future__ import annotations

from typing import Any

from flowrl.errors import ConfigError
from flowrl.models.local import require_transformers, resolve_local_dir

__all__ = ["load_tokenizer", "check_chat_template", "check_vocab", "VOCABULARY_FILES"]

#: Files that hold a tokenizer's vocabulary, as ``save_pretrained`` writes them (fast tokenizers,
#: BPE, WordPiece, SentencePiece, tiktoken). A directory with none of them holds no tokenizer:
#: ``transformers`` would still build one from ``config.json``'s model type, with an empty vocabulary
#: (every prompt encodes to no tokens, and it has no chat template).
VOCABULARY_FILES: tuple[str, ...] = ("tokenizer.json", "vocab.json", "vocab.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model")


def load_tokenizer(path: str, *, owner: str = "tokenizer") -> Any:
    """The tokenizer saved in the local directory ``path`` (``save_pretrained`` layout).

    Raises:
        ConfigError: for a missing directory or hub id, a missing ``transformers``, or a directory
            without tokenizer files (none of ``VOCABULARY_FILES``: "no tokenizer files in DIR").
    """
    directory = resolve_local_dir(path, owner=owner)
    if not any((directory / f).is_file() for f in VOCABULARY_FILES) and not any(directory.glob("*.tiktoken")):
        present = sorted(p.name for p in directory.iterdir())[:12]
        raise ConfigError(
            f"{owner}: no tokenizer files in {str(directory)!r} (files there: {present}); a model directory needs its "
            f"tokenizer ({', '.join(VOCABULARY_FILES[:2])} or another vocabulary file, with tokenizer_config.json): copy "
            "them from the model's original directory (tokenizer.save_pretrained(DIR)), or name the directory that "
            "holds them with tokenizer='DIR'"
        )
    transformers = require_transformers(f"{owner} (a Hugging Face tokenizer)")
    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        present = sorted(p.name for p in directory.iterdir())[:12]
        raise ConfigError(
            f"{owner}: no tokenizer could be loaded from {str(directory)!r} (files there: {present}): {exc}. "
            "Save one with tokenizer.save_pretrained(DIR)."
        ) from None
    if tok.pad_token_id is None:
        if tok.eos_token_id is None:
            raise ConfigError(f"{owner}: the tokenizer in {str(directory)!r} has neither a pad nor an end-of-sequence token")
        tok.pad_token = tok.eos_token
    return tok


def check_chat_template(tok: Any, *, owner: str) -> None:
    """Raise a ``ConfigError`` when ``chat_template=True`` is asked of a tokenizer that has none."""
    if not getattr(tok, "chat_template", None):
        raise ConfigError(
            f"{owner}: chat_template=True, but the tokenizer has no chat template; "
            "give plain-text prompts (chat_template=False) or use a tokenizer that defines one"
        )


def check_vocab(tok: Any, vocab_size: int, *, owner: str) -> None:
    """Raise a ``ConfigError`` when the tokenizer can emit ids the model's embeddings do not have."""
    if len(tok) > vocab_size:
        raise ConfigError(
            f"{owner}: the tokenizer has {len(tok)} tokens but the model's embedding has {vocab_size} rows; "
            "use the model's own tokenizer or resize the embeddings (model.resize_token_embeddings) and save again"
        )
