"""Stagers for async_save: how the copy of what a rank saves is made before the writing goes on in the background
(torch's `checkpoint.staging` names: StagingOptions, DefaultStager, BlockingAsyncStager, AsyncStager).

Layer: checkpoint. async_save stages through its own host buffers (kept between saves) whatever built-in stager it
gets; the options choose pinned host memory and whether staging blocks the caller (see async_save). A stager of the
user's own (any object with `stage`) stages the state dict itself, as in torch.
"""

from __future__ import annotations

import abc
import concurrent.futures
import dataclasses
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

from spmd.comm.collectives import holds_fewer_bytes
from spmd.tensor import DTensor

__all__ = ["AsyncStager", "BlockingAsyncStager", "DefaultStager", "StagingOptions"]


@dataclasses.dataclass
class StagingOptions:
    """use_async_staging: async_save returns before the copy is made (an AsyncSaveResponse whose
    staging_completion says when the tensors may change again); use_pinned_memory: page-locked host buffers
    for accelerator tensors; use_non_blocking_copy: asynchronous copies into them. use_shared_memory serves
    torch's process-based checkpointer, which spmd has not (its writer is a thread)."""

    use_pinned_memory: bool = True
    use_shared_memory: bool = True
    use_async_staging: bool = True
    use_non_blocking_copy: bool = True


class AsyncStager(abc.ABC):
    """What async_save asks of a stager: `stage(state_dict)` returns the staged copy (or a Future of it);
    `synchronize_staging()` waits for a copy still in flight when `should_synchronize_after_execute`."""

    _synchronize_after_execute: bool = False

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._synchronize_after_execute

    @abc.abstractmethod
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any] | concurrent.futures.Future[dict[str, Any]]:
        """The staged copy of `state_dict`."""

    def synchronize_staging(self) -> None:
        """Wait for staging still in flight (nothing, for a stager that blocks)."""

    def close(self) -> None:
        """Release what the stager holds (its buffers, its thread)."""


def _snapshot(state_dict: dict[str, Any], pin_memory: bool) -> dict[str, Any]:
    """A copy of `state_dict`'s tensors: plain ones in host memory, DTensors as DTensors of a copy of their
    local tensor (on their own device, as their mesh's)."""
    def copy(value: Any) -> Any:
        if isinstance(value, DTensor) or (isinstance(value, Tensor) and holds_fewer_bytes(value)):
            return value.detach().clone()     # a compressed tensor stays itself (storage.py, Note: compressed tensors)
        if isinstance(value, Tensor):
            pin = pin_memory and value.device.type != "cpu" and torch.accelerator.is_available()
            return torch.empty(value.shape, dtype=value.dtype, pin_memory=pin).copy_(value.detach())
        return value

    return tree_map(copy, state_dict)


class DefaultStager(AsyncStager):
    """Staging on a thread by default (StagingOptions()), so async_save returns at once; with
    use_async_staging=False it blocks until the copy is made."""

    def __init__(self, config: StagingOptions | None = None) -> None:
        self.config = config if config is not None else StagingOptions()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any] | concurrent.futures.Future[dict[str, Any]]:
        if not self.config.use_async_staging:
            return _snapshot(state_dict, self.config.use_pinned_memory)
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="spmd-staging")
        return self._executor.submit(_snapshot, state_dict, self.config.use_pinned_memory)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


class BlockingAsyncStager(AsyncStager):
    """Staging that blocks the caller until the copy is made; async_save keeps its host buffers between saves
    whatever `cache_staged_state_dict` says (torch's option, accepted)."""

    def __init__(self, cache_staged_state_dict: bool = False, type_check: bool = False) -> None:
        self.cache_staged_state_dict = cache_staged_state_dict
        self.type_check = type_check

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return _snapshot(state_dict, pin_memory=True)
