"""References to user code as strings, resolved only when a graph runs.

A graph file never holds code: a scorer names its function, a source may name its task factory.
Two forms, both stable across processes, backends and JSON round trips:

- ``package.module:qualname``: a function of a module on ``PYTHONPATH``;
- ``path/to/file.py:qualname``: a function defined in a Python file (a graph script, say). The builder
  writes the file's absolute path; a relative path is read from the directory the run starts in.
  Every process of a run loads the file itself (its top level runs again there), so the file must
  be at that path on every host of a multi-host run.

A function a graph script imported from a module beside it (``from rewards import my_reward``, found
because the script's folder is on ``sys.path`` while it runs) is referenced through the script,
``/abs/path/train.py:my_reward`` (or ``...:rewards.my_reward`` after ``import rewards``), not as
``rewards:my_reward``: loading the script puts its folder on ``sys.path`` again, so every process of
the run and ``flowrl sample`` / ``flowrl eval`` of its checkpoints import what the run imported,
from any directory, without ``PYTHONPATH``.

Loading a graph checks the reference's syntax and nothing else; ``references(graph)`` lists them so
that a user can read what a graph would import before running it; ``resolve`` imports the module
(or loads the file) and walks the qualname.

Example:
    >>> check_reference("flowrl.operators.tasks:copy_reward") is None
    True
    >>> check_reference("/home/me/mine.py:my_reward") is None
    True
    >>> check_reference("my_reward")
    "reference 'my_reward' is not of the form 'package.module:function' or 'path/to/file.py:function' (a module-level function, named, not a lambda)"
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from flowrl.errors import GraphError

__all__ = ["reference_of", "check_reference", "is_reference", "resolve", "load_file_module", "REF_RE", "FILE_REF_RE"]

_QUALNAME = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
REF_RE = re.compile(rf"^{_QUALNAME}:{_QUALNAME}\Z")
#: ``path/to/file.py:qualname``; the path holds no newline and no ':' (a Windows drive letter aside).
FILE_REF_RE = re.compile(rf"^(?P<path>(?:[A-Za-z]:)?[^:\n]+\.py):(?P<qualname>{_QUALNAME})\Z")

#: Module names of files loaded by ``load_file_module`` -> the file's absolute path.
_FILE_MODULES: dict[str, str] = {}


def check_reference(ref: str) -> str | None:
    """None if ``ref`` is a well-formed ``module:qualname`` or ``file.py:qualname``, else what is wrong with it."""
    if not isinstance(ref, str) or not (REF_RE.match(ref) or FILE_REF_RE.match(ref)):
        return (
            f"reference {ref!r} is not of the form 'package.module:function' or 'path/to/file.py:function' "
            "(a module-level function, named, not a lambda)"
        )
    return None


def is_reference(text: str) -> bool:
    """True if ``text`` is a well-formed reference of either form."""
    return check_reference(text) is None


def _module_name_for(path: Path) -> str:
    """A module name for the file at ``path``: the same in every process (no salted ``hash``)."""
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    stem = re.sub(r"\W", "_", path.stem)
    return f"_flowrl_file_{stem}_{digest}"


def load_file_module(path: str | Path, *, fresh: bool = False) -> ModuleType:
    """The Python file at ``path`` as a module, executed once per process and cached by absolute path.

    Args:
        path: the file.
        fresh: execute it again even if it was loaded before (a graph script read anew).

    Functions it defines reference themselves as ``<absolute path>:<qualname>`` (``reference_of``).
    The file's folder is on ``sys.path`` while it runs, so it can import its neighbours.

    Raises:
        GraphError: when the file does not exist or is not Python; an exception from the file's own
            code propagates unchanged (the caller says whose code it was).
    """
    resolved = Path(path).expanduser().resolve()
    name = _module_name_for(resolved)
    if name in sys.modules and not fresh:
        return sys.modules[name]
    if not resolved.is_file():
        raise GraphError(f"cannot load {str(path)!r}: no such file (resolved to {resolved})")
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise GraphError(f"cannot load {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before it runs: its own functions and dataclasses look themselves up there
    _FILE_MODULES[name] = str(resolved)
    folder = str(resolved.parent)
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        _FILE_MODULES.pop(name, None)
        raise
    finally:
        if folder in sys.path:
            sys.path.remove(folder)
    return module


def _in_folder(file: str, folder: Path) -> bool:
    try:
        return Path(file).resolve().is_relative_to(folder)
    except (OSError, ValueError):
        return False


def _through_script(fn: Callable[..., Any], module: str, qualname: str) -> str | None:
    """``/abs/script.py:path`` for a function of a module found in a graph script's folder that the
    script's namespace reaches (the function itself, its module, or a package above it); else None."""
    mod = sys.modules.get(module)
    file = getattr(mod, "__file__", None)
    if not file:
        return None
    for name, path in reversed(list(_FILE_MODULES.items())):  # the newest script first
        script = sys.modules.get(name)
        if script is None or not _in_folder(file, Path(path).parent):
            continue
        for attr, value in list(vars(script).items()):
            if value is fn:
                candidate = attr
            elif isinstance(value, ModuleType) and (module == value.__name__ or module.startswith(value.__name__ + ".")):
                candidate = ".".join([attr, *module[len(value.__name__) :].split(".")[1:], qualname])
            else:
                continue
            obj: Any = script
            for part in candidate.split("."):
                obj = getattr(obj, part, None)
            if obj is fn:
                return f"{path}:{candidate}"
    return None


def reference_of(fn: Callable[..., Any] | str) -> str:
    """The reference of a module-level function (strings pass through, checked).

    A function of a file loaded by ``load_file_module`` (a graph script) gets the file form
    ``/abs/path/file.py:qualname``; so does one of a module in a graph script's folder that the script
    reaches (``/abs/path/file.py:name``, see the module docstring); any other the module form
    ``module:qualname``.

    Raises:
        GraphError: for a lambda, a nested function or anything without a importable name.
    """
    if isinstance(fn, str):
        ref = fn
    else:
        module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
        if not module or not qualname or "<" in qualname:
            raise GraphError(
                f"cannot reference {fn!r}: graphs store functions by name, so define it at module level "
                "(not a lambda or a nested function) and pass the function, "
                "its 'module:qualname' or its 'path/to/file.py:qualname'"
            )
        scripted = _through_script(fn, module, qualname) if module not in _FILE_MODULES else None
        ref = scripted or f"{_FILE_MODULES.get(module, module)}:{qualname}"
    message = check_reference(ref)
    if message:
        raise GraphError(message)
    return ref


def resolve(ref: str) -> Callable[..., Any]:
    """Import ``module`` (or load ``file.py``) and return ``qualname`` from it.

    Raises:
        GraphError: naming the reference when the module, the file or the attribute cannot be found.
    """
    message = check_reference(ref)
    if message:
        raise GraphError(message)
    file_match = FILE_REF_RE.match(ref)
    if file_match:
        where, qualname = file_match["path"], file_match["qualname"]
        if not Path(where).expanduser().is_file():
            raise GraphError(
                f"cannot load file {where!r} of reference {ref!r}: no such file here "
                f"(relative paths are read from {Path.cwd()}); ship it at that path or edit the graph's reference"
            )
        obj: Any = load_file_module(where)
    else:
        where, qualname = ref.split(":")
        try:
            obj = importlib.import_module(where)
        except ImportError as exc:
            raise GraphError(f"cannot import module {where!r} of reference {ref!r}: {exc}; is it on PYTHONPATH?") from exc
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise GraphError(f"{where!r} has no attribute {qualname!r} (reference {ref!r})") from None
    if not callable(obj):
        raise GraphError(f"reference {ref!r} names {type(obj).__name__} object, not a function")
    return obj
