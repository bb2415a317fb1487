"""Mixture-of-experts benches: the train/inference mismatch with routing replay off and on.

``mismatch``: a Qwen3-MoE-shaped model built from a config (nothing downloaded; ``--experts`` experts,
top-``--top-k``, ``--layers`` layers, ``norm_topk_prob`` as Qwen3-30B-A3B has it), the built-in
engine sampling in bfloat16 with ``routing_replay=True`` (it records each token's experts per
layer), the trainer in float32, k = 0 (the generator receives the trainer's weights after every
step). Per step, on that step's rollout, the trainer's log pi of the completion tokens is computed
twice, with its own routers (replay off) and with the recorded experts (replay on), in alternating
order; then one AIPO step trains the policy (with replay on at even steps, off at odd ones, so that
both kinds of update run in the one run). Reported per step and mode: routing agreement (share of
token-layer choices whose trainer top-k set equals the generator's), mean and max |log pi - log mu|
over completion tokens, the k3 estimate of KL(mu || pi) (mean of ``r - 1 - log r``, ``r = pi / mu``);
and the ratio off / on of the mean mismatch per step.

``--router-std`` sets the routers' initial standard deviation: transformers' initialisation (0.02)
routes near-uniformly, a trained router decides (its logits spread by more than the rounding of
bfloat16); the bench runs each value given. ``--expert-scale`` multiplies the experts' initial weights
(at transformers' initialisation their output is small beside the residual stream, so a token sent
to another expert changes little).

The other parts (``--parts``): ``throughput``, ``benches/moe_throughput.py`` at its defaults (trainer
tokens/s of the MoE against a dense model of the same active parameters, one process), and
``layouts``, ``benches/moe_layouts.py`` at its defaults (one process, FSDP2 alone and ep = 2 on 2
torchrun ranks: step time, peak RSS per rank, and the planner's predicted / measured step for each).

    python benches/moe.py                                   # ~2-4 min on a loaded 2-core CPU
    python benches/moe.py --parts throughput layouts        # ~3 min
    python benches/moe.py --steps 8 --router-std 0.02 0.5 --experts 16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from flowrl.graph.configs import HFModelConfig, SamplingConfig
from flowrl.graph.nodes import GeneratorNode, LossNode, PolicyNode
from flowrl.graph.configs import OptimizerConfig
from flowrl.models.routing import RoutingAgreement, moe_routers
from flowrl.operators.generation import Generator
from flowrl.operators.logprobs import completion_logprobs
from flowrl.operators.trainer import Trainer


def write_model(
    directory: Path, *, layers: int, dim: int, experts: int, top_k: int, vocab: int, router_std: float, expert_scale: float, seed: int
) -> int:
    """A Qwen3-MoE of random weights (routers of std ``router_std``, experts ``expert_scale`` times their
    initial size) and a word-level tokenizer without an end token into ``directory``; returns its parameter count."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=dim, num_hidden_layers=layers, num_attention_heads=dim // 32, num_key_value_heads=max(dim // 64, 1),
        head_dim=32, intermediate_size=2 * dim, moe_intermediate_size=dim // 2, num_experts=experts, num_experts_per_tok=top_k,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=256, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3MoeForCausalLM(config)
        with torch.no_grad():
            for module in model.modules():
                if type(module).__name__ == "Qwen3MoeTopKRouter":
                    module.weight.normal_(0.0, router_std)
                elif type(module).__name__ == "Qwen3MoeExperts":
                    for p in module.parameters():
                        p.mul_(expert_scale)
    model.save_pretrained(str(directory))
    core = Tokenizer(models.WordLevel({"<pad>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, vocab)}}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>").save_pretrained(str(directory))
    return sum(p.numel() for p in model.parameters())


def prompts(n: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(6, 17, (n,), generator=g)
    ids = torch.zeros(n, int(lens.max()), dtype=torch.int64)
    for i, length in enumerate(lens.tolist()):
        ids[i, ids.shape[1] - length :] = torch.randint(2, vocab, (length,), generator=g)
    return {"prompt_ids": ids, "prompt_lens": lens, "prompt_index": torch.arange(seed * n, seed * n + n)}


def measure(trainer: Trainer, rollout: dict[str, torch.Tensor], *, replay: bool) -> dict[str, float]:
    """log pi of the rollout's completions with the trainer's routers (replay False) or the recorded
    experts (True) against mu: agreement, mean / max |log pi - log mu|, k3 KL(mu || pi)."""
    agreement = RoutingAgreement()
    args = [rollout[k] for k in ("sample_prompt_ids", "sample_prompt_lens", "completion_ids", "completion_mask")]
    with torch.no_grad():
        pi = completion_logprobs(trainer.model, *args, routed_experts=rollout["routed_experts"] if replay else None, agreement=agreement, packing=trainer.packing)
        if not replay:  # agreement is measured the same way in both modes: the trainer's own top-k against the recorded one
            completion_logprobs(trainer.model, *args, routed_experts=rollout["routed_experts"], agreement=agreement, packing=trainer.packing)
    mask = rollout["completion_mask"]
    d = (pi - rollout["behaviour_logprobs"])[mask].double()  # log pi - log mu
    return {
        "agreement": round(agreement.agree / max(agreement.total, 1), 5),
        "abs_mean": float(d.abs().mean()),
        "abs_max": float(d.abs().max()),
        "k3_kl": float((d.exp() - 1 - d).mean()),
        "tokens": int(mask.sum()),
    }


def mismatch(args: argparse.Namespace, router_std: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        params = write_model(directory, layers=args.layers, dim=args.dim, experts=args.experts, top_k=args.top_k, vocab=args.vocab, router_std=router_std, expert_scale=args.expert_scale, seed=0)
        model = HFModelConfig(path=str(directory))
        sampling = SamplingConfig(n_samples=args.samples, max_new_tokens=args.new_tokens, precision="bfloat16", temperature=1.0)
        generator = Generator(GeneratorNode(name="gen", model=model, sampling=sampling, routing_replay=True), seed=0)
        trainer = Trainer(PolicyNode(name="policy", model=model, optimizer=OptimizerConfig(lr=args.lr, packing=False)), LossNode(name="aipo"))
        steps = []
        for step in range(args.steps):
            start = time.perf_counter()
            generator.load_weights(trainer.weights(), trainer.version)  # k = 0: the trainer's current weights
            rollout = generator.generate(prompts(args.prompts, args.vocab, seed=step))
            order = (True, False) if step % 2 == 0 else (False, True)
            row: dict = {"step": step}
            for replay in order:
                row["on" if replay else "off"] = measure(trainer, rollout, replay=replay)
            row["off_over_on_abs_mean"] = round(row["off"]["abs_mean"] / max(row["on"]["abs_mean"], 1e-30), 3)
            tokens = rollout["completion_ids"]
            rewards = (tokens < args.vocab // 2).float().mean(1)  # a reward the policy can raise: the share of low ids
            batch = {**rollout, "rewards": rewards}
            if step % 2:  # replay off for this update: the trainer's own routing
                batch.pop("routed_experts")
            metrics = trainer.train_step(batch)
            row["train_replay"] = step % 2 == 0
            row["train_routing_agreement"] = metrics.get("routing/agreement")
            row["reward_mean"] = round(float(rewards.mean()), 4)
            row["seconds"] = round(time.perf_counter() - start, 2)
            steps.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        ratios = [r["off_over_on_abs_mean"] for r in steps]
        return {
            "router_std": router_std,
            "params": params,
            "routers": len(moe_routers(trainer.model)),
            "steps": steps,
            "summary": {
                "agreement_mean": round(statistics.mean(r["off"]["agreement"] for r in steps), 5),
                "abs_mean_off": statistics.mean(r["off"]["abs_mean"] for r in steps),
                "abs_mean_on": statistics.mean(r["on"]["abs_mean"] for r in steps),
                "abs_max_off": max(r["off"]["abs_max"] for r in steps),
                "abs_max_on": max(r["on"]["abs_max"] for r in steps),
                "k3_off": statistics.mean(r["off"]["k3_kl"] for r in steps),
                "k3_on": statistics.mean(r["on"]["k3_kl"] for r in steps),
                "off_over_on_abs_mean": {"min": min(ratios), "median": statistics.median(ratios), "max": max(ratios)},
            },
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["mismatch"], choices=["mismatch", "throughput", "layouts"],
                        help="throughput: benches/moe_throughput.py's figures at its defaults (trainer tokens/s, MoE vs dense of equal active parameters); "
                             "layouts: benches/moe_layouts.py's at its defaults (one process, FSDP2 alone and ep=2 on 2 torchrun ranks: step time, "
                             "peak RSS per rank, the planner's predicted / measured)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--router-std", type=float, nargs="+", default=[0.02, 0.5])
    parser.add_argument("--expert-scale", type=float, default=1.0, help="experts' weights times this (a trained MoE's experts carry its MLP signal)")
    args = parser.parse_args()
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "2"))))
    out: dict = {"config": vars(args), "torch": torch.__version__, "load_before": os.getloadavg()}
    if "mismatch" in args.parts:
        out["mismatch"] = [mismatch(args, std) for std in args.router_std]
    if "throughput" in args.parts:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import moe_throughput

        out["throughput"] = moe_throughput.run(moe_throughput.parse([]))
    if "layouts" in args.parts:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import moe_layouts

        out["layouts"] = moe_layouts.run(moe_layouts.parse([]))
    out["load_after"] = os.getloadavg()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
