"""Parallelism inside a node's process group: collectives, FSDP2, tensor parallelism, meshes."""
