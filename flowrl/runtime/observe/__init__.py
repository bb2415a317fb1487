"""What a run shows: metrics rows and their sinks (TensorBoard, W&B), samples, progress, trace spans."""
