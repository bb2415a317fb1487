"""The long-tail example: the default pipeline on the ``longtail`` task, whose completion lengths are heavy-tailed.

Completions run from 2 to 32 tokens (``flowrl.operators.tasks.LongTailTask``: ``<s>4-3=`` ->
``444</s>``, mean 5.3 tokens), so a lock-step generator waits on the longest of each batch;
``batching="continuous"`` keeps its slots busy instead (``SamplingConfig.batching``).

It learns, slowly: ``flowrl run longtail --steps 200`` went from reward 0.06 to 0.375 (first/last 20
steps; 78 s on a loaded 2-core machine), still rising. The policy learns to repeat the digit first
(most of the credit) and to stop after N later: at step 200 its completions were still long (mean
about 20 tokens, against the task's 5.3). 16 samples per prompt and lr 2e-3 learn; 8 samples and
lr 4e-3 stalled lower (0.28).
"""

from __future__ import annotations

from flowrl.graph.builder import GraphBuilder
from flowrl.graph.configs import ModelConfig
from flowrl.graph.ir import Graph

__all__ = ["build_longtail", "LONGTAIL_MODEL"]

#: The example model with room for a 6-token prompt (at most) and a 32-token completion.
LONGTAIL_MODEL = ModelConfig(vocab_size=16, dim=64, n_layers=2, n_heads=4, n_kv_heads=4, max_seq_len=40)


def build_longtail(*, max_staleness: int = 1, batching: str = "lockstep", slots: int = 0, in_flight: bool = False) -> Graph:
    """prompts(longtail) -> gen -> reward -> aipo -> policy, and policy ~> gen.

    Args:
        max_staleness: k of the weight edge.
        batching: the generator's ``SamplingConfig.batching``, ``"lockstep"`` or ``"continuous"``.
        slots: rows of a continuous generator (0: one per sample of a batch).
        in_flight: let the generator take new weights between decode steps (``WeightEdge.in_flight``).
    """
    b = GraphBuilder("longtail", model=LONGTAIL_MODEL)
    prompts = b.source("prompts", task="longtail", batch_size=8)
    gen = b.generator("gen", prompts, n_samples=16, max_new_tokens=32, temperature=1.0, batching=batching, slots=slots)
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:longtail_reward")
    aipo = b.loss("aipo", gen, reward, objective="aipo", rho=4.0, normalize_std=True)
    policy = b.policy("policy", aipo, lr=2e-3)
    b.weights(policy, gen, max_staleness=max_staleness, in_flight=in_flight)
    return b.build()
