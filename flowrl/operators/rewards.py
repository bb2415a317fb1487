"""Built-in verifiable rewards on text: exact match, a math answer checker, and format rewards.

Each is a text scorer (``ScorerNode(inputs="text")``): ``fn(prompt, completion, **fields) -> float``
in [0, 1], referenced from a graph by name, e.g.
``b.scorer("reward", gen, fn="flowrl.operators.rewards:math_answer", inputs="text")``. The reference
answer is the prompt row's ``answer`` field.

- ``exact_match``: 1.0 when the completion equals the answer after trimming, collapsing whitespace
  and ignoring case; ``exact_match_strict`` compares the trimmed strings as they are.
- ``math_answer``: HF's ``math-verify`` (``pip install 'flowrl[math]'``) extracts the final answer
  of the completion (a ``\\boxed{}`` answer first, else LaTeX, else the last number) and checks it
  against the answer symbolically: ``\\boxed{1/2}`` matches ``0.5``, ``The answer is 42`` matches ``42``.
- ``boxed_format`` and ``think_answer_format``: 1.0 when the completion has the asked layout.

To compare against another field, or with another pattern, define a module-level function with
``make_exact_match`` / ``make_format_reward`` and name it in the graph (``"mymodule:my_reward"``).

Example:
    >>> exact_match("Q", "  Paris ", answer="paris")
    1.0
    >>> exact_match_strict("Q", "Paris", answer="paris")
    0.0
    >>> boxed_format("Q", r"so \\boxed{3}")
    1.0
    >>> same_city = make_exact_match("city")
    >>> same_city("Q", "ROME", city="Rome")
    1.0
"""

from __future__ import annotations

import importlib
import re
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from flowrl.errors import ConfigError

__all__ = [
    "exact_match",
    "exact_match_strict",
    "make_exact_match",
    "math_answer",
    "boxed_format",
    "think_answer_format",
    "make_format_reward",
    "normalize_text",
    "MATH_INSTALL_HINT",
]

MATH_INSTALL_HINT = "pip install 'flowrl[math]'"


def normalize_text(text: str) -> str:
    """``text`` trimmed, with runs of whitespace collapsed to one space, lower-cased."""
    return " ".join(str(text).split()).lower()


def make_exact_match(field: str = "answer", *, normalize: bool = True) -> Callable[..., float]:
    """A reward ``fn(prompt, completion, **{field: value})``: 1.0 when the completion equals the row's ``field``.

    Args:
        field: the row field holding the reference.
        normalize: compare after ``normalize_text`` (else after trimming only).
    """
    clean = normalize_text if normalize else (lambda s: str(s).strip())

    def reward(prompt: str, completion: str, **fields: Any) -> float:
        if field not in fields:
            raise KeyError(f"the row has no field {field!r} (it has {sorted(fields)})")
        return float(clean(completion) == clean(fields[field]))

    reward.__doc__ = f"1.0 when the completion equals the row's {field!r} ({'normalised' if normalize else 'exactly'})."
    return reward


def exact_match(prompt: str, completion: str, answer: Any) -> float:
    """1.0 when ``completion`` equals ``answer`` ignoring case and surrounding/repeated whitespace."""
    return float(normalize_text(completion) == normalize_text(answer))


def exact_match_strict(prompt: str, completion: str, answer: Any) -> float:
    """1.0 when ``completion`` equals ``answer`` after trimming the ends only."""
    return float(str(completion).strip() == str(answer).strip())


def _math_verify() -> ModuleType:
    try:
        return importlib.import_module("math_verify")
    except ImportError:
        raise ConfigError(f"the math_answer reward needs the 'math-verify' package: {MATH_INSTALL_HINT}") from None


def math_answer(prompt: str, completion: str, answer: Any) -> float:
    """1.0 when the final answer of ``completion`` equals ``answer`` mathematically (``math-verify``).

    The answer may be text (``"0.5"``, ``"\\\\frac{1}{2}"``) or a number. math-verify's time limits
    use SIGALRM, which works only in the main thread; in any other thread (the local backend's
    executors) they are off.

    Raises:
        ConfigError: when ``math-verify`` is not installed.
    """
    mv = _math_verify()
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    _quiet(mv)
    gold = mv.parse(str(answer), parsing_timeout=limit)
    if not gold:  # a plain reference math-verify cannot read as math: compare as text
        return exact_match(prompt, completion, answer)
    got = mv.parse(completion, parsing_timeout=limit)
    return float(bool(got) and mv.verify(gold, got, timeout_seconds=limit))


def _quiet(mv: ModuleType) -> None:
    """Silence math-verify's per-call warning that its time limit is off (it is, on purpose, off the main thread)."""
    import logging

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).setLevel(logging.ERROR)


def make_format_reward(pattern: str, *, flags: int = re.DOTALL) -> Callable[..., float]:
    """A reward ``fn(prompt, completion, **fields)``: 1.0 when ``re.search(pattern, completion)`` matches.

    Anchor the pattern (``^...$``) to ask for the whole completion's layout.

    Raises:
        ConfigError: for a pattern that does not compile.
    """
    try:
        compiled = re.compile(pattern, flags)
    except re.error as exc:
        raise ConfigError(f"format reward pattern {pattern!r} does not compile: {exc}") from None

    def reward(prompt: str, completion: str, **fields: Any) -> float:
        return float(compiled.search(completion) is not None)

    reward.__doc__ = f"1.0 when the completion matches {pattern!r}."
    return reward


boxed_format = make_format_reward(r"\\boxed\{[^{}]*(\{[^{}]*\}[^{}]*)*\}")
boxed_format.__doc__ = "1.0 when the completion holds a ``\\boxed{...}`` answer."
think_answer_format = make_format_reward(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$")
think_answer_format.__doc__ = "1.0 when the completion is ``<think>...</think>`` then ``<answer>...</answer>``, nothing else."
