"""Multi-turn episodes on the vLLM engine: each model turn one vLLM request, environments stepping while other samples decode.

``VLLMMultiTurn`` runs the episodes of ``flowrl.operators.multiturn`` (the same environment
protocol, ``ToolEnv``, limits and failure handling: the episode steps ``EpisodeSteps`` it shares with ``MultiTurnGenerator``)
with a ``VLLMGenerator``'s engine, driven through vLLM's step API (``llm.llm_engine``:
``add_request`` / ``step``) instead of one ``generate`` call per turn:

    every episode: reset in a thread; when it returns, its first turn is submitted
    loop until every episode is done:
        an environment call that returned -> finish_reset / finish_step; the next turn is submitted
        vLLM step -> the requests that finished: add_turn, step(turn text) started in a thread

So a sample whose environment is thinking never holds the others back: vLLM keeps decoding the
turns it has while the environment threads run, and a turn joins vLLM's running batch as soon as
its observation is in. Token ids in and out: each turn's prompt is the sample's whole sequence as
sampled (``TokensPrompt`` of prompt + turns + observations, never re-tokenised text), and vLLM
returns the turn's token ids and mu's log-probs (``processed_logprobs``, as ``VLLMGenerator``).

Prefix cache: vLLM's automatic prefix caching (``enable_prefix_caching``, on by default) keeps the
KV blocks of the sequence a turn was sampled from, so the next turn of the same sample prefills only
what its last block did not cover (the blocks are hashed by content; a weight update resets the
cache, ``VLLMGenerator._push``). ``env/cached_prompt_frac`` reports the fraction of the turns' prompt
tokens vLLM found cached; ``benches/vllm_multiturn.py`` times episodes with and without it.

Seeds: turn ``t`` of sample ``j`` of the prompt at stream position ``i`` draws with the seed
``mix(seed, i, j, t)``, whatever it is batched with. Versions: weights change only between
``generate`` calls (lock step), so every model token has the generator's version.

With ``batching="continuous"`` ``generate`` is not used: ``flowrl.runtime.programs.continuous.ContinuousRollouts``
drives this class's episode steps with ``vllm_stream.VLLMSlotBatcher``, one streamed sample per
model turn; a weight update in flight stops the running turns and re-submits them with their kept
tokens, so each token records the version that drew it.

``env/seconds`` is the wall-clock time vLLM had no request to decode while an environment call ran
(the time the generator waited on environments, not the environments' total: see
``env/seconds_per_sample``).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from flowrl.envs.environment import Pending
from flowrl.operators.batch import Batch
from flowrl.operators.generation import _mix
from flowrl.operators.multiturn import Episode, EpisodeSteps

if TYPE_CHECKING:
    from flowrl.operators.engines.vllm_engine import VLLMGenerator

__all__ = ["VLLMMultiTurn"]

#: Seconds to sleep when nothing decodes and no environment call has returned yet.
IDLE_POLL_S = 0.0005
_CALLS = itertools.count()


class VLLMMultiTurn(EpisodeSteps["VLLMGenerator"]):
    """The episode steps (``EpisodeSteps``) over a ``VLLMGenerator`` (see the module docstring); ``MultiTurnGenerator``'s arguments."""

    def _params(self, ep: Episode) -> Any:
        from vllm.sampling_params import RequestOutputKind

        params = self.gen.sampling_params(_mix(self.gen.seed, ep.index, ep.sample, ep.turns) >> 1)
        params.n = 1
        params.output_kind = RequestOutputKind.FINAL_ONLY  # the turn once it is over, not every step
        return params

    def generate(self, prompts: Mapping[str, torch.Tensor], rows: list[dict[str, Any]] | None = None) -> tuple[Batch, dict[str, float]]:
        """Episodes for every sample of ``prompts`` (``prompt_ids``, ``prompt_lens``, ``prompt_index``):
        the rollout with ``ENV_FIELDS`` and the ``env/*`` metrics, as ``MultiTurnGenerator.generate``."""
        from vllm.inputs import TokensPrompt

        gen = self.gen
        ids, lens = gen._check(prompts)
        index = prompts.get("prompt_index")
        if index is None:
            index = torch.arange(ids.shape[0], dtype=torch.int64)
        P, n, width = ids.shape[0], gen.sampling.n_samples, ids.shape[1]
        opened = [self.episode(ids[p, width - int(lens[p]) :].tolist(), int(index[p]), j, rows[p] if rows else None)
                  for p in range(P) for j in range(n)]  # fmt: skip
        episodes = [ep for ep, _ in opened]
        engine = gen.llm.llm_engine
        adapter = gen.lora_request()
        call = next(_CALLS)
        waiting: dict[int, tuple[Pending, list[int] | None]] = {}  # episode -> its environment call (and the turn it answers; None: reset)
        running: dict[str, int] = {}  # vLLM request id -> episode
        cached = prompted = 0
        env_wall = 0.0

        def submit(i: int) -> None:
            nonlocal prompted
            ep = episodes[i]
            if not self.wants_turn(ep):
                return
            rid = f"flowrl-mt-{call}-{i}-{ep.turns}"
            sequence = ep.prompt + ep.tokens
            engine.add_request(rid, TokensPrompt(prompt_token_ids=sequence), self._params(ep), lora_request=adapter)
            running[rid] = i
            prompted += len(sequence)

        for i, (ep, row) in enumerate(opened):
            waiting[i] = (self.start_reset(ep, row), None)
        try:
            while waiting or running:
                for i in [i for i, (pending, _) in waiting.items() if pending.ready()]:
                    pending, turn = waiting.pop(i)
                    if turn is None:
                        self.finish_reset(episodes[i], pending())
                    else:
                        self.finish_step(episodes[i], pending(), turn)
                    submit(i)
                if running:
                    for out in engine.step():
                        if not out.finished:
                            continue
                        i = running.pop(out.request_id)
                        cached += int(getattr(out, "num_cached_tokens", 0) or 0)
                        (completion,) = out.outputs
                        drawn = list(completion.token_ids)[: gen.sampling.max_new_tokens]
                        logps = [step[token].logprob for step, token in zip(completion.logprobs, drawn)]
                        drawn, logps = gen._cut_at_stop_string(drawn, logps)
                        action = self.add_turn(episodes[i], drawn, logps, [gen.version] * len(drawn))
                        waiting[i] = (self.start_step(episodes[i], action), drawn)
                elif waiting:  # nothing to decode: the generator waits on environments
                    t0 = time.perf_counter()
                    time.sleep(IDLE_POLL_S)
                    env_wall += time.perf_counter() - t0
        finally:
            if running:  # an exception mid-batch: no request of this call stays in vLLM
                engine.abort_request(list(running))
        sample_ids, sample_lens = ids.repeat_interleave(n, 0), lens.repeat_interleave(n, 0)
        metrics = self.metrics(episodes, env_wall)
        metrics["env/cached_prompt_frac"] = cached / prompted if prompted else 0.0
        return self.batch(episodes, sample_ids, sample_lens, index), metrics
