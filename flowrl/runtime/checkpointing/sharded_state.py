"""A sharded policy's checkpoint state as torch.distributed.checkpoint (DCP) shards: written per rank, read on any layout.

A policy whose ranks hold parts of it (FSDP2, ``flowrl.runtime.parallel.fsdp``; a tensor- or
pipeline-parallel policy the same way) saves ``policy-<node>.dcp/`` in a checkpoint's ``step-*``
directory (``flowrl.runtime.checkpointing.store``) instead of the one-file ``policy-<node>.pt``::

    policy-<node>.dcp/
        __<i>_0.distcp   what rank i of the policy's group held: its chunks of every tensor (DCP's file)
        .metadata        DCP's index: each tensor's global shape and the file and offset of each chunk
                         (written by the policy's lead, through a rename, once every rank's file is written)
        policy.json      ShardedStateInfo: format, version, model_config, lora, the number of ranks
                         and the mesh that wrote it (written last, by the lead)

The format (format 1), which every layout writes (``save_sharded`` writes it from any trainer whose
parameter names are the whole model's) and every reader relies on:

- ``model.<fqn>``: the model's tensors, ``<fqn>`` each one's name in the *whole* model as one process
  builds it (``Trainer.model.state_dict()`` of an unsplit, unsharded trainer: ``model.layers.5.mlp.up_proj.weight``;
  a pipeline stage keeps its layers' whole-model indices, a tensor-parallel rank its modules' names),
  saved with the tensor's *global* shape whatever its placements (rows for FSDP2's ``Shard(0)``, rows or
  columns for tensor parallelism, a stage's whole tensors), every element in exactly one chunk (a
  tensor several ranks hold whole is written once: DCP keeps one copy). Full weights: the whole
  ``state_dict()``, a tied weight under each of its names, persistent buffers included.
- A LoRA policy (``lora`` true): the trained adapters only, under peft's parameter names
  (``<module>.lora_A.default.weight``, ``.lora_B.``; ``read_state`` renames them as
  ``flowrl.models.lora.adapter_weights`` does); no base weight and no buffer: the base is the model
  description's own (its pretrained weights, or its seed). States written before this rule may hold
  the tied head (``lm_head.weight``) too: readers drop every non-adapter key.
- ``optimizer.state.<fqn>.<key>``: AdamW's state of each trained parameter, by the same ``<fqn>``
  (without ``model.``): ``exp_avg`` and ``exp_avg_sq`` shaped and split like the parameter, ``step`` a
  0-d tensor (the same on every rank, written once). ``optimizer.param_groups.<i>.<hyperparameter>``:
  the groups' settings, and ``params`` the names of the *whole model's* trained parameters in the
  group, in the one-process optimizer's order (the model's ``parameters()`` order): ``save_sharded``
  gathers every rank's names (a pipeline stage's optimizer names its own only), and ``read_state``
  numbers the one-file format's parameters in that order. A state saved before the first step has
  AdamW's state as ``get_state_dict`` fills it (zero moments) and ``version`` 0: readers drop it.

Nothing is gathered: each rank writes the chunks it holds, so while saving no rank holds more than its
own shards and DCP's write buffers (DCP's per-rank write plan is its local chunks; replicated values
such as AdamW's ``step`` are written once). ``benches/sharded_checkpoint.py`` measures it: a few MB
above the resident memory before the save, against 1.2x the full state on the lead of a gathered save.

- ``save_sharded(trainer, path, group=, mesh=)``: collective over the policy's ranks (every rank calls
  it; ``mesh`` the policy's axes for ``policy.json``, default ``{"dp": ranks}``); ``snapshot_sharded``
  the same in two parts, the shards staged to CPU memory now (DCP's ``async_save``) and the write
  returned, to run behind training on a gloo group of its own (``write_group``).
- ``check_complete(path)``: the info of a whole state with every rank's file (``CheckpointWriter.commit``).
- ``check_sharded(path, trainer)``: before any work, the error that names the fix for a checkpoint that
  cannot be loaded into ``trainer`` (incomplete, a shard file missing or cut short, not on this host,
  another model or shapes); ``trainer`` may hold a part of the model (a pipeline stage).
- ``load_sharded(trainer, path, group)``: each rank reads the parts of the saved chunks it holds,
  whatever layout wrote them (DCP reshards by chunk overlap), then ``set_state_dict``.
- ``read_state(path, optimizer=)``: a checkpoint's policy state in the one-file format
  (``Trainer.state()``: full tensors, the optimizer's state by index), from a ``.pt`` file or a
  ``.dcp`` directory of any layout consolidated in this process without a process group: what
  ``flowrl export`` (weights only, ``optimizer=False``), ``flowrl sample`` / ``eval``, the evaluator and
  the resume of a one-process or replicated policy read. It holds the whole state, as the one-file
  format does.

DCP's ``.metadata`` is a pickle: it is read with an unpickler that allows only DCP's metadata
classes and torch's dtypes (``_IndexUnpickler``), as the one-file format is read with
``weights_only=True``: a poisoned checkpoint raises, it does not run code.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

import msgspec
import torch

from flowrl.errors import CheckpointError
from flowrl.runtime.checkpointing.sharded_index import (
    INFO_FILE,
    SHARDED_SUFFIX,
    ShardedStateInfo,
    is_sharded,
    layout_name,
    read_info,
    read_metadata,
    storage_reader,
    written,
)

__all__ = [
    "SHARDED_SUFFIX",
    "INFO_FILE",
    "ShardedStateInfo",
    "is_sharded",
    "written",
    "save_sharded",
    "snapshot_sharded",
    "dcp_write",
    "write_group",
    "check_complete",
    "check_sharded",
    "load_sharded",
    "read_state",
]


# -- saving --------------------------------------------------------------------------------------------
def _options(trainer: Any) -> Any:
    """LoRA: not strict (the frozen base is the description's own, and ``check_sharded`` has checked
    that the adapters are all there); ``_stored`` keeps the adapters of what ``get_state_dict`` gives."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    lora = bool(trainer.lora)
    return StateDictOptions(ignore_frozen_params=lora, strict=not lora)


def _trainable(model: Any) -> set[str]:
    """Every name of every parameter the optimizer trains (a tied parameter under each of its names)."""
    return {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}


def _stored(trainer: Any, model: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint stores of ``get_state_dict``'s ``model``: all of it, or a LoRA policy's trained
    adapters only. ``ignore_frozen_params`` alone is not enough: it drops the frozen parameters by
    ``named_parameters()``' names, which name a tied parameter once, so a tied head's second name
    (``lm_head.weight``, the embedding) stayed, and with it any persistent buffer."""
    if not trainer.lora:
        return model
    keep = _trainable(trainer.model)
    return {k: v for k, v in model.items() if k in keep}


def _writer(path: Path) -> Any:
    """DCP's file writer at ``path``, refusing (inside DCP's planning, so that every rank of the group
    raises, none waits in a collective) a ``path`` whose folder this rank's host does not have."""
    from torch.distributed.checkpoint import FileSystemWriter

    class Writer(FileSystemWriter):
        def prepare_local_plan(self, plan: Any) -> Any:
            if not path.parent.is_dir():
                raise CheckpointError(
                    f"the checkpoint folder {str(path.parent)!r} does not exist on this rank's host: every rank of a "
                    "sharded policy writes its own shards there, so on several hosts --checkpoint-dir must be a "
                    "directory every rank sees (a shared filesystem)"
                )
            return super().prepare_local_plan(plan)  # makes ``path``

    return Writer(str(path))


def _collective(what: str, path: Path, call: Any) -> Any:
    """Run DCP's ``call``; its ``CheckpointException`` (a ``BaseException``, which the rank's serve loop
    and the run's checkpoint cleanup would not catch) as a ``CheckpointError`` naming the ranks that
    failed and the first one's error, raised on every rank alike."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return call()
    except CheckpointException as exc:
        ranks = sorted(exc.failures)
        first = exc.failures[ranks[0]][0]
        message = str(first) if isinstance(first, CheckpointError) else f"{type(first).__name__}: {first}"
        raise CheckpointError(f"{what} {str(path)!r} failed on the policy's rank(s) {ranks} (ranks of its group): {message}") from None


def _whole_groups(optimizer: dict[str, Any], group: Any, device: Any, path: Path) -> dict[str, Any]:
    """``optimizer`` with each param group's ``params`` the names of every rank's, in rank order without
    repeats: the whole model's, whether each rank's optimizer holds them all (dp, tp) or its own stage's
    (pp: DCP keeps one rank's copy of a non-tensor value, so each rank must write the same). The names go
    as JSON bytes in tensors over ``group`` (one all-gather of sizes, one of the bytes), not pickled."""
    import json

    import torch.distributed as dist

    groups = list(optimizer.get("param_groups", []))
    mine = json.dumps([list(g["params"]) for g in groups]).encode()
    n = dist.get_world_size(group)
    size = torch.tensor([len(mine)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(n)]
    dist.all_gather(sizes, size, group=group)
    padded = torch.zeros(int(max(int(x) for x in sizes)), dtype=torch.uint8, device=device)
    padded[: len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8).to(device)
    every = [torch.zeros_like(padded) for _ in range(n)]
    dist.all_gather(every, padded, group=group)
    lists = [json.loads(bytes(b[: int(k)].cpu().tolist())) for b, k in zip(every, sizes)]
    if len({len(x) for x in lists}) > 1:
        raise CheckpointError(
            f"saving the sharded checkpoint {str(path)!r}: the policy's ranks hold {[len(x) for x in lists]} optimizer param "
            "groups; every rank must build its optimizer with the same groups (this is a flowrl bug)"
        )
    merged = [list(dict.fromkeys(name for ranks in lists for name in ranks[i])) for i in range(len(groups))]
    return {**optimizer, "param_groups": [{**g, "params": names} for g, names in zip(groups, merged)]}


def save_sharded(trainer: Any, path: str | Path, *, group: Any, mesh: Mapping[str, int] | None = None) -> None:
    """Write ``trainer``'s shards at ``path`` (a directory in an existing folder). Every rank of the
    policy's ``group`` calls it; each writes only its own shards, the group's first rank DCP's index
    and then the info (the state is whole, ``written``, once both are there). ``trainer.model``'s
    parameter names must be the whole model's (the module docstring's format); ``mesh``: the policy's
    axes, recorded in the info (default ``{"dp": ranks}``).

    Raises:
        CheckpointError: on every rank when one failed (naming it and its error, e.g. a folder its
            host lacks).
    """
    snapshot_sharded(trainer, path, group=group, mesh=mesh, background=False)()


def snapshot_sharded(
    trainer: Any, path: str | Path, *, group: Any, mesh: Mapping[str, int] | None = None, background: bool = True,
    buffers: dict[Any, Any] | None = None,
) -> Callable[[], None]:  # fmt: skip
    """``save_sharded`` in two parts: the shards staged now (each rank's chunks copied into the CPU
    ``buffers`` kept between saves, ``background.stage``, and handed to DCP's ``async_save``), then the
    returned write (each rank's file, the lead's index and info) running while the trainer goes on, its
    collectives on a process group of their own (``write_group``) so that they never meet the
    training's. Every rank of ``group`` calls both parts; ``background=False``: everything now (the
    write returned does nothing)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = Path(path)
    untouched = not trainer.optimizer.state  # before the first step (get_state_dict fills it: an AdamW step at lr 0)
    model, optimizer = get_state_dict(trainer.model, trainer.optimizer, options=_options(trainer))  # DTensors: no gather
    device = next(iter(trainer.model.parameters())).device
    state = {"model": _stored(trainer, model), "optimizer": _whole_groups(optimizer, group, device, path)}
    write = dcp_write("saving the sharded checkpoint", state, path, group=group, background=background,
                      info=_info(trainer, group, mesh or {"dp": _ranks(group)}), buffers=buffers)  # fmt: skip
    if untouched:  # the next step must start AdamW afresh, as it would have without this save
        trainer.optimizer.state.clear()
    return write


def _ranks(group: Any) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group)


def _info(trainer: Any, group: Any, mesh: Mapping[str, int]) -> ShardedStateInfo:
    """The info of ``trainer``'s state as it is now (written by the lead once the shards are)."""
    return ShardedStateInfo(
        version=trainer.version, model_config=msgspec.to_builtins(trainer.node.model), dp=_ranks(group), lora=bool(trainer.lora),
        mesh={str(k): int(v) for k, v in mesh.items()},
    )  # fmt: skip


_WRITE_GROUPS: dict[tuple[int, ...], Any] = {}


def write_group(group: Any) -> Any:
    """A gloo process group over ``group``'s ranks for background checkpoint writes (made once, by its
    members only, the first time they save behind training)."""
    import torch.distributed as dist

    ranks = tuple(dist.get_process_group_ranks(group))
    if ranks not in _WRITE_GROUPS:
        _WRITE_GROUPS[ranks] = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)
    return _WRITE_GROUPS[ranks]


def dcp_write(
    what: str, state: dict[str, Any], path: Path, *, group: Any, background: bool, info: ShardedStateInfo, buffers: dict[Any, Any] | None = None,
) -> Callable[[], None]:  # fmt: skip
    """Save ``state`` with DCP at ``path`` over ``group`` and, on its first rank, ``info`` after it
    (``written``). ``background``: DCP's ``async_save`` of ``state`` staged now into ``buffers``
    (``background.stage``: CPU memory mapped once, not DCP's fresh copy each save, which measured
    slower than the synchronous save on this CPU) and the rest in the returned write, on
    ``write_group(group)``; else all now.

    Raises:
        CheckpointError: on every rank when one failed (now, or from the write).
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    lead = dist.get_rank(group) == 0

    def finish() -> None:
        if lead:
            (path / INFO_FILE).write_bytes(msgspec.json.encode(info))

    if not background:
        _collective(what, path, lambda: dcp.save(state, storage_writer=_writer(path), process_group=group))
        finish()
        return lambda: None
    from torch.distributed.checkpoint.staging import AsyncStager

    from flowrl.runtime.checkpointing.background import stage

    class Staged(AsyncStager):
        _synchronize_after_execute = False

        def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
            return stage(state_dict, {} if buffers is None else buffers)

        def synchronize_staging(self) -> None:  # stage() copies before it returns: nothing to wait for
            return None

        def close(self) -> None:  # it holds nothing but the buffers, which the caller owns
            return None

    pending = _collective(what, path, lambda: dcp.async_save(state, storage_writer=_writer(path), process_group=write_group(group), async_stager=Staged()))

    def write() -> None:
        _collective(what, path, pending.result)
        finish()

    return write


# -- reading: the checks ---------------------------------------------------------------------------------
def _plain(value: Any) -> Any:
    """``value`` as JSON reads it back (tuples become lists), so that policy.json compares with a live config."""
    return msgspec.json.decode(msgspec.json.encode(value))


def _model_config(saved: dict[str, Any]) -> dict[str, Any]:
    """policy.json's model config as ``Trainer.state()`` writes it (``msgspec.to_builtins`` of the
    model description: tuples where its fields are tuples); as read when it is no description."""
    from flowrl.graph.configs import AnyModelConfig

    try:
        return msgspec.to_builtins(msgspec.convert({"family": "builtin", **saved}, AnyModelConfig))
    except msgspec.ValidationError:
        return saved


def _expected(trainer: Any) -> dict[str, tuple[int, ...]]:
    """``model.<name>`` -> global shape of what ``save_sharded`` writes for ``trainer``'s model."""
    params = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad] if trainer.lora else list(trainer.model.state_dict().items())
    return {f"model.{n}": tuple(p.shape) for n, p in params}


def _whole(trainer: Any) -> set[str]:
    """``model.<name>`` of every tensor a checkpoint of ``trainer``'s model description may hold: the whole
    model's (``meta_model``: a pipeline stage's trainer holds some of them only), its base weights too
    for a LoRA policy (a state written before ``_stored`` holds the tied head) and the adapters under
    peft's names."""
    from flowrl.errors import FlowrlError
    from flowrl.models.lora import adapter_shapes
    from flowrl.models.causal_lm import as_module
    from flowrl.models.registry import meta_model

    names = {f"model.{n}" for n in trainer.model.state_dict()}
    try:
        names |= {f"model.{n}" for n in as_module(meta_model(trainer.node.model)).state_dict()}
        if trainer.lora:
            names |= {f"model.{n.removesuffix('.weight')}.default.weight" for n in adapter_shapes(trainer.node.model)}
    except FlowrlError:  # no description to build (a test's bare trainer): this rank's names only
        pass
    return names


def check_complete(path: str | Path) -> ShardedStateInfo:
    """The info of a whole sharded state whose every shard file is there (``CheckpointWriter.commit``
    checks it before a checkpoint is committed).

    Raises:
        CheckpointError: incomplete, or missing a rank's shard file (naming the fix).
    """
    return read_info(Path(path))[0]


def check_sharded(path: str | Path, trainer: Any) -> ShardedStateInfo:
    """Refuse, before any work, a sharded state that ``trainer`` cannot load on its dp size.

    Any dp size reads any other's (DCP reshards); what cannot be resharded is a state that is
    incomplete, lacks a rank's shard file, or was saved from another model.

    Raises:
        CheckpointError: naming the checkpoint, what differs and the fix.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(
            f"sharded checkpoint {str(path)!r} does not exist on this rank's host; every rank of a sharded policy reads "
            "its shards there, so on several hosts --checkpoint-dir must be a directory every rank sees (a shared filesystem)"
        )
    info, metadata = read_info(path)
    saved = _plain({"family": "builtin", **info.model_config})
    mine = _plain(msgspec.to_builtins(trainer.node.model))
    if saved != mine:
        diff = {k: (saved.get(k), v) for k, v in mine.items() if saved.get(k) != v}
        raise CheckpointError(
            f"policy {trainer.name!r}: sharded checkpoint {str(path)!r} holds a model with a different config (saved, now): {diff}; "
            "resume with the model description that wrote it (or export it with flowrl export and start a new run from that directory)"
        )
    have = {k: tuple(v.size) for k, v in metadata.state_dict_metadata.items() if k.startswith("model.") and hasattr(v, "size")}
    want = _expected(trainer)
    wrong = sorted(k for k in want if have.get(k) != want[k])
    extra = sorted(set(have) - set(want) - _whole(trainer))  # another rank's (a pipeline stage's), or a LoRA state's tied head
    if wrong or extra:
        shown = {k.removeprefix("model."): (have.get(k), want[k]) for k in wrong[:3]}
        more = f" and {len(wrong) - 3} more" if len(wrong) > 3 else ""
        lacks = f"; tensors this model lacks: {[k.removeprefix('model.') for k in extra[:3]]}" if extra else ""
        raise CheckpointError(
            f"policy {trainer.name!r}: sharded checkpoint {str(path)!r} ({layout_name(info)}) cannot be resharded into this policy: "
            f"tensors (saved shape, now) {shown}{more}{lacks}; resume with the model that wrote it"
        )
    return info


def load_sharded(trainer: Any, path: str | Path, *, group: Any) -> None:
    """Load a sharded state, whatever layout wrote it, into ``trainer`` split over ``group`` in its own
    (any dp size; tensor- or pipeline-parallel: ``trainer.model`` under the whole model's names). Every
    rank calls it; each reads only the parts of the saved chunks it holds.

    Raises:
        CheckpointError: see ``check_sharded``, before any tensor is read; on every rank, when any
            rank's check fails (one all-reduce of a flag first: a rank whose host lacks the
            checkpoint must not leave the others waiting in DCP's collectives).
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    try:
        info, error = check_sharded(path, trainer), None
    except CheckpointError as exc:
        info, error = None, exc
    failed = torch.tensor([0.0 if error is None else 1.0], device=next(trainer.model.parameters()).device)
    dist.all_reduce(failed, group=group)  # how many of the policy's ranks cannot load it
    if error is not None:
        raise error
    if info is None or float(failed) > 0:
        raise CheckpointError(
            f"policy {trainer.name!r}: {int(failed)} other rank(s) of the policy cannot load sharded checkpoint {str(path)!r} "
            "(their errors say why; a folder on one host only: --checkpoint-dir must be a directory every rank sees)"
        )
    options = _options(trainer)
    model, optimizer = get_state_dict(trainer.model, trainer.optimizer, options=options)  # this rank's shards, to load into
    state = {"model": _stored(trainer, model), "optimizer": optimizer}
    groups = cast(list[dict[str, Any]], optimizer.get("param_groups", []))  # torch types every entry as a union of all values
    own = [list(g["params"]) for g in groups]
    _collective("loading the sharded checkpoint", Path(path), lambda: dcp.load(state, storage_reader=storage_reader(Path(path)), process_group=group))
    for loaded, names in zip(state["optimizer"].get("param_groups", []), own):  # the saved groups name the whole model's (_whole_groups)
        loaded["params"] = names
    set_state_dict(trainer.model, trainer.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"], options=options)
    trainer.version = info.version
    if info.version == 0:  # saved before the first step: AdamW had no state (save_sharded), and has none now
        trainer.optimizer.state.clear()


# -- reading: the whole state in one process -------------------------------------------------------------
def _set_path(root: dict[str, Any], keys: tuple[Any, ...], value: Any) -> None:
    """``root[k0][k1]... = value``, making dicts, and lists where the next key is an int."""
    node: Any = root
    for key, after in zip(keys[:-1], keys[1:]):
        if isinstance(node, list):
            while len(node) <= key:
                node.append(None)
        fresh: Any = [] if isinstance(after, int) else {}
        if (node[key] if isinstance(node, list) else node.get(key)) is None:
            node[key] = fresh
        node = node[key]
    if isinstance(node, list):
        while len(node) <= keys[-1]:
            node.append(None)
    node[keys[-1]] = value


def _consolidated(path: Path, *, parts: tuple[str, ...] = ("model", "optimizer")) -> dict[str, Any]:
    """Every tensor of a sharded state whole, in its saved structure (``{"model": ..., "optimizer": ...}``),
    of the top-level ``parts`` only (the others are not read)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_metadata(path)
    state: dict[str, Any] = {}
    for key, meta in metadata.state_dict_metadata.items():
        keys = tuple(metadata.planner_data.get(key, (key,)))
        if keys[0] not in parts:
            continue
        value = torch.empty(meta.size, dtype=meta.properties.dtype) if isinstance(meta, TensorStorageMetadata) else None
        _set_path(state, keys, value)
    with warnings.catch_warnings():  # DCP warns that no process group is in use: that is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, storage_reader=storage_reader(path), no_dist=True)
    return state


def _one_file_optimizer(saved: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """``get_state_dict``'s optimizer state (by parameter name) as ``optimizer.state_dict()`` (by index:
    the parameters in their groups' order, as torch numbers them)."""
    groups = [dict(g) for g in saved.get("param_groups", [])]
    index: dict[str, int] = {}
    for group in groups:
        names = list(group["params"])
        group["params"] = [index.setdefault(n, len(index)) for n in names]
    state = dict(saved.get("state", {}))
    unnamed = sorted(set(state) - set(index))
    if unnamed:
        raise CheckpointError(
            f"sharded checkpoint {str(path)!r} holds optimizer state for {unnamed[:3]} ({len(unnamed)} parameters) that its "
            "param_groups do not list: its writer saved one rank's groups only (save_sharded writes the whole model's); "
            "it cannot be read as one optimizer"
        )
    return {"state": {index[name]: dict(entry) for name, entry in state.items()}, "param_groups": groups}


def read_state(path: str | Path, *, optimizer: bool = True) -> dict[str, Any]:
    """A policy state in the one-file format (``Trainer.state()``), from a ``.pt`` file or a sharded
    directory of any layout (consolidated here, in this process, with no process group; it holds the
    whole state). ``optimizer=False``: without the ``optimizer`` entry, whose tensors are then not read
    (an export needs the weights only: AdamW's moments are twice their size).

    Raises:
        CheckpointError: an incomplete sharded state, one missing a shard file or with one cut short, or
            one whose optimizer state its param groups do not name (any error reading a file propagates
            as torch raises it).
    """
    from flowrl.models.lora import adapter_name, is_adapter

    p = Path(path)
    if not p.is_dir():
        if optimizer:
            return torch.load(p, map_location="cpu", weights_only=True)
        state = torch.load(p, map_location="cpu", weights_only=True, mmap=True)  # mapped: the optimizer's tensors are never read
        if isinstance(state, dict):
            state.pop("optimizer", None)
        return state
    info, _ = read_info(p)
    saved = _consolidated(p, parts=("model", "optimizer") if optimizer else ("model",))
    model = dict(saved.get("model", {}))
    if info.lora:  # the one-file format names a LoRA policy's adapters as adapter_weights does; a frozen
        model = {adapter_name(n): t for n, t in model.items() if is_adapter(n)}  # base weight (the tied head, before _stored) is the description's
    state = {"version": info.version, "model_config": _model_config(info.model_config), "model": model}
    if optimizer:
        state["optimizer"] = _one_file_optimizer(saved.get("optimizer", {}), p)
        if info.version == 0:  # saved before the first step: AdamW had no state (see save_sharded)
            state["optimizer"]["state"] = {}
    return state
