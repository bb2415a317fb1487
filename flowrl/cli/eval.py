"""``flowrl eval CHECKPOINT``: a checkpoint's greedy and sampled reward, pass rates (pass@k) and each
scorer's reward on held-out prompts of its task: the figures ``--eval-every`` gives during a run.

Held-out prompts are the task's prompt indices from ``HELD_OUT_START`` (2**40) on, beyond what any
training run reads (``flowrl.runtime.evaluation.policy_samples``).
"""

from __future__ import annotations

import argparse
import json

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    from flowrl.cli.policy_samples import add_checkpoint_arguments

    p = sub.add_parser(
        "eval",
        help="score a checkpoint on held-out prompts (greedy and sampled reward, pass@k, per-scorer reward)",
        description="Score the policy in CHECKPOINT on held-out prompts: for a built-in task, its prompt indices from "
        "2**40 on, which no training run reads; for a prompt file, the rows of --data FILE (without it, the training "
        "file's first rows, reported as not held out). Prints the mean reward of greedy completions and of sampled ones, "
        "the share passing --pass-reward (greedy, and pass@1..pass@S by the unbiased estimator from S samples), and, with "
        "several scorers, each one's greedy reward: what --eval-every reports during a run.",
    )
    add_checkpoint_arguments(p)
    p.add_argument("--prompts", type=int, default=256, metavar="N", help="held-out prompts (default: 256)")
    p.add_argument("--samples", type=int, default=4, metavar="S", help="sampled completions per prompt (default: 4)")
    p.add_argument("--pass-reward", type=float, default=1.0, metavar="R",
                   help="a completion passes when its reward is >= R: greedy pass rate and pass@1..pass@S (default: 1.0, as --eval-pass-reward)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from flowrl.errors import ConfigError
    from flowrl.runtime.evaluation.during_run import eval_metrics
    from flowrl.runtime.evaluation.policy_samples import eval_positions, load_policy, rollout

    if args.prompts < 1 or args.samples < 1:
        raise ConfigError(f"--prompts {args.prompts} and --samples {args.samples} must both be >= 1")
    policy = load_policy(args.checkpoint, seed=args.seed, data=args.data)
    indices = eval_positions(policy, args.prompts)
    greedy = rollout(policy, indices, n_samples=1, greedy=True)
    sampled = rollout(policy, indices, n_samples=args.samples, greedy=False)
    metrics = eval_metrics(greedy, sampled, samples=args.samples, pass_reward=args.pass_reward)  # what --eval-every reports in a run
    figures = {
        "checkpoint": str(policy.path),
        "policy_version": policy.version,
        "prompts": len(indices),
        "held_out": policy.held_out,
        "samples_per_prompt": args.samples,
        "pass_reward": args.pass_reward,
        **{key.removeprefix("eval/"): value for key, value in metrics.items() if key != "eval/rows"},
    }
    if args.json:
        print(json.dumps(figures))
        return 0
    passes = ", ".join(f"{k} {v:.3f}" for k, v in figures.items() if k.startswith("pass@"))
    per_reward = ", ".join(f"{k.removeprefix('reward/')} {v:.3f}" for k, v in figures.items() if k.startswith("reward/"))
    print(
        f"{policy.path} (policy version {policy.version}) on {len(indices)} "
        f"{'held-out prompts' if policy.held_out else 'prompts of the training file (no --data given)'}: "
        f"greedy reward {figures['greedy_reward_mean']:.3f}, sampled reward {figures['sampled_reward_mean']:.3f} "
        f"({args.samples} per prompt); reward >= {args.pass_reward:g}: greedy {figures['greedy_pass']:.3f}, {passes}"
        + (f"; greedy reward by scorer: {per_reward}" if per_reward else "")
    )
    return 0
