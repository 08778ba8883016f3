"""Alias at torch's module path `checkpoint.state_dict_saver` (in torch's distributed package): save and
async_save."""

from spmd.checkpoint.api import async_save, save

__all__ = ["async_save", "save"]
