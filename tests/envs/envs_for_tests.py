"""Environments the tests reference by name (module level, so ``module:qualname`` resolves)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any


class Echo:
    """Answers every model turn with ``12=`` (so env tokens are 3 known ids), up to the turn limit; reward 1."""

    def reset(self, row: dict[str, Any]) -> str:
        return "3="

    def step(self, action: str) -> tuple[str | None, float, dict]:
        return "12=", 1.0, {}


class AsyncEcho(Echo):
    async def reset(self, row: dict[str, Any]) -> str:  # type: ignore[override]
        await asyncio.sleep(0)
        return "3="

    async def step(self, action: str) -> tuple[str | None, float, dict]:  # type: ignore[override]
        await asyncio.sleep(0)
        return "12=", 1.0, {}


class Words:
    """For a Hugging Face word-level test tokenizer: observations are words."""

    def reset(self, row: dict[str, Any]) -> None:
        return None

    def step(self, action: str) -> tuple[str | None, float, dict]:
        return "yes a b", 0.5, {}


#: Set by the test that hangs a step (``test_a_failing_environment_fails_its_sample_only``) when it ends.
HANG_RELEASE = threading.Event()


class Flaky:
    """Fails on the samples of prompts at odd stream positions, in the way ``mode`` names; fine elsewhere."""

    mode = "raise"

    def reset(self, row: dict[str, Any]) -> None:
        self.bad = row["prompt_index"] % 2 == 1 and row["sample"] == 0
        return None

    def step(self, action: str) -> Any:
        if not self.bad:
            return None, 1.0, {}
        if self.mode == "raise":
            raise RuntimeError("the environment broke")
        if self.mode == "hang":
            HANG_RELEASE.wait(30)  # a hung call, until the test that hung it ends (RELEASE set): no thread outlives it by 30 s
        if self.mode == "garbage":
            return "not a tuple"
        if self.mode == "nan":
            return None, float("nan"), {}
        if self.mode == "bad_obs":
            return "x!", 0.0, {}  # '!' is not in the built-in tokenizer's vocabulary
        return None, 1.0, {}


class FlakyRaise(Flaky):
    mode = "raise"


class FlakyHang(Flaky):
    mode = "hang"


class FlakyGarbage(Flaky):
    mode = "garbage"


class FlakyNan(Flaky):
    mode = "nan"


class FlakyBadObs(Flaky):
    mode = "bad_obs"


class ResetRaises:
    def reset(self, row: dict[str, Any]) -> None:
        if row["prompt_index"] % 2 == 1 and row["sample"] == 0:
            raise ValueError("no episode today")

    def step(self, action: str) -> tuple[None, float, dict]:
        return None, 1.0, {}


class NoStep:
    def reset(self, row: dict[str, Any]) -> None:
        return None


class SlowEcho(Echo):
    def step(self, action: str) -> tuple[str | None, float, dict]:
        time.sleep(0.2)
        return "12=", 1.0, {}


class RowReward:
    """Ends at once with the prompt row's ``want`` field as reward (checks that rows reach reset)."""

    def reset(self, row: dict[str, Any]) -> None:
        self.want = float(row["want"])

    def step(self, action: str) -> tuple[None, float, dict]:
        return None, self.want, {}


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


from flowrl.envs.tools import ToolEnv  # noqa: E402


class Calculator(ToolEnv):
    """The README's tool environment."""

    tools = (add,)

    def reward(self, answer: str, row: dict[str, Any]) -> float:
        return float(answer.strip().removesuffix("</s>").strip() == str(row["answer"]))


class Gate:
    """Prompt 0's ``step`` waits until prompt 1's ``step`` has run (prompt 1's ``reset`` is slow, so
    prompt 0 takes the one slot first): it returns only if the generator decodes prompt 1 while prompt 0
    waits on its environment. ``opened`` is shared by the instances; a test clears it first."""

    opened = threading.Event()

    def reset(self, row: dict[str, Any]) -> None:
        self.index = int(row["prompt_index"])
        if self.index == 1:
            time.sleep(0.2)

    def step(self, action: str) -> tuple[None, float, dict]:
        if self.index == 1:
            Gate.opened.set()
        elif not Gate.opened.wait(4.0):
            raise TimeoutError("prompt 1's turn was never decoded while prompt 0 waited")
        return None, 1.0, {}


class Jittery(Echo):
    """``Echo`` whose ``step`` takes 0-20 ms and ends the episode after one or two turns, by the prompt's
    position (so groups finish out of order)."""

    def reset(self, row: dict[str, Any]) -> str:
        self.index, self.turns = int(row["prompt_index"]), 0
        return "3="

    def step(self, action: str) -> tuple[str | None, float, dict]:
        self.turns += 1
        time.sleep(0.002 * (self.index % 10))
        done = self.turns >= 1 + self.index % 2
        return (None if done else "12="), 1.0, {}


class SlowSecond:
    """One turn; prompt 1's ``step`` takes 0.5 s, prompt 0's returns at once."""

    def reset(self, row: dict[str, Any]) -> None:
        self.index = int(row["prompt_index"])

    def step(self, action: str) -> tuple[None, float, dict]:
        if self.index == 1:
            time.sleep(0.5)
        return None, 1.0, {}
