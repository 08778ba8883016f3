"""Alias at torch's module path `checkpoint.state_dict_loader` (in torch's distributed package): load."""

from spmd.checkpoint.api import load

__all__ = ["load"]
