"""Does a plan fit the machine it is run on: which node runs on which devices, and are they here.

A plan names devices of the cluster it was made for (``1024xH100``, ``cpu:2``). Before a run starts,
``check_plan_here`` compares them with what this machine (or this torchrun job) has and either
describes the placement in one line or refuses, naming the cluster, the devices it needs, what is
here and how to re-plan. The machine's facts are arguments, so the check is a pure function.

Example:
    >>> from flowrl.examples import build_example
    >>> from flowrl.planners.plan import plan_graph
    >>> plan = plan_graph(build_example("llamarl"), "cpu:2", strategy="disaggregated")
    >>> print(check_plan_here(plan, backend="local", cores=2, cuda_devices=0))
    plan for cpu:2 on this machine's CPU cores: gen on 0, aipo on 1, policy on 1
    >>> check_plan_here(plan_graph(build_example("llamarl"), "16xH100"), backend="local", cores=2, cuda_devices=0)
    Traceback (most recent call last):
    ...
    flowrl.errors.PlanError: the plan was made for 16xH100 (GPU devices 0-...), but this machine has no CUDA GPU (2 CPU cores); make a plan for this machine: flowrl plan GRAPH --cluster cpu -o plan.json
"""

from __future__ import annotations

from flowrl.backend_traits import backend_traits
from flowrl.errors import PlanError
from flowrl.planners.cluster import DEVICE_TRAITS
from flowrl.planners.plan import Plan

__all__ = ["check_plan_here"]


def _ranges(devices: tuple[int, ...]) -> str:
    """``(0, 1, 2, 5)`` -> ``"0-2,5"``."""
    out: list[str] = []
    for d in sorted(devices):
        if out and d == int(out[-1].split("-")[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{d}"
        else:
            out.append(str(d))
    return ",".join(out)


def check_plan_here(
    plan: Plan,
    *,
    backend: str,
    cores: int,
    cuda_devices: int,
    world_size: int | None = None,
    ranks_per_host: int | None = None,
    device: str = "auto",
    graph_arg: str | None = None,
    plan_path: str = "plan.json",
) -> str:
    """One line saying which node runs on which devices here; raises when the devices are not here.

    Args:
        plan: the plan to run.
        backend: ``local``, ``process`` or ``torchrun``.
        cores: CPU cores of this machine.
        cuda_devices: CUDA devices of this machine.
        world_size: ranks of the torchrun job (``backend="torchrun"`` only): plan devices are ranks.
        ranks_per_host: the job's ranks on each host (torchrun's ``LOCAL_WORLD_SIZE``); a plan that
            spans several of its cluster's hosts needs its devices per host.
        device: the run's ``--device`` (``auto``: CUDA when there is a GPU).
        graph_arg: the graph as the user names it on the command line (its file, shell-quoted, with
            any --engine/--sharding rewrites), for the re-plan command; default: ``GRAPH``.
        plan_path: the plan file, for the re-plan command.

    Raises:
        PlanError: naming the plan's cluster, the devices it needs, what is here and the fix.
    """
    placed = {name: p.devices for name, p in plan.placements.items() if p.devices}
    needed = 1 + max((d for ds in placed.values() for d in ds), default=0)
    spec = plan.cluster_spec
    traits = DEVICE_TRAITS[spec.device.kind if spec is not None else "cpu"]
    gpu, kind = traits.cuda, traits.label
    wanted = f"the plan was made for {plan.cluster} ({kind} devices {_ranges(tuple(range(needed)))})"
    graph = graph_arg or "GRAPH"  # a library call: no command line to name (replan.plan_command); the plan's graph name may be another graph's

    def replan(cluster: str) -> str:
        return f"flowrl plan {graph} --cluster {cluster} -o {plan_path}"

    here = f"make a plan for this machine: {replan('cpu')}"
    if gpu and cuda_devices == 0:
        raise PlanError(f"{wanted}, but this machine has no CUDA GPU ({cores} CPU cores); {here}")
    if gpu and device == "cpu":
        raise PlanError(f"{wanted}, but --device cpu runs the models on the CPU; drop --device cpu to run the plan on the GPUs, or {here}")
    on_cuda = device == "cuda" or (device == "auto" and cuda_devices > 0)
    if not gpu and on_cuda:
        raise PlanError(
            f"{wanted}, but this run puts its models on CUDA GPUs (--device {device}; this machine has {cuda_devices}); "
            f"add --device cpu to run the plan as made, or make a plan for the GPUs: {replan(f'{max(cuda_devices, 1)}xH100')} "
            "(your GPU's name, or a cluster file)"
        )
    if backend_traits(backend).ranks:
        have, what = (world_size or 1), "ranks in this torchrun job"
        same = f"{have}x{spec.device.name}" if gpu and spec is not None else f"cpu:{have}"
        if needed > have:
            raise PlanError(
                f"{wanted}, but there are {have} {what}; launch torchrun with {needed} processes in all "
                f"('flowrl plan ... --emit DIR' writes that launch), or re-plan for {have}: {replan(same)}"
            )
        per_host = spec.devices_per_host if spec is not None else needed
        if needed > per_host and ranks_per_host is not None and ranks_per_host != per_host:
            hosts = -(-have // ranks_per_host)
            raise PlanError(
                f"{wanted}, {per_host} per host on {-(-needed // per_host)} hosts, but this job runs {ranks_per_host} ranks per host: "
                f"the plan's groups would span other hosts than it priced; launch --nproc-per-node {per_host} on every host "
                f"('flowrl plan ... --emit DIR' writes that launch), or re-plan for this job: {replan(f'{hosts}x{ranks_per_host}x{spec.device.name}' if spec else same)}"
            )
        where = "torchrun ranks"
    else:
        have, what = (cuda_devices, "CUDA GPUs") if gpu else (cores, "CPU cores")
        if needed > have:
            raise PlanError(f"{wanted}, but this machine has {have} {what}; {here.replace('--cluster cpu', f'--cluster cpu:{have}') if not gpu else here}")
        where = "this machine's GPUs" if gpu else "this machine's CPU cores"
    nodes = ", ".join(f"{name} on {_ranges(ds)}" for name, ds in placed.items())
    return f"plan for {plan.cluster} on {where}: {nodes}"
