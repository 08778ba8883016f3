"""Functional collectives (torch's `_functional_collectives`, "funcol", which TorchTitan's utilities call): each
returns a new tensor and leaves its input alone; the `_autograd` variants differentiate through their adjoint.

Layer: _functional_collectives (imports _core, comm, device_mesh, nn). A group is given as torch's forms are:
a ProcessGroup, a 1-d DeviceMesh, `(mesh, mesh_dim)`, a list of global ranks (the group of those ranks, made
the first time by its members alone and kept), or a group's name. Reductions are named as strings ("sum",
"avg", "max", "min", "product", "band", "bor", "bxor", any case) or ReduceOps. The results are complete when
returned: they are `AsyncCollectiveTensor`s only in name, whose `wait()` is immediate, so code written for
torch's lazily-waited tensors (`wait_tensor(t)`, `t.wait()`) runs unchanged. `broadcast`'s and
`permute_tensor`'s ranks are group ranks, as in torch's functional API (spmd.broadcast's `src` is global).
The in-place variants (`*_inplace`) are torch's names for the classic collectives under tracing.

Under torch.compile each becomes the matching `torch.ops.spmd.*` operator (comm.traceable) in the graph, no graph
break, and returns plain tensors; eager calls run the collectives directly, at no extra cost.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from spmd.comm import collectives as c
from spmd.comm import traceable as ops
from spmd.comm.functional import (
    all_gather_fwd_reduce_scatter_bwd,
    all_gathered,
    all_reduced,
    reduce_scatter_fwd_all_gather_bwd,
    reduce_scattered,
)
from spmd.comm.group import ProcessGroup
from spmd.comm.reduce_op import ReduceOp
from spmd.comm.world import AnyGroup, current_world, default_group, new_group
from spmd.device_mesh import DeviceMesh, group_of
from spmd.nn import functional as differentiable

RANK_TYPES = list[int] | list[list[int]] | ProcessGroup | DeviceMesh | tuple[DeviceMesh, int] | str

REDUCE_OP_TO_STR = {ReduceOp.SUM: "sum", ReduceOp.AVG: "avg", ReduceOp.PRODUCT: "product", ReduceOp.MIN: "min",
                    ReduceOp.MAX: "max", ReduceOp.BAND: "band", ReduceOp.BOR: "bor", ReduceOp.BXOR: "bxor"}
_STR_TO_REDUCE_OP = {name: op for op, name in REDUCE_OP_TO_STR.items()}


class AsyncCollectiveTensor(torch.Tensor):
    """A functional collective's result (torch's lazily-waited tensor type). spmd's results are complete when
    returned, so `wait()` returns the values as a plain tensor at once; ops on it give plain tensors."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def elem(self) -> Tensor:
        return self.as_subclass(Tensor)

    def wait(self) -> Tensor:
        return self.as_subclass(Tensor)

    def trigger_wait(self) -> Tensor:
        return self.as_subclass(Tensor)


def _result(tensor: Tensor) -> Tensor:
    return tensor.as_subclass(AsyncCollectiveTensor) if type(tensor) is Tensor else tensor


def wait_tensor(tensor: Tensor) -> Tensor:
    """`tensor` once its collective is done (at once for spmd's), as a plain tensor."""
    return tensor.wait() if isinstance(tensor, AsyncCollectiveTensor) else tensor


def _group(group: RANK_TYPES, op: str) -> ProcessGroup:
    """The ProcessGroup that torch's group forms name (see the module docstring)."""
    if isinstance(group, list) and group and all(isinstance(r, int) for r in group):
        return _group_of_ranks(tuple(group), op)
    if isinstance(group, list) and group and all(isinstance(r, list) for r in group):
        world = current_world()
        mine = [ranks for ranks in group if world.rank in ranks]
        if len(mine) != 1:
            raise ValueError(f"spmd functional {op} on rank {world.rank}: {group} must hold this rank exactly once")
        return _group_of_ranks(tuple(mine[0]), op)
    if not isinstance(group, (ProcessGroup, DeviceMesh, tuple, str)):
        raise TypeError(f"spmd functional {op}: group must be a ProcessGroup, a DeviceMesh, (mesh, dim), a list of "
                        f"ranks or lists of ranks, or a group name, got {group!r}")
    return group_of(group, f"spmd functional {op}")


def _group_of_ranks(ranks: tuple[int, ...], op: str) -> ProcessGroup:
    """The world's first group of exactly these ranks, or a new one made by its members alone (each member
    reaches this call in the same order, as torch's functional API asks)."""
    world = current_world()
    if world.rank not in ranks:
        raise ValueError(f"spmd functional {op}: rank {world.rank} is not in the ranks {list(ranks)} it was "
                         f"called with")
    for candidate in world.groups:
        if isinstance(candidate, ProcessGroup) and tuple(candidate.ranks) == ranks:
            return candidate
    made = new_group(list(ranks), use_local_synchronization=True)
    assert isinstance(made, ProcessGroup)        # this rank is a member
    return made


def _reduce_op(reduce_op: str | ReduceOp, op: str) -> ReduceOp:
    if isinstance(reduce_op, ReduceOp):
        return reduce_op
    found = _STR_TO_REDUCE_OP.get(str(reduce_op).lower())
    if found is None:
        raise ValueError(f"spmd functional {op}: unknown reduce op {reduce_op!r}; use one of "
                         f"{sorted(_STR_TO_REDUCE_OP)}")
    return found


def broadcast(self: Tensor, src: int, group: RANK_TYPES, tag: str = "") -> Tensor:
    """Group rank `src`'s tensor, on every rank."""
    pg = _group(group, "broadcast")
    if ops.tracing(self):
        return ops.broadcast_op(self.detach(), src, pg.name)
    out = self.clone(memory_format=torch.contiguous_format)
    c.broadcast(out, group_src=src, group=pg)
    return _result(out)


def all_reduce(self: Tensor, reduceOp: str | ReduceOp, group: RANK_TYPES, tag: str = "") -> Tensor:
    """The reduction of every rank's tensor, on every rank."""
    op, pg = _reduce_op(reduceOp, "all_reduce"), _group(group, "all_reduce")
    if ops.tracing(self):
        return ops.all_reduce_op(self.detach(), op.value, pg.name)
    return _result(all_reduced(self, op, pg))


def all_gather_tensor(self: Tensor, gather_dim: int, group: RANK_TYPES, tag: str = "") -> Tensor:
    """Every rank's tensor concatenated along `gather_dim`, in group-rank order."""
    pg = _group(group, "all_gather_tensor")
    if ops.tracing(self):
        return ops.all_gather_op(self.detach(), gather_dim, pg.size(), pg.name)
    return _result(all_gathered(self, gather_dim, pg))


def all_gather_tensor_autograd(self: Tensor, gather_dim: int, group: RANK_TYPES, tag: str = "") -> Tensor:
    """all_gather_tensor whose backward reduce-scatters (sums) the gradient back to each rank's piece."""
    pg = _group(group, "all_gather_tensor_autograd")
    if ops.tracing(self):
        return ops.all_gather_op(self, gather_dim, pg.size(), pg.name)
    return all_gather_fwd_reduce_scatter_bwd(self, gather_dim, pg)


def reduce_scatter_tensor(self: Tensor, reduceOp: str | ReduceOp, scatter_dim: int,
                          group: RANK_TYPES, tag: str = "") -> Tensor:
    """Block `rank` (along `scatter_dim`, equal blocks) of the reduction over the ranks."""
    pg = _group(group, "reduce_scatter_tensor")
    _check_divides(self, scatter_dim, pg, "reduce_scatter_tensor")
    op = _reduce_op(reduceOp, "reduce_scatter_tensor")
    if ops.tracing(self):
        return ops.reduce_scatter_op(self.detach(), op.value, scatter_dim, pg.size(), pg.name)
    return _result(reduce_scattered(self, op, scatter_dim, pg))


def reduce_scatter_tensor_autograd(self: Tensor, reduceOp: str | ReduceOp, scatter_dim: int,
                                   group: RANK_TYPES, tag: str = "") -> Tensor:
    """reduce_scatter_tensor (sum or avg) whose backward all-gathers the gradient (divided by the group size for
    avg)."""
    pg = _group(group, "reduce_scatter_tensor_autograd")
    op = _reduce_op(reduceOp, "reduce_scatter_tensor_autograd")
    if op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"spmd functional reduce_scatter_tensor_autograd: only sum and avg differentiate, got "
                         f"{REDUCE_OP_TO_STR.get(op, op)}")
    _check_divides(self, scatter_dim, pg, "reduce_scatter_tensor_autograd")
    if ops.tracing(self):
        out = ops.reduce_scatter_op(self, ReduceOp.SUM.value, scatter_dim, pg.size(), pg.name)
    else:
        out = reduce_scatter_fwd_all_gather_bwd(self, scatter_dim, pg)
    return out / pg.size() if op is ReduceOp.AVG else out


def _check_divides(tensor: Tensor, dim: int, pg: ProcessGroup, op: str) -> None:
    if tensor.shape[dim] % pg.size():
        raise ValueError(f"spmd functional {op} on rank {current_world().rank}: dim {dim} of size "
                         f"{tensor.shape[dim]} does not split into {pg.size()} equal blocks")


def all_reduce_coalesced(self: list[Tensor], reduceOp: str | ReduceOp, group: RANK_TYPES,
                         tag: str = "") -> list[Tensor]:
    """all_reduce of each tensor (new tensors)."""
    if self and ops.tracing(self[0]):
        return [all_reduce(t, reduceOp, group) for t in self]
    outs = [t.clone(memory_format=torch.contiguous_format) for t in self]
    if outs:
        c.all_reduce_coalesced(outs, _reduce_op(reduceOp, "all_reduce_coalesced"),
                               group=_group(group, "all_reduce_coalesced"))
    return [_result(t) for t in outs]


def all_gather_into_tensor_coalesced(self: list[Tensor], group: RANK_TYPES, tag: str = "") -> list[Tensor]:
    """all_gather_tensor of each tensor along dim 0."""
    return [all_gather_tensor(t, 0, group) for t in self]


def reduce_scatter_tensor_coalesced(inputs: list[Tensor], reduceOp: str | ReduceOp,
                                    scatter_dim: list[int], group: RANK_TYPES, tag: str = "") -> list[Tensor]:
    """reduce_scatter_tensor of each input along its `scatter_dim` entry."""
    if len(scatter_dim) != len(inputs):
        raise ValueError(f"spmd functional reduce_scatter_tensor_coalesced: {len(scatter_dim)} scatter dims for "
                         f"{len(inputs)} inputs")
    return [reduce_scatter_tensor(t, reduceOp, dim, group) for t, dim in zip(inputs, scatter_dim, strict=True)]


# torch 2.13's names for the gather / scatter of one tensor ("single", beside the coalesced ones)
all_gather_single = all_gather_tensor
all_gather_single_autograd = all_gather_tensor_autograd
reduce_scatter_single = reduce_scatter_tensor
reduce_scatter_single_autograd = reduce_scatter_tensor_autograd
all_gather_single_coalesced = all_gather_into_tensor_coalesced


def reduce_scatter_single_coalesced(inputs: list[Tensor], reduceOp: str | ReduceOp,
                                    scatter_dim: list[int], group: RANK_TYPES, tag: str = "") -> list[Tensor]:
    """reduce_scatter_tensor_coalesced (torch 2.13's name)."""
    return reduce_scatter_tensor_coalesced(inputs, reduceOp, scatter_dim, group, tag)


def _output_like(self: Tensor, output_split_sizes: Sequence[int] | None) -> Tensor:
    rows = sum(output_split_sizes) if output_split_sizes is not None else self.shape[0]
    return self.new_empty((rows, *self.shape[1:]))


def all_to_all_single(self: Tensor, output_split_sizes: list[int] | None, input_split_sizes: list[int] | None,
                      group: RANK_TYPES, tag: str = "") -> Tensor:
    """Block j of this rank's input (along dim 0; `input_split_sizes` or equal blocks) to group rank j; the
    blocks received, concatenated in rank order (`output_split_sizes` rows each)."""
    pg = _group(group, "all_to_all_single")
    if ops.tracing(self):
        return ops.all_to_all_single_op(self.detach(), output_split_sizes, input_split_sizes, pg.name)
    out = _output_like(self, output_split_sizes)
    c.all_to_all_single(out, self.contiguous(), output_split_sizes, input_split_sizes, group=pg)
    return _result(out)


def all_to_all_single_autograd(self: Tensor, output_split_sizes: list[int] | None,
                               input_split_sizes: list[int] | None, group: RANK_TYPES, tag: str = "") -> Tensor:
    """all_to_all_single whose backward sends each gradient block back (the splits swapped)."""
    pg = _group(group, "all_to_all_single_autograd")
    if ops.tracing(self):
        return ops.all_to_all_single_op(self, output_split_sizes, input_split_sizes, pg.name)
    return differentiable.all_to_all_single(_output_like(self, output_split_sizes), self.contiguous(),
                                            output_split_sizes, input_split_sizes, group=pg)


def permute_tensor(self: Tensor, src_dst: list[int], group: RANK_TYPES, tag: str = "") -> Tensor:
    """Group rank i's tensor goes to group rank src_dst[i]; returns the tensor this rank receives."""
    pg = _group(group, "permute_tensor")
    size = pg.size()
    if sorted(src_dst) != list(range(size)):
        raise ValueError(f"spmd functional permute_tensor: src_dst {src_dst} must be a permutation of the "
                         f"{size} group ranks")
    me = pg.rank()
    flat = self.contiguous().reshape(-1)
    numel = flat.numel()
    sends = [numel if r == src_dst[me] else 0 for r in range(size)]
    receives = [numel if src_dst[r] == me else 0 for r in range(size)]
    if ops.tracing(self):
        return ops.all_to_all_single_op(flat.detach(), receives, sends, pg.name).view(self.shape)
    out = flat.new_empty(numel)
    c.all_to_all_single(out, flat, receives, sends, group=pg)
    return _result(out.view(self.shape))


def all_gather_tensor_inplace(output_tensor: Tensor, input_tensor: Tensor, group: AnyGroup | None = None,
                              async_op: bool = False, tag: str = "", gather_dim: int = 0) -> Tensor:
    """all_gather_tensor written into `output_tensor`; returns it."""
    pg = _group(group, "all_gather_tensor_inplace") if group is not None else default_group()
    if ops.tracing(input_tensor):
        return output_tensor.copy_(all_gather_tensor(input_tensor, gather_dim, pg))
    return output_tensor.copy_(all_gathered(input_tensor, gather_dim, pg))


def reduce_scatter_tensor_inplace(output: Tensor, input: Tensor, op: str | ReduceOp = "sum",
                                  scatter_dim: int = 0, group: AnyGroup | None = None, async_op: bool = False,
                                  tag: str = "") -> Tensor:
    """reduce_scatter_tensor written into `output`; returns it."""
    pg = _group(group, "reduce_scatter_tensor_inplace") if group is not None else default_group()
    if ops.tracing(input):
        return output.copy_(reduce_scatter_tensor(input, op, scatter_dim, pg))
    return output.copy_(reduce_scattered(input, _reduce_op(op, "reduce_scatter_tensor_inplace"), scatter_dim, pg))


def all_reduce_inplace(tensor: Tensor, op: str | ReduceOp = "sum", group: AnyGroup | None = None,
                       async_op: bool = False, tag: str = "") -> Tensor:
    """spmd.all_reduce of `tensor` in place; returns it."""
    pg = _group(group, "all_reduce_inplace") if group is not None else default_group()
    if ops.tracing(tensor):
        return tensor.copy_(all_reduce(tensor, op, pg))
    c.all_reduce(tensor, _reduce_op(op, "all_reduce_inplace"), group=pg)
    return tensor


def all_gather_inplace(tensor_list: list[Tensor], tensor: Tensor, group: AnyGroup | None = None,
                       async_op: bool = False, tag: str = "") -> list[Tensor]:
    """spmd.all_gather into `tensor_list`; returns it."""
    pg = _group(group, "all_gather_inplace") if group is not None else default_group()
    if ops.tracing(tensor):
        for piece, gathered in zip(tensor_list, all_gather_tensor(tensor.unsqueeze(0), 0, pg).unbind(0), strict=True):
            piece.copy_(gathered)
        return tensor_list
    c.all_gather(tensor_list, tensor, group=pg)
    return tensor_list


def all_to_all_inplace(output: Tensor, input: Tensor, output_split_sizes: list[int] | None = None,
                       input_split_sizes: list[int] | None = None, group: AnyGroup | None = None,
                       async_op: bool = False, tag: str = "") -> Tensor:
    """spmd.all_to_all_single into `output`; returns it."""
    pg = _group(group, "all_to_all_inplace") if group is not None else default_group()
    if ops.tracing(input):
        return output.copy_(all_to_all_single(input, output_split_sizes, input_split_sizes, pg))
    c.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=pg)
    return output

