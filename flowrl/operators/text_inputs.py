"""What a text scorer sees: decoded prompts and completions, and each sample's prompt row fields.

A scorer with ``inputs="text"`` calls ``fn(prompt: str, completion: str, **fields) -> float`` (or the
batched form with lists). ``TextInputs`` builds those arguments from the rollout alone: no strings
cross the data plane. Sample ``i`` answers prompt ``group_ids[i]`` of the batch, which sits at
stream position ``prompt_index[group_ids[i]]``; the scorer opens the same stream as its upstream
source (``flowrl.data.wiring.open_source_stream``), so the position names the same file row, whose
fields (all but the prompt) are the keyword arguments.

Text: the prompt is its tokens decoded without special tokens; the completion is cut before its
first stop token (the generator's ``stop_tokens``, else the tokenizer's end token) and decoded
without special tokens. A task source (no file) decodes with the built-in tokenizer and has no fields.

``fn`` receives the fields its signature names (all of them if it takes ``**fields``). A required
parameter that the rows lack is an error when the scorer is built, naming the field and the fields
present.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import Tensor

from flowrl.errors import ConfigError
from flowrl.graph.ir import Graph
from flowrl.graph.nodes import GeneratorNode
from flowrl.graph.scorer_forms import TRL_KEYWORDS, is_trl_form
from flowrl.models.families.builtin.tokenizer import DEFAULT_TOKENIZER

__all__ = ["TextInputs", "wanted_fields"]


def wanted_fields(fn: Callable[..., Any], present: Sequence[str], *, owner: str) -> tuple[tuple[str, ...] | None, list[str]]:
    """Which row fields to pass to ``fn``, and which of them it requires.

    ``fn``'s first two parameters are the prompt and the completion; every other parameter names a field.
    In TRL's form (``fn(completions, **kwargs)``: ``flowrl.graph.scorer_forms``) every parameter but
    TRL's own keywords (``prompts``, ``completions``, ``completion_ids``) names a field.

    Returns:
        (the fields to pass, None meaning all of them because ``fn`` takes ``**fields``; the
        fields ``fn`` cannot do without).

    Raises:
        ConfigError: when ``fn`` requires a field that is not in ``present``.
    """
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None, []  # a builtin without a signature: give it everything
    rest = [p for p in params if p.kind is not p.VAR_POSITIONAL]
    rest = [p for p in rest if p.name not in TRL_KEYWORDS] if is_trl_form(fn) else rest[2:]
    named = [p for p in rest if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    required = [p.name for p in named if p.default is p.empty]
    missing = [name for name in required if name not in present]
    if missing:
        raise ConfigError(
            f"{owner} asks for row field(s) {missing}, which the prompt rows lack; the fields present are "
            f"{sorted(present)}: add the field to the data file, give the parameter a default, or rename it"
        )
    if any(p.kind is p.VAR_KEYWORD for p in rest):
        return None, required
    return tuple(p.name for p in named if p.name in present), required


class _BuiltinDecoder:
    """The built-in tokenizer behind the ``transformers`` calls TextInputs makes."""

    eos_token_id = DEFAULT_TOKENIZER.eos_id
    _special = {DEFAULT_TOKENIZER.pad_id, DEFAULT_TOKENIZER.bos_id, DEFAULT_TOKENIZER.eos_id}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return DEFAULT_TOKENIZER.decode([i for i in ids if not (skip_special_tokens and i in self._special)])


class TextInputs:
    """Decodes a scorer's rollout into text and row fields (see the module docstring).

    Args:
        graph: the graph the scorer belongs to.
        scorer: the scorer's name.
    """

    def __init__(self, graph: Graph, scorer: str) -> None:
        from flowrl.data.wiring import open_source_stream, source_of

        self.owner = f"{graph.node(scorer).kind} {scorer!r}"
        source = source_of(graph, scorer)
        if source is None:
            raise ConfigError(f"{self.owner} reads text, but no source is upstream of it to decode its prompts with")
        self.stream = open_source_stream(graph, source.name, warn=False) if source.source.data else None
        self.tokenizer: Any = self.stream.tokenizer if self.stream is not None else _BuiltinDecoder()
        gens = [n for n in graph.producers(scorer) if isinstance(n, GeneratorNode)]
        stops = {int(t) for g in gens for t in g.sampling.stop_tokens}
        eos = getattr(self.tokenizer, "eos_token_id", None)
        self.stop_tokens: frozenset[int] = frozenset(stops or ({int(eos)} if eos is not None else set()))
        self.field_names: list[str] = self.stream.dataset.field_names if self.stream is not None else []

    def fields_for(self, fn: Callable[..., Any]) -> tuple[str, ...] | None:
        """The fields ``fn`` gets (None: all), after checking every served row has those it requires.

        Raises:
            ConfigError: for a required field absent from the rows or from some of them.
        """
        names, required = wanted_fields(fn, self.field_names, owner=self.owner)
        if self.stream is not None:
            kept = set(self.stream.encoded.rows)
            for name in required:
                lacking = [r for r in self.stream.dataset.rows_lacking(name) if r in kept]
                if lacking:
                    raise ConfigError(
                        f"{self.owner} asks for row field {name!r}, which {len(lacking)} row(s) of {self.stream.dataset.origin!r} "
                        f"lack (first: row {lacking[0]}); add it to every row or give the parameter a default"
                    )
        return names

    def completion_cut(self, ids: Sequence[int]) -> list[int]:
        """``ids`` cut before the first stop token."""
        cut = next((i for i, t in enumerate(ids) if t in self.stop_tokens), len(ids))
        return list(ids[:cut])

    def completion_text(self, ids: Sequence[int]) -> str:
        """``ids`` cut before the first stop token, decoded without special tokens."""
        return self.tokenizer.decode(self.completion_cut(ids), skip_special_tokens=True)

    def prompt_text(self, ids: Sequence[int]) -> str:
        """The prompt's tokens decoded without special tokens."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def prompt_messages(self, rollout: Mapping[str, Tensor]) -> list[list[dict[str, Any]]] | None:
        """Each sample's prompt as the chat messages its row holds, or None when the rows' prompts are
        text (or there is no prompt file): what TRL passes a reward function as ``prompts`` for a
        conversational dataset."""
        if self.stream is None:
            return None
        index, groups = rollout["prompt_index"].tolist(), rollout["group_ids"].tolist()
        field = self.stream.dataset.prompt_field
        prompts = [self.stream.dataset.rows[self.stream.row_of(int(index[g]))][field] for g in groups]
        return prompts if prompts and all(isinstance(p, list) for p in prompts) else None

    def rows(self, rollout: Mapping[str, Tensor], names: tuple[str, ...] | None) -> list[dict[str, Any]]:
        """Each sample's row fields (only ``names``, or all when None)."""
        if self.stream is None:
            return [{} for _ in range(int(rollout["completion_ids"].shape[0]))]
        index, groups = rollout["prompt_index"].tolist(), rollout["group_ids"].tolist()
        out = []
        for g in groups:
            fields = self.stream.fields(int(index[g]))
            out.append(fields if names is None else {k: fields[k] for k in names if k in fields})
        return out
