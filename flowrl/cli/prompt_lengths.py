"""The prompt length ``flowrl plan`` assumes for a graph whose source reads a prompt file.

The planner reads no files, so the command measures the file here: the source feeding the graph's
first generator is opened as a run opens it (``flowrl.data.wiring.open_source_stream``: its
tokenizer, chat template, length limit and epoch order), and the length assumed is the mean, over
the steps of one epoch, of each step's longest prompt (tokens)::

    prompt_len = round(mean over steps s of max(len(prompt_ids(p)) for p in batch s))

A step's prompts are left-padded to its longest (``operators.source.pad_left``) and the built-in
trainer pads each sequence to the longest of its micro-batch, so the longest prompt of a step is
what both encode. At most ``MAX_PROMPTS`` positions are read (the file is encoded whole on
opening, as a run does). Without a prompt file (a built-in task) nothing is measured; a file that
cannot be opened here (a graph may name a file on another machine, ``SourceConfig``) leaves the
upper bound in place, and the command says why.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flowrl.graph.ir import Graph

__all__ = ["MAX_PROMPTS", "prompt_len_from_file"]

#: Stream positions read at most (whole steps of them).
MAX_PROMPTS = 4096


def prompt_len_from_file(graph: Graph) -> tuple[int | None, str] | None:
    """``(prompt_len, where from)`` for the source feeding the first generator when it reads a
    prompt file, ``(None, why not)`` when that file cannot be read here (what a run would refuse:
    a missing file or tokenizer), else None.
    """
    from flowrl.data.wiring import open_source_stream
    from flowrl.errors import FlowrlError
    from flowrl.graph.nodes import GeneratorNode, SourceNode

    gens = graph.nodes_of(GeneratorNode)
    if not gens:
        return None
    sources = [p for p in graph.producers(gens[0].name) if isinstance(p, SourceNode) and p.source.data]
    if not sources:
        return None
    source = sources[0]
    try:
        stream = open_source_stream(graph, source.name, warn=False)
    except FlowrlError as exc:
        return None, f"the prompt file of source {source.name!r} was not read here ({exc}); the plan assumes the prompt length's upper bound"
    batch = max(1, source.source.batch_size)
    steps = max(1, min(len(stream), MAX_PROMPTS) // batch)
    longest = [max(len(stream.prompt_ids(s * batch + i)) for i in range(batch)) for s in range(steps)]
    tokens = max(1, round(sum(longest) / steps))
    where = (
        f"prompt file {source.source.data!r} (mean over {steps} steps of each step's longest prompt, "
        f"tokenised as source {source.name!r} will)"
    )
    return tokens, where
