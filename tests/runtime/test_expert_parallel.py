"""Expert parallelism (a policy's ``ep`` > 1, ``flowrl.runtime.parallel.expert_parallel``) under torchrun on gloo.

The job runs with ``python -m torch.distributed.run`` (CPU, gloo, 2 ranks); this file is its entry
point (``python tests/runtime/test_expert_parallel.py step OUT DIR``), on a tiny Qwen3-MoE directory
(``tests/hf_fixtures.py``: 8 experts, top-2, hidden 32, 2 layers; Qwen2-MoE, with its shared expert, under ``--runslow``):

- one step of a trainer started as ``ShardedPolicy`` starts it at ep = 2 (on the meta device, each rank
  4 of the 8 experts, FSDP2 over the rest) on half the batch per rank, against a one-process trainer
  on the whole batch: each token's log-prob of the forward, the clipped gradients, AdamW's moments and
  the parameters after the step, each element within its float32 bound (``tests/tolerances.py``, with
  the routers' and experts' gradient magnitudes captured by ``MoeGradientMagnitudes``);
- the checkpoint (torch.distributed.checkpoint, sharded) written at ep = 2 and loaded at ep = 1 (FSDP2
  alone on the same ranks), and one written at ep = 1 loaded at ep = 2: the next step of each within
  the bound of a one-process step from the same state, and at ep = 2 after its own checkpoint bit for bit.

Beside it: a short GRPO-family run through ``flowrl run`` at ep = 2, and the refusals (before any work).
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.runtime.test_torchrun import _rows, _torchrun  # the jobs run with PYTHONPATH=ROOT (see _torchrun)
from tests.tolerances import GradientMagnitudes

THIS = Path(__file__).resolve()


class MoeGradientMagnitudes(GradientMagnitudes):
    """``GradientMagnitudes`` that also covers a Qwen-MoE block's router (``logits = x W^T``) and its
    stacked experts (per expert ``e``: ``[gate, up] = x W_gu[e]^T``, ``y = (silu(gate) * up) W_d[e]^T``,
    scaled by the token's gate weight), their ``|delta|.|x|`` sums recomputed in float64 from the
    experts module's inputs and its output's gradient (transformers' forward left as it is)."""

    def __enter__(self) -> MoeGradientMagnitudes:
        from flowrl.models.routing import moe_routers

        super().__enter__()
        for router in moe_routers(self.inner):
            self._handles.append(router.register_forward_hook(self._router))
        for module in self.inner.modules():
            if hasattr(module, "gate_up_proj") and hasattr(module, "down_proj"):
                self._handles.append(module.register_forward_hook(self._experts))
        return self

    def _router(self, module: torch.nn.Module, args: tuple, out: Any) -> None:
        x = args[0].detach().reshape(-1, module.weight.shape[1]).double().abs()
        if module.weight.requires_grad:
            self._on_grad(out[0], lambda d: self._outer(module.weight, d.reshape(x.shape[0], -1), x))

    def _slice(self, param: torch.Tensor, e: int, d: torch.Tensor, x: torch.Tensor) -> None:
        """``_outer`` for expert ``e``'s slice ``param[e]`` (zeros elsewhere)."""
        dmax, xmax = d.amax(1), x.amax(1)
        parts = (d.T @ x, (dmax @ x)[None, :] + (d.T @ xmax)[:, None],
                 (dmax.square() @ x.square())[None, :] + 2 * (d * (dmax * xmax)[:, None]).T @ x + (d.square().T @ xmax.square())[:, None])
        full = []
        for part in parts:
            z = torch.zeros(param.shape, dtype=torch.float64)
            z[e] = part
            full.append(z)
        self._add(param, *full, d.shape[0])

    def _experts(self, module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        hidden, index, weights = (a.detach() for a in args[:3])

        def grad(g: torch.Tensor) -> None:
            gu_w, d_w = module.gate_up_proj.detach().double(), module.down_proj.detach().double()
            g = g.detach().double()  # the signed gradient at the block's output (``_on_grad`` gives |g|)
            for e in range(int(module.num_experts)):
                tok, pos = torch.where(index == e)
                if not len(tok):
                    continue
                x = hidden[tok].double()
                gate, up = (x @ gu_w[e].T).chunk(2, dim=-1)
                h = torch.nn.functional.silu(gate) * up
                dy = weights[tok, pos, None].double() * g[tok]
                dh = dy @ d_w[e]
                sig = torch.sigmoid(gate)
                dgate = dh * up * (sig * (1 + gate * (1 - sig)))
                dgu = torch.cat([dgate, dh * torch.nn.functional.silu(gate)], dim=-1)
                if module.gate_up_proj.requires_grad:
                    self._slice(module.gate_up_proj, e, dgu.abs(), x.abs())
                if module.down_proj.requires_grad:
                    self._slice(module.down_proj, e, dy.abs(), h.abs())

        if out.requires_grad:
            out.register_hook(grad)


# -- one step, its checkpoint across ep sizes (one torchrun job) ----------------------------------------
@pytest.fixture(scope="module", params=["qwen3_moe", pytest.param("qwen2_moe", marks=pytest.mark.slow)])  # the shared expert's family: --runslow
def step_result(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The step job on the family's tiny directory (Qwen2-MoE: a shared expert beside the routed ones, sharded by FSDP2)."""
    directory = request.getfixturevalue(f"hf_{request.param}_dir")
    out = tmp_path_factory.mktemp("ep-step")
    proc = _torchrun(2, [str(THIS), "step", str(out), str(directory)], out, env={"OMP_NUM_THREADS": "1"}, retry_cxx_abort=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "result.json").read_text())


def _within(bounds: dict[str, float]) -> bool:
    return all(bounds[k] <= 1.0 for k in ("grad_over_bound", "exp_avg_over_bound", "exp_avg_sq_over_bound", "param_over_bound"))


def test_an_ep_step_equals_a_one_process_step(step_result):
    """Each rank holds 4 of each block's 8 experts; its tokens' log-probs (with its routers' own top-k, and
    with recorded experts replayed: ``routed_experts``, which then decide where each token goes), and after one step on half the
    batch per rank the clipped gradients, AdamW moments and parameters, are the one-process trainer's on
    the whole batch, each element within its float32 bound (``_step_bounds``, ``MoeGradientMagnitudes``).
    Measured: log-probs 4.8e-7 (bound 1.2e-4), replayed ones 4.8e-7 while replay moved them by 2.8e-3 to 3.3e-3; gradients, moments, parameters at most 4e-4 of their
    bounds. Without the experts' 1/dp gradient scale the gradients were 100x their bounds."""
    for r in step_result:
        assert r["experts_split"] == 2 and r["local_experts"] == [4, 4] and r["init_diff"] == 0.0, r
        assert r["logprob_diff"] <= r["logprob_atol"], r
        assert r["replay_diff"] <= r["logprob_atol"] < r["replay_moved"], r  # routing replay decides the ep dispatch
        assert _within(r["step"]), r["step"]
    assert step_result[0]["step"] == step_result[1]["step"]  # the global values, the same on both ranks


def test_a_checkpoint_resumes_across_ep_sizes_with_the_same_next_step(step_result):
    """Written at ep = 2, resumed at ep = 2 (bit for bit the uninterrupted step) and at ep = 1 (FSDP2
    alone); written at ep = 1, resumed at ep = 2: each next step within the bound of one process's step
    from the same state (measured at most 3.3e-3 of the bounds)."""
    for r in step_result:
        assert r["ep2_to_ep2_diff"] == 0.0, r
        for case in ("ep2_uninterrupted", "ep2_to_ep1", "ep1_to_ep2"):
            assert _within(r[case]), (case, r[case])
        assert r["version"] == [2, 2, 2, 2], r


# -- flowrl run at ep = 2 (the session's ``moe_ep_run``) ----------------------------------------------------
def test_a_grpo_run_at_ep_2_trains_and_its_checkpoint_exports(moe_ep_run, capsys):
    """2 GRPO steps under torchrun, the policy's experts split over its 2 ranks (its layout says so), the
    generator beside it recording its routing, which the ep trainer replays: step 2's rollout was drawn with the weights the ranks published after step 1,
    so its mu equals the trainer's pi within rounding only if every expert arrived; the experts and the
    routers moved; ``flowrl export`` writes a directory transformers loads with the trained logits."""
    transformers = pytest.importorskip("transformers")
    from flowrl.cli.main import main
    from flowrl.runtime.checkpointing.store import read_policy_state
    from tests.tolerances import graph_logprob_atol, logit_atol

    rows, root = moe_ep_run["rows"], moe_ep_run["root"]
    assert [r["policy_version"] for r in rows] == [1, 2] and all(r["staleness"] == 0 for r in rows)
    assert rows[0]["layout"]["policy"]["mesh"] == {"dp": 2, "ep": 2}, rows[0]["layout"]
    assert all(r["policy/grad_norm"] > 0 for r in rows)
    assert all(r["routing/tokens"] > 0 and 0 <= r["routing/agreement"] <= 1 for r in rows)  # the generator's experts replayed
    assert rows[1]["mismatch/tokens"] > 0 and rows[1]["mismatch/abs_logp_max"] <= graph_logprob_atol(moe_ep_run["graph"], steps=1)
    state = read_policy_state(root / "ck")
    initial = transformers.AutoModelForCausalLM.from_pretrained(str(moe_ep_run["model_dir"]), local_files_only=True, dtype=torch.float32)
    assert int(state["version"]) == 2 and sorted(state["model"]) == sorted(initial.state_dict())
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj", "model.layers.0.mlp.gate.weight"):
        assert not torch.equal(state["model"][name], initial.state_dict()[name]), name
    capsys.readouterr()
    assert main(["export", str(root / "ck"), "-o", str(root / "hf")]) == 0, capsys.readouterr().err
    model = transformers.AutoModelForCausalLM.from_pretrained(str(root / "hf"), local_files_only=True, dtype=torch.float32)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    initial.load_state_dict(state["model"], strict=False)
    ids = torch.tensor([[1, 5, 6, 7, 8, 9, 2], [1, 12, 30, 4, 3, 3, 3]])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, initial(input_ids=ids).logits, rtol=0, atol=logit_atol(model, list(ids)))


# -- bad input: refused by name before any work --------------------------------------------------------
def _placement(graph: Any, policy: dict[str, Any]) -> Any:
    from flowrl.placement.forms import decode_placement

    return decode_placement(json.dumps({"gen": [0], "policy": policy}).encode(), graph, where="place.json")


def test_ep_not_dividing_the_experts_or_not_the_policys_ranks_is_refused(hf_qwen3_moe_dir):
    from flowrl.errors import ConfigError, PlanError
    from flowrl.runtime.preflight import check_meshes
    from tests.runtime.ep_fixtures import ep_graph

    graph = ep_graph(str(hf_qwen3_moe_dir))
    with pytest.raises(ConfigError, match=r"policy 'policy' has ep=3 on its mesh, but ep must divide the 8 routed experts of its model .* \(8 % 3 = 2\).* pick an ep among \[1, 2, 4, 8\]"):
        check_meshes(graph, _placement(graph, {"ranks": [0, 1, 2], "mesh": {"ep": 3}}), backend="torchrun", device="cpu")
    with pytest.raises(PlanError, match=r"place.json: node 'policy': a node on devices \[0, 1\] has ep=4, which does not divide its dp=2 ranks.*pick an ep among \[1, 2\]"):
        _placement(graph, {"ranks": [0, 1], "mesh": {"ep": 4}})
    with pytest.raises(ConfigError, match=r"policy 'policy' has ep=2 beside dp=4 on its mesh: expert parallelism runs with ep equal to the policy's dp ranks"):
        check_meshes(graph, _placement(graph, {"ranks": [0, 1, 2, 3], "mesh": {"dp": 4, "ep": 2}}), backend="torchrun", device="cpu")
    check_meshes(graph, _placement(graph, {"ranks": [0, 1], "mesh": {"ep": 2}}), backend="torchrun", device="cpu")  # what runs


def test_ep_on_a_dense_model_without_fsdp_or_off_a_policy_is_refused(hf_qwen3_moe_dir):
    import msgspec

    from flowrl.errors import ConfigError
    from flowrl.graph.ir import Graph
    from flowrl.runtime.preflight import check_meshes
    from tests.runtime.ep_fixtures import ep_graph
    from tests.runtime.test_fsdp import fsdp_graph

    dense = fsdp_graph()
    with pytest.raises(ConfigError, match=r"policy 'policy' has ep=2 on its mesh, but its model .* is dense \(no routed experts to split\)"):
        check_meshes(dense, _placement(dense, {"ranks": [0, 1], "mesh": {"ep": 2}}), backend="torchrun", device="cpu")
    graph = ep_graph(str(hf_qwen3_moe_dir))
    node = graph.node("policy")
    replicated = Graph(msgspec.structs.replace(graph.spec, nodes=tuple(
        msgspec.structs.replace(n, optimizer=msgspec.structs.replace(node.optimizer, sharding="replicate")) if n.name == "policy" else n for n in graph.nodes)))
    with pytest.raises(ConfigError, match=r"has dp=2 and ep=2 on its mesh .* expert parallelism runs with FSDP2 over the other parameters: set sharding='fsdp'"):
        check_meshes(replicated, _placement(replicated, {"ranks": [0, 1], "mesh": {"ep": 2}}), backend="torchrun", device="cpu")
    with pytest.raises(ConfigError, match=r"policy 'policy' has ep=2 on its mesh .* a policy's program on local runs only dp over several devices"):
        check_meshes(graph, _placement(graph, {"ranks": [0, 1], "mesh": {"ep": 2}}), backend="local", device="cpu")
    from flowrl.placement.forms import decode_placement

    place = decode_placement(json.dumps({"policy": [0, 1], "gen": {"ranks": [0, 1], "mesh": {"ep": 2}}}).encode(), graph, where="place.json")
    with pytest.raises(ConfigError, match=r"generator 'gen' has ep=2 on its mesh .* every expert on each of ranks \[0, 1\] \(only a policy's program splits experts over ep\)"):
        check_meshes(graph, place, backend="torchrun", device="cpu")


def test_flowrl_run_under_torchrun_refuses_ep_on_a_dense_model_on_every_rank(tmp_path):
    """Exit code 2, the message on the ranks, no traceback through flowrl, no metrics: nothing ran."""
    (tmp_path / "place.json").write_text(json.dumps({"gen": [0], "policy": {"ranks": [0, 1], "mesh": {"ep": 2}}}))
    proc = _torchrun(2, ["-m", "flowrl", "run", "tests.runtime.test_fsdp:fsdp_graph", "--backend", "torchrun", "--plan", "place.json",
                         "--steps", "1", "--quiet", "--metrics", "m.jsonl"], tmp_path, env={"OMP_NUM_THREADS": "1"})
    said = " ".join(proc.stderr.split())
    assert proc.returncode != 0 and not (tmp_path / "m.jsonl").exists(), proc.stderr[-3000:]
    assert "flowrl run: error: policy 'policy' has ep=2 on its mesh, but its model" in said and "is dense" in said, proc.stderr[-3000:]
    assert "/flowrl/" not in proc.stderr, proc.stderr[-3000:]  # no traceback through flowrl (torchrun prints its own summary)


# -- the job's entry point (run under torchrun) ---------------------------------------------------------
def _trainer(directory: str, *, ep: int, mesh: Any) -> Any:
    """A trainer started as ``ShardedPolicy`` starts one: on the meta device, the experts split when ``ep`` > 1."""
    from flowrl.graph.nodes import LossNode
    from flowrl.models.registry import family_of
    from flowrl.operators.trainer import Trainer
    from flowrl.runtime.parallel.expert_parallel import shard_experts_
    from flowrl.runtime.parallel.fsdp import shard_trainer_
    from flowrl.runtime.parallel.fsdp_init import meta_build
    from tests.runtime.test_fsdp import _policy

    node = _policy("qwen3_moe", directory, "fsdp")
    model, source = meta_build(node.model)
    trainer = Trainer(node, LossNode(name="aipo"), model=model)
    ignored = shard_experts_(trainer.model, mesh, family_of(node.model).stacked) if ep > 1 else None
    shard_trainer_(trainer, mesh, source=source, ignored=ignored)
    return trainer


def _step_job(out: str, directory: str) -> int:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from flowrl.graph.nodes import LossNode
    from flowrl.operators.trainer import Trainer
    from flowrl.runtime.checkpointing.sharded_state import load_sharded, save_sharded
    from flowrl.runtime.parallel.distributed import shard_by_groups
    from flowrl.runtime.parallel.expert_parallel import ExpertShard
    from flowrl.runtime.parallel.fsdp import full_state, token_scale
    from tests.runtime.test_fsdp import _batch, _max_diff, _policy, _step_bounds
    from tests.tolerances import rollout_logprob_atol

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = DeviceMesh("cpu", torch.tensor([0, 1]), mesh_dim_names=("dp",))
    group = mesh.get_group()
    batches = [_batch("qwen3_moe", directory, s) for s in (0, 1)]
    shards = [shard_by_groups(b, 2) for b in batches]
    result: dict[str, Any] = {}

    def step(trainer: Any, i: int) -> dict[str, float]:
        b, shard = batches[i], shards[i][rank]
        trainer.loss_scale = token_scale(2, float(shard["completion_mask"].sum()), float(b["completion_mask"].sum()))
        return trainer.train_step(shard)

    def one_process(state: dict[str, Any] | None) -> Trainer:
        torch.manual_seed(0)
        one = Trainer(_policy("qwen3_moe", directory, "replicate", packing=False), LossNode(name="aipo"))
        if state is not None:
            one.load_state(copy.deepcopy(state))  # AdamW steps its "step" tensors in place: each reference from the same state
        return one

    torch.manual_seed(0)
    mine = _trainer(directory, ep=2, mesh=mesh)
    ref = one_process(None)
    result["experts_split"] = sum(isinstance(m, ExpertShard) for m in mine.model.modules())
    result["local_experts"] = [int(m.gate_up_proj.to_local().shape[0]) for m in mine.model.modules() if isinstance(m, ExpertShard)]
    result["init_diff"] = _max_diff(dict(mine.model.named_parameters()), dict(ref.model.named_parameters()))
    # the forward: each token's log-prob on this rank's rows, against one process on the same rows
    part = shards[0][rank]
    with torch.no_grad():
        lp, want = mine._logprobs(part, grad=False), ref._logprobs(part, grad=False)
    mask = part["completion_mask"].bool()
    result["logprob_diff"] = float((lp - want).abs()[mask].max())
    result["logprob_atol"] = rollout_logprob_atol(ref.model, part)
    # routing replay decides the dispatch: the same recorded experts (random, distinct per token) in both
    from flowrl.models.routing import expert_dtype

    width = part["sample_prompt_ids"].shape[1] + part["completion_ids"].shape[1]
    g = torch.Generator().manual_seed(7 + rank)
    rows = int(part["completion_ids"].shape[0]) * width * 2  # tokens x layers
    recorded = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(rows)]).reshape(-1, width, 2, 2).to(expert_dtype(8))
    replayed = {**part, "routed_experts": recorded}
    with torch.no_grad():
        lp_replayed, want_replayed = mine._logprobs(replayed, grad=False), ref._logprobs(replayed, grad=False)
    result["replay_diff"] = float((lp_replayed - want_replayed).abs()[mask].max())
    result["replay_moved"] = float((want_replayed - want).abs()[mask].max())  # the recorded experts, not the router's, routed
    # one step at ep = 2 on half the batch per rank against one process on the whole batch
    step_metrics = step(mine, 0)
    result["step"] = _step_bounds(mine, *_ref_step(None, batches[0], one_process), "qwen3_moe")
    result["grad_norm_ep"] = step_metrics["policy/grad_norm"]
    # checkpoints across ep sizes: 2 -> 2 (bit for bit), 2 -> 1, and 1 -> 2, each next step against one process
    ck = Path(out) / "ep2.dcp"
    save_sharded(mine, ck, group=group)
    state = full_state(mine)
    shared = [state]
    dist.broadcast_object_list(shared, src=0, group=group)  # test-only plumbing: the one-process reference's start
    step(mine, 1)
    uninterrupted = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in mine.model.state_dict().items()}
    torch.manual_seed(99)  # other initial weights: only the checkpoint can make them equal
    again = _trainer(directory, ep=2, mesh=mesh)
    load_sharded(again, ck, group=group)
    step(again, 1)
    result["ep2_to_ep2_diff"] = _max_diff(dict(again.model.state_dict()), uninterrupted)
    fsdp = _trainer(directory, ep=1, mesh=mesh)
    load_sharded(fsdp, ck, group=group)
    ck1 = Path(out) / "ep1.dcp"
    save_sharded(fsdp, ck1, group=group)  # the same state, written at ep = 1
    step(fsdp, 1)
    result["ep2_to_ep1"] = _step_bounds(fsdp, *_ref_step(shared[0], batches[1], one_process), "qwen3_moe", step=2)
    result["ep2_uninterrupted"] = _step_bounds(mine, *_ref_step(shared[0], batches[1], one_process), "qwen3_moe", step=2)
    back = _trainer(directory, ep=2, mesh=mesh)
    load_sharded(back, ck1, group=group)
    step(back, 1)
    result["ep1_to_ep2"] = _step_bounds(back, *_ref_step(shared[0], batches[1], one_process), "qwen3_moe", step=2)
    result["version"] = [mine.version, again.version, fsdp.version, back.version]
    results: list[Any] = [None, None]
    dist.all_gather_object(results, result)  # test-only plumbing: plain JSON-able dicts
    if rank == 0:
        Path(out, "result.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _ref_step(state: dict[str, Any] | None, batch: dict[str, torch.Tensor], one_process: Any) -> tuple[Any, Any, dict[str, torch.Tensor], float]:
    """A one-process trainer from ``state`` (None: its initial weights) after one step on ``batch``, its
    gradient magnitudes, the batch and the step's gradient norm: ``_step_bounds``' reference."""
    one = one_process(state)
    with MoeGradientMagnitudes(one.model) as mags:
        metrics = one.train_step(batch)
    return one, mags, batch, metrics["policy/grad_norm"]


if __name__ == "__main__":  # a rank: ends without interpreter teardown (see rank_exit)
    from flowrl.runtime.backends.torchrun.rank_exit import end_rank_process

    if sys.argv[1] == "step":
        end_rank_process(_step_job(sys.argv[2], sys.argv[3]))
    raise SystemExit(f"unknown mode {sys.argv[1]!r}")
