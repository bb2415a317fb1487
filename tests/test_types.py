"""The type checker's escape hatches, counted: every ``# type: ignore`` in flowrl/ names its error code
and says why, and there are few of them.

mypy itself runs in ``.ci/run`` after the tests (``[tool.mypy]`` in pyproject.toml; it takes ~30 s,
too long to repeat here); ``warn_unused_ignores`` there fails it on an ignore that no longer hides an
error, and this file checks what mypy does not: the reason and the count.
"""

from __future__ import annotations

import io
import re
import tokenize
import tomllib
from pathlib import Path

import flowrl

ROOT = Path(flowrl.__file__).parent
PYPROJECT = ROOT.parent / "pyproject.toml"

#: The most ``type: ignore`` comments flowrl/ may hold (issue 47: no more than 20).
MAX_IGNORES = 20

#: ``# type: ignore[code, ...]  # reason``: at least one code, then a comment of its own with words in it.
WELL_FORMED = re.compile(r"#\s*type:\s*ignore\[[a-z-]+(?:,\s*[a-z-]+)*\]\s+#\s*\S.*\w")


def ignores() -> list[tuple[str, int, str]]:
    """``(path, line, comment)`` of every ``type: ignore`` comment in flowrl/ (comments only, not strings)."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT and re.search(r"type:\s*ignore", tok.string):
                line = source.splitlines()[tok.start[0] - 1]
                found.append((str(path.relative_to(ROOT.parent)), tok.start[0], line[tok.start[1] :]))
    return found


def test_every_type_ignore_names_its_code_and_a_reason():
    bad = [f"{path}:{line}: {comment}" for path, line, comment in ignores() if not WELL_FORMED.match(comment)]
    assert not bad, "write each as '# type: ignore[code]  # why the checker is wrong here':\n" + "\n".join(bad)


def test_few_type_ignores_remain():
    found = ignores()
    assert len(found) <= MAX_IGNORES, f"{len(found)} type: ignore in flowrl/ (at most {MAX_IGNORES}): fix the types instead:\n" + "\n".join(
        f"{path}:{line}" for path, line, _ in found
    )


def test_the_well_formed_pattern_tells_good_from_bad():
    assert WELL_FORMED.match("# type: ignore[attr-defined]  # torch's stub lacks DTensor.to_local")
    assert WELL_FORMED.match("# type: ignore[arg-type, union-attr]  # checked above")
    assert not WELL_FORMED.match("# type: ignore")
    assert not WELL_FORMED.match("# type: ignore[attr-defined]")
    assert not WELL_FORMED.match("# type: ignore  # no code")


def test_mypy_config_checks_the_whole_package_and_unused_ignores():
    config = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["tool"]["mypy"]
    assert config["files"] == ["flowrl"]
    assert config["warn_unused_ignores"] is True
    assert "ignore-without-code" in config["enable_error_code"]
    assert "exclude" not in config, "the checker covers every module of flowrl/"


def test_ci_runs_the_type_checker_and_fails_with_it():
    ci = (ROOT.parent / ".ci" / "run").read_text(encoding="utf-8")
    assert re.search(r"^mypy --cache-dir=\S+", ci, re.M), ".ci/run runs mypy"
    assert 'ci: mypy failed' in ci and "status=1" in ci
