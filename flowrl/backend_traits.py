"""What a run backend is (``BackendTraits``), by name: pure data the CLI, preflight, the runtime and the planner read.

A backend's traits say whether its programs live in several processes, whether it is a job of
torch.distributed ranks (each rank runs ``run_graph`` on its share, rank 0 reports and checks the
run's directory, plan devices are ranks), whether it shards a policy with FSDP2 and whether it does
colocated offloading. The built-ins' are the table ``BACKENDS`` (each backend class's
``crosses_processes`` is its row's); which class runs a name is the runtime's business
(``flowrl.runtime.backends.backend.BUILTIN_BACKENDS``). A backend a user registers has the traits of a
backend in one process unless it declares its own (``declare_traits``). Code asking what a backend
does reads these traits, not its name.

Example:
    >>> backend_traits("torchrun").ranks, backend_traits("local").ranks, backend_traits("mine").offloads
    (True, False, True)
"""

from __future__ import annotations

import msgspec

__all__ = ["BackendTraits", "BACKENDS", "declare_traits", "backend_traits"]


class BackendTraits(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a backend is.

    Attributes:
        crosses_processes: the two ends of a weight edge may live in different processes (decides the
            transport each edge opens: ``flowrl.runtime.weights.edges``).
        ranks: this process is one rank of a torch.distributed job: every rank runs the graph's
            share placed on it, checks that share's memory itself, and rank 0 reports; a plan's
            devices are the job's ranks.
        shards: a policy with ``sharding="fsdp"`` (FSDP2 over its ranks) runs under it.
        offloads: colocated offloading (``RunConfig.offload``: a trainer's state in host memory while
            its generator runs, a vLLM engine asleep while its trainer runs).
        zygote: its workers are forked by a zygote that imports torch once
            (``runtime/backends/process/zygote.py``); ``flowrl run`` starts it before importing torch itself,
            so that the two imports overlap.
    """

    crosses_processes: bool = False
    ranks: bool = False
    shards: bool = False
    offloads: bool = True
    zygote: bool = False


#: The built-in backends' traits, one line each.
BACKENDS: dict[str, BackendTraits] = {
    "local": BackendTraits(crosses_processes=False),
    "process": BackendTraits(crosses_processes=True, zygote=True),
    "torchrun": BackendTraits(crosses_processes=True, ranks=True, shards=True, offloads=False),
}

_DECLARED: dict[str, BackendTraits] = {}


def declare_traits(name: str, traits: BackendTraits) -> None:
    """Record the traits of backend ``name`` in this process."""
    _DECLARED[name] = traits


def backend_traits(name: str) -> BackendTraits:
    """The traits backend ``name`` has in this process: declared, else a built-in's, else a one-process backend's."""
    return _DECLARED.get(name) or BACKENDS.get(name) or BackendTraits()
