"""``flowrl``'s entry point: builds the parser from the subcommand modules and turns user mistakes into exit 2.

Each subcommand module defines ``register(subparsers)`` (adds its parser and sets ``func``).
A ``FlowrlError`` (a user mistake: bad graph, bad plan, bad flag value) prints one paragraph to
stderr and exits 2. A ``NodeExecutionError`` (an operator failed during a run) prints the
operator's traceback and the node and step, and exits 1, unless what failed was a flowrl check of
the user's input (a ``FlowrlError`` at the root of the chain: a prompt longer than the model's
context, a reward of NaN), which prints one paragraph and exits 2 like any other user mistake.
A ``NodeBuildError`` (a node's program could not be built: a user factory that raised, a model config
torch refuses) prints one paragraph naming the node and where the error was raised, and exits 2.
A closed stdout (``flowrl plan ... | head -1``) ends the command quietly with exit status 141, as
a process killed by SIGPIPE reports. Anything else is a flowrl bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import textwrap
import traceback
from typing import NoReturn

from flowrl import __version__
from flowrl.errors import FlowrlError, NodeBuildError, NodeExecutionError
from flowrl.runtime.backends.torchrun.rank_exit import end_rank_process, is_rank_process, native_threads

__all__ = ["main", "build_parser", "SUBCOMMANDS"]

#: Subcommand modules, in the order ``--help`` lists them.
SUBCOMMANDS = ("run", "plan", "viz", "plot", "sample", "eval", "export", "examples", "calibrate")

DESCRIPTION = """\
flowrl: declare an RL pipeline for language models as a graph, plan it onto devices, run it
asynchronously with a hard bound on weight staleness (LlamaRL's AIPO).

first steps:
  flowrl examples                      list the built-in pipelines
  flowrl viz llamarl --format mermaid  draw the default pipeline
  flowrl plan llamarl --cluster cpu    dry-run a placement, no hardware needed
  flowrl run                           train the built-in example on this CPU
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse's own usage errors: exit 2, no traceback
        self.print_usage(sys.stderr)
        self.exit(2, f"flowrl: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="flowrl", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"flowrl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"flowrl.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"flowrl.cli.{name}":  # a subcommand not built yet
                continue
            raise
        module.register(sub)
    return parser


def _user_mistake(exc: NodeExecutionError) -> bool:
    """True when the root of ``exc``'s cause chain is another flowrl error (a bad config, a reference
    that does not resolve, a reward that is not a finite float), not an exception from user code or torch."""
    inner: BaseException = exc
    for _ in range(32):  # cause chains are short; the bound only guards against a cycle
        if inner.__cause__ is None:
            break
        inner = inner.__cause__
    # a worker process that died or raised is a failed run, unless it reports a flowrl input check
    return inner is not exc and isinstance(inner, FlowrlError) and getattr(inner, "user_mistake", True)


def _print_error(command: str, exc: FlowrlError) -> None:
    first, *rest = str(exc).split("\n")
    text = textwrap.fill(
        first,
        width=100,
        initial_indent=f"flowrl {command}: error: ",
        subsequent_indent="  ",
        break_long_words=False,  # keep paths and references whole, so they can be copied
        break_on_hyphens=False,
    )
    print(text + "".join(f"\n{line}" for line in rest), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Run the command in ``argv`` (default: this process's arguments) and return its exit status.

    Called without ``argv`` it is this process's command (``flowrl``, ``python -m flowrl``): as a rank
    of a torchrun job whose C++ threads still run at the end (gloo's, of process groups that outlive
    the job's ``destroy_process_group``), it ends the process itself with that status and without
    interpreter teardown, where such a thread can abort the rank (``runtime.backends.torchrun.rank_exit``); a
    flowrl bug's traceback is printed first (exit 1). A rank that stopped before any process group
    (a refused input) exits as any process does.
    """
    if argv is not None or not is_rank_process():
        return _command(argv)
    try:
        code = _command(None)
    except Exception:  # noqa: BLE001 - a flowrl bug: its traceback, as an uncaught exception prints it
        if not native_threads():
            raise
        traceback.print_exc()
        code = 1
    if native_threads():
        end_rank_process(code)
    return code


def _command(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # inside the try: a closed pipe must fail here, not at interpreter exit
        return code
    except BrokenPipeError:
        return _closed_stdout()
    except NodeBuildError as exc:  # a node's program could not be built: the message names node and cause
        _print_error(args.command, exc)
        return 2
    except NodeExecutionError as exc:  # an operator failed mid-run: its traceback is the useful part
        cause = exc.__cause__
        if _user_mistake(exc):  # e.g. prompts longer than max_seq_len, a reward of NaN: no traceback helps
            _print_error(args.command, exc)
            return 2
        if cause is not None:
            print("".join(traceback.format_exception(type(cause), cause, cause.__traceback__)).rstrip(), file=sys.stderr)
        print(f"flowrl {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except FlowrlError as exc:
        _print_error(args.command, exc)
        return 2
    except KeyboardInterrupt:
        print(f"flowrl {args.command}: interrupted", file=sys.stderr)
        return 130


def _closed_stdout() -> int:
    """The reader of stdout went away: point stdout at /dev/null so that the exit flush is quiet."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout without a file descriptor (an embedding): nothing to quiet
        pass
    return 141


if __name__ == "__main__":
    sys.exit(main())
