"""A pipeline-parallel policy's checkpoint: each stage writes its own parameters and AdamW state, keyed by
the whole model's names, in the sharded format (``flowrl.runtime.checkpointing.sharded_state``).

``save_stages`` writes, with torch.distributed.checkpoint over the policy's ranks, the state
``get_state_dict`` gives an FSDP2 policy (``{"model": {name: tensor}, "optimizer": {"state": {name:
{"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [...]}}``: the model's ``state_dict`` names, AdamW's
state by parameter name, a tied head's under its embedding's), each stage its own tensors: the
``policy-<node>.dcp`` directory is the same format whoever wrote it. A stage's dp ranks and a tied head's
two copies (first and last stage) hold equal tensors under one name, which DCP writes once. Every stage
writes the same ``param_groups`` (the whole model's trainable names, in its parameter order), so
``read_state`` consolidates it into the one-file format in one process (``flowrl export``, a one-process
resume), and an FSDP2 policy (``load_sharded``) reads it on any dp size.

``load_stages`` reads, on any pp x dp layout, a sharded state (a pipeline's, an FSDP2 policy's) or a
one-file state (a process's or a replicated policy's ``Trainer.state()``, memory-mapped): each rank
takes its stage's tensors by name. The controller sends ``save`` and ``load`` to every rank of the
policy (``saves_on_every_rank``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import torch

from flowrl.errors import CheckpointError

__all__ = ["save_stages", "snapshot_stages", "load_stages", "stage_state"]


def stage_state(trainer: Any, whole: list[str], *, optimizer: bool = True) -> dict[str, Any]:
    """``trainer``'s stage state by the whole model's names (the tensors themselves, no copy).

    Args:
        trainer: a ``PipelineTrainer``.
        whole: the whole model's trainable parameter names, in its parameter order (``param_groups``).
        optimizer: with AdamW's state (else its param groups only).
    """
    names = trainer.stage.names
    model = dict(trainer.model.state_dict())  # the whole model's state_dict names (a tied head's too, as it lists it)
    state: dict[str, Any] = {}
    if optimizer:
        for local, p in trainer.model.named_parameters():
            entry = trainer.optimizer.state.get(p)
            if entry:
                state[names[local]] = dict(entry)
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(whole)} for g in trainer.optimizer.param_groups]
    return {"model": model, "optimizer": {"state": state, "param_groups": groups} if state else {"param_groups": groups}}


def save_stages(trainer: Any, whole: list[str], path: str | Path, *, group: Any) -> None:
    """Write every stage's state at ``path`` (every rank of the policy's ``group`` calls it); the group's
    first rank writes the info last (``sharded_state.written``).

    Raises:
        CheckpointError: on every rank when one failed (``sharded_state._collective``).
    """
    snapshot_stages(trainer, whole, path, group=group, background=False)()


def snapshot_stages(trainer: Any, whole: list[str], path: str | Path, *, group: Any, background: bool = True, buffers: dict[Any, Any] | None = None) -> Any:
    """``save_stages`` in two parts: the stages' state staged now into ``buffers``, the write returned
    (``sharded_state.dcp_write``)."""
    import torch.distributed as dist

    from flowrl.runtime.checkpointing.sharded_state import ShardedStateInfo, dcp_write

    state = stage_state(trainer, whole, optimizer=trainer.version > 0)  # before the first step AdamW has no state
    info = ShardedStateInfo(version=trainer.version, model_config=msgspec.to_builtins(trainer.node.model), dp=dist.get_world_size(group))
    return dcp_write("saving the pipeline stages' checkpoint", state, Path(path), group=group, background=background, info=info, buffers=buffers)


def _check_config(trainer: Any, saved: Any, path: Path) -> None:
    from flowrl.runtime.checkpointing.sharded_state import _plain

    if saved is None:
        return
    saved = _plain({"family": "builtin", **dict(saved)})
    mine = _plain(msgspec.to_builtins(trainer.node.model))
    if saved != mine:
        diff = {k: (saved.get(k), v) for k, v in mine.items() if saved.get(k) != v}
        raise CheckpointError(
            f"policy {trainer.name!r}: checkpoint {str(path)!r} holds a model with a different config (saved, now): {diff}; "
            "resume with the model description that wrote it"
        )


def load_stages(trainer: Any, whole: list[str], path: str | Path, *, group: Any) -> None:
    """Load a sharded or one-file policy state into ``trainer``'s stage (every rank of ``group`` calls it).

    Raises:
        CheckpointError: an incomplete sharded state, one missing a shard file, another model's state,
            or a state lacking this stage's tensors (naming them).
    """
    path = Path(path)
    if path.is_dir():
        version, model, moments = _read_sharded(trainer, whole, path, group)
    else:
        version, model, moments = _read_file(trainer, whole, path)
    names = trainer.stage.names
    with torch.no_grad():
        for local, t in trainer.model.state_dict(keep_vars=True).items():
            t.copy_(model[local] if local in model else model[names[local]])  # a tied head under its own name, or its embedding's
    state = trainer.optimizer.state_dict()
    params = [names[local] for local, p in trainer.model.named_parameters() if p.requires_grad]
    state["state"] = {i: moments[n] for i, n in enumerate(params) if n in moments}
    trainer.optimizer.load_state_dict(state)
    if not moments:  # saved before the first step: AdamW starts afresh
        trainer.optimizer.state.clear()
    trainer.version = version


def _read_file(trainer: Any, whole: list[str], path: Path) -> tuple[int, dict[str, Any], dict[str, Any]]:
    state = torch.load(path, weights_only=True, map_location="cpu", mmap=True)
    missing = [k for k in ("version", "model", "optimizer") if k not in state]
    if missing:
        raise CheckpointError(f"policy {trainer.name!r}: checkpoint {str(path)!r} lacks {missing}")
    _check_config(trainer, state.get("model_config"), path)
    _require(trainer, state["model"], path)
    by_index = state["optimizer"].get("state", {})
    moments = {whole[i]: dict(entry) for i, entry in by_index.items()}  # the one-file format numbers the whole model's parameters
    return int(state["version"]), state["model"], moments


def _require(trainer: Any, model: dict[str, Any], path: Path) -> None:
    wanted = sorted(local for local, name in trainer.stage.names.items() if local not in model and name not in model)
    if wanted:
        raise CheckpointError(f"policy {trainer.name!r}: checkpoint {str(path)!r} lacks this stage's tensors {wanted[:3]}; resume with the model that wrote it")


def _read_sharded(trainer: Any, whole: list[str], path: Path, group: Any) -> tuple[int, dict[str, Any], dict[str, Any]]:
    import torch.distributed.checkpoint as dcp

    from flowrl.runtime.checkpointing.sharded_index import read_info, storage_reader
    from flowrl.runtime.checkpointing.sharded_state import _collective

    info, metadata = read_info(path)
    _check_config(trainer, info.model_config, path)
    keys = set(metadata.state_dict_metadata)
    names = trainer.stage.names
    saved = {k.removeprefix("model.") for k in keys if k.startswith("model.")}
    _require(trainer, {k: None for k in saved}, path)
    model = {(k if k in saved else names[k]): torch.empty_like(v, device="cpu") for k, v in trainer.model.state_dict().items()}
    moments: dict[str, dict[str, torch.Tensor]] = {}
    for local, p in trainer.model.named_parameters():
        name = names[local]
        if f"optimizer.state.{name}.exp_avg" in keys:
            moments[name] = {"step": torch.zeros(()), "exp_avg": torch.empty_like(p, device="cpu"), "exp_avg_sq": torch.empty_like(p, device="cpu")}
    state: dict[str, Any] = {"model": model, "optimizer": {"state": moments}} if moments else {"model": model}
    _collective("loading the pipeline stages' checkpoint", path, lambda: dcp.load(state, storage_reader=storage_reader(path), process_group=group))
    return info.version, model, moments
