"""The all-gather and reduce-scatter a parameter group issues, as objects a user may replace: torch's FSDP2 `Comm`
protocol (`set_custom_all_gather` / `set_custom_reduce_scatter`), for control over where the communication
buffers live (a persistent buffer, a memory pool) and how the collective runs.

Layer: fsdp. A Comm allocates the buffer the collective writes (`allocate`) and issues the collective
(`__call__`), returning its Work, or None when it has finished. spmd passes its own process group and ReduceOp,
so a custom comm calls spmd's collectives (`spmd.all_gather_into_tensor`, `spmd.reduce_scatter_tensor`). spmd
always reduce-scatters with ReduceOp.SUM and divides afterwards.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
from torch import Tensor

from spmd.comm.collectives import all_gather_into_tensor, reduce_scatter_tensor
from spmd.comm.group import ProcessGroup
from spmd.comm.reduce_op import ReduceOp
from spmd.comm.work import Work


class Comm(ABC):
    """A communication primitive: where its output buffer comes from, and the call that fills it."""

    @abstractmethod
    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> Tensor:
        """The buffer the collective writes (a new tensor, or one kept from call to call)."""


class AllGather(Comm):
    """The group's parameter all-gather."""

    @abstractmethod
    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: ProcessGroup,
                 async_op: bool = False) -> Work | None:
        """Gather every rank's `input_tensor` into `output_tensor`, in rank order."""


class ReduceScatter(Comm):
    """The group's gradient reduce-scatter."""

    @abstractmethod
    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: ProcessGroup, op: ReduceOp,
                 async_op: bool = False) -> Work | None:
        """Reduce `input_tensor` over the group with `op` and leave this rank's chunk in `output_tensor`."""


class GroupAllocAllGather(AllGather):
    """spmd's all_gather_into_tensor, its output allocated by the process group (set_allocate_memory_from_process_
    group_for_comm): from the transport's own allocator where it has one, as torch's ProcessGroupAllocAllGather."""

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return self.group.allocate_tensor(math.prod(size), dtype, device).view(*size)

    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: ProcessGroup,
                 async_op: bool = False) -> Work | None:
        return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class GroupAllocReduceScatter(ReduceScatter):
    """spmd's reduce_scatter_tensor, its output allocated by the process group (see GroupAllocAllGather)."""

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return self.group.allocate_tensor(math.prod(size), dtype, device).view(*size)

    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: ProcessGroup, op: ReduceOp,
                 async_op: bool = False) -> Work | None:
        return reduce_scatter_tensor(output_tensor, input_tensor, op, group=group, async_op=async_op)


class DefaultAllGather(AllGather):
    """A new buffer per call and spmd's all_gather_into_tensor."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: ProcessGroup,
                 async_op: bool = False) -> Work | None:
        return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class DefaultReduceScatter(ReduceScatter):
    """A new buffer per call and spmd's reduce_scatter_tensor."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: ProcessGroup, op: ReduceOp,
                 async_op: bool = False) -> Work | None:
        return reduce_scatter_tensor(output_tensor, input_tensor, op, group=group, async_op=async_op)
