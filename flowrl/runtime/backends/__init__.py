"""Backends decide where executors' programs live: threads in this process, or one process each."""
