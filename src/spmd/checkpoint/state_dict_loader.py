"""torch's `torch.distributed.checkpoint.state_dict_loader` path: load."""

from spmd.checkpoint.api import load

__all__ = ["load"]
