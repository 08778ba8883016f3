"""torch's `torch.distributed.checkpoint.state_dict_saver` path: save and async_save."""

from spmd.checkpoint.api import async_save, save

__all__ = ["async_save", "save"]
