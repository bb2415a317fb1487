"""The built-in example pipelines, by name: what ``flowrl run`` and ``flowrl viz`` accept as GRAPH.

Example:
    >>> sorted(EXAMPLES)
    ['calc_agent', 'guess_game', 'hf_agent', 'hf_copy', 'hf_copy_ppo', 'llamarl', 'llamarl_ppo', 'llamarl_ref', 'longtail', 'qwen_math', 'two_scorers']
"""

from __future__ import annotations

from collections.abc import Callable

from flowrl.errors import GraphError
from flowrl.examples.agents import build_calc_agent, build_guess_game
from flowrl.examples.hf_agent import build_hf_agent
from flowrl.examples.hf_copy import build_hf_copy
from flowrl.examples.longtail import build_longtail
from flowrl.examples.ppo import build_hf_copy_ppo, build_llamarl_ppo
from flowrl.examples.qwen_math import build_qwen_math
from flowrl.examples.llamarl import build_llamarl, build_llamarl_ref, build_two_scorers
from flowrl.graph.ir import Graph

__all__ = ["EXAMPLES", "DEFAULT_EXAMPLE", "DEFAULT_STEPS", "EXAMPLE_STEPS", "build_example", "describe_examples", "default_steps"]

#: name -> (builder, one-line description)
EXAMPLES: dict[str, tuple[Callable[[], Graph], str]] = {
    "llamarl": (build_llamarl, "prompts -> generator -> scorer -> AIPO loss -> policy, weights policy ~> generator (the default)"),
    "llamarl_ppo": (build_llamarl_ppo, "the default pipeline with a critic (a value model) and PPO's GAE advantages instead of group baselines"),
    "llamarl_ref": (build_llamarl_ref, "the default plus a frozen reference model and a KL penalty in the loss"),
    "hf_copy": (build_hf_copy, "a Hugging Face Llama (random init, word tokenizer) learns to copy digits from a JSONL prompt file"),
    "hf_copy_ppo": (build_hf_copy_ppo, "the Hugging Face example with a critic of the same architecture and PPO's GAE advantages"),
    "longtail": (build_longtail, "the default pipeline on the longtail task: completion lengths from a heavy-tailed law (continuous batching's case)"),
    "qwen_math": (build_qwen_math, "Qwen2.5-0.5B-Instruct on math word problems, math-verify reward; point --model at your local copy"),
    "calc_agent": (build_calc_agent, "the built-in model learns to call a calculator tool for sums (multi-turn, CalcEnv)"),
    "hf_agent": (build_hf_agent, "a Hugging Face Llama (random init, word tokenizer) learns to call a tool (ToolEnv) and answer with its result; runs with --engine vllm as shipped"),
    "guess_game": (build_guess_game, "a two-turn guessing game: the environment says higher or lower after a wrong guess"),
    "two_scorers": (build_two_scorers, "two scorers (correctness and brevity) whose rewards the loss weighs"),
}

DEFAULT_EXAMPLE = "llamarl"

#: ``flowrl run``'s step count when ``--steps`` is not given: the default example reaches a reward
#: of about 0.9 by step ~210.
DEFAULT_STEPS = 250

#: Examples that need more steps to show what they learn: ``calc_agent`` copies the calculator's
#: result only after ~350 steps, ``hf_agent`` the tool's after ~200-300 (benches/RESULTS.md, Agents).
EXAMPLE_STEPS: dict[str, int] = {"calc_agent": 600, "hf_agent": 400}


def default_steps(graph: str | None) -> int:
    """``flowrl run GRAPH``'s steps without ``--steps``: the example's own count, else ``DEFAULT_STEPS``.

    Example:
        >>> default_steps(None), default_steps("calc_agent"), default_steps("my_graph.json")
        (250, 600, 250)
    """
    return EXAMPLE_STEPS.get(graph or DEFAULT_EXAMPLE, DEFAULT_STEPS)


def build_example(name: str = DEFAULT_EXAMPLE) -> Graph:
    """The built-in example ``name``; ``GraphError`` listing the examples if there is none."""
    if name not in EXAMPLES:
        raise GraphError(f"no built-in example {name!r}; built-in examples: {', '.join(sorted(EXAMPLES))}")
    return EXAMPLES[name][0]()


def describe_examples() -> list[tuple[str, str]]:
    return [(name, desc) for name, (_, desc) in sorted(EXAMPLES.items())]
