"""torch's ProcessGroup methods on spmd's groups (`pg.allreduce([t]).wait()`, `pg.broadcast(t, root)`, ...), for
code written against torch's group objects (torch's own comm hooks, fault-tolerance libraries, older scripts).

Layer: comm. Each method starts its collective asynchronously and returns its Work, as torch's do; ranks (`root`,
`dstRank`, `srcRank`) are group ranks, as torch's methods take them; a list of tensors holds one tensor, as torch
asks of a process with one device. The second positional argument is torch's options object (AllreduceOptions,
..., read by its fields: reduceOp, rootRank, rootTensor, timeout) or what torch's shorter overload takes there
(the ReduceOp, the root, the timeout); a timeout bounds that one operation instead of the group's. The options
classes are served too, with torch's fields and defaults (AllreduceOptions, BroadcastOptions, ...).
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from torch import Tensor

from spmd._core.deadline import as_seconds
from spmd.comm.reduce_op import ReduceOp

if TYPE_CHECKING:
    from spmd.comm.work import Work

_UNSET = datetime.timedelta(milliseconds=-1)   # torch's options' timeout when none is set: the group's


@dataclasses.dataclass
class _Options:
    """The fields every options object of torch's has; `asyncOp` is taken (a method's Work is async either way)."""

    timeout: datetime.timedelta = _UNSET
    asyncOp: bool = True


@dataclasses.dataclass
class AllreduceOptions(_Options):
    reduceOp: ReduceOp = ReduceOp.SUM


@dataclasses.dataclass
class AllreduceCoalescedOptions(AllreduceOptions):
    pass


@dataclasses.dataclass
class ReduceScatterOptions(AllreduceOptions):
    pass


@dataclasses.dataclass
class BroadcastOptions(_Options):
    rootRank: int = 0
    rootTensor: int = 0


@dataclasses.dataclass
class ReduceOptions(BroadcastOptions):
    reduceOp: ReduceOp = ReduceOp.SUM


@dataclasses.dataclass
class GatherOptions(_Options):
    rootRank: int = 0


@dataclasses.dataclass
class ScatterOptions(GatherOptions):
    pass


@dataclasses.dataclass
class AllgatherOptions(_Options):
    pass


@dataclasses.dataclass
class AllToAllOptions(_Options):
    pass


@dataclasses.dataclass
class BarrierOptions(_Options):
    device_ids: list[int] = dataclasses.field(default_factory=list)
    device: Any = None


def reduce_op_of(op: Any, where: str) -> ReduceOp:
    """spmd's ReduceOp for `op`: spmd's, or torch's (a ReduceOp or its RedOpType, by name)."""
    if isinstance(op, ReduceOp):
        return op
    name = getattr(getattr(op, "op", op), "name", None)
    if name not in ReduceOp.__members__:
        raise ValueError(f"{where}: reduce op {op!r} has no spmd counterpart (PREMUL_SUM: scale the tensor, then "
                         f"reduce with SUM)")
    return ReduceOp[name]


def _is_reduce_op(value: Any) -> bool:
    """spmd's ReduceOp, or torch's (a ReduceOp, whose `.op` is a RedOpType, or the RedOpType itself)."""
    return isinstance(value, ReduceOp) or type(getattr(value, "op", value)).__name__ == "RedOpType"


def _seconds(timeout: Any, group: Any, where: str) -> float | None:
    """The timeout in seconds, or None for torch's unset one (options objects hold a negative timedelta)."""
    if timeout is None or (isinstance(timeout, datetime.timedelta) and timeout.total_seconds() < 0):
        return None
    return as_seconds(timeout, group.timeout, f"{where}: timeout")


class _Call:
    """One method call's arguments, sorted out of torch's overloads."""

    def __init__(self, group: Any, method: str, opts: Any, timeout: Any, positional: str | None, op: Any = None,
                 root: int | None = None) -> None:
        self.where = f"ProcessGroup.{method} on rank {group.global_rank} of {group.description}"
        self.op, self.root = ReduceOp.SUM, 0
        if opts is None:
            pass
        elif _is_reduce_op(opts):                                       # torch's shorter overloads' arguments
            self.op = reduce_op_of(opts, self.where)
        elif isinstance(opts, datetime.timedelta):
            timeout = opts
        elif isinstance(opts, int) and not isinstance(opts, bool) and positional == "root":
            self.root = opts
        elif hasattr(opts, "timeout"):                                  # torch's options object
            if hasattr(opts, "reduceOp"):
                self.op = reduce_op_of(opts.reduceOp, self.where)
            self.root = int(getattr(opts, "rootRank", 0))
            timeout = opts.timeout if timeout is None else timeout
        else:
            raise TypeError(f"{self.where}: {opts!r} is neither torch's options object nor "
                            f"{'a root rank, ' if positional == 'root' else ''}a ReduceOp or a timeout")
        if op is not None:                                              # torch's keyword forms
            self.op = reduce_op_of(op, self.where)
        if root is not None:
            self.root = int(root)
        self.seconds = _seconds(timeout, group, self.where)

    def one(self, tensors: Tensor | Sequence[Any], what: str) -> Any:
        """The one entry of `tensors` (torch's list holds one per device of the process), or the tensor itself."""
        if isinstance(tensors, Tensor):
            return tensors
        if len(tensors) != 1:
            raise ValueError(f"{self.where}: {what} holds {len(tensors)} entries; this process has one device, so "
                             f"torch's group methods take one (a list of one)")
        return tensors[0]

    def one_and_list(self, tensors: Tensor | Sequence[Tensor], lists: Sequence[Any] | None, what: str,
                     lists_what: str) -> tuple[Tensor, list[Tensor] | None]:
        """A collective's one tensor and its list of tensors, from either of torch's overloads: (a tensor, a list)
        or (a list of one tensor, a list of one list); None for a list this rank does not take (not the root)."""
        if isinstance(tensors, Tensor):
            return tensors, None if lists is None else list(lists)
        return self.one(tensors, what), None if lists is None else list(self.one(lists, lists_what))


class TorchGroupMethods:
    """torch's ProcessGroup methods (see the module docstring); mixed into spmd's ProcessGroup."""

    def get_group_store(self) -> Any:
        """The group's own store (its keys under the group's prefix), as torch's."""
        return self.store

    def set_timeout(self, timeout: float | datetime.timedelta) -> None:
        """Bound the group's later operations by `timeout` instead (seconds or a timedelta)."""
        self.timeout = as_seconds(timeout, self.timeout, f"ProcessGroup.set_timeout on {self.description}")

    def shutdown(self) -> None:
        """torch's name for destroying the group on this rank: queued operations finish, then its transport is
        released (`close`)."""
        self.close()

    def _issue(self, call: _Call, start: Callable[[], Work | None]) -> Work:
        from spmd.comm.collectives import op_timeout

        with op_timeout(call.seconds):
            return start()

    def allreduce(self, tensors: Tensor | Sequence[Tensor], opts: Any = None, timeout: Any = None, *,
                  op: Any = None) -> Work:
        from spmd.comm.collectives import all_reduce

        call = _Call(self, "allreduce", opts, timeout, "op", op=op)
        tensor = call.one(tensors, "tensors")
        return self._issue(call, lambda: all_reduce(tensor, call.op, group=self, async_op=True))

    def allreduce_coalesced(self, tensors: Sequence[Tensor], opts: Any = None) -> Work:
        from spmd.comm.collectives import all_reduce_coalesced

        call = _Call(self, "allreduce_coalesced", opts, None, "op")
        return self._issue(call, lambda: all_reduce_coalesced(list(tensors), call.op, group=self, async_op=True))

    def broadcast(self, tensors: Tensor | Sequence[Tensor], opts: Any = None, timeout: Any = None, *,
                  root: int | None = None) -> Work:
        from spmd.comm.collectives import broadcast

        call = _Call(self, "broadcast", opts, timeout, "root", root=root)
        tensor = call.one(tensors, "tensors")
        return self._issue(call, lambda: broadcast(tensor, group=self, async_op=True, group_src=call.root))

    def reduce(self, tensors: Tensor | Sequence[Tensor], opts: Any = None, op: Any = None,
               timeout: Any = None, *, root: int | None = None) -> Work:
        from spmd.comm.collectives import reduce

        call = _Call(self, "reduce", opts, timeout, "root", op=op, root=root)
        tensor = call.one(tensors, "tensors")
        return self._issue(call, lambda: reduce(tensor, op=call.op, group=self, async_op=True, group_dst=call.root))

    def allgather(self, output_tensors: Sequence[Any], input_tensors: Tensor | Sequence[Tensor], opts: Any = None,
                  timeout: Any = None) -> Work:
        from spmd.comm.collectives import all_gather

        call = _Call(self, "allgather", opts, timeout, None)
        tensor, outputs = call.one_and_list(input_tensors, output_tensors, "input_tensors", "output_tensors")
        return self._issue(call, lambda: all_gather(outputs, tensor, group=self, async_op=True))

    def _allgather_base(self, output: Tensor, input: Tensor, opts: Any = None) -> Work:
        from spmd.comm.collectives import all_gather_into_tensor

        call = _Call(self, "_allgather_base", opts, None, None)
        return self._issue(call, lambda: all_gather_into_tensor(output, input, group=self, async_op=True))

    all_gather_single = _allgather_base

    def reduce_scatter(self, output_tensors: Tensor | Sequence[Tensor], input_tensors: Sequence[Any],
                       opts: Any = None, timeout: Any = None, *, op: Any = None) -> Work:
        from spmd.comm.collectives import reduce_scatter

        call = _Call(self, "reduce_scatter", opts, timeout, "op", op=op)
        output, inputs = call.one_and_list(output_tensors, input_tensors, "output_tensors", "input_tensors")
        return self._issue(call, lambda: reduce_scatter(output, inputs, call.op, group=self, async_op=True))

    def _reduce_scatter_base(self, outputTensor: Tensor, inputTensor: Tensor, opts: Any = None) -> Work:
        from spmd.comm.collectives import reduce_scatter_tensor

        call = _Call(self, "_reduce_scatter_base", opts, None, "op")
        return self._issue(call, lambda: reduce_scatter_tensor(outputTensor, inputTensor, call.op, group=self,
                                                               async_op=True))

    reduce_scatter_single = _reduce_scatter_base

    def alltoall_base(self, output: Tensor, input: Tensor, output_split_sizes: Sequence[int],
                      input_split_sizes: Sequence[int], opts: Any = None, timeout: Any = None) -> Work:
        from spmd.comm.collectives import all_to_all_single

        call = _Call(self, "alltoall_base", opts, timeout, None)
        return self._issue(call, lambda: all_to_all_single(output, input, list(output_split_sizes) or None,
                                                           list(input_split_sizes) or None, group=self,
                                                           async_op=True))

    all_to_all_single = alltoall_base

    def alltoall(self, output_tensors: Sequence[Tensor], input_tensors: Sequence[Tensor], opts: Any = None) -> Work:
        from spmd.comm.collectives import all_to_all

        call = _Call(self, "alltoall", opts, None, None)
        return self._issue(call, lambda: all_to_all(list(output_tensors), list(input_tensors), group=self,
                                                    async_op=True))

    def gather(self, output_tensors: Sequence[Any], input_tensors: Tensor | Sequence[Tensor], opts: Any = None,
               timeout: Any = None, *, root: int | None = None) -> Work:
        from spmd.comm.collectives import gather

        call = _Call(self, "gather", opts, timeout, "root", root=root)
        tensor, outputs = call.one_and_list(input_tensors, output_tensors if self.group_rank == call.root else None,
                                            "input_tensors", "output_tensors")
        return self._issue(call, lambda: gather(tensor, outputs, group=self, async_op=True, group_dst=call.root))

    def scatter(self, output_tensors: Tensor | Sequence[Tensor], input_tensors: Sequence[Any], opts: Any = None,
                timeout: Any = None, *, root: int | None = None) -> Work:
        from spmd.comm.collectives import scatter

        call = _Call(self, "scatter", opts, timeout, "root", root=root)
        output, inputs = call.one_and_list(output_tensors, input_tensors if self.group_rank == call.root else None,
                                           "output_tensors", "input_tensors")
        return self._issue(call, lambda: scatter(output, inputs, group=self, async_op=True, group_src=call.root))

    def barrier(self, opts: Any = None, timeout: Any = None) -> Work:
        from spmd.comm.collectives import barrier

        call = _Call(self, "barrier", opts, timeout, None)
        return self._issue(call, lambda: barrier(group=self, async_op=True, timeout=call.seconds))

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        from spmd.comm.collectives import monitored_barrier

        monitored_barrier(group=self, timeout=timeout, wait_all_ranks=wait_all_ranks)

    def send(self, tensors: Sequence[Tensor], dstRank: int, tag: int) -> Work:
        from spmd.comm.p2p import isend

        call = _Call(self, "send", None, None, None)
        return isend(call.one(tensors, "tensors"), group=self, tag=tag, group_dst=dstRank)

    def recv(self, tensors: Sequence[Tensor], srcRank: int, tag: int) -> Work:
        from spmd.comm.p2p import irecv

        call = _Call(self, "recv", None, None, None)
        return irecv(call.one(tensors, "tensors"), group=self, tag=tag, group_src=srcRank)
