"""The built-in tasks: endless, seeded prompt streams with verifiable rewards, and their reward functions.

A task is anything with ``name``, ``prompt(index) -> list[int]`` (prompt ``index`` of its endless
stream, a pure function of the task's seed and ``index``) and ``reward(prompt_ids, completion_ids)
-> float``. Prompts include the start token; completions include the stop token when the generator
emitted one.

Built-in tasks (``TASKS``), both scored position by position against the target answer followed by
``</s>``, so that they give partial credit (a chance-level policy scores about 1/16 per position):

- ``copy`` (easy): ``<s>407=`` -> ``407</s>``; 3 digits. The 2-layer, 64-wide example model learns
  it from scratch with RL in well under a minute on a laptop CPU (``benches/learning.py``).
- ``add`` (harder): ``<s>27+385=`` -> ``412</s>``; operands of 1 to 3 digits, the sum written most
  significant digit first (so the first digit needs the carries of all others).
- ``longtail`` (long completions, rarely): ``<s>4-9=`` -> ``444444444</s>``, a digit repeated as
  many times as the prompt says, the count drawn per prompt from a truncated Zipf law, so that
  completion lengths are heavy-tailed (``LongTailTask``): what continuous batching is measured on.

Reward functions are module-level so that a scorer can reference them as ``module:qualname``
(``flowrl.operators.tasks:copy_reward``).

Example:
    >>> task = make_task("add", seed=0)
    >>> p = task.prompt(0)
    >>> DEFAULT_TOKENIZER.decode(p)
    '<s>467+0='
    >>> task.reward(p, DEFAULT_TOKENIZER.encode("467</s>"))
    1.0
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from flowrl.errors import ConfigError
from flowrl.graph.refs import resolve
from flowrl.digits import DEFAULT_TOKENIZER, Tokenizer, positional_reward

__all__ = [
    "Task",
    "CopyTask",
    "AddTask",
    "LongTailTask",
    "TASKS",
    "make_task",
    "positional_reward",
    "copy_reward",
    "add_reward",
    "longtail_reward",
    "brevity_reward",
]

_TOK = DEFAULT_TOKENIZER
_EQ = _TOK.encode("=")[0]
_PLUS = _TOK.encode("+")[0]
_MINUS = _TOK.encode("-")[0]
_DIGITS = {i: c for c in "0123456789" for i in _TOK.encode(c)}


@runtime_checkable
class Task(Protocol):
    """A prompt stream with a reward (see the module docstring)."""

    name: str

    def prompt(self, index: int) -> list[int]: ...

    def reward(self, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> float: ...


def _rng(name: str, seed: int, index: int) -> random.Random:
    # Seeding with a str hashes it with SHA-512: the same stream on every machine and Python run.
    return random.Random(f"{name}:{seed}:{index}")


def _question(prompt_ids: Sequence[int]) -> list[int]:
    """The tokens between ``<s>`` and ``=`` of a built-in prompt."""
    ids = [int(i) for i in prompt_ids if int(i) not in (_TOK.pad_id, _TOK.bos_id)]
    if not ids or ids[-1] != _EQ:
        raise ValueError(f"not a built-in task prompt (expected '<s>...='): {_TOK.decode(prompt_ids)!r}")
    return ids[:-1]


def copy_reward(prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> float:
    """Reward of the ``copy`` task: the completion should repeat the prompt's digits, then stop."""
    return positional_reward(_question(prompt_ids), completion_ids)


def add_reward(prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> float:
    """Reward of the ``add`` task: the completion should be the sum's digits, then stop."""
    question = _question(prompt_ids)
    if question.count(_PLUS) != 1:
        raise ValueError(f"not an 'add' prompt: {_TOK.decode(prompt_ids)!r}")
    at = question.index(_PLUS)
    a = int("".join(_DIGITS[i] for i in question[:at]))
    b = int("".join(_DIGITS[i] for i in question[at + 1 :]))
    return positional_reward(_TOK.digits(str(a + b)), completion_ids)


def longtail_reward(prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> float:
    """Reward of the ``longtail`` task: the prompt's digit repeated as often as it says, then stop."""
    question = _question(prompt_ids)
    if question.count(_MINUS) != 1 or question.index(_MINUS) != 1:
        raise ValueError(f"not a 'longtail' prompt (expected '<s>D-N='): {_TOK.decode(prompt_ids)!r}")
    count = int("".join(_DIGITS[i] for i in question[2:]))
    return positional_reward([question[0]] * count, completion_ids)


def brevity_reward(prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> float:
    """1.0 when the completion stops (ends with ``</s>``) within one token more than the question
    between ``<s>`` and ``=`` is long, else 0.0: it rewards stopping, not rambling, for any built-in task."""
    ids = [int(i) for i in completion_ids]
    limit = len(_question(prompt_ids)) + 1
    return 1.0 if ids and ids[-1] == _TOK.eos_id and len(ids) <= limit else 0.0


class CopyTask:
    """``<s>DDD=`` -> ``DDD</s>`` (see the module docstring).

    Args:
        seed: seed of the prompt stream.
        n_digits: digits per prompt.
    """

    name = "copy"

    def __init__(self, seed: int = 0, *, n_digits: int = 3) -> None:
        if n_digits < 1:
            raise ConfigError(f"copy task: n_digits={n_digits} must be >= 1")
        self.seed, self.n_digits = seed, n_digits
        self.tokenizer: Tokenizer = _TOK
        self.pad_id = _TOK.pad_id

    def prompt(self, index: int) -> list[int]:
        rng = _rng(self.name, self.seed, index)
        digits = "".join(rng.choice("0123456789") for _ in range(self.n_digits))
        return _TOK.encode(f"<s>{digits}=")

    def reward(self, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> float:
        return copy_reward(prompt_ids, completion_ids)


class AddTask:
    """``<s>A+B=`` -> ``(A+B)</s>`` with A and B of 1 to ``max_digits`` digits (see the module docstring).

    Args:
        seed: seed of the prompt stream.
        max_digits: most digits of an operand.
    """

    name = "add"

    def __init__(self, seed: int = 0, *, max_digits: int = 3) -> None:
        if max_digits < 1:
            raise ConfigError(f"add task: max_digits={max_digits} must be >= 1")
        self.seed, self.max_digits = seed, max_digits
        self.tokenizer: Tokenizer = _TOK
        self.pad_id = _TOK.pad_id

    def prompt(self, index: int) -> list[int]:
        rng = _rng(self.name, self.seed, index)
        a, b = (rng.randrange(10 ** rng.randint(1, self.max_digits)) for _ in range(2))
        return _TOK.encode(f"<s>{a}+{b}=")

    def reward(self, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> float:
        return add_reward(prompt_ids, completion_ids)


class LongTailTask:
    """``<s>D-N=`` -> ``DDD...`` (N digits), then ``</s>``: completion lengths N + 1 with a heavy tail.

    The length N of prompt ``i`` is drawn from its seeded stream by a truncated Zipf law,
    ``P(N = j) = j ** -alpha / Z`` for ``j`` in ``1 .. max_count`` (``Z`` normalises), the digit D
    uniformly. With the defaults (``alpha=1.5``, ``max_count=31``, so completions fit
    ``max_new_tokens=32``): mean N about 4.3 (completions 5.3 tokens), median 2; P(N >= 8) about 0.16, P(N >= 16)
    about 0.065, P(N = 31) about 0.003. A batch of 32 completions holds one of 16 tokens or more 9 times in 10,
    so a lock-step batch decodes about 4 times as many steps as its mean completion needs: the
    long tail that continuous batching removes (``benches/generation.py --longtail``).

    The reward is positional (``positional_reward``) against the N digits and ``</s>``, so a policy
    first learns to repeat the digit (most of the credit), then to stop after N. One digit, not a
    longer pattern, keeps the task learnable by the example model (a two-digit alternating pattern
    stayed at chance, reward 0.07, over 250 steps); the price is fewer distinct prompts: 10 digits
    times the lengths, most of them short (about 33 distinct in 50 prompts).

    Args:
        seed: seed of the prompt stream.
        alpha: the Zipf exponent (> 1; smaller is a heavier tail).
        max_count: the longest count; completions are at most ``max_count + 1`` tokens.

    Example:
        >>> task = LongTailTask(seed=0)
        >>> [len(task.target(i)) for i in range(12)]
        [1, 4, 2, 1, 1, 6, 1, 2, 1, 2, 3, 5]
    """

    name = "longtail"

    def __init__(self, seed: int = 0, *, alpha: float = 1.5, max_count: int = 31) -> None:
        if not alpha > 1.0:
            raise ConfigError(f"longtail task: alpha={alpha} must be > 1 (the Zipf exponent; smaller is a heavier tail)")
        if not 1 <= max_count <= 99:
            raise ConfigError(f"longtail task: max_count={max_count} must be in [1, 99] (at most two digits in the prompt)")
        self.seed, self.alpha, self.max_count = seed, alpha, max_count
        self.tokenizer: Tokenizer = _TOK
        self.pad_id = _TOK.pad_id
        weights = [j**-alpha for j in range(1, max_count + 1)]
        total, acc = sum(weights), 0.0
        self._cdf = []
        for w in weights:
            acc += w / total
            self._cdf.append(acc)

    def _draw(self, index: int) -> tuple[str, int]:  # (digit, count)
        rng = _rng(self.name, self.seed, index)
        pattern = rng.choice("0123456789")
        u = rng.random()
        count = next((j + 1 for j, c in enumerate(self._cdf) if u < c), self.max_count)
        return pattern, count

    def target(self, index: int) -> list[int]:
        """The answer of prompt ``index`` without the stop token."""
        pattern, count = self._draw(index)
        return _TOK.digits(pattern * count)

    def prompt(self, index: int) -> list[int]:
        pattern, count = self._draw(index)
        return _TOK.encode(f"<s>{pattern}-{count}=")

    def reward(self, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> float:
        return longtail_reward(prompt_ids, completion_ids)


#: Built-in tasks: name -> factory(seed).
TASKS: dict[str, Callable[[int], Task]] = {"copy": CopyTask, "add": AddTask, "longtail": LongTailTask}


def make_task(name_or_ref: str, seed: int) -> Task:
    """The task ``name_or_ref``: a built-in name, or the ``module:qualname`` of a factory ``(seed) -> Task``.

    Raises:
        ConfigError: for an unknown name (listing the built-in ones) or a factory whose result is no task.
        GraphError: for a reference that does not resolve.
    """
    if name_or_ref in TASKS:
        return TASKS[name_or_ref](seed)
    if ":" not in name_or_ref:
        raise ConfigError(
            f"unknown task {name_or_ref!r}: built-in tasks are {', '.join(sorted(TASKS))}; "
            "or name a factory as 'package.module:function' taking the seed"
        )
    task = resolve(name_or_ref)(seed)
    if not isinstance(task, Task):
        raise ConfigError(
            f"task factory {name_or_ref!r} returned {type(task).__name__}, which lacks name, prompt(index) or reward(prompt, completion)"
        )
    return task
