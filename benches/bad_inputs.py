"""Bad inputs tried through the CLI entry point, and how many got a clean error.

Runs, in this process, through ``flowrl.cli.main.main([...])``: every corpus entry of
``tests/reliability/corpus`` with each command its kind implies, the generated graph files (deep
nesting, over the size limit, a directory, a missing file), the bad-argument and bad-cluster-string
tables, and N hypothesis-generated inputs of each family (mutated graph JSON, random JSON values,
mutated plan files, cluster strings). A hand-made input is clean when it exits 2 with its expected
message, no traceback and no output file left; a generated one may also be valid (exit 0).

Prints JSON: ``tried``, ``clean`` (and ``valid`` for generated inputs that happened to be fine),
per family, and every failure with its argv and what went wrong.

    python benches/bad_inputs.py [--n 500] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.reliability.badinput import (  # noqa: E402
    ARGV_CASES,
    CLUSTER_STRINGS,
    COMMANDS,
    CORPUS,
    clean_error,
    cluster_texts,
    commands_for,
    generated_graph_files,
    load_manifest,
    mutated_graph_files,
    mutated_plan_files,
    random_json_files,
    run_cli,
)


class Tally:
    def __init__(self) -> None:
        self.tried: Counter[str] = Counter()
        self.clean: Counter[str] = Counter()
        self.valid: Counter[str] = Counter()
        self.failures: list[dict] = []
        self._n = 0

    def folder(self, root: str) -> str:
        self._n += 1
        path = os.path.join(root, f"o{self._n}")
        os.mkdir(path)
        return path

    def check(self, family: str, argv: list[str], out: str, match: str | None, **kw: bool) -> None:
        outcome = run_cli(argv)
        problem = clean_error(outcome, out, match, **kw)
        self.tried[family] += 1
        if problem is None:
            (self.valid if outcome.code == 0 else self.clean)[family] += 1
        else:
            self.failures.append({"family": family, "argv": [a[:200] for a in argv], "problem": problem[-1500:]})


def hand_made(t: Tally, root: str) -> None:
    for entry in load_manifest():
        for i in range(len(COMMANDS[entry["kind"]])):
            out = t.folder(root)
            argv = commands_for(entry["kind"], str(CORPUS / entry["file"]), out)[i]
            t.check(f"corpus:{entry['kind']}", argv, out, entry["match"], complete_ok=entry["kind"] == "graph-run")
    for _name, path, match in generated_graph_files(os.path.join(root, "generated")):
        for i in range(len(COMMANDS["graph"])):
            out = t.folder(root)
            t.check("generated-graph-files", commands_for("graph", path, out)[i], out, match)
    for argv, match in ARGV_CASES:
        out = t.folder(root)
        t.check("arguments", [a.replace("{out}", out) for a in argv], out, match)
    cwd = os.getcwd()
    os.chdir(root)  # 'missing.json' is looked up here
    try:
        for text, match in CLUSTER_STRINGS:
            out = t.folder(root)
            t.check("cluster-strings", ["plan", "--cluster", text, "-o", f"{out}/plan.json"], out, match)
    finally:
        os.chdir(cwd)


def fuzzed(t: Tally, root: str, n: int, seed: int) -> None:
    from hypothesis import HealthCheck, Phase, given, seed as hseed, settings

    config = settings(max_examples=n, database=None, phases=[Phase.generate], deadline=None,
                      suppress_health_check=list(HealthCheck))

    def file_case(family: str, strategy, argv_of) -> None:
        @hseed(seed)
        @config
        @given(raw=strategy)
        def case(raw: bytes) -> None:
            out = t.folder(root)
            path = os.path.join(out + "-input.json")
            with open(path, "wb") as f:
                f.write(raw)
            t.check(family, argv_of(path, out), out, None, allow_success=True)

        case()

    file_case("fuzz:mutated-graphs", mutated_graph_files(), lambda p, o: ["viz", p, "-o", f"{o}/g.mmd"])
    file_case("fuzz:random-json-graphs", random_json_files(), lambda p, o: ["viz", p, "-o", f"{o}/g.mmd"])
    file_case("fuzz:mutated-plans", mutated_plan_files(), lambda p, o: ["viz", "llamarl", "--plan", p, "-o", f"{o}/g.mmd"])
    file_case("fuzz:mutated-graphs-planned", mutated_graph_files(),
              lambda p, o: ["plan", p, "--cluster", "cpu:2", "-o", f"{o}/plan.json"])

    @hseed(seed)
    @config
    @given(text=cluster_texts())
    def cluster_case(text: str) -> None:
        out = t.folder(root)
        t.check("fuzz:cluster-strings", ["plan", "--cluster", text, "--strategy", "nosuch", "-o", f"{out}/plan.json"], out, None,
                allow_success=True)

    cluster_case()


def summary(n: int = 500, seed: int = 0) -> dict:
    """Run every hand-made bad input and ``n`` generated ones per family; the figures as a dict."""
    t = Tally()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="flowrl-bad-inputs-") as root:
        hand_made(t, root)
        hand_s = time.perf_counter() - start
        fuzzed(t, root, n, seed)
    families = sorted(t.tried)
    hand = [f for f in families if not f.startswith("fuzz:")]
    fuzz = [f for f in families if f.startswith("fuzz:")]
    return {
        "tried": sum(t.tried.values()),
        "clean_errors": sum(t.clean.values()),
        "valid_generated": sum(t.valid.values()),
        "failures": len(t.failures),
        "hand_made": {"tried": sum(t.tried[f] for f in hand), "clean": sum(t.clean[f] for f in hand), "seconds": round(hand_s, 1)},
        "generated": {"tried": sum(t.tried[f] for f in fuzz), "clean": sum(t.clean[f] for f in fuzz),
                      "valid": sum(t.valid[f] for f in fuzz), "per_family": n},
        "by_family": {f: {"tried": t.tried[f], "clean": t.clean[f], "valid": t.valid[f]} for f in families},
        "wall_s": round(time.perf_counter() - start, 1),
        "failure_list": t.failures,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=500, help="generated inputs per fuzzed family (default: 500)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(json.dumps(summary(args.n, args.seed), indent=2))


if __name__ == "__main__":
    main()
