"""Local model directories and the optional ``transformers`` import: the checks every HF path shares.

flowrl never downloads anything. A path that is not a local directory is an error; when it looks
like a hub id (``Qwen/Qwen2.5-0.5B-Instruct``) the message says how to make a local copy.

Example:
    >>> resolve_local_dir("Qwen/Qwen2.5-0.5B-Instruct", owner="model")
    Traceback (most recent call last):
    ...
    flowrl.errors.ConfigError: model: 'Qwen/Qwen2.5-0.5B-Instruct' looks like a Hugging Face hub id, not a local directory. flowrl never downloads models: fetch a copy yourself (huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct --local-dir DIR) and pass DIR.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from types import ModuleType

from flowrl.errors import ConfigError

__all__ = ["require_transformers", "resolve_local_dir", "HF_INSTALL_HINT"]

HF_INSTALL_HINT = "pip install 'flowrl[hf]'"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def require_transformers(feature: str) -> ModuleType:
    """Import ``transformers`` or raise a ``ConfigError`` saying which feature needs it and how to install it."""
    try:
        return importlib.import_module("transformers")
    except ImportError:
        raise ConfigError(f"{feature} needs the 'transformers' package: {HF_INSTALL_HINT}") from None


def resolve_local_dir(path: str, *, owner: str) -> Path:
    """``path`` as an existing local directory (``~`` expanded).

    Raises:
        ConfigError: for a hub id, a missing path, or a file where a directory is expected.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        return p
    if p.exists():
        raise ConfigError(f"{owner}: {path!r} is a file; pass the directory that holds config.json")
    if _HUB_ID.match(path) and not path.startswith((".", "/", "~")):
        raise ConfigError(
            f"{owner}: {path!r} looks like a Hugging Face hub id, not a local directory. flowrl never downloads "
            f"models: fetch a copy yourself (huggingface-cli download {path} --local-dir DIR) and pass DIR."
        )
    raise ConfigError(f"{owner}: model directory {path!r} does not exist (resolved to {p.resolve()})")
