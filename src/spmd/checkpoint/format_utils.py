"""Alias at torch's module path `checkpoint.format_utils` (in torch's distributed package): conversions
between a checkpoint and a torch.save file (spmd.checkpoint.convert)."""

from spmd.checkpoint.convert import dcp_to_torch_save, torch_save_to_dcp

__all__ = ["dcp_to_torch_save", "torch_save_to_dcp"]
