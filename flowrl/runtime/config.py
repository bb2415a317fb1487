"""The run configuration: one typed struct, filled from the command line (CLI > defaults).

Where the nodes run is not part of it: ``run_graph(graph, placement, config)`` takes a
``flowrl.placement.Placement`` beside it."""

from __future__ import annotations

import math
from typing import Any, Literal

import msgspec

from flowrl.errors import ConfigError

__all__ = ["RunConfig"]



class RunConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How to execute a graph.

    Attributes:
        steps: trainer steps to run in total (a resumed run continues up to this many).
        max_staleness: override every weight edge's k; None keeps the graph's.
        backend: ``local`` (threads in this process), ``process`` (one OS process per executor),
            ``torchrun`` (this process is one rank of a torchrun job; see ``flowrl.runtime.backends.torchrun.backend``)
            or a backend registered with ``flowrl.runtime.backends.backend.register_backend``; an unknown
            name is refused by ``run_graph`` before any work.
        seed: seed of sampling and of the synthetic operators.
        metrics: JSON-lines file, one row per trainer step.
        trace: Chrome trace file (open in https://ui.perfetto.dev).
        checkpoint_dir: where checkpoints go; checkpoint_every: every N steps (0: only at the end).
        checkpoint_every_minutes: also a checkpoint after the first step that ends this many minutes
            after the last one was taken (or the run began); 0: by steps only. Each checkpoint's
            state is taken between steps and written behind training (``checkpointing.background``).
        keep_checkpoints: how many of the newest checkpoints stay in ``checkpoint_dir`` (>= 1);
            older ones are deleted as each new one is committed.
        resume: continue from the newest complete checkpoint in ``checkpoint_dir`` (True: there must
            be one, the CLI checks); ``"auto"``: continue from it when there is one and start fresh
            when there is none, the same setting for a job's first start and every restart
            (``torchrun --max-restarts``); False: a fresh run.
        programs: node -> ``module:qualname`` program factory replacing the built-in one.
        options: settings passed to those programs (``ProgramEnv.options``).
        channel_capacity: messages per data edge; 0 picks ``max_staleness + 1``.
        stall_timeout_s: fail the run if no executor finishes a step for this long.
        liveness_timeout_s: torchrun only: a rank of any role whose heartbeat stands still this long
            (dead, stopped, wedged) ends every rank of the job, naming it, so torchrun can restart
            (``flowrl.runtime.backends.torchrun.heartbeat``); None: 60 s. Refused on another backend.
        progress: draw a progress bar on stderr.
        log_samples: every N trainer steps, decode a few samples of the batch into the metrics row
            (``samples_text``; ``flowrl.runtime.observe.samples``); 0 never.
        threads: torch intra-op threads of the local backend; 0 divides the cores among the
            placement's colocation groups.
        device: where the models run: ``"auto"`` (CUDA when torch sees a CUDA device, else the CPU),
            ``"cpu"`` or ``"cuda"`` (each node on ``cuda:N`` from its placement; see
            ``flowrl.runtime.control.executor_placement.node_devices``). ``"cuda"`` without CUDA is refused when the run starts.
        eval_every: every N trainer steps, score the policy on the rows of ``eval_data`` in a
            background thread (``flowrl.runtime.evaluation.during_run``: ``eval/...`` keys in that step's
            metrics row); 0 never.
        eval_data: the held-out prompt file (the fields of the training file); needs ``eval_every``.
        eval_samples: sampled completions per eval row (``k`` of pass@k), besides the greedy one.
        eval_pass_reward: an eval completion passes (pass@k, ``eval/greedy_pass``) when its combined
            reward is at least this.
        offload: colocated offloading (``flowrl.runtime.programs.offload``): ``"auto"`` as the plan says (a
            placement from ``flowrl plan``; none otherwise), ``"on"`` every trainer sharing devices
            with a generator keeps its state in host memory while the generator runs, and a vLLM
            engine that can sleep sleeps while the trainer runs (a trainer sharing no device with a
            generator is refused), ``"off"`` never.
    """

    steps: int = 250
    max_staleness: int | None = None
    backend: str = "local"
    seed: int = 0
    metrics: str | None = None
    trace: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    checkpoint_every_minutes: float = 0.0
    keep_checkpoints: int = 3
    resume: bool | Literal["auto"] = False
    programs: dict[str, str] = {}
    options: dict[str, Any] = {}
    channel_capacity: int = 0
    stall_timeout_s: float = 300.0
    liveness_timeout_s: float | None = None
    progress: bool = False
    threads: int = 0
    log_samples: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    eval_every: int = 0
    eval_data: str | None = None
    eval_samples: int = 4
    eval_pass_reward: float = 1.0
    offload: Literal["auto", "on", "off"] = "auto"

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ConfigError(f"steps={self.steps} must be >= 1")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ConfigError(f"max_staleness={self.max_staleness} must be >= 0 (0 is synchronous on-policy training)")
        if self.log_samples < 0:
            raise ConfigError(f"log_samples={self.log_samples} must be >= 0 (0: never)")
        if self.checkpoint_every < 0:
            raise ConfigError(f"checkpoint_every={self.checkpoint_every} must be >= 0")
        if self.keep_checkpoints < 1:
            raise ConfigError(
                f"keep_checkpoints={self.keep_checkpoints} must be >= 1 (the newest checkpoint, the one LATEST names, always stays)"
            )
        if not isinstance(self.resume, bool) and self.resume != "auto":
            raise ConfigError(f"resume={self.resume!r}: one of True (continue), 'auto' (continue if there is a checkpoint, else start fresh) or False")
        if not (self.checkpoint_every_minutes >= 0 and math.isfinite(self.checkpoint_every_minutes)):
            raise ConfigError(f"checkpoint_every_minutes={self.checkpoint_every_minutes} must be a finite number >= 0 (0: by steps only)")
        if (self.checkpoint_every or self.checkpoint_every_minutes or self.resume) and not self.checkpoint_dir:
            raise ConfigError("checkpointing and --resume need a checkpoint directory (--checkpoint-dir DIR)")
        if self.channel_capacity < 0:
            raise ConfigError(f"channel_capacity={self.channel_capacity} must be >= 0")
        if self.threads < 0:
            raise ConfigError(f"threads={self.threads} must be >= 0 (0: divide the cores among colocation groups)")
        if self.eval_every < 0:
            raise ConfigError(f"eval_every={self.eval_every} must be >= 1 to evaluate every N steps (0: never)")
        if self.eval_every and not self.eval_data:
            raise ConfigError(f"eval_every={self.eval_every} needs eval_data, a prompt file of held-out rows with the training file's fields")
        if self.eval_every > self.steps:
            raise ConfigError(
                f"eval_every={self.eval_every} never fires within steps={self.steps} (it counts trainer steps): "
                f"set eval_every to at most {self.steps}, or steps={self.eval_every} or more"
            )
        if self.eval_data and not self.eval_every:
            raise ConfigError(f"eval_data={self.eval_data!r} is read only with eval_every, how often to evaluate (in steps)")
        if self.eval_samples < 1:
            raise ConfigError(f"eval_samples={self.eval_samples} must be >= 1 (sampled completions per eval row)")
        if self.liveness_timeout_s is not None and self.liveness_timeout_s <= 0:
            raise ConfigError(f"liveness_timeout_s={self.liveness_timeout_s} must be > 0 (seconds a rank's heartbeat may stand still)")
        if self.liveness_timeout_s is not None and self.backend != "torchrun":
            raise ConfigError(
                f"liveness_timeout_s={self.liveness_timeout_s} bounds how long a torchrun rank may stop answering, but backend={self.backend!r} "
                "runs no heartbeat (its workers' deaths close their sockets at once; a stopped worker meets stall_timeout_s): "
                "drop it or run with backend='torchrun'"
            )
        if self.stall_timeout_s <= 0:
            raise ConfigError(f"stall_timeout_s={self.stall_timeout_s} must be > 0")
