"""Tiny Hugging Face model directories built in the test (never downloaded), for every HF test.

``make_hf_dir(path, family)`` writes what ``save_pretrained`` writes for a 2-layer Llama, Qwen2 or
Qwen3 of hidden size 32-64 and a 100-token vocabulary, plus a word-level tokenizer built with
``tokenizers`` (``<pad>`` 0, ``<s>`` 1, ``</s>`` 2, the words of ``WORDS``). The fixtures
``hf_llama_dir``, ``hf_qwen2_dir`` and ``hf_dir`` (both families in turn) build one per session;
``hf_qwen3_moe_dir``, ``hf_qwen2_moe_dir`` and ``hf_moe_dir`` the same for the mixture-of-experts
families. They are registered for the whole suite through ``tests/conftest.py``'s ``pytest_plugins``, so
integration tests use them too. Each skips visibly when ``transformers`` is missing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

__all__ = ["WORDS", "VOCAB", "make_hf_dir", "hf_llama_dir", "hf_qwen2_dir", "hf_qwen2_chat_dir", "hf_dir", "hf_qwen3_moe_dir", "hf_qwen2_moe_dir", "hf_moe_dir", "hf_config", "CHAT_TEMPLATE"]

VOCAB = 100
WORDS: tuple[str, ...] = tuple(str(i) for i in range(10)) + tuple("abcdefghijklmnopqrstuvwxyz") + ("+", "=", "-", "?", "yes", "no")


#: A minimal chat template (role: content lines, then "assistant:") for tokenizers that need one.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)


def _tokenizer(path: Path, *, chat_template: bool = False) -> None:
    pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for w in WORDS:
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


def hf_config(family: str, *, tie: bool = True, hidden: int = 32, vocab: int = VOCAB, moe_width: int | None = None):
    """A transformers config of a tiny model of ``family`` (a ``model_type``: ``llama``, ``qwen2``, ``qwen3``, ...);
    a mixture of experts' expert width is ``moe_width`` (default ``hidden // 2``)."""
    transformers = pytest.importorskip("transformers")
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if family in ("qwen3", "qwen3_moe"):  # its head_dim is a field of its own (default 128), not hidden / heads
        common["head_dim"] = hidden // 4
    if family.endswith("_moe"):  # 8 experts, top-2, every layer sparse
        common.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=moe_width or hidden // 2, decoder_sparse_step=1, mlp_only_layers=[])
    if family == "qwen2_moe":
        common["shared_expert_intermediate_size"] = hidden
    return transformers.AutoConfig.for_model(family, **common)


def make_hf_dir(
    path: Path, family: str = "llama", *, tie: bool = True, hidden: int = 32, seed: int = 0, weights: bool = True, chat_template: bool = False,
    moe_width: int | None = None,
) -> Path:
    """Write a tiny ``family`` model (safetensors weights unless ``weights=False``; a mixture of experts'
    expert width ``moe_width``, see ``hf_config``) and its tokenizer (with ``CHAT_TEMPLATE`` when
    ``chat_template``) to ``path``."""
    import torch

    transformers = pytest.importorskip("transformers")
    path.mkdir(parents=True, exist_ok=True)
    config = hf_config(family, tie=tie, hidden=hidden, moe_width=moe_width)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
    if weights:
        model.save_pretrained(str(path), safe_serialization=True)
    else:
        config.save_pretrained(str(path))
    _tokenizer(path, chat_template=chat_template)
    return path


def perturbed_model(directory: Path, scale: float = 0.05):
    """A policy's model: ``directory``'s weights plus seeded noise of ``scale`` (what a few optimizer steps do)."""
    import torch

    from flowrl.graph.configs import HFModelConfig
    from flowrl.models.causal_lm import weight_dict
    from flowrl.models.registry import build_model

    model = build_model(HFModelConfig(path=str(directory)))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for t in weight_dict(model).values():
            t.add_(torch.randn(t.shape, generator=g) * scale)
    return model


def check_mu_per_version(out, models, checked: dict[int, int], spans: set[tuple[int, ...]], **completion) -> None:
    """Each drawn token's mu (``behaviour_logprobs``) equals the forward of the version that drew it
    (``token_versions``; ``models``: version -> model) within ``rollout_logprob_atol``; counts the
    tokens checked per version into ``checked`` and each sample's set of versions into ``spans``.
    ``completion``: ``completion_lens=`` for multi-turn samples (environment tokens attended)."""
    import torch

    from flowrl.operators.logprobs import completion_logprobs
    from tests.tolerances import rollout_logprob_atol

    mask, versions = out["completion_mask"], out["token_versions"]
    for v, model in models.items():
        with torch.no_grad():
            pi = completion_logprobs(model, out["sample_prompt_ids"], out["sample_prompt_lens"], out["completion_ids"], mask, **completion)
        drawn = mask & (versions == v)
        checked[v] += int(drawn.sum())
        diff = (out["behaviour_logprobs"] - pi)[drawn].abs()
        assert not len(diff) or float(diff.max()) < rollout_logprob_atol(model, out), (v, diff)
    for s in range(mask.shape[0]):
        spans.add(tuple(sorted(set(versions[s][mask[s]].tolist()))))


@pytest.fixture(scope="session")
def hf_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama directory (tied embeddings), built once per session."""
    return make_hf_dir(tmp_path_factory.mktemp("hf") / "llama", "llama")


@pytest.fixture(scope="session")
def hf_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 directory (untied embeddings, qkv biases), built once per session."""
    return make_hf_dir(tmp_path_factory.mktemp("hf") / "qwen2", "qwen2", tie=False, hidden=48)


@pytest.fixture(scope="session")
def hf_qwen2_chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 directory (tied, like Qwen2.5-0.5B) whose tokenizer has a chat template: the
    architecture of the ``qwen_math`` example on tiny random weights."""
    return make_hf_dir(tmp_path_factory.mktemp("hf") / "qwen2_chat", "qwen2", hidden=32, chat_template=True)


@pytest.fixture(params=["llama", "qwen2"])
def hf_dir(request: pytest.FixtureRequest) -> Path:
    """Each tiny HF family's directory in turn."""
    return request.getfixturevalue(f"hf_{request.param}_dir")


@pytest.fixture(scope="session")
def hf_qwen3_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-MoE directory (8 experts, top-2, every layer sparse), built once per session."""
    return make_hf_dir(tmp_path_factory.mktemp("hf") / "qwen3_moe", "qwen3_moe")


@pytest.fixture(scope="session")
def hf_qwen2_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2-MoE directory (8 experts, top-2, a shared expert; untied), built once per session."""
    return make_hf_dir(tmp_path_factory.mktemp("hf") / "qwen2_moe", "qwen2_moe", tie=False)


@pytest.fixture(params=["qwen3_moe", "qwen2_moe"])
def hf_moe_dir(request: pytest.FixtureRequest) -> Path:
    """Each tiny mixture-of-experts family's directory in turn."""
    return request.getfixturevalue(f"hf_{request.param}_dir")
