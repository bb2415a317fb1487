"""The digit vocabulary of the built-in tasks and games (pure Python): its small deterministic tokenizer
(three special tokens, ten digits, three operators) and the positional score of a digit answer.

Vocabulary (16 ids, so it fits the default ``ModelConfig(vocab_size=16)``):

====  =======  ==========================================
id    text     meaning
====  =======  ==========================================
0     <pad>    padding (prompts left, completions right)
1     <s>      start of a prompt
2     </s>     end of a completion (the default stop token)
3-12  0-9      digits
13    +        plus
14    =        "answer follows"
15    -        minus
====  =======  ==========================================

Operators take token ids, so another tokenizer can plug in: a generator then names its end token in
``SamplingConfig.stop_tokens``.

Example:
    >>> tok = Tokenizer()
    >>> tok.encode("<s>12+3=")
    [1, 4, 5, 13, 6, 14]
    >>> tok.decode([4, 5, 2])
    '12</s>'
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["Tokenizer", "PAD", "BOS", "EOS", "DEFAULT_TOKENIZER", "positional_reward"]

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
_SPECIALS = (PAD, BOS, EOS)
_CHARS = "0123456789+=-"


class Tokenizer:
    """Characters and special tokens to ids and back; ``decode(encode(s)) == s`` for every valid ``s``.

    Attributes:
        pad_id, bos_id, eos_id: ids of the special tokens.
        vocab_size: number of ids (16).
    """

    def __init__(self) -> None:
        self.tokens: tuple[str, ...] = (*_SPECIALS, *_CHARS)
        self._ids = {t: i for i, t in enumerate(self.tokens)}
        self.pad_id: int = self._ids[PAD]
        self.bos_id: int = self._ids[BOS]
        self.eos_id: int = self._ids[EOS]
        self.vocab_size: int = len(self.tokens)

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``: one per character, special tokens written ``<pad>``, ``<s>``, ``</s>``.

        Raises:
            ValueError: naming the first character that is not in the vocabulary.
        """
        ids: list[int] = []
        i = 0
        while i < len(text):
            if text[i] == "<":
                for special in _SPECIALS:
                    if text.startswith(special, i):
                        ids.append(self._ids[special])
                        i += len(special)
                        break
                else:
                    raise ValueError(f"cannot encode {text!r}: '<' at {i} does not start one of {_SPECIALS}")
                continue
            if text[i] not in self._ids:
                raise ValueError(f"cannot encode {text!r}: character {text[i]!r} at {i} is not one of {_CHARS!r} or {_SPECIALS}")
            ids.append(self._ids[text[i]])
            i += 1
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``; ids outside the vocabulary decode as ``<unk:ID>``."""
        return "".join(self.tokens[i] if 0 <= i < self.vocab_size else f"<unk:{i}>" for i in map(int, ids))

    def digits(self, text: str) -> list[int]:
        """Ids of a string of digits (no special tokens)."""
        return [self._ids[c] for c in text]

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, pad={self.pad_id}, bos={self.bos_id}, eos={self.eos_id})"


#: The tokenizer every built-in task, the source and the generator's default stop token use.
DEFAULT_TOKENIZER = Tokenizer()


def positional_reward(target: Sequence[int], completion_ids: Sequence[int]) -> float:
    """Fraction of the positions of ``target + [</s>]`` that ``completion_ids`` gets right, in [0, 1].

    Example:
        >>> positional_reward([4, 5], [4, 9, 2])  # '0' right, '1' wrong, </s> right
        0.6666666666666666
    """
    want = [*target, DEFAULT_TOKENIZER.eos_id]
    got = list(completion_ids)
    return sum(1 for i, w in enumerate(want) if i < len(got) and int(got[i]) == w) / len(want)
