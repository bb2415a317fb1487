"""Time a policy rank's train-step phases in any flowrl process, without editing the runtime: put this
directory on ``PYTHONPATH`` (``benches/trainer_parallel.py`` passes the caller's ``PYTHONPATH`` on to its
ranks) and set ``FLOWRL_STEP_PHASES=DIR``; every process then appends one JSON line per call,
``{"p": phase, "s": seconds, "r": RANK}``, to ``DIR/<pid>.jsonl``. The phases: ``Trainer.train_step``,
``_accumulate`` (forward + backward), ``_clip_gradients``, ``_logprobs``; ``PipelineTrainer``'s own
``_accumulate`` / ``_clip_gradients`` / ``_run``; ``adamw`` (``torch.optim.AdamW.step``); ``bcast``
(``broadcast_batch``), ``reduce_metrics``, ``release`` (``release_freed_memory``); the tp and pp
programs' metric reduction and ``publish``; ``rp.step`` (a rank program's whole step). The methods are
wrapped when their modules are first imported (a hook on ``__import__``; without the variable nothing
is changed).

Run: FLOWRL_STEP_PHASES=/tmp/phases PYTHONPATH=$PWD:$PWD/benches/step_phases \
     python benches/trainer_parallel.py --layouts one,tp2,pp2 --steps 3
"""

import os, time, json, functools
if os.environ.get("FLOWRL_STEP_PHASES"):
    _out = os.path.join(os.environ["FLOWRL_STEP_PHASES"], f"{os.getpid()}.jsonl")
    def _wrap(owner, name, label):
        fn = getattr(owner, name)
        @functools.wraps(fn)
        def w(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                with open(_out, "a") as f:
                    f.write(json.dumps({"p": label, "s": time.perf_counter() - t, "r": os.environ.get("RANK")}) + "\n")
        setattr(owner, name, w)
    import builtins
    _orig_import = builtins.__import__
    _done = set()
    import sys
    _busy = []
    def _hook(name, *a, **k):
        m = _orig_import(name, *a, **k)
        if _busy or len(_done) >= 7:
            return m
        _busy.append(1)
        try:
            if "trainer" not in _done and "flowrl.operators.trainer" in sys.modules and hasattr(sys.modules["flowrl.operators.trainer"], "Trainer"):
                _done.add("trainer")
                T = sys.modules["flowrl.operators.trainer"].Trainer
                for n in ("train_step", "_accumulate", "_clip_gradients", "_logprobs"):
                    _wrap(T, n, "T." + n)
                import torch
                _wrap(torch.optim.AdamW, "step", "adamw")
            if "pt" not in _done and "flowrl.runtime.parallel.pipeline_trainer" in sys.modules and hasattr(sys.modules["flowrl.runtime.parallel.pipeline_trainer"], "PipelineTrainer"):
                _done.add("pt")
                P = sys.modules["flowrl.runtime.parallel.pipeline_trainer"].PipelineTrainer
                for n in ("_accumulate", "_clip_gradients", "_logprobs", "_run"):
                    if n in P.__dict__: _wrap(P, n, "P." + n)
            if "dist" not in _done and "flowrl.runtime.parallel.distributed" in sys.modules and hasattr(sys.modules["flowrl.runtime.parallel.distributed"], "reduce_metrics"):
                _done.add("dist")
                D = sys.modules["flowrl.runtime.parallel.distributed"]
                _wrap(D, "broadcast_batch", "bcast"); _wrap(D, "reduce_metrics", "reduce_metrics")
            if "host" not in _done and "flowrl.host" in sys.modules and hasattr(sys.modules["flowrl.host"], "release_freed_memory"):
                _done.add("host"); _wrap(sys.modules["flowrl.host"], "release_freed_memory", "release")
            if "tp" not in _done and "flowrl.runtime.backends.torchrun.tp_policy" in sys.modules and hasattr(sys.modules["flowrl.runtime.backends.torchrun.tp_policy"], "TensorParallelPolicy"):
                _done.add("tp"); C = sys.modules["flowrl.runtime.backends.torchrun.tp_policy"].TensorParallelPolicy
                _wrap(C, "_reduce", "tp._reduce"); _wrap(C, "publish", "tp.publish")
            if "pp" not in _done and "flowrl.runtime.backends.torchrun.pp_policy" in sys.modules and hasattr(sys.modules["flowrl.runtime.backends.torchrun.pp_policy"], "PipelinePolicy"):
                _done.add("pp"); C = sys.modules["flowrl.runtime.backends.torchrun.pp_policy"].PipelinePolicy
                _wrap(C, "_share_metrics", "pp._share_metrics"); _wrap(C, "publish", "pp.publish")
            if "rp" not in _done and "flowrl.runtime.backends.torchrun.rank_policy" in sys.modules and hasattr(sys.modules["flowrl.runtime.backends.torchrun.rank_policy"], "_RankPolicy"):
                _done.add("rp"); C = sys.modules["flowrl.runtime.backends.torchrun.rank_policy"]._RankPolicy
                _wrap(C, "step", "rp.step")
        except Exception as e:
            print('SHIM', repr(e), file=sys.stderr)
        finally:
            _busy.pop()
        return m
    builtins.__import__ = _hook
