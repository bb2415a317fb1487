"""Tensor- and pipeline-parallel training on 2 CPU ranks over gloo, part by part, beside the planner's terms.

A Qwen2.5-0.5B-shaped transformers model (hidden 896, 14 heads of 64, 2 KV heads, MLP 4864, vocabulary
320) with ``--layers`` decoder layers (default 4), float32, one training pass (forward + backward of a
cross-entropy loss) over ``--batch`` sequences of ``--seq`` tokens, on two one-thread processes
(``torchrun --nproc-per-node 2``, ``OMP_NUM_THREADS=1``, gloo):

- ``tp``: every decoder layer's q, k, v, gate and up projections ``ColwiseParallel``, o and down
  ``RowwiseParallel`` (DTensor, ``parallelize_module`` over a 1-D ``tp`` mesh), the attention's and the
  MLP's input made one replicated DTensor (``PrepareModuleInput``, ``use_local_output=False``: one
  all-reduce of its gradient, as ``cpu_ranks.TP_BACKWARD_ALL_REDUCES`` prices; the plan without it,
  whose count is printed too, issues one per colwise projection); embedding, norms and head replicated. Measured: the whole pass; the same pass of one rank's shard as a plain model of
  its own (7 heads, 1 KV head, MLP 2432: the compute, no collective); the all-reduces the pass issues
  (``CommDebugMode``'s count) and one all-reduce of ``[tokens, hidden]`` timed alone; the rest
  (``other``: DTensor's dispatch and what the parts miss) is the whole minus those.
- ``pp``: two stages (embedding + the first half of the layers; the second half + norm + head + loss),
  ``torch.distributed.pipelining``'s ``Schedule1F1B`` over ``--microbatches`` micro-batches. Measured:
  the whole step; each stage's forward + backward of one micro-batch alone (compute); one send of a
  micro-batch's activations ``[mb * seq, hidden]`` each way (p2p); the rest (``bubble``: the stage
  waiting for the other, and the schedule's own work) is the whole minus compute and p2p.

The parts are timed taking turns (whole, compute, collective, whole, ...: each sees the machine's load
alike), medians of ``--repeats``. The planner's terms for the same work (``flowrl.planners.estimate.cpu_ranks``) are computed from this
machine calibrated right before (``flowrl calibrate``'s pass rate at width 896 and gloo's rates by size:
``--gloo``'s all-gather / reduce-scatter, all-reduce and send), and printed beside each measured part with predicted / measured.

Run: python benches/tp_pp_parts.py [--layers 4] [--batch 8] [--seq 32] [--microbatches 4] [--repeats 5]
(about 2 minutes on 2 cores, ~3 GB). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPE = dict(hidden_size=896, num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864, head_dim=64)
VOCAB = 320


def _config(layers: int, tp: int = 1):
    from transformers import Qwen2Config

    shape = dict(SHAPE)
    if tp > 1:  # one rank's shard as a model of its own: its heads, its KV heads, its part of the MLP
        shape.update(num_attention_heads=shape["num_attention_heads"] // tp, num_key_value_heads=shape["num_key_value_heads"] // tp,
                     intermediate_size=shape["intermediate_size"] // tp)
    return Qwen2Config(vocab_size=VOCAB, num_hidden_layers=layers, max_position_embeddings=512, tie_word_embeddings=True,
                       rms_norm_eps=1e-6, rope_theta=1e6, attn_implementation="sdpa", **shape)


def _model(layers: int, tp: int = 1):
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(_config(layers, tp))


def _medians_s(calls: list, repeats: int, barrier) -> list[float]:
    """Median seconds of each call, the calls taking turns (so that each sees the machine's load alike),
    each after a barrier of both ranks, after one warm-up round."""
    times: list[list[float]] = [[] for _ in calls]
    for r in range(repeats + 1):
        for call, seen in zip(calls, times):
            barrier()
            t0 = time.perf_counter()
            call()
            if r:
                seen.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def _loss(logits, labels):
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


# -- the two ranks ---------------------------------------------------------------------------------
def _tp_parts(args, rank: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    plain = {**{f"self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")}, "self_attn.o_proj": RowwiseParallel(),
             **{f"mlp.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")}, "mlp.down_proj": RowwiseParallel()}
    # each block's input one replicated DTensor for its colwise projections: one all-reduce of its gradient, not one each
    shared = {**plain, "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Replicate()},
                                                       desired_input_kwarg_layouts={"hidden_states": Replicate()}, use_local_output=False),
              "mlp": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False)}
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (args.batch, args.seq), generator=g)

    def step(m) -> None:
        m.zero_grad(set_to_none=True)
        _loss(m(input_ids=ids).logits, ids).backward()

    counts = {}
    for name, plan in (("plain", plain), ("shared_input", shared)):
        model = _model(args.layers)
        for layer in model.model.layers:
            parallelize_module(layer, mesh, plan)
        with CommDebugMode() as comm:
            step(model)
        counts[name] = sum(comm.get_comm_counts().values())
    shard = _model(args.layers, tp=2)  # the same compute without DTensor or collectives, both ranks at once
    act = torch.randn(args.batch * args.seq, SHAPE["hidden_size"])
    whole, compute, all_reduce = _medians_s([lambda: step(model), lambda: step(shard), lambda: dist.all_reduce(act)], args.repeats, dist.barrier)
    return {"whole_s": whole, "compute_s": compute, "all_reduce_one_s": all_reduce, "all_reduces_per_pass": counts,
            "all_reduce_bytes": act.numel() * 4}


def _stage_module(model, first: bool, layers: range):
    import torch

    class Stage(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = model.model.embed_tokens if first else None
            self.layers = torch.nn.ModuleList(model.model.layers[i] for i in layers)
            self.norm = None if first else model.model.norm
            self.head = None if first else torch.nn.Linear(SHAPE["hidden_size"], VOCAB, bias=False)  # the tied head's copy on the last stage
            if self.head is not None:
                self.head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
            self.rotary = model.model.rotary_emb

        def forward(self, x):
            h = self.embed(x) if self.embed is not None else x
            pos = torch.arange(h.shape[1]).unsqueeze(0)
            rope = self.rotary(h, pos)
            for layer in self.layers:
                out = layer(h, attention_mask=None, position_ids=pos, position_embeddings=rope)
                h = out[0] if isinstance(out, tuple) else out
            return h if self.head is None else self.head(self.norm(h))

    return Stage()


def _pp_parts(args, rank: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    model = _model(args.layers)
    half = args.layers // 2 + args.layers % 2
    stage = _stage_module(model, rank == 0, range(0, half) if rank == 0 else range(half, args.layers))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (args.batch, args.seq), generator=g)
    m = args.microbatches
    mb = args.batch // m
    pipe = PipelineStage(stage, rank, 2, torch.device("cpu"))
    schedule = Schedule1F1B(pipe, n_microbatches=m, loss_fn=_loss)

    def step() -> None:
        stage.zero_grad(set_to_none=True)
        if rank == 0:
            schedule.step(ids)
        else:
            schedule.step(target=ids, losses=[])

    hidden = torch.randn(mb, args.seq, SHAPE["hidden_size"], requires_grad=True)

    def local() -> None:  # one micro-batch through this stage alone, forward and backward
        stage.zero_grad(set_to_none=True)
        if rank == 0:
            stage(ids[:mb]).backward(torch.ones(mb, args.seq, SHAPE["hidden_size"]))
        else:
            _loss(stage(hidden), ids[:mb]).backward()

    act = torch.randn(mb * args.seq, SHAPE["hidden_size"])

    def send() -> None:  # one micro-batch's activations 0 -> 1, then its gradient 1 -> 0
        if rank == 0:
            dist.send(act, 1)
            dist.recv(act, 1)
        else:
            dist.recv(act, 0)
            dist.send(act, 0)

    whole, compute, both_ways = _medians_s([step, local, send], args.repeats, dist.barrier)
    return {"whole_s": whole, "stage_compute_one_mb_s": compute, "p2p_both_ways_s": both_ways, "p2p_bytes": act.numel() * 4,
            "stage_layers": half if rank == 0 else args.layers - half}


def _rank_main(args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        parts = _tp_parts(args, rank) if args.part == "tp" else _pp_parts(args, rank)
        gathered: list = [None, None]
        dist.all_gather_object(gathered, json.dumps(parts))
        if rank == 0:
            print("PARTS " + json.dumps([json.loads(p) for p in gathered]), flush=True)
    finally:
        dist.barrier()
        dist.destroy_process_group()


# -- the launcher ------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_ranks(args, part: str) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", __file__, "--rank-part", part,
           "--layers", str(args.layers), "--batch", str(args.batch), "--seq", str(args.seq),
           "--microbatches", str(args.microbatches), "--repeats", str(args.repeats)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    line = next((ln for ln in run.stdout.splitlines() if ln.startswith("PARTS ")), None)
    if run.returncode != 0 or line is None:
        sys.exit(f"the {part} ranks failed (exit {run.returncode}):\n{run.stderr[-4000:]}")
    return json.loads(line[len("PARTS "):])


def _ratio(p: float, m: float) -> float | None:
    return round(p / m, 2) if m > 0 else None


def _side_by_side(predicted: dict[str, float], measured: dict[str, float]) -> dict:
    return {k: {"predicted_s": round(predicted[k], 4), "measured_s": round(measured[k], 4), "ratio": _ratio(predicted[k], measured[k])}
            for k in predicted}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="sequences of the pass")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--microbatches", type=int, default=4, help="pipeline micro-batches (divides --batch, >= 2)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rank-part", choices=("tp", "pp"), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_part:  # a member of a gloo group: ends without interpreter teardown, where gloo's threads may abort it
        from flowrl.runtime.backends.torchrun.rank_exit import end_rank_process

        args.part = args.rank_part
        _rank_main(args)
        end_rank_process(0)
    if args.layers < 2 or args.batch % args.microbatches or args.microbatches < 2 or args.repeats < 1:
        parser.error("--layers >= 2, --microbatches >= 2 dividing --batch, --repeats >= 1")
    from flowrl.calibration.gloo_rate import measure_gloo, with_gloo
    from flowrl.calibration.measure import calibrated_cluster, measure
    from flowrl.planners.estimate.common import Context
    from flowrl.planners.estimate.cpu_ranks import TP_BACKWARD_ALL_REDUCES, TP_FORWARD_ALL_REDUCES, pp_parts, tp_parts
    from flowrl.planners.tuning import Tuning
    from flowrl.planners.workload import Workload
    from flowrl.modelspec import model_from_hf_config

    load = [os.getloadavg()[0]]
    m = with_gloo(measure(widths=(SHAPE["hidden_size"],)), measure_gloo())  # as `flowrl calibrate --gloo`
    cluster = calibrated_cluster(m, cores=2)
    ctx = Context(cluster=cluster, workload=Workload(prompts_per_step=args.batch, samples_per_prompt=1, prompt_len=args.seq, gen_len=1), tuning=Tuning())
    with tempfile.TemporaryDirectory() as tmp:
        _config(args.layers).save_pretrained(tmp)
        spec = model_from_hf_config(Path(tmp) / "config.json", name="qwen2.5-0.5b-shaped")
    tp = _run_ranks(args, "tp")
    pp = _run_ranks(args, "pp")
    load.append(os.getloadavg()[0])

    tokens = args.batch * args.seq
    tp_pred = tp_parts(spec, ctx, tp=2, tokens=tokens, context=args.seq / 2)
    t0 = tp[0]
    ar_count = t0["all_reduces_per_pass"]["shared_input"]
    tp_meas = {"compute": t0["compute_s"], "tp_comm": ar_count * t0["all_reduce_one_s"]}
    tp_meas["other"] = t0["whole_s"] - tp_meas["compute"] - tp_meas["tp_comm"]
    tp_meas["whole"] = t0["whole_s"]
    mb_tokens = tokens // args.microbatches
    pp_pred = pp_parts(spec, ctx, pp=2, microbatches=args.microbatches, tokens=mb_tokens, context=args.seq / 2)
    slow = max(pp, key=lambda r: r["stage_compute_one_mb_s"])  # the slower stage sets the pace
    pp_meas = {"compute": args.microbatches * slow["stage_compute_one_mb_s"], "pp_comm": args.microbatches * pp[0]["p2p_both_ways_s"]}
    pp_meas["bubble"] = max(r["whole_s"] for r in pp) - pp_meas["compute"] - pp_meas["pp_comm"]
    pp_meas["whole"] = max(r["whole_s"] for r in pp)
    print(json.dumps({
        "model": f"Qwen2.5-0.5B-shaped, {args.layers} layers, fp32; {args.batch} x {args.seq} tokens; 2 ranks, gloo, OMP_NUM_THREADS=1",
        "calibrated": {"train_gflops_at_896": round(cluster.device.measured_flops(896, "train") / 1e9, 2),
                       **{f"{name}_gb_per_s_by_kib": {f"{n // 1024}": round(r / 1e9, 3) for n, r in getattr(m.cpu, field)}
                          for name, field in (("gather", "gloo_by_bytes"), ("all_reduce", "gloo_all_reduce_by_bytes"), ("send", "gloo_send_by_bytes"))}},
        "tp2": {"all_reduces_per_pass": t0["all_reduces_per_pass"], "all_reduces_priced": (TP_FORWARD_ALL_REDUCES + TP_BACKWARD_ALL_REDUCES) * args.layers, "all_reduce_bytes": t0["all_reduce_bytes"],
                "all_reduce_one_s": round(t0["all_reduce_one_s"], 5),
                "other_measured_s": round(tp_meas["other"], 4),  # DTensor's dispatch and what the parts miss: not priced
                "parts": _side_by_side({**tp_pred, "whole": sum(tp_pred.values())}, tp_meas)},
        "pp2": {"microbatches": args.microbatches, "p2p_bytes": pp[0]["p2p_bytes"], "stage_compute_one_mb_s": [round(r["stage_compute_one_mb_s"], 4) for r in pp],
                "parts": _side_by_side({**pp_pred, "whole": sum(pp_pred.values())}, pp_meas)},
        "loadavg_1m": [round(x, 2) for x in load],
    }, indent=1))


if __name__ == "__main__":
    main()
