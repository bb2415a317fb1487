"""A real-model example: a Qwen2.5-0.5B-Instruct-shaped policy on math word problems, scored by math-verify.

Point it at your local copy of the model (nothing is downloaded)::

    flowrl run qwen_math --option model=~/models/Qwen2.5-0.5B-Instruct

Shipped in ``flowrl/examples/assets/qwen_math``: the model's ``config.json`` only (so the planner's
dry-run, ``flowrl plan qwen_math --cluster 8xH100``, works on any machine) and ``math.jsonl``, 256
arithmetic word problems with integer answers made by ``make_problems`` (rows
``{"question": ..., "answer": ...}``). Its run works on any model directory of a supported family
with a chat template; the tests run it on tiny random weights of the same architecture.

Example:
    >>> row = make_problems(1, seed=3)[0]
    >>> sorted(row)
    ['answer', 'question']
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from flowrl.data.files import write_jsonl
from flowrl.examples.assets_cli import main
from flowrl.graph.builder import GraphBuilder
from flowrl.graph.configs import HFModelConfig
from flowrl.graph.ir import Graph

__all__ = ["ASSETS", "QWEN_CONFIG", "build_qwen_math", "make_problems", "write_assets"]

ASSETS = Path(__file__).parent / "assets" / "qwen_math"

#: The published shape of Qwen2.5-0.5B-Instruct (494M parameters; tied embeddings).
QWEN_CONFIG: dict = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 21,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

def build_qwen_math(*, max_staleness: int = 1, model_dir: str | Path = ASSETS, data: str | Path | None = None) -> Graph:
    """math.jsonl -> gen (chat template, bf16) -> math-verify + boxed format -> AIPO -> policy.

    Args:
        max_staleness: the weight edge's bound k.
        model_dir: your local copy of Qwen2.5-0.5B-Instruct (or any llama/qwen2/qwen3 directory with
            a chat template); the default holds only its ``config.json``, enough for a dry-run plan.
        data: the prompt file (rows with ``question`` and ``answer``); defaults to the shipped problems.
    """
    b = GraphBuilder("qwen_math", model=HFModelConfig(path=str(model_dir), max_seq_len=1024))
    prompts = b.source("prompts", data=str(data or ASSETS / "math.jsonl"), prompt_field="question", chat_template=True, batch_size=8)
    gen = b.generator("gen", prompts, n_samples=8, max_new_tokens=256, temperature=1.0, precision="bfloat16")
    correct = b.scorer("correct", gen, fn="flowrl.operators.rewards:math_answer", inputs="text", output="reward_correct")
    boxed = b.scorer("boxed", gen, fn="flowrl.operators.rewards:boxed_format", inputs="text", output="reward_boxed")
    loss = b.loss("aipo", gen, correct, boxed, objective="aipo", rho=4.0, reward_weights={"reward_correct": 1.0, "reward_boxed": 0.1})
    policy = b.policy("policy", loss, lr=1e-6, micro_batch_size=8, grad_clip=1.0)
    b.weights(policy, gen, max_staleness=max_staleness)
    return b.build()


_NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goro", "Hana")
_ITEMS = ("apples", "books", "marbles", "stamps", "coins", "pencils")


def make_problems(n: int = 256, *, seed: int = 0) -> list[dict[str, str]]:
    """``n`` word problems (sums, differences, products, fair shares) with their integer answers."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        who, item = rng.choice(_NAMES), rng.choice(_ITEMS)
        a, b = rng.randint(2, 60), rng.randint(2, 40)
        kind = rng.randrange(4)
        if kind == 0:
            q, ans = f"{who} has {a} {item} and gets {b} more. How many {item} does {who} have now?", a + b
        elif kind == 1:
            a = a + b
            q, ans = f"{who} has {a} {item} and gives away {b}. How many {item} are left?", a - b
        elif kind == 2:
            a, b = a % 12 + 2, b % 12 + 2
            q, ans = f"{who} buys {a} boxes with {b} {item} in each box. How many {item} is that?", a * b
        else:
            b = b % 9 + 2
            q, ans = f"{who} shares {a * b} {item} equally among {b} friends. How many {item} does each friend get?", a
        rows.append({"question": q + " Put the final answer in \\boxed{}.", "answer": str(ans)})
    return rows


def write_assets(directory: str | Path) -> Path:
    """Write ``config.json`` and ``math.jsonl`` into ``directory`` (created; existing files replaced)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(QWEN_CONFIG, indent=2) + "\n", encoding="utf-8")
    write_jsonl(out / "math.jsonl", make_problems())
    return out


if __name__ == "__main__":  # python -m flowrl.examples.qwen_math DIR
    raise SystemExit(main(sys.argv[1:], write_assets, prog="python -m flowrl.examples.qwen_math", what="the example's config and math problems"))
