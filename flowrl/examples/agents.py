"""Multi-turn examples: ``calc_agent`` (the built-in model learns to call a calculator) and ``guess_game``
(a two-turn guessing game), both with environments of ``flowrl.envs.games``."""

from __future__ import annotations

from flowrl.graph.builder import GraphBuilder
from flowrl.graph.ir import Graph
from flowrl.examples.llamarl import DEFAULT_MODEL, train_with_aipo

__all__ = ["build_calc_agent", "build_guess_game", "AGENT_MODEL"]

#: The built-in examples' tiny model (~100K parameters; ``max_seq_len`` 32 holds a two-turn conversation).
AGENT_MODEL = DEFAULT_MODEL


def build_calc_agent(*, max_staleness: int = 1) -> Graph:
    """Sums of two 2-digit numbers, ``<s>27+38=``: the model may call the calculator with ``=`` (a
    turn ends at ``</s>`` or ``=``), reads the result (``65</s>``, environment tokens, never trained) and
    answers (``65</s>``); ``CalcEnv`` rewards an answer after a call digit by digit, one without a
    call only when exactly right."""
    b = GraphBuilder("calc_agent", model=AGENT_MODEL)
    prompts = b.source("prompts", task="flowrl.envs.games:calc_task", batch_size=16)
    gen = b.generator("gen", prompts, n_samples=16, max_new_tokens=6, stop_tokens=(2, 14),  # a turn ends at </s> or =
                      env="flowrl.envs.games:CalcEnv", max_turns=2)
    train_with_aipo(b, gen, lr=1e-3, max_staleness=max_staleness)  # the loss reads the env's rewards (env_rewards)
    return b.build()


def build_guess_game(*, max_staleness: int = 1) -> Graph:
    """Guess a digit in two tries: the environment answers ``+`` (higher) or ``-`` (lower) after a wrong first guess."""
    b = GraphBuilder("guess_game", model=AGENT_MODEL)
    prompts = b.source("prompts", task="flowrl.envs.games:guess_task", batch_size=16)
    gen = b.generator("gen", prompts, n_samples=16, max_new_tokens=3, env="flowrl.envs.games:GuessNumberEnv", max_turns=2)
    train_with_aipo(b, gen, lr=2e-3, max_staleness=max_staleness)
    return b.build()
