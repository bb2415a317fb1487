"""Several updates per batch on 2 torchrun ranks (gloo): replicas, FSDP shards and tp = 2 equal one process.

The job (``python tests/runtime/test_iterations_ranks.py OUT``, under torchrun) builds the real
rank programs (``DataParallelPolicy``, ``ShardedPolicy``, ``TensorParallelPolicy`` on a mesh
``{"tp": 2}``, whose two ranks train on the whole mini-batch) of a policy with ``num_iterations=2`` and
``num_mini_batches=2`` and runs one ``step`` on a batch of 4 prompt groups; each optimizer step's
mini-batch (2 groups) is split across the ranks, one group each, with unequal token counts. A
one-process ``Trainer`` on the whole batch is the reference: 4 AdamW steps, same versions, same
weights up to float rounding.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.runtime.test_torchrun import _torchrun  # the job runs with PYTHONPATH=ROOT

THIS = Path(__file__).resolve()


@pytest.mark.slow  # one 2-rank torchrun job: ~25 s at load 9 (CI time)
def test_replicas_and_shards_take_the_one_process_updates(tmp_path):
    """Measured (gloo, 2 ranks, 4 updates; replicas / FSDP): the last update's gradient differs from one
    process's by 2.2e-7 / 1.7e-7 (largest element 0.096: 2.3e-6 relative; tolerance 2e-5 relative),
    the weights by 5.0e-6 / 8.6e-7 (tolerance 1e-4: AdamW's normalised updates amplify rounding
    where a gradient is near eps), the mean global gradient norm by 1.2e-7 relative (tolerance 1e-5).
    Equal shares instead of each rank's token share (8 vs 12 tokens) move the norm by 2%.

    These stay measured (CONTRIBUTING, "How a tolerance is chosen", items 5 and 6): the last update's
    gradient is taken at weights that three AdamW steps have already moved apart by rounding (up to
    ~2 lr an element where a gradient is within rounding of 0: ``tests/tolerances.py``,
    ``adamw_param_atol``), and the loss's curvature turns that into a gradient difference which no
    float32 bound of one backward (``GradientMagnitudes``) covers."""
    proc = _torchrun(2, [str(THIS), str(tmp_path / "out.json")], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "out.json").read_text())
    for mode in ("replicate", "fsdp", "tp"):
        r = result[mode]
        assert r["version"] == r["ref_version"] == 4, r
        assert mode == "tp" or r["tokens"][0] != r["tokens"][1], r  # unequal shares: the per-mini-batch scale matters
        assert r["max_grad_diff"] < 2e-5 * r["max_grad"], r
        assert r["max_param_diff"] < 1e-4, r
        assert abs(r["grad_norm"] - r["ref_grad_norm"]) < 1e-5 * r["ref_grad_norm"], r
        # the health metrics the row gets: pi's entropy over every token of the batch's steps, whatever
        # the split (per-rank means weighted by their tokens); per-token entropies of ~log 16 = 2.8 from
        # forwards at other batch shapes differ by a few float32 ulps (~1e-6 relative): 1e-5 relative
        assert r["policy/tokens"] == r["ref_policy/tokens"], r
        assert abs(r["policy/entropy"] - r["ref_policy/entropy"]) < 1e-5 * r["ref_policy/entropy"], r
        assert abs(r["policy/lr"] - r["ref_policy/lr"]) <= 1e-15 * r["ref_policy/lr"], r  # equal values averaged in float64: a few ulps (2.2e-16)


def _job(out: str) -> int:
    import msgspec
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from flowrl.operators.generation import Generator
    from flowrl.operators.scoring import Scorer
    from flowrl.operators.source import PromptSource
    from flowrl.operators.trainer import Trainer
    from flowrl.runtime.backends.torchrun.rank_programs import DataParallelPolicy, RankContext, ShardedPolicy, set_context
    from flowrl.runtime.backends.torchrun.tp_policy import TensorParallelPolicy
    from flowrl.runtime.parallel.distributed import broadcast_batch, shard_by_groups
    from flowrl.runtime.parallel.fsdp import full_weights

    from tests.runtime.test_iterations_run import graph

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    set_context(RankContext(rank=rank, world=2, ranks={"policy": (0, 1)}, programs={}))
    result = {}
    for mode in ("replicate", "fsdp", "tp"):
        g = graph(k=0)
        policy = g.node("policy")
        policy = msgspec.structs.replace(policy, optimizer=msgspec.structs.replace(policy.optimizer, sharding="replicate" if mode == "tp" else mode, grad_clip=0.5))
        batch = None
        if rank == 0:
            rollout = Generator(g.node("gen"), seed=7).generate(PromptSource(g.node("prompts")).next_batch())
            batch = {**rollout, **Scorer(g.node("reward")).score(rollout)}
            batch["rewards"] = torch.rand(batch["rewards"].shape, generator=torch.Generator().manual_seed(0))  # every group learns
            lengths = batch["group_ids"] + 1  # group g's completions keep g + 1 tokens: every split is unequal
            batch["completion_mask"] &= torch.arange(batch["completion_mask"].shape[1])[None, :] < lengths[:, None]
        batch = broadcast_batch(batch, src=0, group=None)
        ref = Trainer(msgspec.structs.replace(policy, optimizer=msgspec.structs.replace(policy.optimizer, sharding="replicate")), g.loss_of("policy"))
        ref_metrics = ref.train_step(batch)
        if mode == "replicate":
            program = DataParallelPolicy(policy, g, None, group=None, ranks=(0, 1))  # type: ignore[arg-type]
        elif mode == "tp":
            mesh = DeviceMesh("cpu", torch.tensor([0, 1]), mesh_dim_names=("tp",))
            program = TensorParallelPolicy(policy, g, None, group=dist.group.WORLD, ranks=(0, 1), mesh=mesh)  # type: ignore[arg-type]
        else:
            mesh = DeviceMesh("cpu", torch.tensor([0, 1]), mesh_dim_names=("dp",))
            program = ShardedPolicy(policy, g, None, group=None, ranks=(0, 1), mesh=mesh)  # type: ignore[arg-type]
        program._edges = []  # no weight edge to publish on: the step alone
        _, info = program.step(0, batch if rank == 0 else {}, 0)
        weights = full_weights(program.trainer.model)
        mini = program.trainer._mini_batches(batch, version=0)[0]
        result[mode] = {
            "version": int(info["version"]),
            "ref_version": ref.version,
            "tokens": [int(s["completion_mask"].sum()) for s in shard_by_groups(mini, 2)],
            "max_param_diff": max(float((weights[n] - t).abs().max()) for n, t in ref.weights().items()),
            "max_grad_diff": max(
                float(((q.grad.full_tensor() if hasattr(q.grad, "full_tensor") else q.grad) - p.grad).abs().max())
                for p, q in zip(ref.model.parameters(), program.trainer.model.parameters())
            ),  # the last update's gradient, clipped
            "max_grad": max(float(p.grad.abs().max()) for p in ref.model.parameters()),
            "grad_norm": info["policy/grad_norm"],
            "ref_grad_norm": ref_metrics["policy/grad_norm"],
            **{f"{side}{key}": m[key] for side, m in (("", info), ("ref_", ref_metrics)) for key in ("policy/entropy", "policy/tokens", "policy/lr")},
        }
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":  # a rank: ends without interpreter teardown (see rank_exit)
    from flowrl.runtime.backends.torchrun.rank_exit import end_rank_process

    end_rank_process(_job(sys.argv[1]))
