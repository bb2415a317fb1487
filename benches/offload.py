"""What a colocated-offloading round trip costs: a trainer's whole state (parameters, gradients, AdamW
moments) to host memory and back with ``flowrl.runtime.programs.offload.HostOffload``, as a run with
``--offload on`` does once per trainer step, against the bytes and the time the planner prices.

The model is the built-in family in Qwen2.5-0.5B's shape (hidden 896, 14 heads of 64, 2 KV heads,
MLP 4864) with a small vocabulary and ``--layers`` of its 24 layers (the whole model's state, 16
bytes per parameter in float32 with AdamW, is 5.7 GB, and the host buffers double it: more than a
shared 24 GB machine should hold). Gradients are filled and one optimizer step taken, so every
tensor a step leaves exists. It prints JSON: the bytes the runtime moved (``HostOffload.nbytes``)
beside the planner's ``offloadable`` bytes for the same model, the median and range of
``--repeats`` offloads, reloads and round trips, the GB/s each reached, and the round trip scaled to
all 24 layers at that rate. On a CPU both sides are host memory (nothing is freed: the mechanism's
cost, a copy out and a copy back); on CUDA the copies go over PCIe into pinned buffers.

    python benches/offload.py                  # 4 layers, 5 repeats, on the CPU
    python benches/offload.py --layers 2 --repeats 3
    python benches/offload.py --device cuda    # pinned host buffers, non_blocking copies
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from flowrl.graph.configs import LossConfig, ModelConfig, OptimizerConfig
from flowrl.graph.nodes import LossNode, PolicyNode
from flowrl.operators.trainer import Trainer
from flowrl.runtime.programs.offload import HostOffload

FULL_LAYERS = 24


def _shape(layers: int) -> ModelConfig:
    return ModelConfig(vocab_size=320, dim=896, n_layers=layers, n_heads=14, n_kv_heads=2, ffn_dim=4864, max_seq_len=128, tie_embeddings=True)


def _planner_bytes(config: ModelConfig) -> float:
    """The planner's offloadable bytes for this model as a policy, on one device (float32, AdamW)."""
    from flowrl.examples import build_example
    from flowrl.modelspec import model_from_config
    from flowrl.planners.cluster import parse_cluster
    from flowrl.planners.estimate.common import Context
    from flowrl.planners.parallel import ParallelDims
    from flowrl.planners.search import evaluator, resolve_roles
    from flowrl.planners.tuning import Tuning
    from flowrl.planners.workload import Workload

    graph = build_example("llamarl")
    work = Workload(prompts_per_step=1, samples_per_prompt=1, prompt_len=4, gen_len=4)
    ctx = Context(cluster=parse_cluster("cpu:2"), workload=work, tuning=Tuning())
    spec = model_from_config(config)
    return evaluator(graph, resolve_roles(graph, ctx, spec), ctx, 0).offloadable("policy", ParallelDims())


def _trainer(config: ModelConfig, device: str) -> Trainer:
    trainer = Trainer(PolicyNode(name="policy", model=config, optimizer=OptimizerConfig()), LossNode(name="aipo", loss=LossConfig()), device=device)
    for p in trainer.model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    trainer.optimizer.step()  # the AdamW moments exist, as after any step
    return trainer


def _timed(fn, device: str) -> float:
    start = time.perf_counter()
    fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4, help=f"layers of the 0.5B shape's {FULL_LAYERS} (default 4)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    config = _shape(args.layers)
    trainer = _trainer(config, args.device)
    params = sum(p.numel() for p in trainer.model.parameters())
    offload = HostOffload(trainer)
    offload.offload()  # the first: allocates the host buffers (pinned on CUDA)
    first_reload = _timed(offload.reload, args.device)
    outs, backs = [], []
    for _ in range(args.repeats):
        outs.append(_timed(offload.offload, args.device))
        backs.append(_timed(offload.reload, args.device))
    trips = [a + b for a, b in zip(outs, backs)]
    gb = offload.nbytes / 1e9

    def stats(xs: list[float]) -> dict[str, float]:
        return {"median_s": round(statistics.median(xs), 4), "min_s": round(min(xs), 4), "max_s": round(max(xs), 4),
                "GBps_median": round(gb / statistics.median(xs), 3)}

    round_trip = statistics.median(trips)
    print(json.dumps({
        "device": args.device,
        "model": f"Qwen2.5-0.5B shape, {args.layers}/{FULL_LAYERS} layers, vocab 320, float32",
        "parameters": params,
        "runtime_bytes": offload.nbytes,
        "planner_bytes": int(_planner_bytes(config)),
        "runtime_minus_planner_bytes": offload.nbytes - int(_planner_bytes(config)),
        "offload": stats(outs),
        "reload": stats(backs),
        "round_trip": stats(trips),
        "first_reload_s": round(first_reload, 4),
        "round_trip_per_GB_s": round(round_trip / gb, 4),
        "full_24_layers_round_trip_s_at_this_rate": round(round_trip / gb * 16 * params_full(), 2),
        "threads": torch.get_num_threads(),
        "load_avg": os.getloadavg(),
    }, indent=1))


def params_full() -> float:
    """The whole 24-layer shape's parameters, counted on the meta device (no memory), in GB of float32 per 4 bytes."""
    from flowrl.models.registry import build_model

    model = build_model(_shape(FULL_LAYERS), device="meta")
    return sum(p.numel() for p in model.parameters()) / 1e9


if __name__ == "__main__":
    main()
