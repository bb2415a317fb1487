"""The ``torchrun`` backend: every rank of a torch.distributed job runs part of the graph."""
