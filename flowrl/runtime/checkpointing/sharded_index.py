"""A sharded policy state's directory read and checked before any tensor is: its ``policy.json``, DCP's
index (``.metadata``, read without running code) and every shard file the index names, there and whole.

``flowrl.runtime.checkpointing.sharded_state`` writes and reads the tensors (its docstring states the
format); this module is what every reader checks first:

- ``written(path)``: a state's directory has its info and index (written last by the save).
- ``read_info(path)``: the info and the index of a whole state, or a ``CheckpointError`` naming what is
  missing: which of ``policy.json`` / ``.metadata``, the shard files of which ranks (and a tensor they
  held), a file shorter than its index says, a tensor whose chunks do not cover it exactly once.
- ``read_metadata(path)`` / ``storage_reader(path)``: DCP's index through ``_IndexUnpickler``, which
  allows only DCP's metadata classes and torch's dtypes (DCP's ``.metadata`` is a pickle): a poisoned
  index raises, it does not run code, as the one-file format is read with ``weights_only=True``.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pickle
import re
from pathlib import Path
from typing import Any

import msgspec
import torch

from flowrl.errors import CheckpointError

__all__ = [
    "SHARDED_SUFFIX",
    "INFO_FILE",
    "METADATA_FILE",
    "INTACT",
    "ShardedStateInfo",
    "is_sharded",
    "written",
    "read_metadata",
    "storage_reader",
    "read_info",
    "layout_name",
]

#: The suffix of a sharded policy state's directory (``policy-<node>.dcp``).
SHARDED_SUFFIX = ".dcp"
#: What a sharded state holds besides tensors, in its directory.
INFO_FILE = "policy.json"
#: DCP's index in it.
METADATA_FILE = ".metadata"  # torch.distributed.checkpoint.filesystem's name


class ShardedStateInfo(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a sharded state holds besides tensors (``policy.json``).

    Attributes:
        version: the policy version (completed optimizer steps).
        model_config: the policy's model description (``msgspec.to_builtins``), as the one-file format.
        dp: the number of ranks that wrote it, whatever their layout (``__<rank>_0.distcp`` files;
            any dp size reads it).
        lora: whether ``model`` holds a LoRA policy's adapters only.
        mesh: the writer's mesh, axis -> size (``{"dp": 2}``, ``{"tp": 2, "pp": 2}``); informative only
            (readers need none of it: the index has every tensor's global shape). Empty in states
            written before it was recorded.
        format: this layout's version.
    """

    version: int
    model_config: dict[str, Any]
    dp: int
    lora: bool = False
    mesh: dict[str, int] = msgspec.field(default_factory=dict)
    format: int = 1


def is_sharded(path: str | Path) -> bool:
    """Whether ``path`` is a sharded state (a directory), not a one-file state."""
    return Path(path).is_dir()


def written(path: str | Path) -> bool:
    """Whether a policy state at ``path`` is whole: a file, or a directory with its info and DCP's
    index (written last, so a kill during the save leaves it without one)."""
    p = Path(path)
    return p.is_file() or (p.is_dir() and (p / INFO_FILE).is_file() and (p / METADATA_FILE).is_file())


class _IndexUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` pickle with DCP's metadata dataclasses and enums, torch's dtypes and layouts
    and a few plain containers only: nothing it names can run code (no function of those modules)."""

    _MODULES = ("torch.distributed.checkpoint.", "torch.distributed._shard.")  # their dataclasses and enums only
    _ALLOWED = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a layout by its name (torch.strided)
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        if module.startswith(self._MODULES):
            value = super().find_class(module, name)
            if isinstance(value, type) and (dataclasses.is_dataclass(value) or issubclass(value, enum.Enum)):
                return value
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's index")


def storage_reader(path: Path) -> Any:
    """DCP's file reader of ``path`` that reads the index through ``read_metadata``."""
    from torch.distributed.checkpoint import FileSystemReader

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = read_metadata(path)
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader(str(path))


def read_metadata(path: Path) -> Any:
    """DCP's index of the state at ``path`` (its ``Metadata``), through ``_IndexUnpickler``.

    Raises:
        CheckpointError: an index that is missing, unreadable or names anything but DCP's metadata.
    """
    from torch.distributed.checkpoint.metadata import StorageMeta

    try:
        metadata = _IndexUnpickler(io.BytesIO((path / METADATA_FILE).read_bytes())).load()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError) as exc:
        raise CheckpointError(
            f"sharded checkpoint {str(path)!r} has an unreadable index {METADATA_FILE} ({type(exc).__name__}: {exc}); "
            "resume from an intact checkpoint (remove this one and point LATEST at an older step-*)"
        ) from None
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata


#: The way out every refusal of a state names.
INTACT = "resume from an intact checkpoint (remove this one and point LATEST at an older step-*; flowrl export takes a step-* directory)"


def read_info(path: Path) -> tuple[ShardedStateInfo, Any]:
    """The info and DCP's index of a whole sharded state whose shard files are all there, each as long
    as its index says, every tensor's chunks covering it once.

    Raises:
        CheckpointError: naming what is missing (see the module docstring) and the fix.
    """
    if not written(path):
        lacks = " and ".join(f for f in (INFO_FILE, METADATA_FILE) if not (path / f).is_file())
        raise CheckpointError(
            f"sharded checkpoint {str(path)!r} is incomplete (no {lacks}: its save did not finish); {INTACT}"
        )
    try:
        info = msgspec.json.decode((path / INFO_FILE).read_bytes(), type=ShardedStateInfo)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CheckpointError(f"sharded checkpoint {str(path)!r} has an unreadable {INFO_FILE}: {exc}") from None
    if info.format != 1:
        raise CheckpointError(f"sharded checkpoint {str(path)!r} has format {info.format}; this flowrl reads format 1: read it with the flowrl that wrote it")
    metadata = read_metadata(path)
    _check_files(path, info, metadata)
    return info, metadata


def layout_name(info: ShardedStateInfo) -> str:
    """The writer's mesh as ``dp=2`` / ``tp=2, pp=2`` (states written before ``mesh``: their dp size)."""
    return ", ".join(f"{a}={n}" for a, n in info.mesh.items()) if info.mesh else f"dp={info.dp}"


def _check_files(path: Path, info: ShardedStateInfo, metadata: Any) -> None:
    """Refuse a state whose index names a shard file that is not there, or is shorter than the
    chunks the index places in it (a copy cut short), naming the files, their ranks and a tensor each held;
    or whose chunks of a tensor do not add up to it (a reader fills each tensor from its chunks)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    ends: dict[str, int] = {}
    held: dict[str, list[str]] = {}
    for index, where in metadata.storage_data.items():
        ends[where.relative_path] = max(ends.get(where.relative_path, 0), int(where.offset) + int(where.length))
        held.setdefault(where.relative_path, []).append(index.fqn)
    layout = f"{layout_name(info)}; " if info.mesh else ""

    def ranks(files: list[str]) -> str:
        numbers = [m.group(1) for f in files if (m := re.match(r"__(\d+)_", f))]
        tensors = sorted({t for f in files for t in held[f]})
        return f"{layout}rank(s) {', '.join(numbers) or '?'}'s, holding chunks of {len(tensors)} tensors such as {tensors[0]!r}"

    for key, meta in metadata.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            covered = sum(torch.Size(c.sizes).numel() for c in meta.chunks)
            if covered != meta.size.numel():
                raise CheckpointError(
                    f"sharded checkpoint {str(path)!r}: the chunks of {key!r} hold {covered} of its {meta.size.numel()} elements "
                    f"(shape {tuple(meta.size)}): its writers did not save each element exactly once; {INTACT}"
                )
    missing = sorted(f for f in ends if not (path / f).is_file())
    if missing:
        raise CheckpointError(
            f"sharded checkpoint {str(path)!r} lacks shard files {missing} of the {info.dp} ranks that wrote it ({ranks(missing)}); "
            "on several hosts --checkpoint-dir must be a directory every rank sees (a shared filesystem); copy the "
            f"missing files in, or {INTACT}"
        )
    short = {f: (path / f).stat().st_size for f in sorted(ends) if (path / f).stat().st_size < ends[f]}
    if short:
        sizes = ", ".join(f"{f} has {n} bytes of {ends[f]}" for f, n in short.items())
        raise CheckpointError(
            f"sharded checkpoint {str(path)!r} has shard files cut short ({sizes}; {ranks(list(short))}) of the "
            f"{info.dp} ranks that wrote it: a copy that did not finish; copy them again, or {INTACT}"
        )
