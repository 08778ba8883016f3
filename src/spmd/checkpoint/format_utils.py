"""Alias at torch's module path `checkpoint.format_utils` (in torch's distributed package): conversions
between a checkpoint and a torch.save file (spmd.checkpoint.convert), and loading a torch.save file straight into
any layout (spmd.checkpoint.torch_save_reader)."""

from spmd.checkpoint.convert import dcp_to_torch_save, torch_save_to_dcp
from spmd.checkpoint.torch_save_reader import BroadcastingTorchSaveReader, DynamicMetaLoadPlanner

__all__ = ["BroadcastingTorchSaveReader", "DynamicMetaLoadPlanner", "dcp_to_torch_save", "torch_save_to_dcp"]
