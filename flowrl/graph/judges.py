"""How a reward-model node asks a generative judge for its verdict: ``JudgeConfig``, plain data.

A ``reward_model`` node (``flowrl.graph.nodes.RewardModelNode``) with a ``judge`` prompts a causal LM
with ``template`` filled in with the sample's ``{prompt}`` and ``{completion}`` text, and reads a
verdict from its answer (``flowrl.operators.reward_models``):

- ``verdict="logprob"`` (the default): one forward pass; the reward is the judge's probability of
  ``yes`` against ``no`` as its next token, ``p(yes) / (p(yes) + p(no)) = sigmoid(z_yes - z_no)``.
  It needs no sampling, is never unparseable, is smooth in the judge's confidence (a graded
  reward, not 0/1), and a batch costs one forward with no decode loop.
- ``verdict="regex"``: the judge answers greedily (up to ``max_new_tokens``); the reward is the
  first match of ``pattern`` in the answer (its first group, or the whole match), read as a number.
  An answer with no match, or one that is not a number, gets reward 0 and is counted
  (``judge/unparsed`` in the metrics rows) and logged.

The template is checked here, when the graph is built: it must hold ``{completion}``, may hold
``{prompt}``, and no other ``{field}`` (write a literal brace as ``{{`` or ``}}``).

Example:
    >>> JudgeConfig(template="Q: {prompt} A: {completion} Correct?").verdict
    'logprob'
    >>> JudgeConfig(template="Is this right? {prompt}")
    Traceback (most recent call last):
    ...
    flowrl.errors.ConfigError: JudgeConfig: template 'Is this right? {prompt}' has no {completion}: the judge would not see the completion it judges; add {completion} where it goes
"""

from __future__ import annotations

import re
import string
from typing import Literal

import msgspec

from flowrl.errors import ConfigError

__all__ = ["JudgeConfig", "TEMPLATE_FIELDS", "template_fields"]

#: The fields a judge's template may name.
TEMPLATE_FIELDS: tuple[str, ...] = ("prompt", "completion")


def template_fields(template: str) -> list[str]:
    """The ``{field}`` names in ``template`` (``str.format`` syntax), in order.

    Raises:
        ConfigError: when ``template`` is not valid ``str.format`` syntax (an unmatched brace).

    Example:
        >>> template_fields("{prompt} -> {completion} {{literal}}")
        ['prompt', 'completion']
    """
    try:
        return [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        raise ConfigError(f"JudgeConfig: template {template!r} is not str.format syntax ({exc}); write a literal brace as {{{{ or }}}}") from None


class JudgeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A generative judge's prompt and how its verdict is read.

    Attributes:
        template: the judge's prompt, ``str.format`` syntax with ``{completion}`` and optionally
            ``{prompt}``. With a tokenizer that has a chat template it is sent as the user message
            (``add_generation_prompt``), else as plain text.
        verdict: ``"logprob"`` (reward ``p(yes) / (p(yes) + p(no))`` at the answer's first token) or
            ``"regex"`` (a greedy answer, parsed with ``pattern``); see the module docstring.
        yes: the answer token counted for (``verdict="logprob"``); must be one token of the judge's
            tokenizer (checked when the node is built; a BPE tokenizer may need a leading space).
        no: the answer token counted against.
        pattern: ``verdict="regex"``: a regular expression whose first group (or whole match) is the
            reward, e.g. ``r"Score: (\\d+(?:\\.\\d+)?)"``.
        max_new_tokens: ``verdict="regex"``: the longest answer.
    """

    template: str
    verdict: Literal["logprob", "regex"] = "logprob"
    yes: str = "Yes"
    no: str = "No"
    pattern: str = ""
    max_new_tokens: int = 16

    def __post_init__(self) -> None:
        o = "JudgeConfig"
        names = template_fields(self.template)
        if "completion" not in names:
            raise ConfigError(
                f"{o}: template {self.template!r} has no {{completion}}: the judge would not see the completion it judges; "
                "add {completion} where it goes"
            )
        unknown = sorted({n for n in names if n not in TEMPLATE_FIELDS})
        if unknown:
            raise ConfigError(
                f"{o}: template {self.template!r} names {unknown}; a template may name only {list(TEMPLATE_FIELDS)} "
                "(write a literal brace as {{ or }})"
            )
        if self.verdict not in ("logprob", "regex"):
            raise ConfigError(f"{o}: verdict={self.verdict!r} must be 'logprob' (p(yes) vs p(no)) or 'regex' (a parsed greedy answer)")
        if self.verdict == "logprob":
            if not self.yes or not self.no or self.yes == self.no:
                raise ConfigError(f"{o}: yes={self.yes!r} and no={self.no!r} must be two different, non-empty answer tokens")
            if self.pattern:
                raise ConfigError(f"{o}: pattern={self.pattern!r} is read only with verdict='regex'; set verdict='regex' or drop pattern")
        else:
            if not self.pattern:
                raise ConfigError(f"{o}: verdict='regex' needs a pattern whose first group is the reward, e.g. pattern=r'Score: (\\d+)'")
            try:
                re.compile(self.pattern)
            except re.error as exc:
                raise ConfigError(f"{o}: pattern={self.pattern!r} is not a regular expression: {exc}") from None
            if self.max_new_tokens < 1:
                raise ConfigError(f"{o}: max_new_tokens={self.max_new_tokens} must be >= 1 (the longest answer)")

    def describe(self) -> str:
        """A short summary: the verdict and what it reads."""
        if self.verdict == "logprob":
            return f"judge={self.yes}/{self.no}"
        return f"judge=regex {self.pattern!r}"
