"""The planner: cluster and model specs, cost and memory estimates, placement search, the ``Plan``.

A pipeline of pure functions: enumerate candidates (``strategies``) -> estimate time and memory
(``estimate``) -> search (``search``) -> emit a ``Plan`` (``plan``). A dry-run needs no hardware::

    >>> from flowrl.examples import build_example
    >>> from flowrl.planners import plan_graph
    >>> plan = plan_graph(build_example("llamarl"), "1024xH100", model=model_preset("llama3-8b"))
    >>> plan.family
    'disaggregated'

The planner is pure: no I/O, no torch, and nothing from the runtime, operators or models
(``tests/test_layers.py``); a plan becomes what the runtime executes through ``Plan.placement()``.
Measuring this machine is ``flowrl.calibration``'s, above it. The search enumerates for each node
only the mesh axes its program runs on the backend the cluster implies (``runnable``: torchrun for
GPUs, an FSDP2 policy or CPU cores priced as ranks; the local backend for a calibrated CPU or one
device), runs a node that runs none over several devices on its side's first device, and refuses a
given placement with another axis.

On a calibrated CPU the estimates take the measured pass rates as they are (no MFU, no launch term);
a mesh is one process with intra-op threads (no tp or pp) except an FSDP2 policy's, which runs under
torchrun as one one-thread process per rank at the one-core rate, its gathers and reduce-scatters
over gloo, not overlapped with compute where the job's ranks and vLLM's workers outnumber the host's
cores (``host_crowded``). A tp or pp mesh on a CPU runs as such ranks too, priced by
``estimate.cpu_ranks``. A plan that runs as a torchrun job prices the weight edges
``flowrl.placement.weight_routes`` sends direct by ``estimate.direct`` and every other vLLM edge
with the hop; ``schedule.shared_step_s`` slows the overlapped meshes of one host. Every efficiency
constant is a documented field of ``tuning.Tuning`` or ``cluster.DeviceSpec`` with its source, and
what a kind of device is (CUDA or not, a core the runtime pins to, tensor cores, the
continuous-batching and packing defaults) is one table, ``cluster.DEVICE_TRAITS``, read instead of
``"gpu"``/``"cpu"``; ``benches/planner.py`` checks the predictions against runs here and LlamaRL's
table.
"""

from flowrl.planners.cluster import ClusterSpec, DeviceSpec, parse_cluster
from flowrl.modelspec import ModelSpec, model_from_config, model_from_hf_config, model_preset, resolve_model
from flowrl.planners.parallel import AXES, ParallelDims
from flowrl.planners.plan import NodePlacement, Plan, load_plan, parse_plan, plan_graph, plan_to_json, save_plan
from flowrl.planners.tuning import Tuning
from flowrl.planners.workload import LLM_DEFAULTS, Workload

__all__ = [
    "ClusterSpec",
    "DeviceSpec",
    "parse_cluster",
    "ModelSpec",
    "model_preset",
    "model_from_config",
    "model_from_hf_config",
    "resolve_model",
    "AXES",
    "ParallelDims",
    "Plan",
    "NodePlacement",
    "plan_graph",
    "parse_plan",
    "save_plan",
    "load_plan",
    "plan_to_json",
    "Tuning",
    "Workload",
    "LLM_DEFAULTS",
]
