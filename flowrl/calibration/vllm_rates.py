"""vLLM's figures on this CPU, measured where vLLM is installed: its decode rate against the built-in engine's, and its weight-sync rate.

The planner prices a vLLM generator on a CPU as the built-in engine's calibrated decode rate times
a speed-up, and the last hop of a weight sync into it (the weight-sync group's broadcast and vLLM's
reload) at a bandwidth (``flowrl.planners.estimate.generate`` / ``.sync``). Without this
measurement those are fixed figures (``Tuning``'s 1.3 and 0.4 GB/s), each from one machine at one
load. Both price CPU devices only: on a GPU cluster the planner uses the cluster spec's own figures
(``flowrl.planners.estimate.rates``), never a rate measured here. ``measure_vllm(model)`` measures both at the shape of the graph's vLLM generator's model,
with ``layers`` of its blocks (2: the per-layer rates are what count, and start-up and memory stay
small), a word-level tokenizer built in code, random weights:

- ``decode_speedup``: tokens/s of ``VLLMGenerator.generate`` over tokens/s of the built-in engine's
  ``Generator.generate`` with one intra-op thread (the per-core rate the pass-rate tables give),
  the same prompts (``rows`` / 4 prompts x 4 samples, up to ``new_tokens`` tokens each, tokens
  counted from each call's completion mask), the two taking turns ``repeats`` times after one
  warm-up each; vLLM runs as the runtime starts it for a one-device generator;
- ``sync_bandwidth``: the model's bytes over the seconds of one weight update into vLLM over the
  weight-sync group (``VLLMGenerator``'s version setter after the staging copy is written: the
  broadcast in buckets and vLLM's reload in place, what ``add_engine_load`` prices), ``repeats``
  updates of new weights after one warm-up.

Each is the median (or ``statistic="best"``) over its repeats. Starting vLLM takes 20-60 s on a
2-core CPU, so ``flowrl calibrate`` does it only when asked (``--vllm``, or ``--graph`` of a graph
with a vLLM generator). Raises ``PlanError`` when vLLM is not installed.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import msgspec

from flowrl.calibration.measure import Measurements
from flowrl.errors import PlanError
from flowrl.modelspec import ModelSpec

__all__ = ["VllmFigures", "measure_vllm", "with_vllm", "write_model_dir", "qwen2_config"]


class VllmFigures(msgspec.Struct, frozen=True, kw_only=True):
    """What ``measure_vllm`` found (module docstring); ``CpuTerms.vllm_decode_speedup`` and
    ``CpuTerms.vllm_sync_bandwidth`` take them."""

    decode_speedup: float
    sync_bandwidth: float
    width: int
    sync_bytes: int


def with_vllm(m: Measurements, figures: VllmFigures) -> Measurements:
    """``m`` with vLLM's measured figures in its ``CpuTerms`` (pure).

    Example:
        >>> m = Measurements(matmul_flops=40e9, copy_bandwidth=6e9, op_overhead_s=4e-6, cores=2, memory_bytes=2**30)
        >>> cpu = with_vllm(m, VllmFigures(decode_speedup=1.6, sync_bandwidth=0.8e9, width=896, sync_bytes=10**8)).cpu
        >>> cpu.vllm_decode_speedup, cpu.vllm_sync_bandwidth
        (1.6, 800000000.0)
    """
    cpu = msgspec.structs.replace(m.cpu, vllm_decode_speedup=figures.decode_speedup, vllm_sync_bandwidth=figures.sync_bandwidth)
    return msgspec.structs.replace(m, cpu=cpu)


def qwen2_config(model: ModelSpec, *, layers: int, vocab: int, max_len: int = 256, special: tuple[int, int, int] = (1, 2, 0)) -> dict:
    """A Hugging Face ``config.json`` of a Qwen2 model of ``model``'s shape with ``layers`` blocks and
    ``vocab`` tokens (``special``: the bos, eos and pad ids), as plain data.

    Example:
        >>> shape = ModelSpec(name="t", n_layers=4, dim=96, n_heads=3, n_kv_heads=1, ffn_dim=160, vocab_size=64)
        >>> c = qwen2_config(shape, layers=2, vocab=32)
        >>> c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"], c["architectures"]
        (96, 2, 160, ['Qwen2ForCausalLM'])
    """
    bos, eos, pad = special
    config = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": vocab, "hidden_size": model.dim,
        "num_hidden_layers": layers, "num_attention_heads": model.n_heads, "num_key_value_heads": model.n_kv_heads,
        "intermediate_size": model.ffn_dim, "max_position_embeddings": max_len, "tie_word_embeddings": model.tie_embeddings,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1e6, "torch_dtype": "float32",
        "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad,
    }  # fmt: skip
    if model.head_dim and model.head_dim != model.dim // model.n_heads:
        config["head_dim"] = model.head_dim
    return config


def write_model_dir(path: Path, model: ModelSpec, *, layers: int, max_len: int = 256) -> Path:
    """``qwen2_config`` of ``model`` (no weights) and the HF example's word-level tokenizer in ``path``."""
    import json

    from flowrl.examples.hf_copy import build_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    special = (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    config = qwen2_config(model, layers=layers, vocab=len(tokenizer), max_len=max_len, special=special)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    tokenizer.save_pretrained(path)
    return path


def _timed(call) -> float:
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0


def measure_vllm(
    model: ModelSpec, *, layers: int = 2, rows: int = 16, new_tokens: int = 16, repeats: int = 3, statistic: str = "median"
) -> VllmFigures:
    """vLLM's decode speed-up over the built-in engine and its weight-sync rate at ``model``'s shape
    (module docstring).

    Raises:
        PlanError: vLLM is not installed; a count below 1.
    """
    import torch

    from flowrl.graph.configs import HFModelConfig, SamplingConfig
    from flowrl.graph.nodes import GeneratorNode
    from flowrl.operators.engines.vllm_engine import VLLM_INSTALL_HINT, VLLMGenerator, vllm_distribution
    from flowrl.examples.hf_copy import build_tokenizer
    from flowrl.operators.generation import Generator

    if min(layers, rows, new_tokens, repeats) < 1:
        raise PlanError(f"measure_vllm: layers={layers}, rows={rows}, new_tokens={new_tokens}, repeats={repeats} must each be >= 1")
    if statistic not in ("median", "best"):
        raise PlanError(f"calibration statistic {statistic!r} is not one of median, best")
    if vllm_distribution() is None:
        raise PlanError(f"measuring vLLM needs vLLM installed: {VLLM_INSTALL_HINT}")
    pick = min if statistic == "best" else statistics.median  # seconds: the best is the shortest
    samples = min(4, rows)
    prompts = max(1, rows // samples)
    with tempfile.TemporaryDirectory(prefix="flowrl-calibrate-vllm-") as folder:
        config = HFModelConfig(path=str(write_model_dir(Path(folder) / "model", model, layers=layers)), init="random", seed=0)
        sampling = SamplingConfig(n_samples=samples, max_new_tokens=new_tokens, temperature=1.0)
        g = torch.Generator().manual_seed(0)
        vocab = len(build_tokenizer())
        ids = torch.randint(4, vocab, (prompts, 6), generator=g)  # past the special tokens
        batch = {"prompt_ids": ids, "prompt_lens": torch.full((prompts,), 6), "prompt_index": torch.arange(prompts)}
        builtin = Generator(GeneratorNode(name="gen", model=config, sampling=sampling), seed=0)
        vllm = VLLMGenerator(GeneratorNode(name="gen", model=config, sampling=sampling, engine="vllm"), seed=0)
        try:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                rates: dict[str, list[float]] = {"builtin": [], "vllm": []}
                calls = {"builtin": builtin.generate, "vllm": vllm.generate}
                for r in range(repeats + 1):
                    for name, generate in calls.items():  # taking turns: a change of load touches both
                        t0 = time.perf_counter()
                        tokens = int(generate(batch)["completion_mask"].sum())
                        if r:
                            rates[name].append(tokens / (time.perf_counter() - t0))
            finally:
                torch.set_num_threads(threads)
            targets = vllm.weight_targets()
            nbytes = sum(t.numel() * t.element_size() for t in targets.values())
            seconds = []
            for version in range(1, repeats + 2):
                with torch.no_grad():
                    for t in targets.values():  # new weights each time, written where a transport writes them
                        t.mul_(1.0 + 1e-3)
                spent = _timed(lambda: setattr(vllm, "version", version))
                if version > 1:
                    seconds.append(spent)
        finally:
            vllm.close()
    rate = max if statistic == "best" else statistics.median  # tokens/s: the best is the highest
    return VllmFigures(decode_speedup=rate(rates["vllm"]) / rate(rates["builtin"]), sync_bandwidth=nbytes / pick(seconds), width=model.dim, sync_bytes=nbytes)
