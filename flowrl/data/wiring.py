"""Where a graph's data source finds its tokenizer and length limit, and how any node opens its stream.

A data source (``SourceConfig.data``) encodes prompts with ``SourceConfig.tokenizer`` or, when that
is empty, with the tokenizer of the Hugging Face model of a generator it feeds; its length limit is
``max_prompt_len`` or else the generator model's ``max_seq_len - max_new_tokens`` (the smallest over
the generators it feeds). A text scorer opens the same stream as its upstream source, so both map
a stream position to the same row.

Example:
    >>> from flowrl.examples import build_example
    >>> graph = build_example("llamarl")
    >>> source_of(graph, "reward").name, default_max_prompt_len(graph, "prompts")
    ('prompts', 27)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowrl.errors import ConfigError
from flowrl.graph.configs import HFModelConfig, ModelConfig
from flowrl.graph.nodes import GeneratorNode, SourceNode
from flowrl.graph.structure import generators_fed_by, tokenizer_path

if TYPE_CHECKING:
    from flowrl.data.stream import PromptStream
    from flowrl.graph.ir import Graph

__all__ = ["source_of", "generators_fed_by", "tokenizer_path", "default_max_prompt_len", "open_source_stream", "row_of"]


def source_of(graph: Graph, name: str) -> SourceNode | None:
    """The source node upstream of node ``name`` (itself if it is one), following data edges back."""
    seen, todo = set(), [name]
    while todo:
        current = todo.pop(0)
        if current in seen:
            continue
        seen.add(current)
        node = graph.node(current)
        if isinstance(node, SourceNode):
            return node
        todo.extend(p.name for p in graph.producers(current))
    return None


def _max_seq_len(model: Any) -> int:
    """The model's longest sequence, or 0 when it cannot be known without its files."""
    if isinstance(model, ModelConfig):
        return model.max_seq_len
    if isinstance(model, HFModelConfig):
        if model.max_seq_len:
            return model.max_seq_len
        try:
            config = json.loads((Path(model.path).expanduser() / "config.json").read_text())
        except (OSError, ValueError):
            return 0
        return int(config.get("max_position_embeddings") or 0)
    return 0


def default_max_prompt_len(graph: Graph, source: str) -> int:
    """``max_prompt_len`` of source ``source``, or the smallest ``max_seq_len - max_new_tokens`` of
    the generators it feeds (0: no limit known).

    Raises:
        ConfigError: when a generator's ``max_new_tokens`` leaves no room for a prompt.
    """
    node = graph.node_of(source, SourceNode)
    if node.source.max_prompt_len:
        return node.source.max_prompt_len
    limits = []
    for gen in generators_fed_by(graph, source):
        seq = _max_seq_len(gen.model)
        if seq:
            room = seq - gen.sampling.max_new_tokens
            if room < 1:
                raise ConfigError(
                    f"generator {gen.name!r}: max_new_tokens={gen.sampling.max_new_tokens} leaves no room for a prompt in "
                    f"max_seq_len={seq}; lower max_new_tokens"
                )
            limits.append(room)
    return min(limits, default=0)


def open_source_stream(graph: Graph, source: str, *, warn: bool = True) -> PromptStream:
    """The prompt stream of data source ``source``: its file, encoded with its tokenizer and limit.

    Raises:
        ConfigError: for a source without ``data``, a missing tokenizer, ``chat_template=True``
            with a tokenizer without one, a tokenizer larger than a built-in model's vocabulary,
            or any problem with the file (``flowrl.data``).
    """
    from flowrl.data.stream import PromptStream
    from flowrl.models.tokenizer import check_chat_template, check_vocab, load_tokenizer

    node = graph.node_of(source, SourceNode)
    cfg, owner = node.source, f"source {source!r}"
    if not cfg.data:
        raise ConfigError(f"{owner} reads task {cfg.task!r}, not a prompt file")
    path = tokenizer_path(graph, source)
    if not path:
        raise ConfigError(
            f"{owner} reads {cfg.data!r} but names no tokenizer; set tokenizer=DIR (a local tokenizer directory) "
            "or feed it to a generator with a Hugging Face model"
        )
    tok = load_tokenizer(path, owner=f"{owner}'s tokenizer")
    if cfg.chat_template:
        check_chat_template(tok, owner=owner)
    for gen in generators_fed_by(graph, source):
        if isinstance(gen.model, ModelConfig):
            check_vocab(tok, gen.model.vocab_size, owner=f"{owner} -> generator {gen.name!r}")
    return PromptStream.open(
        path=cfg.data,
        tokenizer=tok,
        prompt_field=cfg.prompt_field,
        chat_template=cfg.chat_template,
        max_prompt_len=default_max_prompt_len(graph, source),
        overlong=cfg.overlong,
        seed=cfg.seed,
        shuffle=cfg.shuffle,
        owner=owner,
        warn=warn,
    )


def row_of(graph: Graph, source: str, position: int) -> int:
    """The file row (0-based, file order) that data source ``source`` served at stream ``position``:
    what a metrics row's ``prompt_index`` entry names. Opens (reads and encodes) the file."""
    return open_source_stream(graph, source, warn=False).row_of(position)
