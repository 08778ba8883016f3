"""Alias at torch's module path `checkpoint.state_dict_loader` (in torch's distributed package): load."""

from spmd.checkpoint.api import load, load_state_dict

__all__ = ["load", "load_state_dict"]
