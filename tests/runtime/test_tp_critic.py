"""A tensor-parallel critic (a ``tp`` axis on its mesh) under torchrun on gloo: one step equal to one process's.

The job runs with ``python -m torch.distributed.run`` (CPU, gloo, 2 ranks); this file is its entry
point (``python tests/runtime/test_tp_critic.py step OUT``): a critic split by
``tp_critic.shard_critic_`` at tp = 2 against a one-process ``Critic`` from the same weights, one
``train_step`` on the same batch: the values it writes (within ``logit_atol``: the value head is the
model's "logits"), the clipped gradients, AdamW moments and parameters after the step (each element
within its derived float32 bound, ``test_fsdp._step_bounds``, ``tests/tolerances.py``), the global
norm. Then its checkpoint: gathered whole (``whole_state``) it is the sharded critic's state exactly
and a one-process critic loads it; a one-file state loaded into the sharded ranks gives them exactly
that state.

Beside it: the refusals, before any work.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from flowrl.errors import ConfigError
from flowrl.graph.configs import HFModelConfig, LoraConfig, LossConfig, ModelConfig, OptimizerConfig
from flowrl.graph.critic import CriticNode

from tests.runtime.test_torchrun import _torchrun  # the job runs with PYTHONPATH=ROOT (see _torchrun)

THIS = Path(__file__).resolve()
MODEL = ModelConfig(vocab_size=16, dim=32, n_layers=2, n_heads=2, n_kv_heads=2, max_seq_len=32)
CLIP = 0.01  # the clip is active (``test_fsdp._step_bounds`` bounds clipped gradients at this max_norm)


def _node(model=MODEL) -> CriticNode:
    return CriticNode(name="critic", model=model, optimizer=OptimizerConfig(lr=1e-2, grad_clip=CLIP))


@pytest.mark.parametrize(
    ("sizes", "match"),
    [
        ({"dp": 2, "tp": 2}, r"critic 'critic' \(mesh .*\): a tensor-parallel critic splits its model over tp only; give it a mesh of tp=2 \(\{'dp': 2\} must be 1\)"),
        ({"tp": 4}, r"critic 'critic' \(mesh .*\): tensor parallelism splits attention by whole heads: tp=4 must divide"),
    ],
    ids=["dp-beside-tp", "heads"],
)
def test_a_tp_the_critic_cannot_take_is_refused_by_name(sizes, match):
    from flowrl.runtime.parallel.tp_train import check_tp_critic

    with pytest.raises(ConfigError, match=match):
        check_tp_critic(_node(), {"dp": 1, "tp": 1, "pp": 1, **sizes})


def test_a_lora_critic_on_tp_is_refused_by_name(tmp_path):
    from tests.hf_fixtures import make_hf_dir

    from flowrl.mesh_support import node_facts, refusal
    from flowrl.runtime.parallel.tp_train import check_tp_critic

    model = HFModelConfig(path=str(make_hf_dir(tmp_path / "q", "qwen2", weights=False)), init="random", lora=LoraConfig(r=2, alpha=4, target_modules=("q_proj",)))
    with pytest.raises(ConfigError, match=r"critic 'critic' \(mesh .*\): a LoRA critic is not split over tp; give it one rank"):
        check_tp_critic(_node(model), {"dp": 1, "tp": 2, "pp": 1})
    said = refusal("critic", "critic", {"tp": 2}, "torchrun", devices=(1, 2), facts=node_facts(_node(model)))
    assert said is not None and "a LoRA critic is not split over tp" in said, said
    assert refusal("critic", "critic", {"tp": 2}, "torchrun", devices=(1, 2), facts=node_facts(_node())) is None


def test_the_value_head_stays_whole():
    """The plan splits the trunk's linears (as a policy's) and never the Linear(dim, 1) value head."""
    from flowrl.operators.critic import Critic
    from flowrl.runtime.parallel.tensor_parallel import param_splits
    from flowrl.runtime.parallel.tp_train import tp_plan

    critic = Critic(_node(), LossConfig(objective="ppo"))
    splits = {n: s for n, s in param_splits(MODEL).items() if n.rpartition(".")[0] != critic.head}
    plan = tp_plan(critic.model, splits)
    assert critic.head == "output" and "output" not in plan
    assert {k for k in plan if k.startswith("layers.0.")} == {f"layers.0.attention.{w}" for w in ("wq", "wk", "wv", "wo")} | {f"layers.0.feed_forward.{w}" for w in ("w1", "w2", "w3")}


@pytest.fixture(scope="module")
def step_result(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp-critic")
    proc = _torchrun(2, [str(THIS), "step", str(out)], out, retry_cxx_abort=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "result.json").read_text())


def test_a_tp_critic_step_equals_a_one_process_step(step_result):
    r = step_result
    assert r["sharded"] > 0 and not r["head_sharded"], r  # the trunk's linears are DTensors over tp, the value head whole
    assert r["values_moved"] > 10 * r["values_atol"], r  # values that differ by position (a random head), far beyond the bound
    assert r["values_diff"] <= r["values_atol"], r
    assert r["grad_norm_ref"] > CLIP, r  # the clip is active, so the global norm is checked too
    assert abs(r["grad_norm_tp"] - r["grad_norm_ref"]) <= r["grad_norm_atol"], r
    assert r["grad_over_bound"] <= 1.0 and r["exp_avg_over_bound"] <= 1.0 and r["exp_avg_sq_over_bound"] <= 1.0, r
    assert r["param_over_bound"] <= 1.0 and r["param_moved"] > 0, r
    assert r["replicated_alike"], r  # the plain parameters (the head among them) equal bit for bit across the tp ranks
    assert r["value_loss_tp"] == pytest.approx(r["value_loss_ref"], rel=1e-5), r


def test_a_tp_critic_checkpoint_is_one_process_state(step_result):
    r = step_result
    assert r["gathered_vs_sharded"] == 0.0 and r["one_process_loaded"], r  # tp -> 1: whole, loadable by one process
    assert r["loaded_vs_file"] == 0.0 and r["loaded_version"] == 1, r  # 1 -> tp: each rank keeps its shards of it


@pytest.mark.slow  # three torchrun jobs, ~45 s on 2 shared cores
def test_a_tp_critic_checkpoints_and_resumes_as_one_rank_runs(tmp_path):
    """``llamarl_ppo`` with the critic at tp = 2, checkpointed after 2 steps and resumed for 2 more, gives
    the rows of 4 uninterrupted steps with the critic on one rank: the same tokens and versions, every
    critic metric within float32 rounding (``test_torchrun_critic._float_atol``)."""
    from flowrl.examples import build_example
    from flowrl.models.families.builtin.model import Transformer
    from tests.runtime.test_torchrun import _rows
    from tests.runtime.test_torchrun_critic import _float_atol
    from tests.tolerances import reductions

    (tmp_path / "tp.json").write_text(json.dumps({"gen": [0], "policy": [1], "critic": {"ranks": [0, 1], "mesh": {"tp": 2}}}))
    (tmp_path / "one.json").write_text(json.dumps({"gen": [0], "policy": [1], "critic": [0]}))
    run = ["-m", "flowrl", "run", "llamarl_ppo", "--backend", "torchrun", "--seed", "0", "--quiet", "--max-staleness", "0"]
    for args in (["--plan", "tp.json", "--steps", "2", "--metrics", "a.jsonl", "--checkpoint-dir", "ck", "--checkpoint-every", "1"],
                 ["--plan", "tp.json", "--steps", "4", "--metrics", "b.jsonl", "--checkpoint-dir", "ck", "--resume"],
                 ["--plan", "one.json", "--steps", "4", "--metrics", "c.jsonl"]):
        proc = _torchrun(2, [*run, *args], tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
    ran, ref = _rows(tmp_path / "a.jsonl") + _rows(tmp_path / "b.jsonl"), _rows(tmp_path / "c.jsonl")
    assert [r["step"] for r in ran] == [1, 2, 3, 4] and ran[0]["layout"]["critic"]["mesh"] == {"tp": 2}
    model = build_example("llamarl_ppo").node("critic").model
    n = sum(reductions(Transformer(model), model.max_seq_len)) + ref[0]["samples"] * model.max_seq_len
    for a, b in zip(ran, ref):
        assert a["critic/version"] == b["critic/version"] and a["reward_mean"] == b["reward_mean"], (a, b)
        for k in (k for k in b if k.startswith("critic/")):
            assert abs(a[k] - b[k]) <= _float_atol(max(abs(a[k]), abs(b[k])), n), (a["step"], k, a[k], b[k])
    assert abs(ran[-1]["critic/value_mean"]) > 10 * _float_atol(abs(ran[-1]["critic/value_mean"]), n), ran[-1]  # it trained


# -- the job (each rank) -------------------------------------------------------------------------------
def _step_job(out: str) -> int:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    from flowrl.operators.critic import Critic
    from flowrl.runtime.backends.torchrun.tp_critic import load_whole_state_, shard_critic_, whole_state
    from tests.operators.test_critic import _batch
    from tests.runtime.test_fsdp import _full, _step_bounds
    from tests.tolerances import GradientMagnitudes, logit_atol, rollout_sequences

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = DeviceMesh("cpu", [0, 1], mesh_dim_names=("tp",))
    loss = LossConfig(objective="ppo")

    def built() -> Critic:
        torch.manual_seed(0)
        critic = Critic(_node(), loss)
        with torch.no_grad():  # a head that is not zero, so values differ by position
            critic.model.output.weight.normal_(generator=torch.Generator().manual_seed(3))
        return critic

    ref, mine = built(), built()
    shard_critic_(mine, mesh, group=dist.group.WORLD)
    batch = _batch(0)
    sequences = rollout_sequences(batch)
    values_atol = logit_atol(ref.model, sequences)
    with GradientMagnitudes(ref.model) as mags:
        ref_values, ref_m = ref.train_step(batch)
    values, m = mine.train_step(batch)
    result = {
        "sharded": sum(isinstance(p, DTensor) for p in mine.model.parameters()),
        "head_sharded": any(isinstance(p, DTensor) for p in mine.model.output.parameters()),
        "values_diff": float((values - ref_values).abs().max()),
        "values_moved": float(ref_values.abs().max()),
        "values_atol": values_atol,
        "grad_norm_ref": ref_m["critic/grad_norm"],
        "grad_norm_tp": m["critic/grad_norm"],
        "value_loss_ref": ref_m["critic/value_loss"],
        "value_loss_tp": m["critic/value_loss"],
        **_step_bounds(mine, ref, mags, batch, ref_m["critic/grad_norm"], "builtin"),
    }
    start = built()
    result["param_moved"] = max(float((_full(p).detach() - q).abs().max()) for p, q in zip(mine.model.parameters(), start.model.parameters()))
    plain = torch.cat([p.detach().reshape(-1) for p in mine.model.parameters() if not isinstance(p, DTensor)])
    every = [torch.empty_like(plain) for _ in range(2)]
    dist.all_gather(every, plain)
    result["replicated_alike"] = bool(torch.equal(every[0], every[1]))
    # checkpoints: gathered whole (tp -> 1), then a one-file state into fresh shards (1 -> tp)
    state = whole_state(mine)
    result["gathered_vs_sharded"] = max(float((_full(p).detach() - state["weights"][n]).abs().max()) for n, p in mine.trainable.items())
    one = built()
    one.load_state(state)
    result["one_process_loaded"] = all(torch.equal(one.trainable[n].detach(), w) for n, w in state["weights"].items())
    fresh = built()
    shard_critic_(fresh, mesh, group=dist.group.WORLD)
    load_whole_state_(fresh, ref.state())
    back = whole_state(fresh)
    result["loaded_vs_file"] = max(float((back["weights"][n] - w).abs().max()) for n, w in ref.state()["weights"].items())
    result["loaded_vs_file"] = max(result["loaded_vs_file"], *(
        float((back["optimizer"]["state"][i][k] - v).abs().max()) for i, e in ref.state()["optimizer"]["state"].items() for k, v in e.items()
    ))
    result["loaded_version"] = fresh.version
    if rank == 0:
        Path(out, "result.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "step":
        sys.exit(_step_job(sys.argv[2]))
    raise SystemExit(f"unknown mode {sys.argv[1]!r}")
