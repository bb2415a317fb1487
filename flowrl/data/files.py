"""Reading prompt files into rows: JSONL, JSON (a list of objects), Parquet and CSV.

``read_rows(path)`` returns the file's rows as a list of dicts, one per record, in file order. The
format is chosen by the file's extension. Every problem with the file is a ``ConfigError`` naming the
file, what is wrong (the line, for JSONL) and how to fix it, raised before any training work:

- the file is missing or is a directory; it holds no rows;
- it is not UTF-8 (JSONL, JSON, CSV);
- a JSONL line, or the JSON document, does not parse; a record is not an object;
- Parquet without ``pyarrow`` installed (``pip install 'flowrl[data]'``).

CSV values are strings (the csv module does not type them); an empty CSV cell is an empty string.

Example:
    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "p.jsonl"
    >>> _ = path.write_text('{"prompt": "2+2=", "answer": "4"}\\n{"prompt": "3+3=", "answer": "6"}\\n')
    >>> read_rows(str(path))
    [{'prompt': '2+2=', 'answer': '4'}, {'prompt': '3+3=', 'answer': '6'}]
"""

from __future__ import annotations

import csv
import importlib
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flowrl.errors import ConfigError

__all__ = ["read_rows", "write_jsonl", "FORMATS", "DATA_INSTALL_HINT"]

DATA_INSTALL_HINT = "pip install 'flowrl[data]'"

Row = dict[str, Any]


def _text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8-sig")  # a UTF-8 byte-order mark is tolerated
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[: exc.start].count(b"\n") + 1
        raise ConfigError(
            f"prompt file {str(path)!r} is not UTF-8 text (byte {exc.start}, line {line}: {exc.reason}); "
            "re-encode it as UTF-8 (e.g. iconv -f LATIN1 -t UTF-8)"
        ) from None


def _object(value: Any, path: Path, where: str) -> Row:
    if not isinstance(value, dict):
        raise ConfigError(
            f"prompt file {str(path)!r}: {where} is a JSON {type(value).__name__}, not an object; "
            'each record must be an object such as {"prompt": "...", "answer": "..."}'
        )
    return value


def _jsonl(path: Path) -> list[Row]:
    rows = []
    for number, line in enumerate(_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"prompt file {str(path)!r} is malformed on line {number}, column {exc.colno}: {exc.msg}; "
                "each line of a .jsonl file must be one complete JSON object"
            ) from None
        rows.append(_object(value, path, f"line {number}"))
    return rows


def _json(path: Path) -> list[Row]:
    try:
        value = json.loads(_text(path))
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"prompt file {str(path)!r} is malformed JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}; "
            "a .json prompt file must hold one list of objects (use .jsonl for one object per line)"
        ) from None
    if not isinstance(value, list):
        raise ConfigError(
            f"prompt file {str(path)!r} holds a JSON {type(value).__name__}, not a list of objects; "
            'write [{"prompt": ...}, ...] or use .jsonl with one object per line'
        )
    return [_object(v, path, f"record {i}") for i, v in enumerate(value)]


def _csv(path: Path) -> list[Row]:
    try:
        return [dict(row) for row in csv.DictReader(io.StringIO(_text(path), newline=""), strict=True)]
    except csv.Error as exc:
        raise ConfigError(f"prompt file {str(path)!r} is malformed CSV: {exc}; check its quoting") from None


def _parquet(path: Path) -> list[Row]:
    try:
        parquet = importlib.import_module("pyarrow.parquet")
    except ImportError:
        raise ConfigError(f"prompt file {str(path)!r} is Parquet, which needs the 'pyarrow' package: {DATA_INSTALL_HINT}") from None
    try:
        return parquet.read_table(path).to_pylist()
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a broken file
        raise ConfigError(f"prompt file {str(path)!r} is not a readable Parquet file: {exc}") from None


#: Extension -> reader.
FORMATS: dict[str, Callable[[Path], list[Row]]] = {".jsonl": _jsonl, ".json": _json, ".csv": _csv, ".parquet": _parquet}


def write_jsonl(path: str | Path, rows: list[Row]) -> Path:
    """Write ``rows`` to ``path`` as JSON lines (UTF-8, one object per line); ``read_rows`` reads them back."""
    out = Path(path)
    out.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return out


def read_rows(path: str) -> list[Row]:
    """The rows of the prompt file ``path`` (``~`` expanded), in file order.

    Args:
        path: a ``.jsonl``, ``.json``, ``.csv`` or ``.parquet`` file.

    Returns:
        One dict per record.

    Raises:
        ConfigError: naming the file and the fix (see the module docstring).
    """
    p = Path(path).expanduser()
    reader = FORMATS.get(p.suffix.lower())
    if reader is None:
        raise ConfigError(f"prompt file {path!r} has extension {p.suffix!r}; use one of {sorted(FORMATS)}")
    if not p.exists():
        raise ConfigError(f"prompt file {path!r} does not exist (resolved to {p.resolve()}); check the source's data= path")
    if not p.is_file():
        raise ConfigError(f"prompt file {path!r} is a directory, not a file; name the file itself")
    rows = reader(p)
    if not rows:
        raise ConfigError(f"prompt file {path!r} holds no rows; give it at least one record with a prompt")
    return rows
