"""Tools: JSON schemas from signatures, Hermes/Qwen tool-call parsing, bad calls as observations,
``ToolEnv``, and the gymnasium-style adapter (``flowrl.envs.tools``, ``flowrl.envs.gym``)."""

from __future__ import annotations

from typing import Literal

import pytest

from flowrl.envs.environment import parse_step
from flowrl.envs.gym import GymTextEnv
from flowrl.envs.tools import ToolCall, ToolEnv, ToolError, call_tool, parse_tool_calls, tool, tools_prompt


def search(query: str, limit: int = 3, mode: Literal["fast", "exact"] = "fast", tags: list[str] | None = None) -> list[str]:
    """Search the notes.

    Longer text that is not the description."""
    return [query] * limit


def divide(a: float, b: float) -> float:
    """Divide a by b."""
    return a / b


def test_a_tool_schema_comes_from_the_signature_and_the_docstring():
    t = tool(search)
    assert t.schema() == {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the notes.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "limit": {"type": "integer"},
                    "mode": {"enum": ["fast", "exact"]},
                    "tags": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["query"],
            },
        },
    }
    assert '"name": "search"' in tools_prompt([t]) and "<tool_call>" in tools_prompt([t])


def _no_annotation(x):  # noqa: ANN001
    return x


def _star_args(*values: int) -> int:
    return 0


class _Opaque:
    pass


def _opaque(x: _Opaque) -> int:
    return 0


@pytest.mark.parametrize(
    "fn, match",
    [(_no_annotation, "has no type annotation"), (_star_args, r"\*args and \*\*kwargs"), (_opaque, "cannot describe the type"),
     (lambda x: x, "give a named function")],
    ids=["no-annotation", "star-args", "opaque-type", "lambda"],
)
def test_a_function_whose_signature_cannot_be_described_is_refused(fn, match):
    with pytest.raises(ToolError, match=match):
        tool(fn)


def test_tool_calls_are_parsed_in_the_hermes_form_and_bad_ones_become_error_texts():
    text = ('I will call. <tool_call>\n{"name": "divide", "arguments": {"a": 6, "b": 3}}\n</tool_call>'
            '<tool_call>{"name": "divide", "arguments": "{\\"a\\": 1, \\"b\\": 4}"}</tool_call>'
            "<tool_call>{not json}</tool_call><tool_call>[1, 2]</tool_call>")
    calls = parse_tool_calls(text)
    assert calls[:2] == [ToolCall("divide", {"a": 6, "b": 3}), ToolCall("divide", {"a": 1, "b": 4})]
    assert "not valid JSON" in calls[2] and '{"name": ..., "arguments"' in calls[3]
    assert parse_tool_calls("no call here") == []


@pytest.mark.parametrize(
    "call, want",
    [(ToolCall("divide", {"a": 6, "b": 3}), "2.0"),
     (ToolCall("multiply", {"a": 1}), "error: unknown tool 'multiply'; the tools are ['divide', 'search']"),
     (ToolCall("divide", {"a": 1}), "error: tool 'divide' got missing arguments ['b'] and unexpected ones []; it takes ['a', 'b']"),
     (ToolCall("divide", {"a": 1, "b": 2, "c": 3}), "error: tool 'divide' got missing arguments [] and unexpected ones ['c']; it takes ['a', 'b']"),
     (ToolCall("divide", {"a": "six", "b": 3}), "error: tool 'divide': a='six' is not number"),
     (ToolCall("divide", {"a": 1, "b": 0}), "error: tool 'divide' raised ZeroDivisionError: division by zero"),
     (ToolCall("search", {"query": "x", "limit": 2}), '["x", "x"]'),
     (ToolCall("search", {"query": "x", "mode": "slow"}), "error: tool 'search': mode='slow' is not {'enum': ['fast', 'exact']}")],
    ids=["ok", "unknown", "missing", "unexpected", "mistyped", "raises", "json-result", "enum"],
)
def test_a_call_gives_its_result_or_an_error_text_for_the_model(call, want):
    tools = {t.name: t for t in (tool(divide), tool(search))}
    assert call_tool(tools, call) == want


class Divider(ToolEnv):
    tools = (divide,)
    max_calls = 2

    def reward(self, answer: str, row: dict) -> float:
        return float(answer.strip() == str(row["want"]))


def test_tool_env_answers_calls_with_tool_responses_then_scores_the_final_answer():
    env = Divider()
    assert env.reset({"want": 2.0}) is None
    obs, reward, info = parse_step(env.step('<tool_call>{"name": "divide", "arguments": {"a": 6, "b": 3}}</tool_call>'))
    assert obs == "<tool_response>\n2.0\n</tool_response>" and reward == 0.0
    obs, reward, _ = parse_step(env.step('<tool_call>{"name": "divide", "arguments": {"a": 6}}</tool_call>'))
    assert "missing arguments ['b']" in obs  # a bad call is an observation: the episode goes on
    assert parse_step(env.step("2.0")) == (None, 1.0, {"calls": 2})
    env.reset({"want": 1})
    for _ in range(2):
        env.step('<tool_call>{"name": "divide", "arguments": {"a": 1, "b": 1}}</tool_call>')
    assert env.step('<tool_call>{"name": "divide", "arguments": {"a": 1, "b": 1}}</tool_call>')[:2] == (None, 0.0)  # max_calls


class _GymLike:
    """A gymnasium-style text environment: guess the seed's parity in at most two steps."""

    def reset(self, *, seed=None, options=None):
        self.parity, self.t = seed % 2, 0
        return "even or odd?", {"seed": seed}

    def step(self, action):
        self.t += 1
        right = action.strip() == ("even", "odd")[self.parity]
        return "try again", float(right), right, self.t >= 2, {}


class Parity(GymTextEnv):
    def make(self):
        return _GymLike()


def test_a_gymnasium_style_text_environment_plays_through_the_adapter():
    env = Parity()
    assert env.reset({"prompt_index": 0, "sample": 1}) == "even or odd?"  # seed 1: odd
    assert parse_step(env.step("even")) == ("try again", 0.0, {})
    assert parse_step(env.step("even")) == (None, 0.0, {})  # truncated after two steps
    env.reset({"prompt_index": 0, "sample": 1})
    assert parse_step(env.step("odd")) == (None, 1.0, {})  # terminated
