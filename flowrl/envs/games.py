"""Built-in environments in the built-in tokenizer's vocabulary (digits, ``+``, ``=``, ``-``), and their tasks.

- ``GuessNumberEnv``: a two-turn guessing game. The secret is a digit drawn from the prompt's stream
  position; the model guesses (its first digit counts); the environment answers ``+`` (higher) or
  ``-`` (lower), or ends the episode on a right guess. Reward 1 for a right first guess, 0.5 for a
  right second guess, else 0. Prompts: ``GuessTask`` (``<s>=`` for every position).
- ``CalcEnv``: arithmetic with a calculator tool (``flowrl run calc_agent``). The prompt is a sum,
  ``<s>27+38=``. The call is a short fixed form in the tokenizer's vocabulary: a model turn ``=``
  calls the calculator on the question, an expression (``27+38=`` or ``27+38</s>``) calls it on that
  expression; either way the observation is the value followed by ``</s>`` (``65</s>``), so the
  answer turn starts after a token unlike the prompt's last (with ``65=``, the call turn and the answer
  turn both followed ``=``: learning to call taught the model to call again instead of answering, and
  its answers stalled at a constant number; ``end`` sets this token). The generator stops a turn at
  ``</s>`` or ``=`` (``stop_tokens``), so the call is one token. A turn that is a bare number
  (``65</s>`` or ``65=``) is the final answer: after a call, its ``positional_reward`` against the
  true sum (1 when right, partial credit per digit); without a call, 1 only when exactly right (a
  tiny model cannot add two 2-digit numbers by itself: guessing earns nearly nothing, the calculator
  is the way). Any other turn is a malformed call, answered ``-</s>``. ``call_credit`` (default 0)
  rewards the first call, for shaping experiments. Prompts: ``CalcTask``.

Both are plain Python classes following ``flowrl.envs.environment`` (one instance per sample).

Example:
    >>> env = GuessNumberEnv()
    >>> env.reset({"prompt_index": 1})
    >>> env.secret, env.step("5</s>")
    (1, ('-', 0.0, {'secret': 1}))
    >>> env.step("1</s>")
    (None, 0.5, {'secret': 1})
    >>> calc = CalcEnv()
    >>> calc.reset({"prompt": "<s>27+38="})
    >>> calc.step("=")
    ('65</s>', 0.0, {'call': '27+38'})
    >>> calc.step("65</s>")
    (None, 1.0, {'answer': 65})
    >>> calc.reset({"prompt": "<s>27+38="})
    >>> calc.step("64</s>")  # no call: only an exact answer counts
    (None, 0.0, {'answer': 64})
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any

from flowrl.digits import DEFAULT_TOKENIZER, positional_reward

__all__ = ["GuessNumberEnv", "GuessTask", "guess_task", "CalcEnv", "CalcTask", "calc_task"]

_TOK = DEFAULT_TOKENIZER
_END = "</s>"


def _strip(action: str) -> str:
    return action[: action.index(_END)] if _END in action else action


class GuessNumberEnv:
    """A two-turn guessing game (see the module docstring).

    Args:
        seed: mixed with the prompt's stream position to draw the secret.
        higher, lower: the observations for "the secret is higher/lower".
    """

    def __init__(self, seed: int = 0, higher: str = "+", lower: str = "-") -> None:
        self.seed, self.higher, self.lower = seed, higher, lower
        self.secret = 0
        self.guesses = 0

    def reset(self, row: dict[str, Any]) -> None:
        self.secret = random.Random(f"guess:{self.seed}:{int(row['prompt_index'])}").randrange(10)
        self.guesses = 0
        return None

    def step(self, action: str) -> tuple[str | None, float, dict[str, Any]]:
        self.guesses += 1
        digits = re.findall(r"\d", _strip(action))
        info = {"secret": self.secret}
        if not digits:
            return None, 0.0, info
        guess = int(digits[0])
        if guess == self.secret:
            return None, 1.0 if self.guesses == 1 else 0.5, info
        if self.guesses >= 2:
            return None, 0.0, info
        return (self.higher if self.secret > guess else self.lower), 0.0, info


class GuessTask:
    """The guessing game's prompts: ``<s>=`` at every position (the secret comes from the position)."""

    name = "guess"

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def prompt(self, index: int) -> list[int]:
        return _TOK.encode("<s>=")

    def reward(self, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> float:
        return 0.0  # the environment's rewards are the reward (env_rewards)


def guess_task(seed: int) -> GuessTask:
    """The guessing game's task factory (``b.source(..., task="flowrl.envs.games:guess_task")``)."""
    return GuessTask(seed)


_EXPR = re.compile(r"^(\d{1,4})([+-])(\d{1,4})$")
_NUMBER = re.compile(r"^-?\d{1,5}$")


class CalcEnv:
    """Arithmetic with a calculator (see the module docstring).

    Args:
        call_credit: the most the first call earns (for copying the question's expression exactly).
        end: the last token of every observation (default ``</s>``; see the module docstring).
    """

    def __init__(self, call_credit: float = 0.0, end: str = _END) -> None:
        self.call_credit, self.end = call_credit, end
        self.question = ""
        self.called = False

    def reset(self, row: dict[str, Any]) -> None:
        text = row["prompt"].replace("<s>", "")
        self.question = text[:-1] if text.endswith("=") else text
        self.called = False
        return None

    @staticmethod
    def _value(expr: str) -> int:
        m = _EXPR.match(expr)
        if m is None:
            raise ValueError(f"not an expression: {expr!r}")
        a, op, b = int(m[1]), m[2], int(m[3])
        return a + b if op == "+" else a - b

    def step(self, action: str) -> tuple[str | None, float, dict[str, Any]]:

        text = _strip(action)
        ended = text.endswith("=") or _END in action
        body = text[:-1] if text.endswith("=") else text
        if ended and _NUMBER.match(body) and _EXPR.match(self.question):  # the final answer
            target, got = _TOK.encode(str(self._value(self.question))), [*_TOK.encode(body), _TOK.eos_id]
            if self.called:
                return None, positional_reward(target, got), {"answer": int(body)}
            return None, float(got == [*target, _TOK.eos_id]), {"answer": int(body)}
        expr = self.question if body == "" and text == "=" else body
        if _EXPR.match(expr):
            reward = 0.0 if self.called else self.call_credit
            self.called = True
            return f"{self._value(expr)}{self.end}", reward, {"call": expr}
        return f"-{self.end}", 0.0, {"call": text}


class CalcTask:
    """``calc_agent``'s prompts: ``<s>A+B=`` with the sum ``A+B`` drawn uniformly from ``[lo, hi]`` per
    position (seeded), then ``A`` uniformly from ``[10, A+B-10]``: both addends and the sum have two
    digits, and the sum's digits are about uniform, so no constant answer earns more digit credit than
    another. (With ``A`` and ``B`` each uniform over 10..49, the sums' first digit was 5 or 6 for 44% of
    the prompts, and the model settled on answering ``5x``/``6x`` whatever the calculator said before
    it learned to copy; with 10..99, ``11``.)"""

    name = "calc"

    def __init__(self, seed: int = 0, lo: int = 20, hi: int = 98) -> None:
        if not 20 <= lo <= hi <= 98:
            raise ValueError(f"CalcTask: sums must lie in 20..98 (two-digit addends and sum), got [{lo}, {hi}]")
        self.seed, self.lo, self.hi = seed, lo, hi

    def prompt(self, index: int) -> list[int]:
        rng = random.Random(f"calc:{self.seed}:{index}")
        total = rng.randint(self.lo, self.hi)
        a = rng.randint(10, total - 10)
        return _TOK.encode(f"<s>{a}+{total - a}=")

    def reward(self, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> float:
        return 0.0  # the environment's rewards are the reward (env_rewards)


def calc_task(seed: int) -> CalcTask:
    """``calc_agent``'s task factory (``b.source(..., task="flowrl.envs.games:calc_task")``)."""
    return CalcTask(seed)
