"""Evaluation during training (``flowrl run --eval-every N --eval-data FILE``): the policy after every Nth
trainer step scored on held-out rows, greedy and sampled, with pass@k, off the trainer's path.

At an evaluation step the controller has the policy save its state (``NodeProgram.save``, the file a
checkpoint holds: the one way to read a policy's weights that every backend offers) into a scratch
folder and goes on; one background thread loads those weights into a generator of its own (built once
from the running graph: ``policy_samples.policy_on_rows``, torch on one intra-op thread) and scores
the eval rows as ``flowrl eval`` does (``policy_samples.rollout``: one greedy completion and ``k``
sampled ones per row, scored by the graph's scorers, combined with the loss's ``reward_weights``).
Training waits only for the save. The step's metrics row waits for its results, since rows are
written in step order (``Controller``), and a checkpoint waits for the evaluations of the steps it
covers, so a stopped run's metrics file never lacks an evaluation a resume would not repeat.

The keys an evaluated row gets (``EVAL_KEYS`` and the ``eval/pass@j``):

- ``eval/version``: the policy version evaluated (the row's ``policy_version``); ``eval/rows``: rows scored;
- ``eval/greedy_reward_mean``, ``eval/sampled_reward_mean`` (over the ``k`` samples of every row);
- ``eval/greedy_pass``: the fraction of rows whose greedy completion passes (combined reward
  ``>= pass_reward``); ``eval/pass@j`` for ``j`` in ``pass_ks(k)``: the unbiased estimate (Chen et
  al. 2021, arXiv 2107.03374) from the ``k`` samples, averaged over rows;
- ``eval/reward/NAME``: each named reward's greedy mean, when the loss combines several;
- ``eval/time_s``: seconds the evaluation took in its thread; ``eval/save_s``: seconds the policy
  took to save its state, the only time the trainer waited for this evaluation.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from flowrl.errors import ConfigError

if TYPE_CHECKING:
    from flowrl.graph.ir import Graph
    from flowrl.runtime.evaluation.policy_samples import LoadedPolicy, Scored
    from flowrl.runtime.programs.nodes import NodeProgram

__all__ = ["pass_at_k", "pass_ks", "eval_metrics", "evaluate_policy", "check_eval_data", "Evaluator", "merge_eval", "EVAL_KEYS"]

#: The keys every evaluated row has, besides ``eval/pass@j`` and ``eval/reward/NAME``.
EVAL_KEYS = (
    "eval/version", "eval/rows", "eval/greedy_reward_mean", "eval/sampled_reward_mean", "eval/greedy_pass", "eval/time_s", "eval/save_s",
)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from ``n`` samples of which ``c`` pass: ``1 - C(n-c, k) / C(n, k)``.

    The probability that ``k`` of the ``n`` samples, drawn without replacement, hold at least one
    that passes (Chen et al. 2021, "Evaluating Large Language Models Trained on Code").

    Example:
        >>> pass_at_k(5, 2, 1), pass_at_k(5, 2, 2), pass_at_k(5, 2, 4)
        (0.4, 0.7, 1.0)

    Raises:
        ValueError: unless ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_ks(n: int) -> list[int]:
    """The ``k`` of the pass@k reported from ``n`` samples per row: the powers of two below ``n``, and ``n``.

    Example:
        >>> pass_ks(1), pass_ks(4), pass_ks(6)
        ([1], [1, 2, 4], [1, 2, 4, 6])
    """
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return [*ks, n]


def eval_metrics(greedy: Sequence[Scored], sampled: Sequence[Scored], *, samples: int, pass_reward: float) -> dict[str, float]:
    """The ``eval/...`` figures (the module docstring) of one greedy completion per row and
    ``samples`` sampled ones per row (row ``i``'s are ``sampled[i * samples : (i + 1) * samples]``).

    Raises:
        ValueError: when ``sampled`` does not hold ``samples`` completions for each greedy row.
    """
    if len(sampled) != samples * len(greedy) or not greedy:
        raise ValueError(f"{len(greedy)} rows need {samples} sampled completions each; got {len(sampled)}")
    rows = len(greedy)
    out = {
        "eval/rows": float(rows),
        "eval/greedy_reward_mean": sum(s.reward for s in greedy) / rows,
        "eval/sampled_reward_mean": sum(s.reward for s in sampled) / len(sampled),
        "eval/greedy_pass": sum(s.reward >= pass_reward for s in greedy) / rows,
    }
    passed = [sum(s.reward >= pass_reward for s in sampled[i * samples : (i + 1) * samples]) for i in range(rows)]
    for k in pass_ks(samples):
        out[f"eval/pass@{k}"] = sum(pass_at_k(samples, c, k) for c in passed) / rows
    names = sorted({name for s in greedy for name in s.rewards})
    if len(names) > 1:
        out.update({f"eval/reward/{name}": sum(s.rewards.get(name, 0.0) for s in greedy) / rows for name in names})
    return out


def evaluate_policy(policy: LoadedPolicy, *, samples: int, pass_reward: float) -> dict[str, float]:
    """Score ``policy`` (its current weights) on every row of its prompt file: ``eval_metrics`` of a
    greedy and ``samples`` sampled completions per row, with ``eval/version``."""
    from flowrl.runtime.evaluation.policy_samples import eval_positions, rollout

    assert policy.source.stream is not None  # policy_on_rows with a file (check_eval_data refuses a task)
    indices = eval_positions(policy, len(policy.source.stream))
    greedy = rollout(policy, indices, n_samples=1, greedy=True)
    sampled = rollout(policy, indices, n_samples=samples, greedy=False)
    return {"eval/version": float(policy.version), **eval_metrics(greedy, sampled, samples=samples, pass_reward=pass_reward)}


def check_eval_data(graph: Graph, data: str) -> None:
    """Refuse an evaluation file that cannot be used, before any work: missing or unreadable, lacking
    the prompt field or a field a text scorer needs, or given for a graph whose source is a task.

    Raises:
        ConfigError: naming the file, what is wrong and the fix.
    """
    from flowrl.graph.nodes import SourceNode
    from flowrl.runtime.evaluation.policy_samples import rows_and_scorers

    sources = graph.nodes_of(SourceNode)
    if not sources:
        raise ConfigError(f"eval_data {data!r}: graph {graph.name!r} has no source node whose rows the eval rows replace")
    config = sources[0].source
    if not config.data:
        raise ConfigError(
            f"eval_data {data!r}: graph {graph.name!r} draws prompts from task {config.task!r}, not a file; evaluation during "
            "training reads held-out rows of a prompt file (evaluate a task's checkpoints with 'flowrl eval CHECKPOINT')"
        )
    if not os.path.isfile(data):
        raise ConfigError(f"eval_data {data!r}: no such file; give a prompt file with the fields of {config.data!r}")
    try:
        rows_and_scorers(graph, data)
    except ConfigError as exc:
        raise ConfigError(f"eval_data {data!r}: {exc}") from None


class Evaluator:
    """Evaluates saved policy versions in a background thread (see the module docstring).

    Args:
        graph: the running graph; policy: the policy node whose versions are evaluated.
        data: the eval rows' file; samples: sampled completions per row (``k``).
        pass_reward: a completion passes when its combined reward is at least this.
        seed: seed of the evaluation's sampling (the same prompts and weights give the same figures).
    """

    def __init__(self, graph: Graph, policy: str, *, data: str, samples: int, pass_reward: float, seed: int = 0) -> None:
        from flowrl.runtime.parallel.threads import set_intra_op_threads
        from flowrl.runtime.evaluation.policy_samples import policy_on_rows

        self.samples, self.pass_reward = samples, pass_reward
        self.policy = policy_on_rows(graph, policy=policy, seed=seed, data=data)
        self._dir = tempfile.mkdtemp(prefix="flowrl-eval-")
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="flowrl-eval", initializer=set_intra_op_threads, initargs=(1,))

    def submit(self, program: NodeProgram, version: int) -> Future[dict[str, float]]:
        """Save ``program``'s state now (the trainer waits for this only) and evaluate it in the background."""
        path = os.path.join(self._dir, f"policy-v{version}")  # a file, or a sharded policy's directory of shards
        start = time.perf_counter()
        program.save(path)
        return self._pool.submit(self._evaluate, path, time.perf_counter() - start)

    def _evaluate(self, path: str, save_s: float) -> dict[str, float]:
        from flowrl.runtime.evaluation.policy_samples import load_weights
        from flowrl.runtime.checkpointing.sharded_state import read_state

        start = time.perf_counter()
        state = read_state(path)
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
        load_weights(self.policy, state)
        out = evaluate_policy(self.policy, samples=self.samples, pass_reward=self.pass_reward)
        out["eval/time_s"] = time.perf_counter() - start
        out["eval/save_s"] = save_s
        return out

    def close(self) -> None:
        """Drop the evaluations not started, wait for the running one, remove the scratch folder."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(self._dir, ignore_errors=True)


def merge_eval(row: dict[str, Any], results: Mapping[str, float]) -> None:
    """Put an evaluation's figures into ``row`` (``eval/version``, ``eval/rows`` as integers)."""
    for key, value in results.items():
        row[key] = int(value) if key in ("eval/version", "eval/rows") else value
