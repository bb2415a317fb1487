"""run_graph refuses a graph that cannot fit in memory before allocating anything."""

from __future__ import annotations

import msgspec
import pytest

from flowrl.errors import ConfigError
from flowrl.examples.llamarl import build_llamarl
from flowrl.graph.ir import Graph
from flowrl.runtime.config import RunConfig
from flowrl.runtime.preflight import check_fits_in_memory
from flowrl.runtime.run import run_graph
from flowrl.runtime.programs.synthetic import synthetic_programs


def _huge_vocab(g: Graph | None = None) -> Graph:
    """``g`` (default: the default example) with a 2**36-token vocabulary: no host holds it, sharded or not."""
    g = g if g is not None else build_llamarl()
    nodes = tuple(
        msgspec.structs.replace(n, model=msgspec.structs.replace(n.model, vocab_size=2**36)) if hasattr(n, "model") else n
        for n in g.nodes
    )
    return Graph(msgspec.structs.replace(g.spec, nodes=nodes))


def test_run_graph_refuses_a_graph_too_big_for_this_machine():
    with pytest.raises(ConfigError, match=r"node 'gen' \(generator\) needs at least .* GiB"):
        run_graph(_huge_vocab(), RunConfig(steps=1))


def test_the_default_example_fits_and_synthetic_programs_are_skipped():
    check_fits_in_memory(build_llamarl(), memory_bytes=2**30)
    g = _huge_vocab()
    check_fits_in_memory(g, memory_bytes=2**30, skip=frozenset(synthetic_programs(g)))
    with pytest.raises(ConfigError, match=r"node .* needs at least .* more than the 0.000977 GiB"):
        check_fits_in_memory(build_llamarl(), memory_bytes=2**20)


def test_an_hf_model_too_big_for_this_machine_is_refused_before_it_is_built(tmp_path):
    """A Hugging Face directory whose config describes a 405B-shaped model: refused from its config.json
    (no weights read, nothing allocated); the HF example itself fits."""
    import json

    from flowrl.examples.hf_copy import ASSETS, build_hf_copy

    big = tmp_path / "big"
    big.mkdir()
    config = json.loads((ASSETS / "config.json").read_text())
    config.update(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128, num_key_value_heads=8, vocab_size=128256)
    config.pop("head_dim", None)  # the small model's head width would stay (transformers reads it): 16384 / 128 it is
    (big / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (big / name).write_bytes((ASSETS / name).read_bytes())
    check_fits_in_memory(build_hf_copy(), memory_bytes=2**30)
    with pytest.raises(ConfigError, match=r"node 'gen' \(generator\) needs at least .* GiB \(vocab_size=128256, dim=16384, n_layers=126, max_seq_len=64, 4.04e\+11 parameters"):
        run_graph(build_hf_copy(model_dir=big), RunConfig(steps=1))


# -- a torchrun placement: each rank's share (preflight.check_ranks_fit) ----------------------------------
def _fsdp_graph() -> Graph:
    from tests.runtime.test_fsdp import fsdp_graph

    return fsdp_graph()


def test_an_fsdp_policy_holds_one_dp_th_of_its_state_on_each_rank():
    from flowrl.runtime.preflight import rank_needs

    g = _fsdp_graph()
    whole = rank_needs(g, {"gen": (0,), "policy": (1,)})[1]["policy"]
    halves = rank_needs(g, {"gen": (0,), "policy": (1, 2)})
    assert halves[1]["policy"] == halves[2]["policy"] == whole // 2
    assert set(halves) == {0, 1, 2} and set(halves[0]) == {"gen"}


def test_a_layout_whose_ranks_cannot_hold_their_models_is_refused_naming_the_rank():
    from flowrl.runtime.preflight import check_ranks_fit, rank_needs

    g = _fsdp_graph()
    policy = rank_needs(g, {"policy": (1,)})[1]["policy"]
    gen = rank_needs(g, {"gen": (0,)})[0]["gen"]
    memory = max(policy * 3 // 4, gen + 1)  # one GPU holds half the policy's state, not all of it
    with pytest.raises(ConfigError, match=r"rank 1 needs at least .* \(rank 1 policy: .* GiB\), more than its GPU's .*sharding='fsdp'"):
        check_ranks_fit(g, {"gen": (0,), "policy": (1,)}, device="cuda", memory_bytes=memory, ranks_per_host=2)
    check_ranks_fit(g, {"gen": (0,), "policy": (1, 2)}, device="cuda", memory_bytes=memory, ranks_per_host=3)
    # on the CPU a host's ranks share its memory: 3 ranks on one host need the sum; on 3 hosts each its own
    total = gen + policy
    with pytest.raises(ConfigError, match=r"the ranks of host 0 \(\[0, 1, 2\]\) need at least"):
        check_ranks_fit(g, {"gen": (0,), "policy": (1, 2)}, device="cpu", memory_bytes=total - 2, ranks_per_host=3)
    check_ranks_fit(g, {"gen": (0,), "policy": (1, 2)}, device="cpu", memory_bytes=total - 2, ranks_per_host=1)


def huge_fsdp_graph() -> Graph:
    """``fsdp_graph`` with a 2**36-token vocabulary (the graph the torchrun job below runs)."""
    return _huge_vocab(_fsdp_graph())


def test_under_torchrun_every_rank_refuses_a_layout_that_does_not_fit_before_any_work(tmp_path):
    import json

    from tests.runtime.test_torchrun import _torchrun

    (tmp_path / "place.json").write_text(json.dumps({"gen": [0], "policy": [0, 1]}))
    proc = _torchrun(2, ["-m", "flowrl", "run", "tests.runtime.test_preflight:huge_fsdp_graph", "--backend", "torchrun",
                         "--plan", "place.json", "--steps", "1", "--quiet", "--metrics", "m.jsonl"], tmp_path)
    assert proc.returncode != 0
    assert proc.stderr.count("the ranks of host 0 ([0, 1]) need at least") == 2, proc.stderr[-3000:]  # each rank says it
    assert "flowrl/" not in "".join(line for line in proc.stderr.splitlines() if line.strip().startswith("File "))  # torchrun's own traceback only
    assert not (tmp_path / "m.jsonl").exists()


@pytest.mark.parametrize(
    ("place", "extra", "message"),
    [
        ({"policy": [2], "gen": {"ranks": [0, 1], "mesh": {"tp": 3}}}, [],
         "node 'gen' has mesh tp=3 = 3 ranks but 2 rank(s) [0, 1]; the\n  product of the mesh axes must equal the number of ranks"),
        ({"policy": [2], "gen": [0, 1]}, ["--device", "cuda"], "--device cuda: this machine has no CUDA device; use --device cpu or auto"),
    ],
    ids=["tp-larger-than-the-generators-ranks", "cuda-or-nccl-without-cuda"],
)
def test_a_torchrun_rank_refuses_bad_input_through_the_cli_before_any_work(tmp_path, monkeypatch, capsys, place, extra, message):
    """What each rank of ``torchrun --nproc-per-node 3 -m flowrl run ... --backend torchrun`` does first, run
    here as rank 0 (the checks precede the process group: gloo on a CPU, NCCL exactly when the rank's
    device is CUDA, so ``--device cuda`` is also the NCCL refusal): exit 2, the error and its fix, no
    traceback, no process group, thread, metrics file or checkpoint folder left behind."""
    import json
    import threading

    import torch
    import torch.distributed as dist

    from flowrl.cli.main import main

    if "cuda" in extra and torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal cannot happen")
    (tmp_path / "place.json").write_text(json.dumps(place))
    monkeypatch.chdir(tmp_path)
    for key, value in {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "3"}.items():
        monkeypatch.setenv(key, value)
    threads = threading.active_count()
    code = main(["run", "tests.runtime.test_torchrun:file_graph", "--backend", "torchrun", "--plan", "place.json", "--steps", "1",
                 "--quiet", "--metrics", "m.jsonl", "--checkpoint-dir", "ck", *extra])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err
    assert not dist.is_initialized() and threading.active_count() <= threads  # none started (one of an earlier test may end)
    assert not (tmp_path / "m.jsonl").exists() and not (tmp_path / "ck").exists()
