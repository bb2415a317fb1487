"""Environments for multi-turn rollouts: the protocol, tools, adapters and built-in environments.

- ``base``: the protocol (``reset(row)``, ``step(action)``), its checks, and the time-limited calls
  that turn an environment's exception, hang or garbage into a failed sample;
- ``tools``: Python functions as tools (JSON schema from the signature), Hermes/Qwen ``<tool_call>``
  parsing, and ``ToolEnv`` (tools plus a final-answer check);
- ``gym``: an adapter for gymnasium-style text environments;
- ``games``: built-in environments (``GuessNumberEnv``, ``CalcEnv``) and their task.

Pure Python: nothing here imports torch. ``flowrl.operators.multiturn`` runs episodes with a model.
"""

from flowrl.envs.environment import EnvError, EnvResult, check_env, make_env

__all__ = ["EnvError", "EnvResult", "check_env", "make_env"]
