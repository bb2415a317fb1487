"""The built-in model's tokenizer: the digit vocabulary of the built-in tasks and games, which lives
in ``flowrl.digits`` (pure Python, shared with ``operators.tasks`` and ``envs.games`` without their
importing the models package)."""

from flowrl.digits import BOS, DEFAULT_TOKENIZER, EOS, PAD, Tokenizer

__all__ = ["Tokenizer", "PAD", "BOS", "EOS", "DEFAULT_TOKENIZER"]
