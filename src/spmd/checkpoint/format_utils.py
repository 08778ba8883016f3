"""torch's `torch.distributed.checkpoint.format_utils` path: conversions between a checkpoint and a torch.save
file (spmd.checkpoint.convert)."""

from spmd.checkpoint.convert import dcp_to_torch_save, torch_save_to_dcp

__all__ = ["dcp_to_torch_save", "torch_save_to_dcp"]
