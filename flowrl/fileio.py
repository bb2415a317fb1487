"""Writing and reading flowrl's files: one atomic write and one way of naming a bad JSON file.

- :func:`write_atomic`: the data goes to a temporary file in the target's folder, is flushed to
  disk, then renamed over the target, so a reader sees the old file or the new one, never a part.
  Every file flowrl writes whole (exports, plans, calibrated clusters, traces, truncated metrics)
  goes through it.
- :func:`read_bounded`: a user's file read whole, refused when missing, over a size limit (a
  wrong file, not a config) or unreadable, each error naming the file.
- :func:`decode_errors`: around a msgspec decode, turns its three failures (schema mismatch, bad
  JSON, bytes that are not UTF-8) into one domain error with the same wording everywhere.

Example:
    >>> import tempfile, os
    >>> folder = tempfile.mkdtemp()
    >>> path = write_atomic(os.path.join(folder, "a.txt"), "hello")
    >>> path.read_text()
    'hello'
    >>> import msgspec
    >>> from flowrl.errors import PlanError
    >>> try:
    ...     with decode_errors(PlanError, mismatch="plan file 'p' does not match the flowrl plan schema",
    ...                        invalid="plan file 'p' is not valid JSON"):
    ...         msgspec.json.decode(b"{", type=dict)
    ... except PlanError as exc:
    ...     print(str(exc).split(":")[0])
    plan file 'p' is not valid JSON
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import msgspec

from flowrl.errors import FlowrlError

__all__ = ["write_atomic", "read_bounded", "decode_errors"]


def _new_file_mode() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def write_atomic(path: str | os.PathLike[str], data: bytes | str, *, error: type[FlowrlError] = FlowrlError, what: str = "") -> Path:
    """Write ``data`` to ``path`` through a temporary file in the same folder and a rename.

    On failure the temporary file is removed. A new file gets the usual permissions (0o666 less the
    umask); a replaced one keeps its own.

    Args:
        path: the file to write.
        data: its whole content (str is written as UTF-8).
        error: the domain error to raise (``ExportError``, ``PlanError`` ...).
        what: how messages name the file (``"plan "`` gives "cannot write plan 'x'").

    Returns:
        The path written.

    Raises:
        error: naming the path when it cannot be written (missing folder, a folder in the way, ...).
    """
    target = Path(path)
    payload = data.encode() if isinstance(data, str) else data
    folder = target.parent if str(target.parent) else Path(".")
    name = f"{what}{str(target)!r}"
    if not folder.is_dir():
        raise error(f"cannot write {name}: folder {str(folder)!r} does not exist; create it first")
    if target.is_dir():
        raise error(f"cannot write {name}: it is a folder; give a file name")
    try:
        mode = os.stat(target).st_mode & 0o777 if target.exists() else _new_file_mode()
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as exc:
        raise error(f"cannot write {name}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise error(f"cannot write {name}: {exc.strerror or exc}") from None
        raise
    return target


@contextlib.contextmanager
def decode_errors(error: type[FlowrlError], *, mismatch: str, invalid: str, hint: str = "") -> Iterator[None]:
    """Raise ``error`` for a msgspec decode or convert failing inside the block.

    Args:
        error: the domain error.
        mismatch: the message's start when the data does not match the type (``"... does not match the schema"``).
        invalid: its start when the data is not JSON (``"... is not valid JSON"``).
        hint: appended to a mismatch (the expected fields, say).
    """
    try:
        yield
    except msgspec.ValidationError as exc:
        raise error(f"{mismatch}: {exc}{hint}") from None
    except msgspec.DecodeError as exc:
        raise error(f"{invalid}: {exc}") from None
    except UnicodeDecodeError as exc:  # msgspec raises it, not a DecodeError, for bad bytes inside a string
        raise error(f"{invalid}: a string holds bytes that are not UTF-8 ({exc.reason})") from None


def read_bounded(path: str | os.PathLike[str], *, limit: int, what: str, missing_hint: str, error: type[FlowrlError]) -> bytes:
    """The bytes of ``path``, a user's ``what`` (e.g. ``"plan file"``) of at most ``limit`` bytes.

    Raises:
        error: ``what`` and the path named: it does not exist (``missing_hint`` says what to do), it is
            over ``limit`` bytes, or it cannot be read.
    """
    p = Path(path)
    if not p.is_file():
        raise error(f"{what} {str(p)!r} does not exist; {missing_hint}")
    if p.stat().st_size > limit:
        raise error(f"{what} {str(p)!r} is over the {limit}-byte limit; is it a {what.split()[0]} file?")
    try:
        return p.read_bytes()
    except OSError as exc:
        raise error(f"cannot read {what} {str(p)!r}: {exc.strerror}") from None
