"""An accelerator's tensors over spmd's own host transports (threads, tcp, shm), copied through host memory: the
slow path, as torch's gloo serves CUDA tensors. A job that launches with `backend="gloo"` (or "shm", "tcp",
"auto") on a GPU machine runs unchanged; its collectives pay a device-to-host copy, the host transport and a
host-to-device copy each. For speed, use `"nccl"` or a device map `"cpu:gloo,cuda:nccl"`.

Layer: comm (transports). create_transport wraps spmd's host transports in HostStagedTransport when the machine
has an accelerator (torch's gloo, asked for as "torch:gloo", stays as torch serves it).

Note: staged copies and streams
Every method is called with the caller's stream S current (see base.py, Streams). Each device tensor the op reads
is copied into a fresh host tensor (pinned where the accelerator can pin) by a blocking copy on S, so it holds S's
pending writes; the host transport runs on the copies; each device tensor the op writes gets its copy back by a
copy on S, non-blocking from pinned memory (torch's host allocator keeps the pinned block until that copy is
done; the device tensor is recorded on S, so freeing it from the stream it was made on can't reuse its memory
before the copy), so S, and through the group's event every waiter's stream, is ordered after the result. A
staged receive completes its host Work on whichever thread the host transport finishes it (a progress thread, or
the waiter's through `poll`): the message is copied into the device tensor there, blocking, and only then does the
caller's Work complete, so the copy is done before any stream can read the tensor.
"""

from __future__ import annotations

import torch
from torch import Tensor

from spmd.comm.reduce_op import ReduceOp
from spmd.comm.transports.base import OpContext, Transport, deliver_into
from spmd.comm.work import Work

_PINNED_HOST_MEMORY = ("cuda", "xpu")    # accelerators whose copies take page-locked host memory (MPS has none)


class _StagedReceive(Work):
    """The host-side Work of a staged receive: completed by the host transport, it copies the message into the
    caller's device tensor, then completes the caller's Work (or fails it)."""

    __slots__ = ("_caller_work", "_device_tensor", "_host_tensor")

    def __init__(self, caller_work: Work, device_tensor: Tensor, host_tensor: Tensor) -> None:
        super().__init__(caller_work.description, [host_tensor])
        self._caller_work = caller_work
        self._device_tensor = device_tensor
        self._host_tensor = host_tensor

    def to_completed(self, ready: torch.Event | None = None) -> None:
        super().to_completed(ready)
        try:
            deliver_into(self._device_tensor, self._host_tensor)
        except BaseException as error:       # the caller's Work must finish either way
            self._caller_work.to_failed(error)
            return
        self._caller_work.to_completed()

    def to_failed(self, error: BaseException) -> None:
        super().to_failed(error)
        self._caller_work.to_failed(error)


class HostStagedTransport(Transport):
    """A host transport that also moves the tensors of the device types in `staged`, through host copies."""

    devices = ("cpu", "cuda", "xpu", "mps", "hpu", "mtia")  # what it may serve; each instance narrows it to its
                                                              # host transport's and the staged ones
    def __init__(self, host: Transport, staged: tuple[str, ...]) -> None:
        self.devices = (*host.devices, *(kind for kind in staged if kind not in host.devices))
        super().__init__(host.spec)
        self.host = host
        self.name = host.name
        self.moves_data = host.moves_data
        self.matches_by_tag = host.matches_by_tag
        self.staged_devices = staged
        self._pin = any(kind in _PINNED_HOST_MEMORY for kind in staged)

    def _copy_in(self, tensor: Tensor) -> Tensor:
        """A host copy of `tensor` holding its current values (blocks until the caller's stream has them)."""
        if tensor.device.type not in self.staged_devices:
            return tensor
        return self._empty_like(tensor).copy_(tensor)

    def _host_output(self, tensor: Tensor) -> Tensor:
        """A host tensor for the op to write what goes into `tensor` (its values are not read)."""
        return tensor if tensor.device.type not in self.staged_devices else self._empty_like(tensor)

    def _empty_like(self, tensor: Tensor) -> Tensor:
        return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=self._pin)

    def _copy_out(self, tensor: Tensor, host: Tensor) -> None:
        if host is tensor:
            return
        tensor.copy_(host, non_blocking=self._pin)
        if self._pin:       # the copy may still be queued when the caller frees `tensor` from another stream
            tensor.record_stream(torch.accelerator.current_stream(tensor.device))

    def all_reduce(self, tensor: Tensor, op: ReduceOp, ctx: OpContext) -> None:
        host = self._copy_in(tensor)
        self.host.all_reduce(host, op, ctx)
        self._copy_out(tensor, host)

    def broadcast(self, tensor: Tensor, root: int, ctx: OpContext) -> None:
        is_root = self.group_rank == root
        host = self._copy_in(tensor) if is_root else self._host_output(tensor)
        self.host.broadcast(host, root, ctx)
        if not is_root:
            self._copy_out(tensor, host)

    def reduce(self, tensor: Tensor, root: int, op: ReduceOp, ctx: OpContext) -> None:
        host = self._copy_in(tensor)
        self.host.reduce(host, root, op, ctx)
        if self.group_rank == root:
            self._copy_out(tensor, host)

    def all_gather(self, output: Tensor, input: Tensor, ctx: OpContext) -> None:
        host_output = self._host_output(output)
        self.host.all_gather(host_output, self._copy_in(input), ctx)
        self._copy_out(output, host_output)

    def reduce_scatter(self, output: Tensor, input: Tensor, op: ReduceOp, ctx: OpContext) -> None:
        host_output = self._host_output(output)
        self.host.reduce_scatter(host_output, self._copy_in(input), op, ctx)
        self._copy_out(output, host_output)

    def gather(self, output: Tensor | None, input: Tensor, root: int, ctx: OpContext) -> None:
        host_output = None if output is None else self._host_output(output)
        self.host.gather(host_output, self._copy_in(input), root, ctx)
        if output is not None and host_output is not None:
            self._copy_out(output, host_output)

    def scatter(self, output: Tensor, input: Tensor | None, root: int, ctx: OpContext) -> None:
        host_output = self._host_output(output)
        self.host.scatter(host_output, None if input is None else self._copy_in(input), root, ctx)
        self._copy_out(output, host_output)

    def all_to_all(self, output: Tensor, input: Tensor, output_splits: list[int], input_splits: list[int],
                   ctx: OpContext) -> None:
        host_output = self._host_output(output)
        self.host.all_to_all(host_output, self._copy_in(input), output_splits, input_splits, ctx)
        self._copy_out(output, host_output)

    def barrier(self, ctx: OpContext) -> None:
        self.host.barrier(ctx)

    def isend(self, tensor: Tensor, dst: int, tag: int, work: Work) -> None:
        # the copy is made before isend returns, so the caller's tensor may be reused as soon as the Work completes
        self.host.isend(self._copy_in(tensor), dst, tag, work)

    def irecv(self, tensor: Tensor, src: int, tag: int, work: Work) -> None:
        if tensor.device.type not in self.staged_devices:
            self.host.irecv(tensor, src, tag, work)
            return
        receive = _StagedReceive(work, tensor, self._empty_like(tensor))
        self.host.irecv(receive._host_tensor, src, tag, receive)
        if receive.poll is not None:           # a waiter on the caller's Work moves the host transport's data
            work.poll = receive.poll

    def allocate_tensor(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor | None:
        return None if device.type in self.staged_devices else self.host.allocate_tensor(numel, dtype, device)

    def abort(self, error: BaseException) -> None:
        self.host.abort(error)

    def close(self) -> None:
        self.host.close()


def stage_accelerator(transport: Transport) -> Transport:
    """`transport`, wrapped to move the machine's accelerator tensors through host copies when it moves host
    tensors but not the accelerator's; as it is otherwise (no accelerator, or a device transport)."""
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None or accelerator.type in transport.devices or "cpu" not in transport.devices:
        return transport
    return HostStagedTransport(transport, (accelerator.type,))
