"""The fake transport: one rank of a world whose other ranks are simulated, so nothing is sent.

Layer: comm. Backend "fake", torch's name for the same thing (its FakeProcessGroup): one process plays rank r
of a job of any size, to check a parallel layout's shapes, memory and code paths at the job's size (FSDP over
1024 ranks on a laptop) without a cluster. Collectives return at once and give deterministic stand-ins
for the values (the same ones torch's fake group gives, so outputs are never uninitialized memory):

    all_reduce, reduce, broadcast    the tensor is left as it is
    all_gather, gather (on root)     every rank's block is a copy of this rank's input
    reduce_scatter                   this rank's block of the input
    scatter                          on the root, its own block; elsewhere the output is left as it is
    all_to_all                       even splits: the input; uneven: each block repeats the input's head
    barrier, send, recv              complete at once (a receive leaves its tensor as it is)

The values are not what a real job computes: use it for shapes, memory, compile and control flow, never to
check numbers. A world initialised with "fake" needs no store or launcher (init_process_group takes
rank= and world_size=) and all its groups are fake; a real world may make fake groups too.
"""

from __future__ import annotations

import torch
from torch import Tensor

from spmd.comm.reduce_op import ReduceOp
from spmd.comm.transports.base import OpContext, Transport
from spmd.comm.work import Work


class FakeTransport(Transport):
    """A group whose other ranks are simulated; see the module docstring for what each collective gives."""

    name = "fake"
    devices = ("cpu", "cuda")
    moves_data = False       # so it takes FakeTensors too: a model traced under torch's FakeTensorMode

    def all_reduce(self, tensor: Tensor, op: ReduceOp, ctx: OpContext) -> None:
        pass

    def broadcast(self, tensor: Tensor, root: int, ctx: OpContext) -> None:
        pass

    def reduce(self, tensor: Tensor, root: int, op: ReduceOp, ctx: OpContext) -> None:
        pass

    def all_gather(self, output: Tensor, input: Tensor, ctx: OpContext) -> None:
        output.view(self.group_size, input.numel()).copy_(_apart_from(input, output).view(1, -1))

    def reduce_scatter(self, output: Tensor, input: Tensor, op: ReduceOp, ctx: OpContext) -> None:
        output.copy_(_apart_from(input, output).view(self.group_size, output.numel())[self.group_rank])

    def gather(self, output: Tensor | None, input: Tensor, root: int, ctx: OpContext) -> None:
        if output is not None:
            self.all_gather(output, input, ctx)

    def scatter(self, output: Tensor, input: Tensor | None, root: int, ctx: OpContext) -> None:
        if input is not None:
            output.copy_(_apart_from(input, output).view(self.group_size, output.numel())[self.group_rank])

    def all_to_all(self, output: Tensor, input: Tensor, output_splits: list[int], input_splits: list[int],
                   ctx: OpContext) -> None:
        input = _apart_from(input, output)
        if len(set(output_splits)) <= 1 and output_splits == input_splits:
            output.copy_(input)
            return
        start = 0
        for count in output_splits:
            if count and not input.numel():
                raise ValueError(f"spmd: all_to_all on {ctx.group_desc} (backend 'fake'): this rank expects "
                                 f"{count} elements from a peer but sends none, so the fake group has nothing "
                                 f"to fill them with")
            for offset in range(0, count, input.numel() or 1):
                piece = min(count - offset, input.numel())
                output[start + offset:start + offset + piece].copy_(input[:piece])
            start += count

    def barrier(self, ctx: OpContext) -> None:
        pass

    def isend(self, tensor: Tensor, dst: int, tag: int, work: Work) -> None:
        work.to_completed()

    def irecv(self, tensor: Tensor, src: int, tag: int, work: Work) -> None:
        work.to_completed()

    def abort(self, error: BaseException) -> None:
        pass

    def close(self) -> None:
        pass


def _apart_from(source: Tensor, destination: Tensor) -> Tensor:
    """`source`, copied first if it shares memory with `destination` (an in-place all_gather's input is its
    own block of the output)."""
    if source.numel() and torch._C._is_alias_of(source, destination):     # by storage: FakeTensors have no data
        return source.clone()
    return source
