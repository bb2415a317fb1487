"""The long-tail bench on the vLLM engine (``benches/longtail_generation.py --engine vllm``): lock step
against continuous batching with in-flight weight updates, interleaved in one run on one vLLM engine.

The model is a built-in transformer with head size 32 (vLLM's CPU kernels take no smaller), fitted to
the task by ``longtail_generation.fit_to_task``, exported as a Hugging Face directory
(``flowrl.models.hf_export.export_hf``, Llama) and served by one ``VLLMGenerator``:

- lock step: ``VLLMGenerator.generate`` on batches of ``slots`` rows (``slots / n`` prompts), one
  after the other, and a weight update between batches (vLLM batches inside a call; a batch lasts as
  long as its longest completion);
- continuous: one ``VLLMSlotBatcher`` (``flowrl.operators.engines.vllm_stream``) with ``slots``
  requests in vLLM; a weight update each time another ``slots`` samples have finished (as many as
  lock step makes), landing while requests run: they stop, the weights load, and they continue with
  their kept tokens re-submitted (KV recomputed).

Each update loads the fitted weights again under a new version (same values, so both modes draw
from the same law; the cost of the update is paid in full: file or process-group push, reload,
prefix-cache reset). A third mode, ``continuous_no_updates``, streams the same way without them: the
price of the in-flight updates. Utilisation is tokens / (engine steps * slots); lock step's engine steps are
its batches' longest completions.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import torch

from flowrl.graph.configs import HFModelConfig, ModelConfig, SamplingConfig
from flowrl.graph.nodes import GeneratorNode
from flowrl.operators.generation import Generator, _mix
from flowrl.operators.slots import Sample

__all__ = ["VLLM_MODEL", "run_vllm"]

#: The bench's tiny model with 4 heads of 32 (the ``tiny`` one has heads of 16, which vLLM's CPU kernels lack).
VLLM_MODEL = ModelConfig(vocab_size=16, dim=128, n_layers=2, n_heads=4, n_kv_heads=4, max_seq_len=40)


def _exported(gen: Generator, directory: Path) -> Path:
    from flowrl.models.hf_export import export_hf

    state = {"model_config": msgspec.to_builtins(VLLM_MODEL), "model": {k: v.detach().clone() for k, v in gen.model.state_dict().items()}}
    return export_hf(state, directory)


def lockstep(gen: Any, weights: dict, prompts: list[list[int]], slots: int) -> dict:
    """``longtail_generation.lockstep`` on vLLM, with a weight update between batches."""
    from longtail_generation import lockstep as batches

    return batches(gen, prompts, slots, between=lambda: gen.load_weights(weights, gen.version + 1))


def continuous(gen: Any, weights: dict, prompts: list[list[int]], slots: int, *, updates_in_flight: bool = True) -> dict:
    from flowrl.operators.engines.vllm_stream import VLLMSlotBatcher

    n = gen.sampling.n_samples
    batcher = VLLMSlotBatcher(gen, slots=slots, rng=torch.Generator().manual_seed(_mix(gen.seed, 0, 0)))
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        for j in range(n):
            batcher.add(Sample(key=(i, j), prompt=p))
    lengths, versions, updates, update_s = [], [], 0, 0.0
    try:
        while batcher.busy or batcher.waiting:
            for s in batcher.step():
                lengths.append(len(s.tokens))
                versions.append(len(set(s.versions)))
                if updates_in_flight and len(lengths) % slots == 0 and (batcher.busy or batcher.waiting):
                    t0 = time.perf_counter()
                    gen.load_weights(weights, gen.version + 1)  # in flight: running requests stop and continue
                    update_s += time.perf_counter() - t0
                    updates += 1
    finally:
        batcher.close()
    wall = time.perf_counter() - start
    tokens = sum(lengths)
    return {"seconds": wall, "tokens": tokens, "decode_steps": batcher.steps, "utilisation": sum(lengths) / (batcher.steps * slots),
            "lengths": lengths, "updates": updates, "update_s": update_s, "interrupts": batcher.interrupts, "resubmitted": batcher.resubmitted,
            "samples_spanning_versions": sum(v > 1 for v in versions)}


def _law(lengths: list[int]) -> dict:
    ordered = sorted(lengths)
    return {"mean": round(statistics.fmean(ordered), 2), "p90": ordered[int(0.9 * (len(ordered) - 1))], "max": ordered[-1]}


def run_vllm(args: Any, task: Any, fit_to_task: Any, max_new: int) -> dict:
    """Fit, export, start vLLM, run both modes ``args.repeats`` times interleaved; the JSON figures."""
    from flowrl.models.causal_lm import weight_dict
    from flowrl.models.registry import build_model
    from flowrl.operators.engines.vllm_engine import VLLMGenerator

    sampling = SamplingConfig(n_samples=args.n, max_new_tokens=max_new)
    fitted = Generator(GeneratorNode(name="gen", model=VLLM_MODEL, sampling=sampling), seed=args.seed)
    fit_start = time.perf_counter()
    fit_loss = fit_to_task(fitted, task, steps=args.fit_steps, batch=64, seed=args.seed)
    fit_s = time.perf_counter() - fit_start
    with tempfile.TemporaryDirectory(prefix="flowrl-longtail-vllm-") as tmp:
        directory = _exported(fitted, Path(tmp) / "model")
        config = HFModelConfig(path=str(directory))
        weights = weight_dict(build_model(config))  # Hugging Face names, as a policy publishes them
        node = GeneratorNode(name="gen", model=config, engine="vllm",
                             sampling=msgspec.structs.replace(sampling, batching="continuous", slots=args.slots))
        start = time.perf_counter()
        gen = VLLMGenerator(node, seed=args.seed)
        start_s = time.perf_counter() - start
        prompts = [task.prompt(i) for i in range(args.prompts)]
        runs: dict[str, list[dict]] = {"lockstep": [], "continuous": [], "continuous_no_updates": []}
        modes = (("lockstep", lockstep), ("continuous", continuous),
                 ("continuous_no_updates", lambda *a: continuous(*a, updates_in_flight=False)))
        try:
            lockstep(gen, weights, prompts[: args.slots // args.n], args.slots)  # warm-up
            for r in range(args.repeats):
                for mode, fn in modes:
                    runs[mode].append(fn(gen, weights, prompts, args.slots))
                    x = runs[mode][-1]
                    print(f"[{r}] vllm {mode:21s} {x['tokens'] / x['seconds']:8.0f} tok/s, utilisation {x['utilisation']:.2f}",
                          file=sys.stderr, flush=True)
        finally:
            gen.close()

    def summary(mode: str) -> dict:
        rs = runs[mode]
        rates = [x["tokens"] / x["seconds"] for x in rs]
        out = {"tokens_per_s": {"min": round(min(rates), 1), "max": round(max(rates), 1)},
               "slot_utilisation": {"min": round(min(x["utilisation"] for x in rs), 3), "max": round(max(x["utilisation"] for x in rs), 3)},
               "decode_steps": rs[0]["decode_steps"], "tokens": rs[0]["tokens"], "weight_updates": rs[0]["updates"],
               "seconds": {"min": round(min(x["seconds"] for x in rs), 2), "max": round(max(x["seconds"] for x in rs), 2)},
               "update_seconds": {"min": round(min(x["update_s"] for x in rs), 2), "max": round(max(x["update_s"] for x in rs), 2)},
               "lengths": _law(rs[0]["lengths"])}
        for key in ("interrupts", "resubmitted", "samples_spanning_versions"):
            if key in rs[0]:
                out[key] = rs[0][key]
        return out

    ratios = [c["tokens"] / c["seconds"] / (lk["tokens"] / lk["seconds"]) for lk, c in zip(runs["lockstep"], runs["continuous"])]
    lock, cont = summary("lockstep"), summary("continuous")
    static = [c["tokens"] / c["seconds"] / (lk["tokens"] / lk["seconds"]) for lk, c in zip(runs["lockstep"], runs["continuous_no_updates"])]
    return {
        "bench": "generation-longtail-vllm",
        "model": VLLM_MODEL.short(),
        "vllm_start_s": round(start_s, 1),
        "weights_by": gen.weights_by,
        "fit": {"steps": args.fit_steps, "final_loss_per_token": round(fit_loss, 3), "seconds": round(fit_s, 1)},
        "lockstep": lock,
        "continuous": cont,
        "continuous_no_updates": summary("continuous_no_updates"),
        "speedup_tokens_per_s": {"min": round(min(ratios), 2), "max": round(max(ratios), 2)},
        "speedup_no_updates_tokens_per_s": {"min": round(min(static), 2), "max": round(max(static), 2)},
    }
