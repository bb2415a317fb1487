"""``flowrl eval CHECKPOINT``: a checkpoint's greedy and sampled mean reward on held-out prompts of its task.

Held-out prompts are the task's prompt indices from ``HELD_OUT_START`` (2**40) on, beyond what any
training run reads (``flowrl.runtime.policy_samples``).
"""

from __future__ import annotations

import argparse
import json

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    from flowrl.cli.policy_samples import add_checkpoint_arguments

    p = sub.add_parser(
        "eval",
        help="score a checkpoint on held-out prompts (greedy and sampled mean reward)",
        description="Score the policy in CHECKPOINT on held-out prompts: for a built-in task, its prompt indices from "
        "2**40 on, which no training run reads; for a prompt file, the rows of --data FILE (without it, the training "
        "file's first rows, reported as not held out). Prints the mean reward of greedy completions and of sampled ones.",
    )
    add_checkpoint_arguments(p)
    p.add_argument("--prompts", type=int, default=256, metavar="N", help="held-out prompts (default: 256)")
    p.add_argument("--samples", type=int, default=4, metavar="S", help="sampled completions per prompt (default: 4)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from flowrl.runtime.policy_samples import eval_positions, load_policy, rollout
    from flowrl.errors import ConfigError

    if args.prompts < 1 or args.samples < 1:
        raise ConfigError(f"--prompts {args.prompts} and --samples {args.samples} must both be >= 1")
    policy = load_policy(args.checkpoint, seed=args.seed, data=args.data)
    indices = eval_positions(policy, args.prompts)
    greedy = rollout(policy, indices, n_samples=1, greedy=True)
    sampled = rollout(policy, indices, n_samples=args.samples, greedy=False)
    figures = {
        "checkpoint": str(policy.path),
        "policy_version": policy.version,
        "prompts": len(indices),
        "held_out": policy.held_out,
        "greedy_reward_mean": sum(r.reward for r in greedy) / len(greedy),
        "sampled_reward_mean": sum(r.reward for r in sampled) / len(sampled),
        "samples_per_prompt": args.samples,
    }
    if args.json:
        print(json.dumps(figures))
    else:
        print(
            f"{policy.path} (policy version {policy.version}) on {len(indices)} "
            f"{'held-out prompts' if policy.held_out else 'prompts of the training file (no --data given)'}: "
            f"greedy reward {figures['greedy_reward_mean']:.3f}, sampled reward {figures['sampled_reward_mean']:.3f} "
            f"({args.samples} per prompt)"
        )
    return 0
