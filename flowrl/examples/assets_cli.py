"""The command line of the examples' asset writers: ``python -m flowrl.examples.hf_copy DIR [HEADS]``.

Each example that ships files (``hf_copy``, ``hf_agent``, ``qwen_math``) writes them again with its
``write_assets``; this module gives those modules one argparse front end: ``--help`` prints the usage
(it is never taken for a directory name), and a directory that exists and holds files is refused
unless ``--force`` says to replace them.

Example:
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> main(["--help"], lambda out: out, prog="demo", what="demo files")  # doctest: +ELLIPSIS
    usage: demo [-h] [--force] DIR
    ...
    0
    >>> (d / "x.txt").write_text("kept")
    4
    >>> main([str(d)], lambda out: out, prog="demo", what="demo files")  # refused, with the reason on stderr
    2
    >>> refuse_non_empty(d)  # doctest: +ELLIPSIS
    'DIR ... exists and is not empty (holds x.txt); pass --force to replace its files, or name a new directory'
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["main", "refuse_non_empty"]


def refuse_non_empty(directory: Path) -> str | None:
    """Why ``directory`` may not be written without ``--force`` (it is a file, or a directory holding files), else None."""
    if directory.is_file():
        return f"DIR {directory} is a file; name a directory"
    if directory.is_dir():
        held = sorted(p.name for p in directory.iterdir())
        if held:
            listed = ", ".join(held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
            return f"DIR {directory} exists and is not empty (holds {listed}); pass --force to replace its files, or name a new directory"
    return None


def main(
    argv: Sequence[str] | None,
    write: Callable[..., Path],
    *,
    prog: str,
    what: str,
    heads: int | None = None,
) -> int:
    """Parse ``argv`` (``DIR [HEADS] [--force]``), write the assets with ``write(DIR[, heads=HEADS])``, print DIR.

    ``heads`` is the default head count when the writer takes one (``HEADS`` is then accepted), else None.
    Returns the exit status: 0 written (or ``--help``), 2 refused.
    """
    parser = argparse.ArgumentParser(prog=prog, description=f"Write {what} into DIR (the files shipped with flowrl are these).")
    parser.add_argument("directory", metavar="DIR", help="where to write them (a new or empty directory; see --force)")
    if heads is not None:
        parser.add_argument("heads", metavar="HEADS", nargs="?", type=int, default=heads, help=f"attention heads of the width 64 (default {heads})")
    parser.add_argument("--force", action="store_true", help="replace the files of a DIR that exists and is not empty")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help (0) or a usage error (2): argparse has printed what to print
        return int(exit_.code or 0)
    out = Path(args.directory)
    why = None if args.force else refuse_non_empty(out)
    if why is not None:
        print(f"{prog}: {why}", file=sys.stderr)
        return 2
    print(write(out, heads=args.heads) if heads is not None else write(out))
    return 0
