"""Generation on the long-tail task: tokens per second and slot utilisation, continuous against lock-step batching.

Both modes run the same model (same weights), the same prompts and the same seed, ``--samples``
completions (``--prompts`` prompts of the ``longtail`` task, ``n`` samples each) through ``--slots``
rows at a time:

- lock step: ``Generator.generate`` on batches of ``slots`` rows, one batch after the other; a
  batch decodes until its longest completion stops;
- continuous: one ``SlotBatcher`` (``flowrl.operators.slots``) with ``slots`` rows, a freed row
  taking the next waiting sample at once.

Heavy-tailed lengths at measurement: an untrained model does not stop on the task's law (it rambles
to ``max_new_tokens`` or stops at random), so the model is first fitted to the task by teacher
forcing (cross-entropy on ``prompt -> answer</s>``, seeded, a few seconds): it then samples, with
the real engines and the real forward passes, completions whose lengths follow the task's
truncated Zipf law; the JSON reports their mean, 90th percentile and maximum next to the task's.
Utilisation is the share of row-steps that drew a real token: tokens / (decode steps * slots).
Tokens per second are given per wall second and per CPU second of this process (``--threads 1``):
on a shared machine the second is the steadier figure.

Prints one JSON object (``speedup_tokens_per_s`` = continuous / lock step, min and max over repeats).
``step_costs`` (one extra untimed run of each mode, after the repeats) splits each mode's time by
what a step does, in ms per run and per call: lock step's prefill and decode forward passes;
continuous batching's decode forward passes, staging prefills, splices (KV copy and masks) and
compactions (``flowrl.operators.slots``); ``rest`` is sampling, stop checks and bookkeeping.

    python benches/generation.py --longtail              # about a minute on a loaded 2-core machine
    python benches/generation.py --longtail --repeats 5 --model small
    python benches/longtail_generation.py --engine vllm --repeats 3   # the same on vLLM, in-flight updates (longtail_vllm.py)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from flowrl.graph.configs import ModelConfig, SamplingConfig
from flowrl.graph.nodes import GeneratorNode
from flowrl.operators.generation import Generator, _mix
from flowrl.operators.logprobs import completion_logprobs
from flowrl.operators.slots import Sample, SlotBatcher
from flowrl.operators.source import pad_left
from flowrl.operators.tasks import LongTailTask
from flowrl.models.families.builtin.tokenizer import DEFAULT_TOKENIZER as TOK

__all__ = ["main"]

MODELS = {
    "tiny": ModelConfig(vocab_size=16, dim=64, n_layers=2, n_heads=4, n_kv_heads=4, max_seq_len=40),  # the example's
    "small": ModelConfig(vocab_size=16, dim=256, n_layers=4, n_heads=8, n_kv_heads=2, max_seq_len=40),
}
MAX_NEW = 32


def fit_to_task(gen: Generator, task: LongTailTask, *, steps: int, batch: int, seed: int) -> float:
    """Teacher-force ``gen``'s model on the task's answers (prompts past the measured ones); the final loss per token."""
    torch.manual_seed(seed)
    model = gen.model
    params = list(model.parameters())
    for param in params:  # a generator's weights are inference-only; train them here, then freeze again
        param.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=3e-3)
    loss = torch.tensor(0.0)
    for step in range(steps):
        index = range(10**6 + step * batch, 10**6 + (step + 1) * batch)
        ids, lens = pad_left([task.prompt(i) for i in index], TOK.pad_id)
        answers, alens = pad_left([[*task.target(i), TOK.eos_id] for i in index], TOK.pad_id)
        C = answers.shape[1]
        completion = torch.stack([torch.cat([a[C - n :], a[: C - n]]) for a, n in zip(answers, alens.tolist())])  # right-padded
        mask = torch.arange(C)[None, :] < alens[:, None]
        logp = completion_logprobs(model, ids, lens, completion, mask)
        loss = -logp.sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    for param in params:
        param.requires_grad_(False)
    return float(loss.detach())


def lockstep(gen: Any, prompts: list[list[int]], slots: int, *, between: Callable[[], None] | None = None) -> dict:
    """Lock-step batches of ``slots // n_samples`` prompts; ``between``: called after each batch (a
    weight update, ``longtail_vllm``), its seconds and count reported as ``update_s`` and ``updates``."""
    n = gen.sampling.n_samples
    per_batch = slots // n
    start, cpu, tokens, steps, lengths, updates, update_s = time.perf_counter(), time.process_time(), 0, 0, [], 0, 0.0
    for first in range(0, len(prompts), per_batch):
        ids, lens = pad_left(prompts[first : first + per_batch], TOK.pad_id)
        out = gen.generate({"prompt_ids": ids, "prompt_lens": lens, "prompt_index": torch.arange(first, first + ids.shape[0])})
        got = out["completion_lens"]
        tokens += int(got.sum())
        steps += int(got.max())
        lengths += got.tolist()
        if between is not None:
            t0 = time.perf_counter()
            between()
            update_s += time.perf_counter() - t0
            updates += 1
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"seconds": wall, "cpu_seconds": cpu, "tokens": tokens, "decode_steps": steps, "utilisation": tokens / (steps * slots), "lengths": lengths,
            "updates": updates, "update_s": update_s}


def continuous(gen: Generator, prompts: list[list[int]], slots: int) -> dict:
    n = gen.sampling.n_samples
    batcher = SlotBatcher(gen, slots=slots, rng=torch.Generator().manual_seed(_mix(gen.seed, 0, 0)))
    start, cpu = time.perf_counter(), time.process_time()
    for i, p in enumerate(prompts):
        for j in range(n):
            batcher.add(Sample(key=(i, j), prompt=p))
    lengths = []
    while batcher.busy or batcher.waiting:
        lengths += [len(s.tokens) for s in batcher.step()]
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(lengths)
    return {"seconds": wall, "cpu_seconds": cpu, "tokens": tokens, "decode_steps": batcher.steps, "utilisation": batcher.busy_steps / (batcher.steps * slots),
            "lengths": lengths, "compactions": batcher.compactions, "prefills": batcher.prefills}


class _Clock:
    """Wall time and calls per label, from wrapped callables (``step_costs``)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, label: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - start
                self.calls[label] = self.calls.get(label, 0) + 1

        return timed

    def report(self, total: float) -> dict:
        out = {k: {"ms": round(1e3 * v, 2), "calls": self.calls[k], "ms_per_call": round(1e3 * v / self.calls[k], 3)} for k, v in self.seconds.items()}
        out["rest"] = {"ms": round(1e3 * (total - sum(self.seconds.values())), 2)}
        out["total_ms"] = round(1e3 * total, 2)
        return out


def step_costs(gen: Generator, prompts: list[list[int]], slots: int) -> dict:
    """One run of each mode with its step kinds timed (see the module docstring): ``{mode: {kind: ...}}``."""
    model, out = gen.model, {}
    clock = _Clock()
    forward = model.forward
    model.forward = lambda tokens, **kw: clock.wrap("prefill" if tokens.shape[1] > 1 else "decode", forward)(tokens, **kw)
    try:
        start = time.perf_counter()
        lockstep(gen, prompts, slots)
        out["lockstep"] = clock.report(time.perf_counter() - start)
    finally:
        del model.forward
    clock = _Clock()
    kinds = {"_decode": "decode", "_stage": "stage_prefill", "_place": "splice", "_prefill_all": "compaction"}
    originals = {name: getattr(SlotBatcher, name) for name in kinds}
    for name, label in kinds.items():
        setattr(SlotBatcher, name, clock.wrap(label, originals[name]))
    try:
        start = time.perf_counter()
        continuous(gen, prompts, slots)
        out["continuous"] = clock.report(time.perf_counter() - start)
    finally:
        for name, fn in originals.items():
            setattr(SlotBatcher, name, fn)
    return out


def _law(lengths: list[int]) -> dict:
    ordered = sorted(lengths)
    return {"mean": round(statistics.fmean(ordered), 2), "p90": ordered[int(0.9 * (len(ordered) - 1))], "max": ordered[-1]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", choices=sorted(MODELS))
    p.add_argument("--prompts", type=int, default=128, help="prompts of the longtail task measured")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--slots", type=int, default=32, help="rows decoded at once (lock step: its batch size in samples)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs of each mode (min and max reported)")
    p.add_argument("--fit-steps", type=int, default=150, help="teacher-forcing steps that give the model the task's lengths")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--engine", default="builtin", choices=("builtin", "vllm"),
                   help="vllm: lock step against continuous batching with in-flight weight updates on vLLM (benches/longtail_vllm.py)")
    args = p.parse_args()
    if args.slots % args.n:
        p.error(f"--slots {args.slots} must be a multiple of --n {args.n} (lock step batches whole prompts)")
    torch.set_num_threads(args.threads)
    task = LongTailTask(seed=args.seed)
    if args.engine == "vllm":
        # benches/ is on sys.path when a bench runs as a script
        import longtail_vllm

        result = longtail_vllm.run_vllm(args, task, fit_to_task, MAX_NEW)
        result.update(prompts=args.prompts, n_samples=args.n, slots=args.slots, repeats=args.repeats, seed=args.seed,
                      load_average=[round(x, 2) for x in os.getloadavg()], machine=platform.machine())
        print(json.dumps(result, indent=1))
        return
    node = GeneratorNode(name="gen", model=MODELS[args.model], sampling=SamplingConfig(n_samples=args.n, max_new_tokens=MAX_NEW))
    gen = Generator(node, seed=args.seed)
    fit_start = time.perf_counter()
    fit_loss = fit_to_task(gen, task, steps=args.fit_steps, batch=64, seed=args.seed)
    fit_s = time.perf_counter() - fit_start
    gen.model.eval()
    prompts = [task.prompt(i) for i in range(args.prompts)]
    answers = [len(task.target(i)) + 1 for i in range(args.prompts) for _ in range(args.n)]
    runs: dict[str, list[dict]] = {"lockstep": [], "continuous": []}
    with torch.no_grad():
        lockstep(gen, prompts[: args.slots // args.n], args.slots)  # warm-up
        for r in range(args.repeats):
            for mode, fn in (("lockstep", lockstep), ("continuous", continuous)):
                runs[mode].append(fn(gen, prompts, args.slots))
                print(f"[{r}] {mode:10s} {runs[mode][-1]['tokens'] / runs[mode][-1]['seconds']:8.0f} tok/s, "
                      f"utilisation {runs[mode][-1]['utilisation']:.2f}", file=sys.stderr, flush=True)
        costs = step_costs(gen, prompts, args.slots)

    def summary(mode: str) -> dict:
        rs = runs[mode]
        rates = [x["tokens"] / x["seconds"] for x in rs]
        cpu_rates = [x["tokens"] / x["cpu_seconds"] for x in rs]
        out = {
            "tokens_per_s": {"min": round(min(rates), 1), "max": round(max(rates), 1)},
            "tokens_per_cpu_s": {"min": round(min(cpu_rates), 1), "max": round(max(cpu_rates), 1)},
            "slot_utilisation": round(rs[0]["utilisation"], 3),
            "decode_steps": rs[0]["decode_steps"],
            "tokens": rs[0]["tokens"],
            "lengths": _law(rs[0]["lengths"]),
        }
        if "compactions" in rs[0]:
            out["compactions"] = rs[0]["compactions"]
            out["staging_prefills"] = rs[0]["prefills"]
        return out

    lock, cont = summary("lockstep"), summary("continuous")
    pairs = list(zip(runs["lockstep"], runs["continuous"]))
    ratios = [c["tokens"] / c["seconds"] / (lk["tokens"] / lk["seconds"]) for lk, c in pairs]
    cpu_ratios = [c["tokens"] / c["cpu_seconds"] / (lk["tokens"] / lk["cpu_seconds"]) for lk, c in pairs]
    result = {
        "bench": "generation-longtail",
        "model": MODELS[args.model].short(),
        "prompts": args.prompts,
        "n_samples": args.n,
        "slots": args.slots,
        "repeats": args.repeats,
        "threads": args.threads,
        "seed": args.seed,
        "fit": {"steps": args.fit_steps, "final_loss_per_token": round(fit_loss, 3), "seconds": round(fit_s, 1)},
        "task_lengths": _law(answers),  # the answers' lengths with </s>, which the fitted model should follow
        "lockstep": lock,
        "continuous": cont,
        "speedup_tokens_per_s": {"min": round(min(ratios), 2), "max": round(max(ratios), 2)},
        "speedup_tokens_per_cpu_s": {"min": round(min(cpu_ratios), 2), "max": round(max(cpu_ratios), 2)},
        "utilisation_ratio": round(cont["slot_utilisation"] / lock["slot_utilisation"], 2),
        "step_costs": costs,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "machine": platform.machine(),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
