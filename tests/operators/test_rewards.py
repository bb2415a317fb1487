"""The built-in verifiable rewards: exact match, math-verify's answer checker, format patterns."""

from __future__ import annotations

import threading

import pytest

from flowrl.errors import ConfigError
from flowrl.operators import rewards

EXACT = [
    ("Paris", "Paris", 1.0, 1.0),
    ("  paris \n", "Paris", 1.0, 0.0),
    ("new   york", "New York", 1.0, 0.0),
    ("Paris.", "Paris", 0.0, 0.0),
    ("42", 42, 1.0, 1.0),
]


@pytest.mark.parametrize(("completion", "answer", "normalised", "strict"), EXACT, ids=["same", "case-space", "inner-space", "punct", "int"])
def test_exact_match(completion, answer, normalised, strict):
    assert rewards.exact_match("q", completion, answer=answer) == normalised
    assert rewards.exact_match_strict("q", completion, answer=answer) == strict


def test_exact_match_on_another_field():
    reward = rewards.make_exact_match("city", normalize=False)
    assert reward("q", "Rome ", city="Rome") == 1.0 and reward("q", "rome", city="Rome") == 0.0
    with pytest.raises(KeyError, match="no field 'city'"):
        reward("q", "Rome", answer="Rome")


MATH = [
    (r"The fraction is \boxed{1/2}.", "0.5", 1.0),
    ("The answer is 42", "42", 1.0),
    ("The answer is 42", 42, 1.0),
    (r"We get $\frac{3}{4}$", r"\frac{3}{4}", 1.0),
    (r"so \boxed{\frac{6}{8}}", "0.75", 1.0),
    ("We get 0.5.", r"\frac{1}{2}", 1.0),
    ("first 3, then 7, finally 12", "12", 1.0),
    ("The answer is 41", "42", 0.0),
    (r"\boxed{2/3}", "0.5", 0.0),
    ("I do not know", "7", 0.0),
    ("", "7", 0.0),
]


@pytest.mark.parametrize(("completion", "answer", "want"), MATH,
                         ids=["boxed-frac-vs-decimal", "last-number", "int-answer", "latex-frac", "boxed-latex-reduced",
                              "decimal-vs-latex", "last-of-many", "wrong", "boxed-wrong", "no-answer", "empty"])
def test_math_answer(completion, answer, want):
    pytest.importorskip("math_verify")
    assert rewards.math_answer("q", completion, answer=answer) == want


def test_math_answer_works_off_the_main_thread():
    """The local backend scores in a thread, where math-verify's SIGALRM time limit cannot work."""
    pytest.importorskip("math_verify")
    got = []
    t = threading.Thread(target=lambda: got.append(rewards.math_answer("q", r"\boxed{1/2}", answer="0.5")))
    t.start()
    t.join()
    assert got == [1.0]


def test_math_answer_without_math_verify_says_how_to_install(monkeypatch):
    def missing(name):
        raise ImportError(name)

    monkeypatch.setattr(rewards.importlib, "import_module", missing)
    with pytest.raises(ConfigError, match=r"pip install 'flowrl\[math\]'"):
        rewards.math_answer("q", "1", answer="1")


FORMATS = [
    (rewards.boxed_format, r"so \boxed{42}", 1.0),
    (rewards.boxed_format, r"so \boxed{\frac{1}{2}}", 1.0),
    (rewards.boxed_format, "so 42", 0.0),
    (rewards.think_answer_format, "<think>2+2</think> <answer>4</answer>", 1.0),
    (rewards.think_answer_format, "<think>2+2</think>\n<answer>4</answer> and more", 0.0),
    (rewards.think_answer_format, "<answer>4</answer>", 0.0),
]


@pytest.mark.parametrize(("fn", "completion", "want"), FORMATS, ids=["boxed", "boxed-nested", "no-box", "think-answer", "trailing", "no-think"])
def test_format_rewards(fn, completion, want):
    assert fn("q", completion) == want


def test_a_bad_format_pattern_is_a_config_error():
    with pytest.raises(ConfigError, match=r"pattern '\(' does not compile"):
        rewards.make_format_reward("(")
