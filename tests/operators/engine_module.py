"""A generator engine defined outside flowrl (``test_engine_extension.py``): the built-in decode
loop behind another name, counting its calls and checking the machine as an engine may."""

from __future__ import annotations

from typing import Any

from flowrl.errors import ConfigError
from flowrl.operators.generation import Generator

CALLS: list[int] = []  # rows of every generate call, in this process


class CountingEngine(Generator):
    def generate(self, prompts: Any) -> dict[str, Any]:
        CALLS.append(int(prompts["prompt_ids"].shape[0]))
        return super().generate(prompts)


def check(node: Any, *, device: str = "cpu") -> None:
    if device != "cpu":
        raise ConfigError(f"generator {node.name!r}: the counting engine runs on the CPU only")
