"""The Hugging Face agent example: a small Llama-architecture model learns to call a tool (``ToolEnv``) and answer with what it returned.

Each prompt asks what is in a box; the digit inside is a field of the prompt file's row (``secret``),
not in the prompt, so the model can only guess it (1 time in 10 at best) unless it calls the tool.
``BoxEnv`` is a ``flowrl.envs.tools.ToolEnv`` with one tool, ``open_box()``, which returns the
row's digit; the episode (at most two model turns):

    what is in the box ?                                       the prompt
    <tool_call>{"name":"open_box","arguments":{}}</tool_call>  model turn 1: a call (it ends the turn)
    <tool_response> 7 </tool_response>                         the tool's result (environment tokens, never trained)
    7 </s>                                                     model turn 2: the answer

The call is parsed from the turn's text by ``parse_tool_calls`` and run by ``call_tool`` like any
tool's (the Hermes ``<tool_call>`` form); a turn without a call is the final answer. The word-level
tokenizer holds the call as one word (JSON without spaces), so a model from random weights can find
it; the tool's response is plain text encoded once (``<tool_response>``, the digit,
``</tool_response>``).

Everything is built in code and shipped as plain files in ``flowrl/examples/assets/hf_agent``
(regenerate with ``python -m flowrl.examples.hf_agent DIR``; a test checks the shipped files equal what
this module builds): a ``LlamaConfig`` of ~88K parameters with 2 heads of 32 (the head size vLLM's CPU
kernels take, so ``flowrl run hf_agent --engine vllm`` runs as shipped), the tokenizer, and
``prompts.jsonl``. Random weights: ``HFModelConfig(init="random", seed=0)``.

Example:
    >>> env = BoxEnv()
    >>> env.reset({"secret": 7})
    >>> env.step(CALL)
    ('<tool_response>\\n7\\n</tool_response>', 0.0, {'calls': 1})
    >>> env.step("7 </s>")
    (None, 1.0, {'calls': 1})
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

from flowrl.data.files import write_jsonl
from flowrl.envs.tools import ToolEnv
from flowrl.examples.assets_cli import main
from flowrl.examples.hf_copy import build_config
from flowrl.graph.builder import GraphBuilder
from flowrl.graph.configs import HFModelConfig
from flowrl.graph.engines import Engine
from flowrl.graph.ir import Graph

__all__ = ["ASSETS", "CALL", "WORDS", "BoxEnv", "build_hf_agent", "build_tokenizer", "make_prompts", "write_assets"]

#: The shipped files (config, tokenizer, prompts).
ASSETS = Path(__file__).parent / "assets" / "hf_agent"

#: The call of ``open_box`` in the Hermes form, one word of the tokenizer.
CALL = '<tool_call>{"name":"open_box","arguments":{}}</tool_call>'

#: The vocabulary, in id order: pad, bos, eos, unk, the digits, the prompt's words, the call and the response's tags.
WORDS: tuple[str, ...] = (
    "<pad>", "<s>", "</s>", "<unk>", *"0123456789",
    "what", "is", "in", "the", "box", "?", "open", "a",
    CALL, "<tool_response>", "</tool_response>",
)  # fmt: skip


#: The reward of an answer given after a call (a second call instead of an answer earns nothing); an
#: answer whose first word is the digit earns the rest of 1.
CALL_CREDIT = 0.2


class BoxEnv(ToolEnv):
    """One tool, ``open_box``, returning the row's ``secret``. The answer's reward: ``CALL_CREDIT`` if
    the tool was called, plus ``1 - CALL_CREDIT`` if its first word is the digit (1 for call and copy,
    0.2 for call and a wrong answer, 0.08 on average for a guess without a call)."""

    max_calls = 1

    def __init__(self) -> None:
        self.tools = (self.open_box,)
        super().__init__()

    def open_box(self) -> int:
        """Open the box: the digit inside."""
        return int(self.row["secret"])

    def reward(self, answer: str, row: dict[str, Any]) -> float:
        words = answer.replace("</s>", " ").split()
        return CALL_CREDIT * (self.calls > 0) + (1.0 - CALL_CREDIT) * (words[:1] == [str(row["secret"])])


def build_hf_agent(
    *,
    max_staleness: int = 1,
    model_dir: str | Path = ASSETS,
    data: str | Path | None = None,
    engine: Engine = "builtin",
    lr: float = 1e-3,
) -> Graph:
    """prompts.jsonl -> gen (episodes with ``BoxEnv``) -> aipo (the episodes' rewards) -> policy, policy ~> gen.

    Args:
        max_staleness: the weight edge's bound k.
        model_dir: the model directory (config and tokenizer; no weights: seeded random ones).
        data: the prompt file (rows with ``prompt`` and ``secret``); defaults to the shipped ``prompts.jsonl``.
        engine: the generator's engine, ``"builtin"`` or ``"vllm"`` (``flowrl run hf_agent --engine vllm``).
        lr: the policy's learning rate.
    """
    model = HFModelConfig(path=str(model_dir), init="random", seed=0)
    b = GraphBuilder("hf_agent", model=model)
    prompts = b.source("prompts", data=str(data or ASSETS / "prompts.jsonl"), prompt_field="prompt", batch_size=16)
    call = WORDS.index(CALL)
    gen = b.generator("gen", prompts, n_samples=16, max_new_tokens=3, temperature=1.0, engine=engine,
                      stop_tokens=(call,), env="flowrl.examples.hf_agent:BoxEnv", max_turns=2)  # fmt: skip
    aipo = b.loss("aipo", gen, objective="aipo", rho=4.0, normalize_std=True)  # reads the episodes' rewards (env_rewards)
    policy = b.policy("policy", aipo, lr=lr)
    b.weights(policy, gen, max_staleness=max_staleness)
    return b.build()


def build_tokenizer() -> Any:
    """The word-level tokenizer, as a ``transformers.PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces, changes none
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>", padding_side="left"
    )


def make_prompts(n: int = 512, *, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` rows ``{"prompt": "what is in the box ?", "secret": D}`` with digits drawn with ``seed``."""
    rng = random.Random(seed)
    return [{"prompt": "what is in the box ?", "secret": rng.randrange(10)} for _ in range(n)]


def write_assets(directory: str | Path) -> Path:
    """Write config (``hf_copy.build_config`` with this vocabulary and 2 heads of 32), tokenizer and prompts
    into ``directory`` (created; existing files replaced)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = build_config(heads=2)
    config.vocab_size = len(WORDS)
    config.save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    write_jsonl(out / "prompts.jsonl", make_prompts())
    return out


if __name__ == "__main__":  # python -m flowrl.examples.hf_agent DIR
    raise SystemExit(main(sys.argv[1:], write_assets, prog="python -m flowrl.examples.hf_agent", what="the example's config, tokenizer and prompts"))
