"""The shm transport: ranks on one host move tensors through shared memory, far faster than over sockets.

Layer: comm. `ShmTransport(spec)` is what `backend="shm"` (and "auto" inside one host) builds. A group whose
ranks share one host runs on LocalShmTransport (local: one shared segment, see segment); a group
spanning hosts runs on HierarchicalTransport (hierarchical: shared memory inside each host, tcp between the
hosts' leaders).
"""

from __future__ import annotations

from torch import Tensor

from spmd.comm.reduce_op import ReduceOp
from spmd.comm.transports.base import OpContext, Transport, TransportSpec
from spmd.comm.transports.shm.hierarchical import HierarchicalTransport
from spmd.comm.transports.shm.local import LocalShmTransport
from spmd.comm.work import Work


class ShmTransport(Transport):
    """Shared memory inside a host; with ranks on several hosts, hierarchical over tcp between hosts."""

    name = "shm"
    devices = ("cpu",)

    def __init__(self, spec: TransportSpec) -> None:
        super().__init__(spec)
        hierarchical = len(set(spec.hosts)) > 1
        self.engine: Transport = HierarchicalTransport(spec) if hierarchical else LocalShmTransport(spec)

    def all_reduce(self, tensor: Tensor, op: ReduceOp, ctx: OpContext) -> None:
        self.engine.all_reduce(tensor, op, ctx)

    def broadcast(self, tensor: Tensor, root: int, ctx: OpContext) -> None:
        self.engine.broadcast(tensor, root, ctx)

    def reduce(self, tensor: Tensor, root: int, op: ReduceOp, ctx: OpContext) -> None:
        self.engine.reduce(tensor, root, op, ctx)

    def all_gather(self, output: Tensor, input: Tensor, ctx: OpContext) -> None:
        self.engine.all_gather(output, input, ctx)

    def reduce_scatter(self, output: Tensor, input: Tensor, op: ReduceOp, ctx: OpContext) -> None:
        self.engine.reduce_scatter(output, input, op, ctx)

    def gather(self, output: Tensor | None, input: Tensor, root: int, ctx: OpContext) -> None:
        self.engine.gather(output, input, root, ctx)

    def scatter(self, output: Tensor, input: Tensor | None, root: int, ctx: OpContext) -> None:
        self.engine.scatter(output, input, root, ctx)

    def all_to_all(self, output: Tensor, input: Tensor, output_splits: list[int], input_splits: list[int],
                   ctx: OpContext) -> None:
        self.engine.all_to_all(output, input, output_splits, input_splits, ctx)

    def barrier(self, ctx: OpContext) -> None:
        self.engine.barrier(ctx)

    def isend(self, tensor: Tensor, dst: int, tag: int, work: Work) -> None:
        self.engine.isend(tensor, dst, tag, work)

    def irecv(self, tensor: Tensor, src: int, tag: int, work: Work) -> None:
        self.engine.irecv(tensor, src, tag, work)

    def abort(self, error: BaseException) -> None:
        self.engine.abort(error)

    def close(self) -> None:
        self.engine.close()
