"""``flowrl sample CHECKPOINT [-n 8]``: decoded prompts and completions of a checkpoint's policy, with their rewards."""

from __future__ import annotations

import argparse

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    from flowrl.cli.policy_samples import add_checkpoint_arguments

    p = sub.add_parser(
        "sample",
        help="print what a checkpoint's policy writes: prompts, completions, rewards",
        description="Sample completions from the policy in CHECKPOINT (a --checkpoint-dir or one of its step-* "
        "directories) for held-out prompts (a built-in task's prompts from 2**40 on; a prompt file's --data FILE, else "
        "its first rows) and print them decoded with their rewards.",
    )
    add_checkpoint_arguments(p)
    p.add_argument("-n", type=int, default=8, metavar="N", help="prompts to sample (default: 8)")
    p.add_argument("--samples", type=int, default=1, metavar="S", help="completions per prompt (default: 1)")
    p.add_argument("--greedy", action="store_true", help="the most likely completion instead of a sampled one")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from flowrl.runtime.evaluation.policy_samples import eval_positions, load_policy, rollout
    from flowrl.errors import ConfigError

    if args.n < 1 or args.samples < 1:
        raise ConfigError(f"-n {args.n} and --samples {args.samples} must both be >= 1")
    policy = load_policy(args.checkpoint, seed=args.seed, data=args.data)
    rows = rollout(policy, eval_positions(policy, args.n), n_samples=args.samples, greedy=args.greedy)
    print(f"{policy.path} (graph {policy.graph.name!r}, policy version {policy.version}), " + ("held-out prompts:" if policy.held_out else "prompts of the training file (give --data FILE for held-out rows):"))
    for row in rows:
        detail = ", ".join(f"{k} {v:.3f}" for k, v in row.rewards.items()) if len(row.rewards) > 1 else ""
        print(f"  {row.prompt!r} -> {row.completion!r}  reward {row.reward:.3f}" + (f" ({detail})" if detail else ""))
    print(f"mean reward {sum(r.reward for r in rows) / len(rows):.3f} over {len(rows)} completions")
    return 0
