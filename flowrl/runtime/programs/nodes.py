"""Node programs: what an executor runs for one node, per step, whatever process it lives in.

A program wraps a node's operator (``flowrl.operators``) with the runtime's concerns: the generator
fetches fresh enough weights before it samples, the policy publishes its weights after each step
and reports timings. Programs are built from plain data (the graph, a node name, transport options)
so that a worker process can rebuild them without pickle.

Protocol (``NodeProgram``):
    step(seq, inputs, min_version) -> (outputs, info)   one batch; ``info`` holds numbers only
    save(path) / load(path)                             checkpoint the node's state (policy only)
    close()                                             release transports and threads
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import torch

from flowrl.errors import ConfigError, FlowrlError, NodeBuildError, TransportError
from flowrl.graph.configs import ReferenceConfig
from flowrl.graph.ir import Graph
from flowrl.graph.nodes import GeneratorNode, LossNode, Node, PolicyNode, ReferenceNode, RewardModelNode, ScorerNode, SourceNode
from flowrl.runtime.staleness import StalenessGate
from flowrl.runtime.weights.edges import TransportSpec
from flowrl.runtime.weights.route import WeightRoute, WeightRoutes

if TYPE_CHECKING:
    from flowrl.runtime.programs.continuous import ContinuousRollouts

__all__ = [
    "NodeProgram",
    "ProgramBase",
    "ProgramEnv",
    "SharedTransports",
    "build_error",
    "build_source",
    "build_generator",
    "build_scorer",
    "build_reference",
    "build_teacher",
    "build_reward_model",
    "build_policy",
    "SourceProgram",
    "GeneratorProgram",
    "ScorerProgram",
    "ReferenceProgram",
    "RewardModelProgram",
    "PolicyProgram",
]

Batch = dict[str, torch.Tensor]
Info = dict[str, Any]


class NodeProgram(Protocol):
    def start(self) -> None: ...

    def seek(self, position: int) -> None: ...

    def step(self, seq: int, inputs: Batch, min_version: int) -> tuple[Batch, Info]: ...

    def save(self, path: str) -> None: ...

    def load(self, path: str) -> None: ...

    def close(self) -> None: ...


class ProgramBase:
    """No-op defaults: most nodes have nothing to start, seek, checkpoint or close."""

    #: Whether ``save`` writes a directory of shards, each rank its own, rather than one file (a
    #: program on the controller's side of an FSDP policy: ``RemoteProgram.sharded_state``); the
    #: checkpoint names its state accordingly (``checkpoint.state_file``). Read with ``getattr``:
    #: a user's program need not have it.
    sharded_state = False

    def start(self) -> None:
        """Called once before the first step (the policy publishes its initial weights here)."""

    def seek(self, position: int) -> None:
        """Continue a data stream from ``position`` (sources only)."""

    def save(self, path: str) -> None:
        """Write the node's checkpoint state to ``path`` (nodes with trainable state only)."""

    def load(self, path: str) -> None:
        """Read state written by ``save``."""

    def close(self) -> None:
        """Release what the program holds."""


class ProgramEnv(msgspec.Struct, frozen=True, kw_only=True):
    """Everything besides the graph that a program needs, as plain data.

    Attributes:
        transports: one spec per weight edge.
        programs: node name -> ``module:qualname`` of a factory ``(node, graph, env, transports) -> NodeProgram``
            replacing the built-in program (synthetic operators in tests and benches).
        seed: the run's seed.
        weight_timeout_s: how long a consumer waits for a published version before failing.
        options: free-form settings for user programs (durations of synthetic operators, ...).
        devices: node name -> the torch device its model lives on (``"cuda:0"``); a node not named
            runs on the CPU. Decided by ``flowrl.runtime.control.executor_placement.node_devices``.
        offload: node name -> its part in colocated offloading, ``"trainer"`` (its state waits in
            host memory between its steps) or ``"engine"`` (its engine sleeps between its steps);
            decided by ``flowrl.runtime.programs.offload.offload_roles``.
        staleness: the run's staleness gate (``run_graph`` builds it once, with the run's override,
            and the controller reads the same); None (a program built outside a run): the graph's own bounds.
    """

    transports: tuple[TransportSpec, ...] = ()
    programs: dict[str, str] = {}
    seed: int = 0
    weight_timeout_s: float = 300.0
    options: dict[str, Any] = {}
    devices: dict[str, str] = {}
    offload: dict[str, str] = {}
    staleness: StalenessGate | None = None

    def device_of(self, node: str) -> str:
        """The torch device of ``node``'s model: ``devices[node]``, else ``"cpu"``.

        Example:
            >>> ProgramEnv(devices={"gen": "cuda:0"}).device_of("gen"), ProgramEnv().device_of("gen")
            ('cuda:0', 'cpu')
        """
        return self.devices.get(node, "cpu")


#: The weight routes one process holds (``flowrl.runtime.weights.route.WeightRoutes``), under the name
#: the programs' builders take them by: ``writer`` / ``reader`` give a program an edge's halves,
#: ``route`` the edge's route object itself.
SharedTransports = WeightRoutes


class SourceProgram(ProgramBase):
    def __init__(self, node: SourceNode, graph: Graph) -> None:
        from flowrl.data.wiring import open_source_stream
        from flowrl.operators.source import PromptSource

        self.source = PromptSource(node, stream=open_source_stream(graph, node.name) if node.source.data else None)

    def step(self, seq: int, inputs: Batch, min_version: int) -> tuple[Batch, Info]:
        info: Info = {"position": self.source.position}
        if self.source.stream is not None:
            encoded = self.source.stream.encoded
            info.update({"data/epoch": self.source.stream.epoch_of(self.source.position),
                         "data/prompts_dropped": encoded.dropped, "data/prompts_truncated": encoded.truncated})
        return self.source.next_batch(), info

    def seek(self, position: int) -> None:
        self.source.load_state({"position": position})



class GeneratorProgram(ProgramBase):
    """Samples with the newest weights it can get, and never with weights older than ``min_version``."""

    def __init__(
        self, node: GeneratorNode, graph: Graph, env: ProgramEnv, transports: SharedTransports, *, seed: int, engine_options: Mapping[str, Any] | None = None
    ) -> None:
        """``engine_options`` go to the engine's constructor (a vLLM replica's ``tensor_parallel_size`` and ``devices``)."""
        from flowrl.operators.engines import build_engine

        self.name = node.name
        self._sampling, self._engine = node.sampling, node.engine
        (edge,) = graph.weight_edges_into(node.name)
        sleeps = {"sleep_mode": True} if env.offload.get(node.name) == "engine" else {}  # an engine that sleeps starts able to
        options = {**sleeps, **(engine_options or {})}
        self._edge = (edge.src, edge.dst)
        routes = getattr(transports, "route", None)  # a caller's own transports (a test's) have no route objects
        route = routes(*self._edge) if routes is not None else None
        # the run's route of the edge; outside a run (no spec), one of the graph's own transport, never opened here
        self._route = route if route is not None else WeightRoute(TransportSpec(src=edge.src, dst=edge.dst, name=edge.transport))
        self._direct = self._route.direct  # the policy's ranks send into vLLM's workers (torchrun: ``direct_route``)
        self._connected = False
        self._engine_of = (0, 1)  # (this engine, the generator's engines): its replicas share one direct route (``ParallelGenerator``)
        # the engine gets the route itself: one whose weights go on into workers of its own asks it the hop (``WeightRoute.hop``)
        self.generator = build_engine(node, seed=seed, device=env.device_of(node.name), transport=self._route, **options)  # node.engine's class
        self._in_flight = edge.in_flight
        self._transports = transports
        self._timeout = env.weight_timeout_s
        self._continuous: ContinuousRollouts | None = None
        self._multiturn = None
        if node.env is not None:  # multi-turn episodes against an environment (lock step, or parked between turns in continuous batching)
            from flowrl.graph.refs import resolve
            from flowrl.operators.engines import ENGINES
            from flowrl.operators.multiturn import row_fields

            if node.env.agent:  # an agent program over the OpenAI-compatible endpoint, any engine
                from flowrl.serve.agents import AgentRollouts

                self._multiturn = AgentRollouts(self.generator, resolve(node.env.env), model=node.model, max_turns=node.env.max_turns,
                                                episode_timeout_s=node.env.episode_timeout_s, rows=row_fields(graph, node.name))
            else:
                episodes = resolve(ENGINES[node.engine].episodes)  # the engine's episode runner (vLLM's: its step API)
                self._multiturn = episodes(self.generator, node, rows=row_fields(graph, node.name))
        # the run hands its gate down (ProgramEnv.staleness); a program built outside a run: the graph's own bounds
        self._bound = (env.staleness or StalenessGate.of(graph)).bound(node.name)  # k and U, the controller's
        if node.sampling.batching == "continuous":
            (feed,) = (graph.node(e.src) for e in graph.edges if e.dst == node.name)
            self._group_count = feed.source.batch_size  # type: ignore[attr-defined]  # a generator's feed is a SourceNode

    def _poll(self) -> None:
        """Take newer weights if the policy published some (in-flight updates; never waits)."""
        got = self._transports.reader(*self._edge).fetch_into(self.generator.weight_targets(), newer_than=self.generator.version)
        if got is not None:
            self.generator.version = got

    def _sync(self, min_version: int) -> float:
        if self._direct:
            return self._take_direct(min_version)
        transport = self._transports.reader(*self._edge)
        start = time.perf_counter()
        deadline = start + self._timeout
        while True:
            got = transport.fetch_into(self.generator.weight_targets(), newer_than=self.generator.version)
            if got is not None:
                self.generator.version = got
            if self.generator.version >= min_version:
                return time.perf_counter() - start
            if time.perf_counter() > deadline:
                raise TransportError(
                    f"generator {self.name!r} waited {self._timeout:.0f} s for weights of version >= {min_version} "
                    f"from {self._edge[0]!r}; the newest it got is {self.generator.version}"
                )
            time.sleep(0.0005)

    def _take_direct(self, min_version: int) -> float:
        """One request to the policy's ranks (the first connects the route): its newest version, at
        least ``min_version``, straight into vLLM's workers when newer than the one held. Holding
        ``min_version`` already, it asks only when the policy's lead says it holds a newer one and is
        between commands (a request waits for a step in progress: with k >= 1 sampling goes on with
        the weights held rather than waiting for the policy's step). With several engines (replicas)
        the first decides and asks for all; the others follow its request (``vllm_direct``)."""
        start = time.perf_counter()
        engine, engines = self._engine_of
        if not self._connected:
            self._channel = self._route.receiver().channel  # the route's generator half (``route.DirectEnd``)
            self.generator.connect_direct(self._channel, engine=engine, engines=engines)
            self._connected = True
        held = self.generator.version  # -1 until the first take: vLLM holds dummy weights, never sampled with
        ask = True
        if engine == 0 and held >= max(min_version, 0):
            said = self._channel.take("policy", what="the policy's version") if self._channel.has("policy") else None
            ask = said is not None and bool(said["idle"]) and int(said["version"]) > held
        self.generator.take_direct(min_version, ask=ask)
        return time.perf_counter() - start

    def _sample(self, seq: int, inputs: Batch, min_version: int) -> tuple[Batch, Info]:
        """Step ``seq``'s rollout with the weights held now: lock step samples ``inputs``; continuous
        batching queues them and returns the next ``P`` finished groups (with its ``slots/*`` numbers).
        ``info["version"]`` is the rollout's version."""
        if self._multiturn is not None and not hasattr(self, "_group_count"):
            rollout, info = self._multiturn.generate(inputs)
            return rollout, {**info, "version": self.generator.version}
        if not hasattr(self, "_group_count"):
            return self.generator.generate(inputs), {"version": self.generator.version}
        from flowrl.graph.refs import resolve
        from flowrl.operators.engines import ENGINES
        from flowrl.operators.multiturn import EpisodeSteps
        from flowrl.runtime.programs.continuous import ContinuousRollouts

        if self._continuous is None:  # group deadlines by the run's bound (a run may override the edge's k)
            episodes = self._multiturn
            # an agent program samples in lock step (GeneratorNode refuses env.agent with continuous batching)
            assert episodes is None or isinstance(episodes, EpisodeSteps), type(episodes).__name__
            self._continuous = ContinuousRollouts(
                self.generator, group_count=self._group_count, k=self._bound.k, updates=self._bound.updates,
                poll=self._poll if self._in_flight else None, episodes=episodes, batcher=resolve(ENGINES[self._engine].batcher),
            )
        self._continuous.add_prompts(inputs)
        rollout, info = self._continuous.next_batch(seq)
        info["version"] = int(rollout["rollout_version"])
        return rollout, info

    def close(self) -> None:
        """Stop the engine's own processes (vLLM's; the built-in engine holds none) and let environment
        calls still parked by continuous batching finish (briefly)."""
        if self._continuous is not None:
            self._continuous.close()
        stop = getattr(self._multiturn, "close", None)  # an agent program's endpoint
        if stop is not None:
            stop()
        close = getattr(self.generator, "close", None)  # optional in GeneratorEngine: only vLLM's has processes
        if close is not None:
            close()

    def step(self, seq: int, inputs: Batch, min_version: int) -> tuple[Batch, Info]:
        from flowrl.operators.generation import check_recorded_sampling

        fetch_s = self._sync(min_version)
        start = time.perf_counter()
        rollout, info = self._sample(seq, inputs, min_version)
        info.update(fetch_s=fetch_s, gen_s=time.perf_counter() - start)
        # mu must be recorded with the truncation it was drawn with, whatever the engine
        check_recorded_sampling(rollout, self._sampling, owner=f"generator {self.name!r} (engine {self._engine!r})")
        return rollout, info


class ScorerProgram(ProgramBase):
    def __init__(self, node: ScorerNode, graph: Graph) -> None:
        from flowrl.operators.scoring import Scorer
        from flowrl.operators.text_inputs import TextInputs

        self.scorer = Scorer(node, TextInputs(graph, node.name) if node.inputs == "text" else None)
        self.scorer.fn  # noqa: B018 - resolve the function at run start: a bad reference or signature fails before any step

    def step(self, seq: int, inputs: Batch, min_version: int) -> tuple[Batch, Info]:
        start = time.perf_counter()
        out = self.scorer.score(inputs)
        return out, {"score_s": time.perf_counter() - start}


class ReferenceProgram(ProgramBase):
    """Log-probs under the reference's weights; a syncing reference (``ReferenceConfig.sync_steps`` = N)
    first mixes in the policy's weights after trainer step ``seq`` when N divides ``seq``.

    Step ``seq`` scores batch ``seq``, which trainer step ``seq + 1`` consumes: the policy has then
    taken at most ``seq`` trainer steps, and cannot take another before these log-probs reach it. So
    the version ``U * seq`` (U updates per batch) that the controller waits for before such a step
    (``ReferenceNode.version_needed``, outside the colocation group's runner) is exactly the policy
    after ``seq`` trainer steps, and the weight edge's newest; a later version would be a flowrl bug,
    refused. With k = 0 the generator waited for that version already; with k >= 1 the wait is a
    pipeline bubble of up to k trainer steps once every N steps. ``ref/sync_s/<node>`` in that step's
    row: the seconds fetching and mixing.

    State (``_lock``: a checkpoint's ``save`` may run while a step mixes): the model's weights, and
    ``synced_at``, the trainer step of the last mix (0: none), which a resumed run continues from.

    A teacher (``flowrl.graph.teacher``) runs this program frozen, with its own operator
    (``build_teacher``: ``operator=Teacher(...)``, ``span="teacher_s"``).
    """

    def __init__(
        self,
        node: ReferenceNode,
        graph: Graph | None = None,
        transports: SharedTransports | None = None,
        *,
        device: str = "cpu",
        timeout_s: float = 300.0,
        operator: Any = None,
        span: str = "ref_s",
    ) -> None:
        import threading

        from flowrl.operators.reference import Reference

        self.name = node.name
        self.reference = operator if operator is not None else Reference(node, device=device)
        self.config = node.reference if isinstance(node, ReferenceNode) else ReferenceConfig()  # another kind's: frozen
        self._span = span
        self.synced_at = 0
        self._lock = threading.Lock()
        if self.config.sync_steps:
            if graph is None or transports is None:
                raise ConfigError(f"reference {node.name!r} syncs with its policy (sync_steps={self.config.sync_steps}) and needs the graph and its transports")
            (edge,) = graph.weight_edges_into(node.name)
            self._edge = (edge.src, edge.dst)
            self._updates = graph.updates_per_batch()
            self._transports = transports
            self._timeout = timeout_s
            self._staging = {k: torch.empty_like(t) for k, t in self.reference.weights.items()}  # the policy's weights, fetched

    def _fetch(self, version: int) -> None:
        """The policy's weights of exactly ``version`` into the staging tensors (waiting for them)."""
        transport = self._transports.reader(*self._edge)
        deadline = time.perf_counter() + self._timeout
        got = -1
        while got < version:
            fetched = transport.fetch_into(self._staging, newer_than=got)
            got = got if fetched is None else fetched
            if got < version:
                if time.perf_counter() > deadline:
                    raise TransportError(
                        f"reference {self.name!r} waited {self._timeout:.0f} s for the weights of version {version} from "
                        f"{self._edge[0]!r} to sync with; the newest it got is {got}"
                    )
                time.sleep(0.0005)
        if got != version:
            raise TransportError(
                f"reference {self.name!r} got version {got} from {self._edge[0]!r} to sync with, past version {version}, "
                "which the policy cannot publish before this step's log-probs reach it: this is a flowrl bug; please report it"
            )

    def step(self, seq: int, inputs: Batch, min_version: int) -> tuple[Batch, Info]:
        info: Info = {}
        if self.config.syncs_at(seq) and seq > self.synced_at:  # not again after a resume that holds this mix
            start = time.perf_counter()
            self._fetch(self._updates * seq)
            with self._lock:
                self.reference.mix(self._staging, self.config.sync_alpha)
                self.synced_at = seq
            info[f"ref/sync_s/{self.name}"] = time.perf_counter() - start
        start = time.perf_counter()
        out = self.reference.logprobs(inputs)
        info[self._span] = time.perf_counter() - start
        return out, info

    def snapshot(self, path: str) -> Callable[[], None]:
        """A syncing reference's mixed weights and ``synced_at`` (a frozen one has no state), copied now;
        returns their write to ``path``. A subclass with its own ``save`` saves now, whole."""
        if type(self).save is not ReferenceProgram.save:
            self.save(path)
            return lambda: None
        with self._lock:
            state = {"synced_at": self.synced_at, "weights": {k: t.detach().cpu().clone() for k, t in self.reference.parameters.items()}}
        return lambda: torch.save(state, path)

    def save(self, path: str) -> None:
        self.snapshot(path)()

    def load(self, path: str) -> None:
        state = torch.load(path, weights_only=True, map_location="cpu")
        with self._lock, torch.no_grad():
            for name, target in self.reference.parameters.items():
                target.copy_(state["weights"][name])
            self.synced_at = int(state["synced_at"])


class RewardModelProgram(ProgramBase):
    """Scores each batch with a reward model (``flowrl.operators.reward_models``); its namespaced
    counts (truncated texts, unparsed verdicts) go to the step's metrics row."""

    def __init__(self, node: RewardModelNode, graph: Graph, *, device: str = "cpu") -> None:
        from flowrl.operators.reward_models import RewardModel
        from flowrl.operators.text_inputs import TextInputs

        self.reward_model = RewardModel(node, TextInputs(graph, node.name), device=device)

    def step(self, seq: int, inputs: Batch, min_version: int) -> tuple[Batch, Info]:
        start = time.perf_counter()
        out, metrics = self.reward_model.score(inputs)
        return out, {**metrics, "rm_s": time.perf_counter() - start}


class PolicyProgram(ProgramBase):
    """Trains on one batch per step, then publishes its weights on every outgoing weight edge."""

    def __init__(self, node: PolicyNode, loss: LossNode, graph: Graph, transports: SharedTransports, *, device: str = "cpu", model: Any = None) -> None:
        from flowrl.operators.trainer import Trainer

        self.name = node.name
        self.trainer = Trainer(node, loss, device=device, model=model)  # model: prebuilt (an FSDP rank's, on the meta device)
        self._edges = [(e.src, e.dst) for e in graph.weight_edges_from(node.name)]
        self._transports = transports
        self._published = -1

    def publish(self) -> float:
        """Publish the current weights (once per version); returns the seconds it took."""
        start = time.perf_counter()
        if self.trainer.version > self._published:
            weights = self.trainer.weights()
            for edge in self._edges:
                self._transports.writer(*edge).publish(weights, self.trainer.version)
            self._published = self.trainer.version
        return time.perf_counter() - start

    def start(self) -> None:
        self.publish()  # the initial (or resumed) weights, so consumers can start

    def step(self, seq: int, inputs: Batch, min_version: int) -> tuple[Batch, Info]:
        start = time.perf_counter()
        metrics = self.trainer.train_step(inputs)
        train_s = time.perf_counter() - start
        publish_s = self.publish()
        info: Info = {k: float(v) for k, v in metrics.items()}
        info.update(train_s=train_s, publish_s=publish_s, version=self.trainer.version)
        if self._edges:  # what one publish puts on each weight edge (a LoRA policy's: its adapters only)
            info["sync/bytes"] = float(sum(t.numel() * t.element_size() for t in self.trainer.weights().values()))
        return {}, info

    def snapshot(self, path: str) -> Callable[[], None]:
        """The trainer's state copied now into CPU buffers kept from one checkpoint to the next
        (``checkpointing.background.stage``: one more copy of the state held for the run); returns its
        write to ``path``, which runs while training goes on. A subclass with its own ``save`` (shards
        over ranks) saves now, whole."""
        if type(self).save is not PolicyProgram.save:
            self.save(path)
            return lambda: None
        from flowrl.runtime.checkpointing.background import stage

        state = stage(self.trainer.state(copy=False), self.__dict__.setdefault("_checkpoint_buffers", {}))
        return lambda: torch.save(state, path)

    def save(self, path: str) -> None:
        self.snapshot(path)()

    def load(self, path: str) -> None:
        from flowrl.runtime.checkpointing.sharded_state import read_state

        self.trainer.load_state(read_state(path))  # one file, or a sharded state consolidated (any dp size); load_state moves to the device
        self._published = -1


def build_error(graph: Graph, name: str, exc: BaseException) -> NodeBuildError:
    """A one-paragraph ``NodeBuildError`` for ``exc`` raised while building node ``name``'s program,
    naming the innermost frame it came from (the user's factory or the operator that refused)."""
    kind = graph.node(name).kind if name in graph else "?"
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (raised at {frames[-1].filename}, line {frames[-1].lineno})" if frames else ""
    what = str(exc) if isinstance(exc, FlowrlError) else f"{type(exc).__name__}: {exc}"
    return NodeBuildError(f"node {name!r} ({kind}): building its program failed: {what}{where}", node=name)


# -- one builder per kind (``flowrl.runtime.programs.table.PROGRAMS[kind]``) ---------------------------------
def build_source(node: SourceNode, graph: Graph, env: ProgramEnv, transports: SharedTransports) -> NodeProgram:
    """A source's program: yields prompt batches."""
    return SourceProgram(node, graph)


def build_generator(node: GeneratorNode, graph: Graph, env: ProgramEnv, transports: SharedTransports) -> NodeProgram:
    """A generator's program: samples completions, fetching weights first."""
    return GeneratorProgram(node, graph, env, transports, seed=env.seed)


def build_scorer(node: ScorerNode, graph: Graph, env: ProgramEnv, transports: SharedTransports) -> NodeProgram:
    """A scorer's program: rewards completions."""
    return ScorerProgram(node, graph)


def build_reference(node: ReferenceNode, graph: Graph, env: ProgramEnv, transports: SharedTransports) -> NodeProgram:
    """A reference model's program: log-probs under its weights, frozen or synced with the policy."""
    return ReferenceProgram(node, graph, transports, device=env.device_of(node.name), timeout_s=env.weight_timeout_s)


def build_teacher(node: Any, graph: Graph, env: ProgramEnv, transports: SharedTransports) -> NodeProgram:
    """A teacher's program (``flowrl.graph.teacher``): a frozen reference's, its operator the teacher's log-probs."""
    from flowrl.operators.teacher import Teacher

    device = env.device_of(node.name)
    return ReferenceProgram(node, device=device, operator=Teacher(node, device=device), span="teacher_s")


def build_reward_model(node: RewardModelNode, graph: Graph, env: ProgramEnv, transports: SharedTransports) -> NodeProgram:
    """A reward model's program: rewards from a frozen Hugging Face model, on its node's device."""
    return RewardModelProgram(node, graph, device=env.device_of(node.name))


def build_policy(node: PolicyNode, graph: Graph, env: ProgramEnv, transports: SharedTransports) -> NodeProgram:
    """A policy's program: its loss's training step, then a publish of the new weights.

    Raises:
        ConfigError: if no loss node feeds it.
    """
    loss = graph.loss_of(node.name)
    if not isinstance(loss, LossNode):
        raise ConfigError(f"policy {node.name!r} has no loss node")
    return PolicyProgram(node, loss, graph, transports, device=env.device_of(node.name))


def merge(batches: list[Mapping[str, torch.Tensor]]) -> Batch:
    out: Batch = {}
    for b in batches:
        out.update(b)
    return out
