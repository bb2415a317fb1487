"""Synthetic programs of known durations: the runtime measured without the model in the way.

They keep every runtime contract the real programs keep (real weight transports, real version
numbers, real data fields), but sleep instead of computing. ``benches/overlap.py`` and the
staleness tests use them; point ``RunConfig.programs`` at ``SYNTHETIC`` to use them.

Options (``RunConfig.options``):
    gen_s, train_s, score_s: seconds per step (default 0.01, 0.01, 0.0);
    jitter: each duration is scaled by a factor in [1 - jitter, 1 + jitter], seeded by (seed, step);
    fail_node, fail_step: that node raises ``RuntimeError`` at that step (fault injection);
    die_node, die_step: that node's process kills itself with SIGKILL at that step (the whole run
        in the local backend, the node's worker in the process backend, its rank under torchrun);
    save_s: a policy checkpoint takes this long to write (half the file, a pause, the rest), so
        that a kill can land while a checkpoint is being written (behind training where the
        controller holds the program: ``snapshot``);
    weight_numel: size of the synthetic weights (float32 elements).

From the command line: ``flowrl run --synthetic --option gen_s=0.05 --option die_node=gen ...``.
"""

from __future__ import annotations

import io
import os
import random
import signal
import time
from typing import Any, Generic, TypeVar

import torch

from flowrl.graph.ir import Graph
from flowrl.graph.kinds import KINDS
from flowrl.graph.nodes import GeneratorNode, Node, NodeBase, PolicyNode, ReferenceNode, ScorerNode, SourceNode
from flowrl.runtime.programs.nodes import Batch, Info, ProgramBase, ProgramEnv, SharedTransports

N = TypeVar("N", bound=NodeBase)

__all__ = ["SYNTHETIC", "synthetic_programs", "OPTIONS"]

#: Every option the synthetic programs read (the module docstring says what each does).
OPTIONS: tuple[str, ...] = (
    "gen_s", "train_s", "score_s", "jitter", "fail_node", "fail_step", "die_node", "die_step", "save_s", "weight_numel",
)


class _Synthetic(ProgramBase, Generic[N]):
    def __init__(self, node: N, graph: Graph, env: ProgramEnv, transports: SharedTransports) -> None:
        self.name = node.name
        self.node = node
        self.graph = graph
        self.opt = env.options
        self.seed = env.seed
        self.transports = transports
        self.weights = {"w": torch.zeros(int(self.opt.get("weight_numel", 1024)))}
        self.version = 0

    def _sleep(self, key: str, default: float, seq: int) -> float:
        base = float(self.opt.get(key, default))
        jitter = float(self.opt.get("jitter", 0.0))
        factor = 1.0 + jitter * (2 * random.Random(f"{self.seed}:{self.name}:{seq}").random() - 1)
        duration = max(0.0, base * factor)
        if duration:
            time.sleep(duration)
        return duration

    def _maybe_fail(self, seq: int) -> None:
        if self.opt.get("die_node") == self.name and int(self.opt.get("die_step", -1)) == seq:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.opt.get("fail_node") == self.name and int(self.opt.get("fail_step", -1)) == seq:
            raise RuntimeError(f"injected failure in {self.name} at step {seq}")


class SyntheticSource(_Synthetic[SourceNode]):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.position = 0
        self.batch_size = self.node.source.batch_size

    def seek(self, position: int) -> None:
        self.position = position

    def step(self, seq: int, inputs: Batch, min_version: int) -> tuple[Batch, Info]:
        self._maybe_fail(seq)
        b = self.batch_size
        index = torch.arange(self.position, self.position + b)
        self.position += b
        return {"prompt_ids": index[:, None] % 7, "prompt_lens": torch.ones(b, dtype=torch.long), "prompt_index": index}, {}


class SyntheticGenerator(_Synthetic[GeneratorNode]):
    """Fetches real weights (a tensor filled with its version) and checks they match the version."""

    def step(self, seq: int, inputs: Batch, min_version: int) -> tuple[Batch, Info]:
        (edge,) = self.graph.weight_edges_into(self.name)
        transport = self.transports.reader(edge.src, edge.dst)
        t0 = time.perf_counter()
        deadline = t0 + 60
        while True:
            got = transport.fetch_into(self.weights, newer_than=self.version)
            if got is not None:
                self.version = got
            if self.version >= min_version:
                break
            if time.perf_counter() > deadline:
                raise TimeoutError(f"{self.name}: no weights of version >= {min_version}")
            time.sleep(0.0005)
        if not torch.all(self.weights["w"] == float(self.version)):
            raise RuntimeError(f"{self.name}: weights do not match version {self.version} (torn fetch?)")
        fetch_s = time.perf_counter() - t0
        self._maybe_fail(seq)
        gen_s = self._sleep("gen_s", 0.01, seq)
        n = self.node.sampling.n_samples
        prompts = inputs["prompt_ids"].shape[0]
        s, t = prompts * n, 2
        rollout = {
            "sample_prompt_ids": inputs["prompt_ids"].repeat_interleave(n, 0),
            "sample_prompt_lens": inputs["prompt_lens"].repeat_interleave(n, 0),
            "completion_ids": torch.zeros(s, t, dtype=torch.long),
            "completion_mask": torch.ones(s, t, dtype=torch.bool),
            "completion_lens": torch.full((s,), t),
            "behaviour_logprobs": torch.zeros(s, t),
            "sampling_temperature": torch.ones(s),
            "group_ids": torch.arange(prompts).repeat_interleave(n),
            "rollout_version": torch.tensor(self.version),
            "prompt_index": inputs["prompt_index"],
        }
        return rollout, {"gen_s": gen_s, "fetch_s": fetch_s, "version": self.version}


class SyntheticScorer(_Synthetic[ScorerNode]):
    def step(self, seq: int, inputs: Batch, min_version: int) -> tuple[Batch, Info]:
        self._maybe_fail(seq)
        self._sleep("score_s", 0.0, seq)
        out = self.node.output
        return {out: torch.ones(inputs["completion_ids"].shape[0])}, {}


class SyntheticReference(_Synthetic[ReferenceNode]):
    def step(self, seq: int, inputs: Batch, min_version: int) -> tuple[Batch, Info]:
        self._maybe_fail(seq)
        return {"ref_logprobs": torch.zeros(inputs["completion_ids"].shape, dtype=torch.float32)}, {}


class SyntheticPolicy(_Synthetic[PolicyNode]):
    """Sleeps ``train_s``, bumps its version, publishes weights filled with the new version."""

    def _publish(self) -> float:
        t0 = time.perf_counter()
        self.weights["w"].fill_(float(self.version))
        for e in self.graph.weight_edges_from(self.name):
            self.transports.writer(e.src, e.dst).publish(self.weights, self.version)
        return time.perf_counter() - t0

    def start(self) -> None:
        self._publish()

    def step(self, seq: int, inputs: Batch, min_version: int) -> tuple[Batch, Info]:
        self._maybe_fail(seq)
        train_s = self._sleep("train_s", 0.01, seq)
        self.version += self.graph.updates_per_batch()  # one version per optimizer step
        publish_s = self._publish()
        return {}, {"loss": 0.0, "train_s": train_s, "publish_s": publish_s, "version": self.version}

    def snapshot(self, path: str) -> Any:
        """The version taken now; the write (``save_s`` long) returned, to run behind training."""
        state = {"version": torch.tensor(self.version)}
        pause = float(self.opt.get("save_s", 0.0))

        def write() -> None:
            if not pause:
                torch.save(state, path)
                return
            buffer = io.BytesIO()
            torch.save(state, buffer)
            data = buffer.getvalue()
            with open(path, "wb") as f:  # a slow writer: half, a pause, the rest
                f.write(data[: len(data) // 2])
                f.flush()
                time.sleep(pause)
                f.write(data[len(data) // 2 :])

        return write

    def save(self, path: str) -> None:
        self.snapshot(path)()

    def load(self, path: str) -> None:
        self.version = int(torch.load(path, weights_only=True)["version"])


#: Each class takes its kind's node (the key picks it).
_BY_KIND: dict[str, type[_Synthetic[Any]]] = {
    "source": SyntheticSource,
    "generator": SyntheticGenerator,
    "scorer": SyntheticScorer,
    "reference": SyntheticReference,
    "policy": SyntheticPolicy,
}


def synthetic_program(node: Node, graph: Graph, env: ProgramEnv, transports: SharedTransports) -> ProgramBase:
    """Factory for ``RunConfig.programs``: the synthetic program of ``node``'s kind."""
    return _BY_KIND[node.kind](node, graph, env, transports)


SYNTHETIC = "flowrl.runtime.programs.synthetic:synthetic_program"


def synthetic_programs(graph: Graph) -> dict[str, str]:
    """``RunConfig.programs`` making every node of ``graph`` synthetic."""
    return {n.name: SYNTHETIC for n in graph.nodes if KINDS[n.kind].runs_on != "policy"}
