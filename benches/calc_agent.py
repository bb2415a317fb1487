"""Score a ``calc_agent`` checkpoint: how often it calls the calculator and copies its result.

Runs fresh episodes (prompts of ``CalcTask(--task-seed)``, not the training stream's) with the
checkpoint's policy, sampled as in training (temperature 1), and prints JSON: the episodes, their
mean reward, the fraction that call the calculator first (``=``), the fraction whose final answer
equals the calculator's result, and the fraction whose answer's first digit is right.

    flowrl run calc_agent --checkpoint-dir ck --checkpoint-every 200
    python benches/calc_agent.py ck [--prompts 64] [--task-seed 12345]      # the newest; or ck/step-00000400
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from flowrl.envs.games import CalcTask  # noqa: E402
from flowrl.examples.agents import build_calc_agent  # noqa: E402
from flowrl.runtime.checkpointing.store import read_policy_state  # noqa: E402
from flowrl.operators.generation import Generator  # noqa: E402
from flowrl.operators.multiturn import MultiTurnGenerator  # noqa: E402
from flowrl.operators.source import pad_left  # noqa: E402
from flowrl.models.families.builtin.tokenizer import DEFAULT_TOKENIZER as TOK  # noqa: E402


def score(checkpoint: str, *, prompts: int = 64, task_seed: int = 12345, seed: int = 1) -> dict[str, float]:
    graph = build_calc_agent(max_staleness=0)
    node = graph.node("gen")
    gen = Generator(node, seed=seed)
    state = read_policy_state(checkpoint)  # what flowrl export reads: a run's checkpoint directory or one step-* in it
    gen.load_weights(state["model"], int(state["version"]))
    episodes = MultiTurnGenerator(gen, node)
    task = CalcTask(seed=task_seed)
    n = called = copied = first = 0
    reward = 0.0
    for start in range(0, prompts, 16):
        rows = [task.prompt(i) for i in range(start, min(start + 16, prompts))]
        ids, lens = pad_left(rows, TOK.pad_id)
        batch, _ = episodes.generate({"prompt_ids": ids, "prompt_lens": lens, "prompt_index": torch.arange(start, start + len(rows))})
        for i in range(batch["completion_ids"].shape[0]):
            text = TOK.decode(batch["completion_ids"][i, : int(batch["completion_lens"][i])].tolist())
            prompt = TOK.decode(batch["sample_prompt_ids"][i, -int(batch["sample_prompt_lens"][i]) :].tolist())
            a, b = prompt.removeprefix("<s>").removesuffix("=").split("+")
            total = str(int(a) + int(b))
            n += 1
            reward += float(batch["env_rewards"][i])
            call = f"={total}</s>"  # the call, then the calculator's observation
            if text.startswith(call):
                called += 1
                answer = text[len(call) :].replace("</s>", "").removesuffix("=")
                copied += answer == total
                first += answer[:1] == total[:1]
    return {"episodes": n, "reward_mean": reward / n, "called": called / n, "answer_is_tool_result": copied / n, "first_digit_right": first / n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", help="a calc_agent run's --checkpoint-dir (its newest) or one step-* directory in it")
    ap.add_argument("--prompts", type=int, default=64, help="prompts, 16 episodes each (default: 64)")
    ap.add_argument("--task-seed", type=int, default=12345, help="CalcTask seed of the fresh prompts")
    args = ap.parse_args()
    print(json.dumps(score(args.checkpoint, prompts=args.prompts, task_seed=args.task_seed), indent=1))


if __name__ == "__main__":
    main()
