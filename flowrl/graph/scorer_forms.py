"""What a scorer function's signature says it takes, checked against the scorer's ``inputs`` and ``batched``.

A scorer calls its function in one of four forms (``flowrl.operators.scoring``):

- ``inputs="ids"``: ``fn(prompt_ids, completion_ids) -> float`` (batched: lists of lists);
- ``inputs="text"``: ``fn(prompt, completion, **fields) -> float`` (batched: lists, fields as lists);
- ``inputs="text", batched=True`` with TRL's reward-function form ``fn(completions, **kwargs) ->
  list[float]`` (first parameter ``completions``): called with keyword arguments as TRL calls it,
  ``completions=``, ``prompts=``, ``completion_ids=`` and every row field as a list.

A function whose signature contradicts the scorer's flags would fail on its first batch with an
error that does not say why (a ``KeyError`` on a row field it never got, a ``TypeError`` on token
ids, ``r() takes 1 positional argument but 2 were given``). ``form_mismatch`` says which flags to
set, or which parameter to add or rename, instead; the builder asks it about a function it is
handed, and the scorer about the function its reference resolves to when the run starts. Only
what the signature states counts (annotations, ``**fields``, parameters beyond the first two, the
name ``completions`` first, how many parameters take a positional argument), so an unannotated
``fn(prompt, completion)`` is taken as written. A function with fewer than the two positional
parameters its call passes is refused; when its first parameter is named nearly ``completions``
(``completion``, ``complitions``) the message names TRL's form, the likelier intent.

Example:
    >>> def reward_len(completions, **kwargs): ...
    >>> is_trl_form(reward_len)
    True
    >>> form_mismatch(reward_len, inputs="text", batched=True) is None
    True
"""

from __future__ import annotations

import difflib
import inspect
import re
from collections.abc import Callable
from typing import Any

__all__ = ["is_trl_form", "form_mismatch", "text_hint", "TRL_KEYWORDS", "TEXT_NAMES"]

#: The keyword arguments TRL passes besides the dataset's columns (those flowrl has).
TRL_KEYWORDS: tuple[str, ...] = ("prompts", "completions", "completion_ids")
#: Parameter names a text-minded author gives the prompt and the completion.
TEXT_NAMES = frozenset({"prompt", "completion", "prompts", "completions", "text", "texts", "response", "responses"})

_TEXT_ANNOTATION = re.compile(r"^(typing\.)?(str|(list|List|Sequence|Iterable|tuple|Tuple)\[str(, \.\.\.)?\])$")


def _parameters(fn: Callable[..., Any]) -> list[inspect.Parameter] | None:
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None  # a builtin without a signature: nothing to say


def is_trl_form(fn: Callable[..., Any]) -> bool:
    """True for TRL's reward-function form: the first parameter is ``completions`` (``f(completions, **kwargs)``)."""
    params = _parameters(fn) or []
    return bool(params) and params[0].name == "completions" and params[0].kind is not inspect.Parameter.VAR_POSITIONAL


def _annotation(p: inspect.Parameter) -> str:
    a = p.annotation
    if a is inspect.Parameter.empty:
        return ""
    return a if isinstance(a, str) else getattr(a, "__name__", "") if isinstance(a, type) else repr(a)


def _text_evidence(params: list[inspect.Parameter]) -> str:
    """Why the signature says text (empty when it does not): the reason, for the message."""
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for p in positional[:2]:
        if _TEXT_ANNOTATION.match(_annotation(p)):
            return f"its parameter {p.name!r} is annotated {_annotation(p)}"
    ids_named = any(p.name.endswith("_ids") for p in positional[:2])
    if any(p.kind is p.VAR_KEYWORD for p in params) and not ids_named:
        return "it takes **fields, the prompt row's fields"
    needs = [p.name for p in positional[2:] if p.default is p.empty] + [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    if needs:
        return f"it needs row field(s) {needs}, which only inputs='text' passes"
    return ""


def form_mismatch(fn: Callable[..., Any], *, inputs: str, batched: bool) -> str | None:
    """What contradicts the scorer's flags in ``fn``'s signature, with the flags to set; None when nothing does.

    The message starts after the function's name: ``f"{ref} {message}"`` reads as a sentence.
    """
    params = _parameters(fn)
    if params is None:
        return None
    if is_trl_form(fn):
        if inputs == "text" and batched:
            return None
        return (
            "has the form of TRL's reward functions, f(completions, **kwargs) -> list[float], called once per batch "
            "with keyword arguments; set inputs='text' and batched=True"
        )
    if inputs == "ids":
        why = _text_evidence(params)
        if why:
            return (
                f"takes text ({why}), but inputs='ids' calls it with token-id lists and no row fields; "
                "set inputs='text' (b.scorer(..., inputs='text'))"
            )
    return _too_few_positional(params, inputs=inputs, batched=batched)


def _too_few_positional(params: list[inspect.Parameter], *, inputs: str, batched: bool) -> str | None:
    """The scorer passes the prompt(s) and the completion(s) positionally: a function with room for
    fewer than two positional arguments fails on its first batch. None when it has room."""
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) >= 2:
        return None
    flags = f"inputs={inputs!r}" + (", batched=True" if batched else "")
    call = {
        ("ids", False): "fn(prompt_ids, completion_ids)",
        ("ids", True): "fn(prompt_ids_list, completion_ids_list)",
        ("text", False): "fn(prompt, completion, **fields)",
        ("text", True): "fn(prompts, completions, **fields)",
    }[(inputs, batched)]
    said = f"takes {len(positional)} positional parameter{'' if len(positional) == 1 else 's'} {positional}, but {flags} calls it as {call}"
    if positional and positional[0] != "completions" and difflib.get_close_matches(positional[0], ["completions"], n=1, cutoff=0.75):
        return (
            f"{said}; for TRL's reward-function form f(completions, **kwargs) -> list[float], name its first parameter "
            f"'completions' (not {positional[0]!r}) and set inputs='text', batched=True"
        )
    return f"{said}; take the prompt and the completion as its first two parameters"


def text_hint(fn: Callable[..., Any], inputs: str) -> str:
    """For a failure of an id scorer whose first parameters are named like text: the hint, else ""."""
    params = _parameters(fn)
    if inputs != "ids" or not params:
        return ""
    if any(p.name in TEXT_NAMES for p in params[:2]):
        return " (inputs='ids' passes token-id lists; for text set inputs='text')"
    return ""
