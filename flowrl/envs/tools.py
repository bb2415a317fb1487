"""Tools for tool-using rollouts: Python functions described as JSON schemas, calls parsed from the
model's text in the Hermes / Qwen form, results returned as tool messages, and ``ToolEnv``.

- ``tool(fn)``: a ``Tool`` from a function: its name, its docstring's first paragraph as the
  description, and a JSON schema of its parameters from the signature and annotations (``int``,
  ``float``, ``str``, ``bool``, ``list[...]``, ``dict``, ``Literal[...]``, ``X | None``); a parameter
  without a default is required. A function whose signature cannot be described (a parameter without
  an annotation, ``*args``/``**kwargs``, an unsupported type) is refused with ``ToolError`` when the tool
  is made, before any work.
- ``parse_tool_calls(text)``: every ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in a
  model turn, each a ``ToolCall`` or, for a malformed one, the error text.
- ``call_tool(tools, call)``: the result as text; a bad call (unknown tool, bad JSON, missing,
  unexpected or mistyped arguments) or a tool that raises gives an error text for the model, never an
  exception: the model is told, and the episode goes on.
- ``ToolEnv``: an environment (``flowrl.envs.environment``) over tools. A turn with tool calls is answered with
  their results (``<tool_response>...</tool_response>``, one per call, as the tool message's content:
  give the generator ``role="tool"`` for a chat template with a tool role); a turn without one is the
  final answer, scored by ``reward(answer, row)``; ``max_calls`` turns of calls at most.

Example:
    >>> def add(a: int, b: int = 0) -> int:
    ...     '''Add two integers.'''
    ...     return a + b
    >>> t = tool(add)
    >>> t.schema()["function"]["parameters"]
    {'type': 'object', 'properties': {'a': {'type': 'integer'}, 'b': {'type': 'integer'}}, 'required': ['a']}
    >>> (call,) = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')
    >>> call_tool({"add": t}, call)
    '5'
    >>> call_tool({"add": t}, parse_tool_calls('<tool_call>{"name": "mul", "arguments": {}}</tool_call>')[0])
    "error: unknown tool 'mul'; the tools are ['add']"
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union

from flowrl.errors import ConfigError

__all__ = ["Tool", "ToolCall", "ToolError", "ToolEnv", "tool", "parse_tool_calls", "call_tool", "tools_prompt"]


class ToolError(ConfigError):
    """A function that cannot be described as a tool (raised when the tool is made)."""


_SIMPLE: dict[Any, str] = {int: "integer", float: "number", str: "string", bool: "boolean", dict: "object", list: "array"}


def _schema(annotation: Any, where: str) -> dict[str, Any]:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation in _SIMPLE:
        return {"type": _SIMPLE[annotation]}
    if origin is Literal:
        return {"enum": list(args)}
    if origin in (list, Sequence, tuple) and args:
        return {"type": "array", "items": _schema(args[0], where)}
    if origin is dict:
        return {"type": "object"}
    if origin in (Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return _schema(rest[0], where)
    raise ToolError(f"{where}: cannot describe the type {annotation!r} as JSON schema; use int, float, str, bool, list[...], dict, Literal[...] or X | None")


@dataclass(frozen=True)
class Tool:
    """A function the model may call.

    Attributes:
        name: the function's name (what a call names).
        description: the docstring's first paragraph.
        parameters: JSON schema of the arguments (an object).
        fn: the function.
    """

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., Any]

    def schema(self) -> dict[str, Any]:
        """The OpenAI/Hermes tool description: ``{"type": "function", "function": {...}}``."""
        return {"type": "function", "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


def tool(fn: Callable[..., Any]) -> Tool:
    """Describe ``fn`` as a tool (see the module docstring).

    Raises:
        ToolError: for a parameter without annotation, ``*args``/``**kwargs``, or a type JSON schema cannot describe.
    """
    name = getattr(fn, "__name__", "")
    if not callable(fn) or not name or name == "<lambda>":
        raise ToolError(f"cannot make a tool of {fn!r}: give a named function")
    try:
        hints = typing.get_type_hints(fn)
    except Exception as exc:
        raise ToolError(f"tool {name!r}: cannot read its annotations ({type(exc).__name__}: {exc})") from exc
    properties: dict[str, Any] = {}
    required: list[str] = []
    for p in inspect.signature(fn).parameters.values():
        where = f"tool {name!r}, parameter {p.name!r}"
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ToolError(f"{where}: *args and **kwargs cannot be described as JSON schema; name every parameter")
        if p.name not in hints:
            raise ToolError(f"{where} has no type annotation; annotate it (e.g. `{p.name}: int`) so its JSON schema can be written")
        properties[p.name] = _schema(hints[p.name], where)
        if p.default is p.empty:
            required.append(p.name)
    doc = inspect.getdoc(fn) or ""
    return Tool(name=name, description=doc.split("\n\n")[0].strip(), parameters={"type": "object", "properties": properties, "required": required}, fn=fn)


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name and its arguments."""

    name: str
    arguments: dict[str, Any]


_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> list[ToolCall | str]:
    """Every ``<tool_call>...</tool_call>`` of ``text``: a ``ToolCall``, or an error text for a malformed one."""
    calls: list[ToolCall | str] = []
    for body in _CALL.findall(text):
        try:
            data = json.loads(body)
        except json.JSONDecodeError as exc:
            calls.append(f"error: the tool call {body.strip()!r:.200} is not valid JSON ({exc.msg} at position {exc.pos})")
            continue
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            calls.append(f'error: a tool call is {{"name": ..., "arguments": {{...}}}}, got {body.strip()!r:.200}')
            continue
        arguments = data.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            calls.append(f"error: the arguments of tool {data['name']!r} must be a JSON object, got {arguments!r:.200}")
            continue
        calls.append(ToolCall(data["name"], arguments))
    return calls


def _check_type(value: Any, schema: dict[str, Any]) -> bool:
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema.get("type")
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "array":
        return isinstance(value, list) and all(_check_type(v, schema.get("items", {})) for v in value)
    expected: type | None = {"string": str, "boolean": bool, "object": dict}.get(kind) if isinstance(kind, str) else None
    return expected is None or isinstance(value, expected)


def call_tool(tools: dict[str, Tool], call: ToolCall | str) -> str:
    """The result of ``call`` as text (``str`` of the return value, or JSON for dicts and lists), or an
    error text telling the model what was wrong (see the module docstring)."""
    if isinstance(call, str):
        return call
    t = tools.get(call.name)
    if t is None:
        return f"error: unknown tool {call.name!r}; the tools are {sorted(tools)}"
    props, required = t.parameters["properties"], t.parameters["required"]
    missing = [r for r in required if r not in call.arguments]
    unexpected = [a for a in call.arguments if a not in props]
    if missing or unexpected:
        return f"error: tool {t.name!r} got missing arguments {missing} and unexpected ones {unexpected}; it takes {list(props)}"
    wrong = [f"{k}={v!r} is not {props[k].get('type', props[k])}" for k, v in call.arguments.items() if not _check_type(v, props[k])]
    if wrong:
        return f"error: tool {t.name!r}: {'; '.join(wrong)}"
    try:
        value = t.fn(**call.arguments)
    except Exception as exc:
        return f"error: tool {t.name!r} raised {type(exc).__name__}: {exc}"
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)


def tools_prompt(tools: Sequence[Tool]) -> str:
    """A system-prompt paragraph describing ``tools`` in the Hermes form (for a prompt file or a template)."""
    lines = "\n".join(json.dumps(t.schema()) for t in tools)
    return (
        "You may call one or more functions to assist with the user query. The functions are:\n<tools>\n"
        f"{lines}\n</tools>\n"
        'For each call, return a JSON object within <tool_call></tool_call> tags: '
        '<tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>'
    )


class ToolEnv:
    """An environment over tools (see the module docstring). Subclass it, setting ``tools`` (functions or
    ``Tool``s) and overriding ``reward(answer, row)``; the class is what a generator's ``env`` names.

    Raises:
        ToolError: when made, for a function that cannot be described as a tool.
    """

    tools: Sequence[Callable[..., Any] | Tool] = ()
    max_calls: int = 4

    def __init__(self) -> None:
        made = [t if isinstance(t, Tool) else tool(t) for t in self.tools]
        self.by_name = {t.name: t for t in made}
        self.row: dict[str, Any] = {}
        self.calls = 0

    def reset(self, row: dict[str, Any]) -> Any:
        self.row, self.calls = row, 0
        return None

    def step(self, action: str) -> tuple[str | None, float, dict[str, Any]]:
        calls = parse_tool_calls(action)
        if not calls:
            return None, float(self.reward(action, self.row)), {"calls": self.calls}
        self.calls += 1
        if self.calls > self.max_calls:
            return None, 0.0, {"calls": self.calls, "stopped": "too many tool calls"}
        results = [call_tool(self.by_name, c) for c in calls]
        return "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in results), 0.0, {"calls": self.calls}

    def reward(self, answer: str, row: dict[str, Any]) -> float:
        """The final answer's reward; override it (the default gives 0)."""
        return 0.0
