"""Evaluation: during a run (--eval-every) and of a saved policy (flowrl sample / eval)."""
