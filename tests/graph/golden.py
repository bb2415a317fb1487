"""Golden-file comparison: ``FLOWRL_UPDATE_GOLDEN=1 pytest tests/graph`` rewrites the files instead of comparing."""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest

__all__ = ["GOLDEN_DIR", "assert_golden"]

GOLDEN_DIR = Path(__file__).parent / "golden"


def assert_golden(name: str, text: str) -> None:
    """``text`` equals the file ``golden/name``, or fail with a unified diff and how to update it."""
    path = GOLDEN_DIR / name
    if os.environ.get("FLOWRL_UPDATE_GOLDEN") == "1":
        path.write_text(text, encoding="utf-8")
        return
    if not path.exists():
        pytest.fail(f"golden file {path} is missing; create it with FLOWRL_UPDATE_GOLDEN=1 pytest {path.parent.parent}")
    expected = path.read_text(encoding="utf-8")
    if text != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True), f"golden/{name}", "actual"))
        pytest.fail(f"output differs from golden/{name} (if the change is intended, rerun with FLOWRL_UPDATE_GOLDEN=1):\n{diff}")
