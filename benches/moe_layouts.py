"""A mixture-of-experts policy on CPU ranks: one process, FSDP2 alone on 2 ranks, and ep = 2 (experts split
over the 2 ranks, FSDP2 over the rest), each a torchrun job through flowrl's own path, beside the planner's
prediction for the same layout, as JSON (``benches/moe.py --parts layouts`` prints it too).

The graph: a Qwen3-MoE built from a config (random weights, seed 0; ``--hidden`` wide, ``--layers``
layers, ``--experts`` experts of width ``--expert-width``, top-``--top-k``, every block sparse, a
512-word vocabulary), 2 prompts of 16 words x 4 samples x ``--new-tokens`` new tokens a step, AIPO,
a reward hashed from each completion's text (``trainer_parallel.REWARD``), ``max_staleness=0``: the
built-in generator on rank 0 and the policy on rank 1 (``one``) or ranks 1-2 (``fsdp2``:
``sharding="fsdp"``; ``ep2``: the same with ``{"mesh": {"dp": 2, "ep": 2}}``, the layout ``flowrl plan``
emits as ``policy:d2e2``). Per layout: the measured step (median interval between rows after the
first), ``train_s``, each rank's peak RSS (``VmHWM``), what the run reports it built (its first row's
``layout``: a layout whose policy did not build ep=2 is marked ``not_run``, its figures kept but not
compared), and the planner's prediction on this CPU calibrated right before (``flowrl calibrate``'s
pass rate at ``--hidden`` and gloo's rates, the all-to-all's among them): predicted / measured for the
step and the policy's time (goal 0.77-1.3), and the policy's parts (``compute``, ``ep_comm``,
``dp_comm``, ``optimizer``).

    python benches/moe_layouts.py [--layouts one,fsdp2,ep2] [--steps 4] [--calibration cpu.json]
    (about a minute a layout on a loaded 2-core CPU at the defaults)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benches"))

from trainer_parallel import _median, run_job, write_job  # noqa: E402

VOCAB = 512

GRAPH = '''
"""A Qwen3-MoE from a config: built-in generator on rank 0, the policy laid out by the placement file."""
from flowrl import GraphBuilder
from flowrl.graph.configs import HFModelConfig


def build_graph():
    b = GraphBuilder("moe_layouts", model=HFModelConfig(path={model!r}, init="random", seed=0))
    prompts = b.source("prompts", data={prompts!r}, prompt_field="prompt", batch_size=2)
    gen = b.generator("gen", prompts, n_samples=4, max_new_tokens={new_tokens}, temperature=1.0)
    score = b.scorer("reward", gen, fn="bench_reward:reward", inputs="text")
    aipo = b.loss("aipo", gen, score, objective="aipo", rho=4.0)
    policy = b.policy("policy", aipo, lr=1e-5, sharding={sharding!r})
    b.weights(policy, gen, max_staleness=0)
    return b.build()
'''

#: layout -> (placement file, the policy's sharding, the mesh its first row must report)
LAYOUTS: dict[str, tuple[dict[str, Any], str, dict[str, int]]] = {
    "one": ({"gen": [0], "policy": [1]}, "replicate", {}),
    "fsdp2": ({"gen": [0], "policy": [1, 2]}, "fsdp", {"dp": 2}),
    "ep2": ({"gen": [0], "policy": {"ranks": [1, 2], "mesh": {"dp": 2, "ep": 2}}}, "fsdp", {"dp": 2, "ep": 2}),
}
#: the policy's parts the planner prices
PARTS = ("compute", "ep_comm", "dp_comm", "optimizer")


def write_model(directory: Path, args: argparse.Namespace) -> Path:
    """A config-only Qwen3-MoE directory (flowrl initialises it, ``init="random"``) and a word tokenizer of ``w3 .. w511``."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=args.hidden // 4, num_experts=args.experts, num_experts_per_tok=args.top_k, moe_intermediate_size=args.expert_width,
        intermediate_size=args.top_k * args.expert_width, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=256,
        tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    directory.mkdir(parents=True)
    config.save_pretrained(str(directory))
    tok = Tokenizer(models.WordLevel(vocab={"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>").save_pretrained(str(directory))
    return directory


def calibrate(path: str | None, width: int) -> Any:
    """This CPU's measurements (the pass rate at ``width``; gloo's rates by size, its all-to-all's too);
    with ``path``, read from it when it exists, else measured and written there."""
    import msgspec

    from flowrl.calibration.gloo_rate import measure_gloo, with_gloo
    from flowrl.calibration.measure import Measurements, measure

    if path and Path(path).is_file():
        return msgspec.json.decode(Path(path).read_bytes(), type=Measurements)
    m = with_gloo(measure(widths=(width,)), measure_gloo())
    if path:
        Path(path).write_bytes(msgspec.json.encode(m))
    return m


def predict(graph_file: Path, m: Any, placement: dict[str, Any]) -> dict[str, Any]:
    """``flowrl plan``'s estimate of ``placement`` on this CPU calibrated (3 ranks, under torchrun)."""
    from flowrl.calibration.measure import calibrated_cluster
    from flowrl.errors import FlowrlError
    from flowrl.graph.refs import load_file_module
    from flowrl.placement.forms import decode_placement
    from flowrl.planners.plan import plan_graph

    graph = load_file_module(graph_file).build_graph()
    strategy = str(decode_placement(json.dumps(placement).encode(), graph, where="moe_layouts"))
    try:
        plan = plan_graph(graph, calibrated_cluster(m, cores=3), strategy=strategy, max_staleness=0, backend="torchrun")
    except FlowrlError as exc:
        return {"refused": str(exc)}
    policy = plan.placements["policy"]
    return {
        "placement": str(plan),
        "step_s": round(plan.step_s, 4),
        "nodes_s": {n: round(p.time_s, 4) for n, p in plan.placements.items() if p.time_s},
        "policy_parts_s": {k: round(policy.breakdown.get(k, 0.0), 5) for k in PARTS},
        "policy_notes": list(policy.notes),
    }


def run_layout(name: str, tmp: Path, model: Path, prompts: Path, args: argparse.Namespace, m: Any) -> dict[str, Any]:
    placement, sharding, expected_mesh = LAYOUTS[name]
    work = tmp / name
    write_job(work, GRAPH.format(model=str(model), prompts=str(prompts), new_tokens=args.new_tokens, sharding=sharding), placement)
    predicted = predict(work / "graph.py", m, placement)
    ranks = 2 if name == "one" else 3
    job = run_job(work, ranks, args.steps, args.timeout)
    if "failed" in job:
        return {"placement": placement, **job, "predicted": predicted}
    rows, rss, load = job["rows"], job["peak_rss"], job["load"]
    steady = rows[1:] or rows
    measured = {k: _median([float(r[k]) for r in steady]) for k in ("train_s", "gen_s", "sync_s")}
    measured["step_s"] = _median([b["time_s"] - a["time_s"] for a, b in zip(rows, rows[1:])] or [rows[0]["time_s"]])
    ran = rows[0].get("layout", {}).get("policy", {})
    result: dict[str, Any] = {
        "placement": placement,
        "ran": ran or "not reported",
        "steps": len(rows),
        "wall_s": round(job["wall_s"], 1),
        "measured": measured,
        "first_loss": rows[0].get("loss"),
        "moe_load_max_over_mean": rows[-1].get("moe/load_max_over_mean"),
        "peak_rss_gib_by_rank": {str(r): round(b / 2**30, 3) for r, b in sorted(rss.items())},
        "predicted": predicted,
        "loadavg_1m": [round(load, 2), round(os.getloadavg()[0], 2)],
    }
    if ran and ran.get("mesh", {}) != expected_mesh:
        result["not_run"] = f"the policy built mesh {ran.get('mesh')}, not {expected_mesh}: this runtime does not run the layout"
    elif "step_s" in predicted:
        result["predicted_over_measured"] = {
            "step": round(predicted["step_s"] / measured["step_s"], 2) if measured["step_s"] else None,
            "train": round(predicted["nodes_s"]["policy"] / measured["train_s"], 2) if measured["train_s"] else None,
        }
    return result


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated among {', '.join(LAYOUTS)}")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-width", type=int, default=256)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a layout's run may take")
    p.add_argument("--calibration", default=None, help="a file of this CPU's measurements: read if it exists, else measured and written")
    args = p.parse_args(argv)
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    if not layouts or any(x not in LAYOUTS for x in layouts) or args.steps < 2 or args.experts % 2:
        p.error(f"--layouts among {', '.join(LAYOUTS)} (got {args.layouts!r}), --steps >= 2, --experts even (ep = 2 splits them)")
    args.layouts = layouts
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The figures of the module docstring."""
    from flowrl.data.files import write_jsonl

    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        model = write_model(tmp / "qwen3_moe", args)
        prompts = tmp / "prompts.jsonl"
        words = [" ".join(f"w{3 + (7 * i + 11 * j) % (VOCAB - 3)}" for j in range(16)) for i in range(8)]
        write_jsonl(prompts, [{"prompt": w, "answer": ""} for w in words])  # the hashed reward reads no answer, but asks for the field
        m = calibrate(args.calibration, args.hidden)
        results = {name: run_layout(name, tmp, model, prompts, args, m) for name in args.layouts}
    fsdp, ep = results.get("fsdp2", {}), results.get("ep2", {})
    compare: dict[str, Any] = {}
    if "measured" in fsdp and "measured" in ep and "not_run" not in ep:
        compare = {
            "step_s_ep2_over_fsdp2": round(ep["measured"]["step_s"] / fsdp["measured"]["step_s"], 3),
            "train_s_ep2_over_fsdp2": round(ep["measured"]["train_s"] / fsdp["measured"]["train_s"], 3),
            "policy_rank_rss_ep2_over_fsdp2": [round(ep["peak_rss_gib_by_rank"][r] / fsdp["peak_rss_gib_by_rank"][r], 3)
                                               for r in ("1", "2") if r in ep["peak_rss_gib_by_rank"] and r in fsdp["peak_rss_gib_by_rank"]],  # fmt: skip
        }
    return {
        "bench": "moe_layouts",
        "model": f"Qwen3-MoE from a config: hidden {args.hidden}, {args.layers} layers, {args.experts} experts of width {args.expert_width}, top-{args.top_k}, "
                 f"{VOCAB}-word vocabulary, fp32; 2 prompts x 4 samples x {args.new_tokens} tokens a step, max_staleness 0",  # fmt: skip
        "calibrated": {
            "train_gflops": [[w, round(f / 1e9, 2)] for w, f in m.cpu.train_flops_by_width],
            **{f"{name}_gb_per_s_by_kib": {f"{n / 2**10:g}": round(r / 1e9, 3) for n, r in getattr(m.cpu, field)}
               for name, field in (("gather", "gloo_by_bytes"), ("all_to_all", "gloo_all_to_all_by_bytes"))},  # fmt: skip
        },
        "layouts": results,
        "ep2_vs_fsdp2": compare or "not measured: both layouts must run, ep2 as planned",
        "loadavg_1m_at_start": round(load, 2),
        "cpus": os.cpu_count(),
    }


if __name__ == "__main__":
    print(json.dumps(run(parse()), indent=1))
