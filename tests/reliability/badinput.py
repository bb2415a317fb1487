"""The bad-input harness: the corpus manifest, the CLI command each entry runs, and the clean-error check.

Shared by ``tests/reliability/test_bad_inputs.py`` and ``benches/bad_inputs.py``. A bad input is
handled cleanly when ``flowrl.cli.main.main(argv)``, run in-process:

- exits with status 2 (returned, or ``SystemExit(2)`` from argparse),
- prints a message matching the entry's ``match`` regex on stderr, and no ``Traceback``,
- leaves nothing behind in the output folder the command was pointed at.

Corpus entries (``corpus/manifest.json``) have a ``kind`` that picks the commands (``COMMANDS``):
``graph`` (viz, plan and run read the file), ``graph-run`` (a graph that loads but cannot run
here: run only), ``plan`` (``viz --plan`` and ``run --plan``), ``plan-run`` (``run --plan`` only)
and ``cluster`` (``plan --cluster``).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import traceback
from dataclasses import dataclass
from pathlib import Path

from flowrl.cli.main import main

__all__ = [
    "CORPUS",
    "COMMANDS",
    "Outcome",
    "load_manifest",
    "commands_for",
    "run_cli",
    "clean_error",
    "generated_graph_files",
    "ARGV_CASES",
    "CLUSTER_STRINGS",
]

CORPUS = Path(__file__).parent / "corpus"

#: kind -> argv templates; ``{file}`` is the corpus file, ``{out}`` an empty folder that must stay empty.
COMMANDS: dict[str, tuple[tuple[str, ...], ...]] = {
    "graph": (
        ("viz", "{file}", "-o", "{out}/g.mmd"),
        ("plan", "{file}", "--cluster", "cpu:2", "-o", "{out}/plan.json"),
        ("run", "{file}", "--steps", "1", "--quiet", "--metrics", "{out}/m.jsonl", "--trace", "{out}/t.json"),
    ),
    "graph-run": (
        ("run", "{file}", "--steps", "1", "--quiet", "--metrics", "{out}/m.jsonl", "--trace", "{out}/t.json"),
    ),
    "plan": (
        ("viz", "llamarl", "--plan", "{file}", "-o", "{out}/g.mmd"),
        ("run", "--plan", "{file}", "--synthetic", "--steps", "1", "--quiet", "--metrics", "{out}/m.jsonl"),
    ),
    "plan-run": (("run", "--plan", "{file}", "--synthetic", "--steps", "1", "--quiet", "--metrics", "{out}/m.jsonl"),),
    "cluster": (("plan", "llamarl", "--cluster", "{file}", "-o", "{out}/plan.json"),),
}


@dataclass(frozen=True)
class Outcome:
    """What one CLI call did: exit status, stderr, and the exception if one escaped ``main``."""

    code: int | None
    stderr: str
    escaped: str | None = None


def load_manifest() -> list[dict[str, str]]:
    """The corpus entries: ``{"kind", "file", "match"}`` (file relative to ``CORPUS``)."""
    return json.loads((CORPUS / "manifest.json").read_text())


def commands_for(kind: str, file: str, out: str) -> list[list[str]]:
    """The argv lists that feed ``file`` to the CLI for an entry of ``kind``, writing under ``out``."""
    return [[a.format(file=file, out=out) for a in template] for template in COMMANDS[kind]]


def run_cli(argv: list[str]) -> Outcome:
    """``main(argv)`` in this process, with stdout and stderr captured; exceptions caught and described."""
    err, out = io.StringIO(), io.StringIO()
    escaped = None
    code: int | None
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            code = main(argv)
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code if isinstance(exc.code, int) else None
    except BaseException as exc:  # noqa: BLE001 - any escape is the finding
        code = None
        escaped = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-2000:]
    return Outcome(code=code, stderr=err.getvalue(), escaped=escaped)


def _complete(path: Path) -> bool:
    """A ``.json`` file that parses, or a ``.jsonl`` file whose every line parses."""
    try:
        text = path.read_text()
        if path.suffix == ".json":
            json.loads(text)
            return True
        if path.suffix == ".jsonl":
            return all(json.loads(line) is not None for line in text.splitlines())
    except (ValueError, OSError):
        return False
    return False


def _leftovers(out: str, *, complete_ok: bool) -> list[str]:
    found = [p for p in Path(out).rglob("*") if not (complete_ok and (p.is_dir() or _complete(p)))]
    return sorted(str(p.relative_to(out)) for p in found)


def clean_error(
    outcome: Outcome, out: str, match: str | None = None, *, allow_success: bool = False, complete_ok: bool = False
) -> str | None:
    """None when ``outcome`` is a clean error (see the module docstring), else what is wrong with it.

    ``match`` is searched in stderr with runs of whitespace collapsed (messages are wrapped at 100
    columns). With ``allow_success``, exit 0 is accepted too (a fuzzed input that happens to be
    valid); the output folder is then not checked. With ``complete_ok`` (a run that failed after it
    started), outputs may remain if they are complete: a trace that parses, metrics rows that parse.
    """
    if outcome.escaped:
        return f"exception escaped main(): {outcome.escaped}"
    if allow_success and outcome.code == 0:
        return None
    if outcome.code != 2:
        return f"exit status {outcome.code}, not 2; stderr: {outcome.stderr[-1500:]}"
    if "Traceback" in outcome.stderr:
        return f"traceback on stderr: {outcome.stderr[-1500:]}"
    if not outcome.stderr.strip():
        return "exit 2 with nothing on stderr"
    if match is not None and not re.search(match, " ".join(outcome.stderr.split()), re.S):
        return f"stderr does not match {match!r}: {outcome.stderr[-1500:]}"
    left = _leftovers(out, complete_ok=complete_ok)
    if left:
        return f"left files behind: {left}"
    return None


def generated_graph_files(folder: str) -> list[tuple[str, str, str]]:
    """Graph inputs too big or too odd to keep in git: ``(id, path, match)``, written under ``folder``."""
    from flowrl.graph.serialize import MAX_GRAPH_BYTES

    os.makedirs(folder, exist_ok=True)
    cases = []

    def write(name: str, data: bytes, match: str) -> None:
        path = os.path.join(folder, name)
        with open(path, "wb") as f:
            f.write(data)
        cases.append((name, path, match))

    write("deep_lists.json", b"[" * 100_000 + b"]" * 100_000, r"nested too deeply|graph (file|JSON)")
    write("deep_objects.json", b'{"a":' * 100_000 + b"1" + b"}" * 100_000, r"nested too deeply|graph (file|JSON)")
    write("deep_in_a_field.json", b'{"name": "g", "nodes": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", r"nested too deeply|graph (file|JSON)")
    write("huge.json", b" " * (MAX_GRAPH_BYTES + 1) + b"{}", r"over the \d+-byte limit")
    directory = os.path.join(folder, "a_directory.json")
    os.makedirs(directory, exist_ok=True)
    cases.append(("a_directory.json", directory, r"is not a file"))
    cases.append(("missing.json", os.path.join(folder, "missing.json"), r"does not exist"))
    return cases


#: Bad command-line arguments for every subcommand: ``(argv, stderr regex)``; ``{out}`` as above.
ARGV_CASES: list[tuple[list[str], str]] = [
    (["nosuch"], r"invalid choice: 'nosuch'"),
    (["--bogus"], r"unrecognized arguments: --bogus"),
    (["run", "--steps", "abc"], r"argument --steps: invalid int value: 'abc'"),
    (["run", "--steps", "1.5"], r"invalid int value: '1.5'"),
    (["run", "--steps", "0"], r"--steps 0 must be >= 1"),
    (["run", "--steps", "-3"], r"steps=-3 must be >= 1"),
    (["run", "--max-staleness", "-1"], r"max_staleness=-1 must be >= 0"),
    (["run", "--max-staleness", "two"], r"invalid int value: 'two'"),
    (["run", "--backend", "gpu"], r"invalid choice: 'gpu'"),
    (["run", "--checkpoint-every", "-1", "--checkpoint-dir", "{out}/ck"], r"checkpoint_every=-1 must be >= 0"),
    (["run", "--checkpoint-every", "2"], r"--checkpoint-dir"),
    (["run", "--resume"], r"--checkpoint-dir"),
    (["run", "--metrics", "{out}/no/such/dir/m.jsonl"], r"does not exist"),
    (["run", "--trace", "{out}/missing/t.json"], r"does not exist"),
    (["run", "--plan", "{out}/missing-plan.json"], r"no such file"),
    (["run", "--plan", "{out}"], r"no such file"),
    (["run", "--seed", "x"], r"invalid int value: 'x'"),
    (["run", "--unknown-flag"], r"unrecognized arguments"),
    (["run", "a", "b"], r"unrecognized arguments: b"),
    (["plan", "--cluster", "cpu:2", "--samples", "0"], r"samples_per_prompt=0 must be >= 1"),
    (["plan", "--cluster", "cpu:2", "--prompts-per-step", "-1"], r"prompts_per_step=-1 must be >= 1"),
    (["plan", "--cluster", "cpu:2", "--gen-len", "0"], r"gen_len=0 must be >= 1"),
    (["plan", "--cluster", "cpu:2", "--prompt-len", "x"], r"invalid int value: 'x'"),
    (["plan", "--cluster", "cpu:2", "--max-staleness", "-1"], r"max_staleness=-1 must be >= 0"),
    (["plan", "--cluster", "cpu:2", "--gen-precision", "fp4"], r"invalid choice: 'fp4'"),
    (["plan", "--cluster", "cpu:2", "--set", "=3"], r"write NAME=VALUE"),
    (["plan", "--cluster", "cpu:2", "--set", "mfu_train"], r"write NAME=VALUE"),
    (["plan", "--cluster", "cpu:2", "--set", "speed=2"], r"unknown tuning parameter"),
    (["plan", "--cluster", "cpu:2", "--set", "mfu_train=nan"], r"mfu_train=nan must be in \(0, 1\]"),
    (["plan", "--cluster", "cpu:2", "--set", "mfu_train=1e999"], r"mfu_train=inf must be in \(0, 1\]"),
    (["plan", "--cluster", "cpu:2", "--set", 'mfu_train="x"'], r"Expected `float`, got `str`"),
    (["plan", "--cluster", "cpu:2", "--model", "llama2"], r"unknown model preset 'llama2'"),
    (["plan", "--cluster", "cpu:2", "--model", "{out}/missing-config.json"], r"missing-config.json"),
    (["plan", "--cluster", "cpu:2", "--strategy", "fast"], r"unknown strategy 'fast'"),
    (["plan", "--cluster", "cpu:2", "--strategy", "gen:d1@0-99999999999 | policy:d1@1"], r"goes past the 131072 devices"),
    (["plan", "--cluster", "cpu:2", "--strategy", "gen:d" + "9" * 5000 + "@0 | policy:d1@1"], r"an axis of over 12 digits"),
    (["plan", "--cluster", "cpu:2", "--strategy", "gen:d1@" + "9" * 5000 + " | policy:d1@1"], r"device range|devices a plan can list"),
    (["plan", "--cluster", "cpu:2", "--strategy", "gen:d1@3-1 | policy:d1@1"], r"runs backwards"),
    (["plan", "--cluster", "cpu:2", "--strategy", "gen:d1@0 | gen:d1@1"], r"names node 'gen' twice"),
    (["plan", "--cluster", "cpu:2", "--strategy", "gen:d1@0"], r"leaves out 'policy'"),
    (["plan", "--cluster", "cpu:2", "-o", "{out}/missing/plan.json"], r"folder .* does not exist"),
    (["plan", "--cluster", "8xH100", "--model", "llama3-405b", "-o", "{out}/plan.json"], r"no placement of graph 'llamarl' fits on 8xH100"),
    (["viz", "--format", "bmp"], r"invalid choice: 'bmp'"),
    (["viz", "--direction", "XY"], r"invalid choice: 'XY'"),
    (["viz", "-o", "{out}/missing/g.svg"], r"folder .* does not exist"),
    (["viz", "-o", "{out}/g.svg", "--format", "dot"], r"has the suffix of format svg but --format is dot"),
    (["viz", "--plan", "{out}/p.json", "--format", "json"], r"--plan labels pictures"),
    (["viz", "--plan", "{out}/missing.json", "-o", "{out}/g.mmd"], r"no such file"),
    (["viz", "no_such_example"], r"cannot find graph 'no_such_example'"),
    (["viz", "llamrl"], r"Did you mean the example 'llamarl'"),
    (["viz", "{out}/missing.py"], r"does not exist"),
    (["viz", "no.such.module:graph"], r"cannot load 'no.such.module:graph'"),
    (["viz", "flowrl.examples:NO_SUCH_ATTR"], r"has no attribute 'NO_SUCH_ATTR'"),
    (["viz", "flowrl.examples:DEFAULT_EXAMPLE"], r"is a str, not a flowrl Graph"),
    (["examples", "extra"], r"unrecognized arguments: extra"),
    (["calibrate", "--cores", "0"], r"--cores 0: must be >= 1"),
    (["calibrate", "--cores", "x"], r"invalid int value: 'x'"),
    (["calibrate", "--matmul-size", "1"], r"--matmul-size 1: must be >= 8"),
    (["calibrate", "-o", "{out}/missing/cpu.json"], r"folder .* does not exist"),
]

#: Bad ``--cluster`` strings: ``(text, stderr regex)``.
CLUSTER_STRINGS: list[tuple[str, str]] = [
    ("", r"cannot parse cluster ''"),
    ("   ", r"cannot parse cluster ''"),
    ("lots", r"cannot parse cluster 'lots'"),
    ("0xH100", r"device count 0 must be >= 1"),
    ("12xH100", r"do not fill hosts of 8"),
    ("0x8xH100", r"hosts=0 and devices per host=8 must both be >= 1"),
    ("8xTPU", r"unknown device 'TPU'"),
    ("cpu:0", r"cores=0 must be >= 1"),
    ("cpu:-1", r"cannot parse cluster 'cpu:-1'"),
    ("cpu:abc", r"cannot parse cluster 'cpu:abc'"),
    ("cpu:99999999999999999999", r"over 12 digits"),
    ("1000000x8xH100", r"8000000 devices, over the 131072 a plan can list"),
    ("99999999999999999999x8xH100", r"over 12 digits"),
    ("9" * 5000 + "xH100", r"over 12 digits"),
    ("-8xH100", r"argument --cluster: expected one argument"),
    ("8x H100", r"cannot parse cluster"),
    ("8xH100\x00", r"cannot parse cluster|unknown device"),
    ("8×H100", r"cannot parse cluster"),
    ("missing.json", r"cluster file 'missing.json' does not exist"),
    ("missing.toml", r"cluster file 'missing.toml' does not exist"),
]


# -- generated inputs (hypothesis) -------------------------------------------------------------------
def _example_documents() -> list[dict]:
    from flowrl.examples import EXAMPLES, build_example
    from flowrl.graph.serialize import to_json

    return [json.loads(to_json(build_example(name))) for name in sorted(EXAMPLES)]


def _plan_document() -> dict:
    from flowrl.examples import build_example
    from flowrl.planners.cluster import parse_cluster
    from flowrl.planners.plan import plan_graph, plan_to_json

    return json.loads(plan_to_json(plan_graph(build_example("llamarl"), parse_cluster("cpu:2"), strategy="disaggregated")))


def _paths(doc: object, prefix: tuple = ()) -> list[tuple]:
    """Every path (tuple of keys / indices) to a value inside ``doc``, the root excluded."""
    out: list[tuple] = []
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in items:
        out.append((*prefix, key))
        out.extend(_paths(value, (*prefix, key)))
    return out


def json_values(max_leaves: int = 8):
    """Any JSON value: nulls, booleans, huge and negative ints, floats, odd strings, nested lists and objects."""
    from hypothesis import strategies as st

    leaves = (
        st.none()
        | st.booleans()
        | st.integers()
        | st.sampled_from([-1, 0, 2**31, 2**63, -(2**63) - 1, 10**30, -(10**30)])
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(max_size=12)
        | st.sampled_from(["", "critic", "policy", "gen", "../x", "a:b", "float32", "inprocess", "\x00", "é" * 3])
    )
    return st.recursive(leaves, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=max_leaves)


def _mutate(doc: dict, data, values) -> object:
    """One random structural edit of a deep copy of ``doc``: drop, retype, duplicate or add a key."""
    from hypothesis import strategies as st

    doc = json.loads(json.dumps(doc))
    paths = _paths(doc)
    path = data.draw(st.sampled_from(paths), label="path")
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    op = data.draw(st.sampled_from(["drop", "retype", "duplicate", "add_key", "rename"]), label="op")
    if op == "drop":
        del parent[key]
    elif op == "retype":
        parent[key] = data.draw(values, label="value")
    elif op == "duplicate":
        if isinstance(parent, list):
            parent.insert(key, json.loads(json.dumps(parent[key])))
        else:
            parent[key + "_copy" if isinstance(key, str) else key] = parent[key]
    elif op == "add_key":
        target = parent[key] if isinstance(parent[key], dict) else parent if isinstance(parent, dict) else None
        if target is not None:
            target[data.draw(st.text(min_size=1, max_size=10), label="new key")] = data.draw(values, label="value")
    elif isinstance(parent, dict):  # rename
        parent[data.draw(st.text(min_size=1, max_size=10), label="new name")] = parent.pop(key)
    return doc


def _byte_edit(raw: bytes, data) -> bytes:
    """Truncate, flip a byte, or splice random bytes into ``raw``."""
    from hypothesis import strategies as st

    op = data.draw(st.sampled_from(["truncate", "flip", "splice"]), label="byte op")
    at = data.draw(st.integers(0, len(raw)), label="at")
    if op == "truncate":
        return raw[:at]
    if op == "flip" and at < len(raw):
        return raw[:at] + bytes([raw[at] ^ data.draw(st.integers(1, 255), label="xor")]) + raw[at + 1 :]
    return raw[:at] + data.draw(st.binary(max_size=8), label="bytes") + raw[at:]


def mutated_graph_files():
    """Bytes of graph files: an example's JSON with structural edits (1-3) and sometimes a byte edit."""
    from hypothesis import strategies as st

    docs = _example_documents()
    values = json_values()

    @st.composite
    def build(draw):
        data = draw(st.data())
        doc: object = data.draw(st.sampled_from(docs), label="example")
        for _ in range(data.draw(st.integers(1, 3), label="edits")):
            if isinstance(doc, dict) and _paths(doc):
                doc = _mutate(doc, data, values)
        raw = json.dumps(doc).encode()
        if data.draw(st.booleans(), label="byte edit"):
            raw = _byte_edit(raw, data)
        return raw

    return build()


def random_json_files():
    """Bytes of any JSON value at all."""
    return json_values(max_leaves=20).map(lambda v: json.dumps(v).encode())


def mutated_plan_files():
    """Bytes of plan files: a real plan's JSON with 1-2 structural edits and sometimes a byte edit."""
    from hypothesis import strategies as st

    doc0 = _plan_document()
    values = json_values()

    @st.composite
    def build(draw):
        data = draw(st.data())
        doc: object = doc0
        for _ in range(data.draw(st.integers(1, 2), label="edits")):
            if isinstance(doc, dict) and _paths(doc):
                doc = _mutate(doc, data, values)
        raw = json.dumps(doc).encode()
        if data.draw(st.booleans(), label="byte edit"):
            raw = _byte_edit(raw, data)
        return raw

    return build()


def cluster_texts():
    """Strings shaped like cluster specs (counts, 'x', device names, 'cpu:'), and arbitrary text."""
    from hypothesis import strategies as st

    count = st.integers(-5, 10**15).map(str) | st.sampled_from(["", "0", "007", "1e3", "9" * 40])
    device = st.sampled_from(["H100", "h200", "A100", "TPU", "cpu", "", "H100 "])
    shaped = st.one_of(
        st.tuples(count, device).map(lambda t: f"{t[0]}x{t[1]}"),
        st.tuples(count, count, device).map(lambda t: f"{t[0]}x{t[1]}x{t[2]}"),
        count.map(lambda c: f"cpu:{c}"),
    )
    return shaped | st.text(max_size=16).filter(lambda t: not t.startswith("-"))
