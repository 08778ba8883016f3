"""The two collectives of a parameter group: copy-in -> all-gather -> copy-out of its parameters, and copy-in ->
reduce-scatter of its gradients. One collective per group per direction, whatever the number of parameters.

Layer: fsdp. Both collectives are asynchronous: `start_*` issues the op and returns a handle that holds every
buffer the op reads or writes, so nothing it touches is freed while it is in flight; `finish_*` waits for it.

Note: the flat layouts
An all-gather input is this rank's padded pieces of the group's parameters end to end, `piece_numels[i]` elements
for parameter i (see Note: FSDP tensors in param.py). The output holds every rank's input in rank order, so it
is rank-major, (group_size, sum(piece_numels)); the unsharded buffer is parameter-major (parameter i's
group_size pieces together), so copy-out is one strided copy, `split_with_sizes_copy` along dim 1. The
reduce-scatter input is the same rank-major layout built from the unsharded gradients, and its output is this
rank's padded pieces end to end, again parameter after parameter.
A group whose mesh only replicates (the composable `replicate`) has no shard group (`group` None): each rank is a
group of one, so its gather output is its input and its reduce-scatter output the gradients, with no
collective; its replicas' all-reduce follows (param_group.py).
A group with frozen parameters of other dtypes or with all-gather extensions (extension.py) gathers bytes in the
same single collective: each rank's block is the buffered parameters' pieces (in the group's dtype, at the
block's start, so they view as it), then each other-dtype piece and each extension input as bytes, then padding
that keeps every rank's block aligned. Copy-out takes the pieces into the unsharded buffer, and each other item's
columns into its own buffer (a separate parameter's, or its extension's persistent output).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor

from spmd.comm.group import ProcessGroup
from spmd.comm.reduce_op import ReduceOp
from spmd.comm.work import Work
from spmd.fsdp.comm import AllGather as AllGatherComm
from spmd.fsdp.comm import ReduceScatter as ReduceScatterComm
from spmd.fsdp.param import FSDPParam


@dataclasses.dataclass
class AllGather:
    """An all-gather in flight: it reads `input` and writes `output`, rank-major with `split_sizes` columns per
    item (see Note: the flat layouts)."""

    work: Work | None
    input: Tensor
    output: Tensor
    group_size: int
    split_sizes: list[int]


def start_all_gather(params: list[FSDPParam], dtype: torch.dtype, device: torch.device, group: ProcessGroup | None,
                     comm: AllGatherComm, pieces: Tensor | None = None,
                     piece_numels: list[int] | None = None) -> AllGather:
    """Issue, through `comm`, the all-gather of `params`: from their sharded parameters (copied, cast to `dtype`,
    straight into this rank's block of the output: an in-place all-gather needs no input buffer), or from
    `pieces`, an all-gather input already laid out (the shards kept after forward for a smaller group). With no
    `group` (a rank alone), the copy is the output and nothing is issued."""
    size, rank = _size_and_rank(group)
    if pieces is None:
        piece_numels = [param.padded_numel for param in params]
        total = sum(piece_numels)
        output = _allocate(comm, group, total * size, dtype, device)
        pieces = output.narrow(0, total * rank, total)     # in place: this rank's block of the output
        for param, piece in zip(params, pieces.split(piece_numels), strict=True):
            param.copy_shard_into(piece)
    else:
        output = _allocate(comm, group, pieces.numel() * size, pieces.dtype, pieces.device)
    assert piece_numels is not None
    work = None if group is None else comm(output_tensor=output, input_tensor=pieces, group=group, async_op=True)
    return AllGather(work, pieces, output, size, piece_numels)


def _size_and_rank(group: ProcessGroup | None) -> tuple[int, int]:
    return (1, 0) if group is None else (group.size(), group.rank())


def _allocate(comm: AllGatherComm | ReduceScatterComm, group: ProcessGroup | None, numel: int, dtype: torch.dtype,
              device: torch.device) -> Tensor:
    """A collective's output buffer from `comm`; a rank alone (no group) issues no collective, so a plain one."""
    if group is None:
        return torch.empty(numel, dtype=dtype, device=device)
    return comm.allocate((numel,), dtype=dtype, device=device)


_BLOCK_ALIGNMENT = 16   # bytes: every rank's block starts aligned, so the plain pieces at its start view as `dtype`


def start_byte_all_gather(params: list[FSDPParam], dtype: torch.dtype, others: list[Tensor],
                          device: torch.device, group: ProcessGroup | None, comm: AllGatherComm) -> AllGather:
    """Issue one all-gather of `params`' pieces (cast to `dtype`) and `others` (flat tensors of any dtypes: other
    dtypes' pieces, extension inputs) as bytes: this rank's block is the pieces, then each of the others, then
    padding to the alignment (see Note: the flat layouts). Split sizes are in bytes, one per piece and per other
    tensor, then the padding's."""
    piece_numels = [param.padded_numel for param in params]
    sizes = [numel * dtype.itemsize for numel in piece_numels]
    sizes += [t.numel() * t.element_size() for t in others]
    sizes.append(-sum(sizes) % _BLOCK_ALIGNMENT)
    total = sum(sizes)
    size, rank = _size_and_rank(group)
    output = _allocate(comm, group, total * size, torch.uint8, device)
    block = output.narrow(0, total * rank, total)
    plain_bytes = sum(sizes[: len(params)])
    pieces = block[:plain_bytes].view(dtype).split(piece_numels)
    for param, piece in zip(params, pieces, strict=True):
        param.copy_shard_into(piece)
    items = block.split(sizes)[len(params):]
    for item, tensor in zip(items, others, strict=False):
        item.copy_(tensor.view(torch.uint8))
    work = None if group is None else comm(output_tensor=output, input_tensor=block, group=group, async_op=True)
    return AllGather(work, block, output, size, sizes)


def finish_all_gather(gather: AllGather, targets: list[Tensor]) -> None:
    """Wait for `gather` and copy each item's columns into its target, a (group_size, split size) view of a
    parameter-major destination (the group's unsharded buffer, an extension's output).

    The copy keeps the targets' version counters: autograd saved views of them in forward, and backward's
    all-gather refills them with the values they were saved with (see Note: FSDP tensors in param.py).
    """
    if gather.work is not None:
        gather.work.wait()
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(targets)):
        torch.split_with_sizes_copy(gather.output.view(gather.group_size, -1), gather.split_sizes, dim=1,
                                    out=targets)


@dataclasses.dataclass
class ReduceScatter:
    """A gradient reduce-scatter in flight: it reads `input` (rank-major) and writes `output`, this rank's
    reduced pieces of `params` end to end."""

    work: Work | None
    input: Tensor
    output: Tensor
    params: list[FSDPParam]
    reduced: bool = False      # a custom reduction made `output` final (no replicate all-reduce, no division)
    pre_divided: float = 1.0   # the gradients were divided by this before the sum (float16; see predivide_factor)
    replicas: ReplicaSum | None = None   # its sum over the replicas, once started (param_group.py)


@dataclasses.dataclass
class ReplicaSum:
    """A reduction's next step: the all-reduce of its output over the replicas (HSDP, replicate) when `work` is
    not None, then the division still owed (`remaining`)."""

    work: Work | None
    remaining: float


CustomReduce = Callable[[Tensor, Tensor], None]
"""A group's own gradient reduction: (flat rank-major unsharded gradients, this rank's output shard) -> None,
writing the reduced, divided shard into the output (FSDP1's register_comm_hook)."""


def predivide_factor(dtype: torch.dtype, divide_factor: float) -> float:
    """What to divide gradients by before their sum: 1, except in a dtype of small range (float16), where about
    the square root of `divide_factor` (a power of two) goes before the sum and the rest after, so that the
    sum does not overflow nor the quotient underflow."""
    if dtype in (torch.float32, torch.float64, torch.bfloat16):
        return 1.0
    pre = 1.0
    while pre * pre * 4 <= divide_factor:
        pre *= 2
    return pre


def start_reduce_scatter(params: list[FSDPParam], dtype: torch.dtype, device: torch.device,
                         group: ProcessGroup | None, comm: ReduceScatterComm, custom: CustomReduce | None = None,
                         pre_divide: float = 1.0) -> ReduceScatter:
    """Move the unsharded gradients of `params` into one rank-major buffer (cast to `dtype`, padding zeroed; each
    gradient is dropped once copied, so the two never both hold the whole group), divide it by `pre_divide`, and
    issue its SUM reduce-scatter over `group` through `comm`, or run `custom` on it (which finishes the
    reduction itself). With no `group` (a rank alone) the buffer is the output, and nothing is issued."""
    piece_numels = [param.padded_numel for param in params]
    flat = torch.empty(_size_and_rank(group)[0], sum(piece_numels), dtype=dtype, device=device)
    with torch.no_grad():
        for param, rows in zip(params, flat.split(piece_numels, dim=1), strict=True):
            param.copy_grad_into(rows)
            if param.unsharded_param is not None:
                param.unsharded_param.grad = None
    if custom is not None:
        output = flat.new_empty(sum(piece_numels))
        custom(flat.view(-1), output)
        return ReduceScatter(None, flat, output, params, reduced=True)
    if pre_divide != 1:
        flat.div_(pre_divide)
    if group is None:
        return ReduceScatter(None, flat, flat.view(-1), params, pre_divided=pre_divide)
    output = comm.allocate((sum(piece_numels),), dtype=dtype, device=device)
    work = comm(output_tensor=output, input_tensor=flat.view(-1), group=group, op=ReduceOp.SUM, async_op=True)
    return ReduceScatter(work, flat, output, params, pre_divided=pre_divide)


def add_reduced(params: list[FSDPParam], output: Tensor) -> None:
    """Add each parameter's piece of `output` (a finished reduction) into its sharded gradient."""
    with torch.no_grad():
        for param, piece in zip(params, output.split([param.padded_numel for param in params]), strict=True):
            param.accumulate_sharded_grad(piece)
