"""Checkpoints: directories and files, the checkpointer's cadence, resume, DCP sharded state."""
