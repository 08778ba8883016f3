"""Alias at torch's module path `checkpoint.state_dict_saver` (in torch's distributed package): save and
async_save, and what async_save takes and returns."""

from spmd.checkpoint.api import AsyncCheckpointerType, AsyncSaveResponse, async_save, save, save_state_dict

__all__ = ["AsyncCheckpointerType", "AsyncSaveResponse", "async_save", "save", "save_state_dict"]
