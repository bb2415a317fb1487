"""``flowrl export CHECKPOINT -o DIR``: a trained policy as a Hugging Face directory (``from_pretrained`` loads it)."""

from __future__ import annotations

import argparse

__all__ = ["register"]

EPILOG = """\
CHECKPOINT is a run's --checkpoint-dir (its newest checkpoint is used) or one step-* directory in it.
A sharded checkpoint (each rank's shards, policy-<node>.dcp, whatever layout wrote it) is read here,
in one process without torchrun; only the weights are read, not the optimizer's state.
The built-in model is written as LlamaForCausalLM (an exact mapping); a Hugging Face policy keeps
its own architecture and tokenizer. A LoRA policy is written with its adapters merged into the base
model, or with --adapter as a peft adapter directory.

examples:
  flowrl export runs/ckpt -o my-model
  flowrl export runs/ckpt -o my-adapter --adapter      # a LoRA policy's adapters (peft's layout)
  python -c "from transformers import AutoModelForCausalLM as M; M.from_pretrained('my-model')"
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="write a checkpoint's policy as a Hugging Face directory",
        description="Write the policy of CHECKPOINT as a Hugging Face directory (weights, config.json, tokenizer).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="a run's checkpoint directory or one step-* directory")
    p.add_argument("-o", "--output", metavar="DIR", required=True, help="directory to write (must be empty or new)")
    p.add_argument("--node", metavar="NAME", help="the policy node, when the checkpoint holds several")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty DIR")
    p.add_argument(
        "--adapter", action="store_true",
        help="a LoRA policy: write its adapters as a peft adapter directory (default: the base model with them merged)",
    )
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from flowrl.models.hf_export import export_hf
    from flowrl.runtime.checkpointing.store import read_policy_state

    state = read_policy_state(args.checkpoint, node=args.node, optimizer=False)  # the weights: AdamW's moments are not read
    out = export_hf(state, args.output, overwrite=args.overwrite, adapter=args.adapter)
    if args.adapter:
        print(f"wrote {out} (PeftModel.from_pretrained(base_model, {str(out)!r}) loads it)")
    else:
        print(f"wrote {out} (AutoModelForCausalLM.from_pretrained({str(out)!r}) loads it)")
    return 0
