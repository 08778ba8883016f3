"""A device map ("cpu:gloo,cuda:nccl"): one group whose operations each go to the transport of their tensors'
device type.

Layer: comm (transports). The group builds one sub-transport per entry, in the map's order, each with its own
store namespace and group name, so the entries connect independently. Every entry must name a transport that
moves its device type (an accelerator's entry naming one of spmd's host transports, "cuda:gloo" as torch takes
it, moves it through host copies, staged.py): a transport for a device this process lacks is refused when the
group is created, as torch refuses an nccl group without CUDA (there is no lazy creation: a lazily created
transport would make its first collective the collective set-up, on ranks that may not all reach it).

Note: which sub-transport runs an operation
Every rank calls every op with tensors on the same device type, so every rank picks the same sub-transport.
An op whose tensors lie on two device types is refused before anything is sent. A barrier and the object
collectives' staging use the first entry (the group's `devices[0]`), like torch's barrier on the default device.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from spmd.comm.reduce_op import ReduceOp
from spmd.comm.store.base import PrefixStore
from spmd.comm.transports.base import OpContext, P2PStart, Transport, TransportSpec, create_transport
from spmd.comm.work import Work

DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "meta")


def is_device_map(backend: str) -> bool:
    """Whether `backend` is a device map: "<device type>:<backend>" entries separated by commas."""
    first = backend.split(",", 1)[0]
    return first.partition(":")[0] in DEVICE_TYPES and ":" in first


def parse_device_map(backend: str) -> list[tuple[str, str]]:
    """The (device type, backend) entries of a device map, in order; ValueError naming what is wrong."""
    entries = []
    for entry in backend.split(","):
        device, _, name = entry.strip().partition(":")
        if device not in DEVICE_TYPES or not name:
            raise ValueError(f"spmd: device map {backend!r}: entry {entry!r} must be '<device type>:<backend>' "
                             f"with a device type among {DEVICE_TYPES}, e.g. 'cpu:gloo,cuda:nccl'")
        if any(device == seen for seen, _ in entries):
            raise ValueError(f"spmd: device map {backend!r} names device type {device!r} twice")
        entries.append((device, name))
    return entries


class DeviceMapTransport(Transport):
    """One sub-transport per device type; each op runs on the one serving its tensors' device type."""

    devices = DEVICE_TYPES   # what a map may name; each instance narrows it to its entries, in map order

    def __init__(self, spec: TransportSpec, entries: list[tuple[str, str]]) -> None:
        self.devices = tuple(device for device, _ in entries)
        super().__init__(spec)
        self._by_device: dict[str, Transport] = {}
        try:
            for device, backend in entries:
                sub_spec = dataclasses.replace(spec, store=PrefixStore(f"device/{device}", spec.store),
                                               group_name=f"{spec.group_name}-{device}")
                transport = create_transport(backend, sub_spec, stage_accelerator=device != "cpu")
                self._by_device[device] = transport
                if device not in transport.devices:
                    raise ValueError(f"spmd: device map entry '{device}:{backend}': the {transport.name} transport "
                                     f"moves only {', '.join(transport.devices)} tensors, not {device} ones")
        except BaseException:
            self.close()
            raise
        self.name = ",".join(f"{device}:{transport.name}" for device, transport in self._by_device.items())
        self.matches_by_tag = all(transport.matches_by_tag for transport in self._by_device.values())

    def allocate_tensor(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor | None:
        transport = self._by_device.get(device.type)
        return None if transport is None else transport.allocate_tensor(numel, dtype, device)

    def _for(self, op: str, *tensors: Tensor | None) -> Transport:
        kinds = {tensor.device.type for tensor in tensors if tensor is not None}
        if len(kinds) > 1:
            raise ValueError(f"spmd: {op} on a device-map group ({self.name}) mixes tensors on "
                             f"{' and '.join(sorted(kinds))}; every tensor of one op must be on one device type")
        kind = kinds.pop() if kinds else self.devices[0]
        transport = self._by_device.get(kind)
        if transport is None:
            raise ValueError(f"spmd: {op} on a {kind} tensor, but the device-map group ({self.name}) has no "
                             f"entry for {kind}")
        return transport

    def all_reduce(self, tensor: Tensor, op: ReduceOp, ctx: OpContext) -> None:
        self._for("all_reduce", tensor).all_reduce(tensor, op, ctx)

    def broadcast(self, tensor: Tensor, root: int, ctx: OpContext) -> None:
        self._for("broadcast", tensor).broadcast(tensor, root, ctx)

    def reduce(self, tensor: Tensor, root: int, op: ReduceOp, ctx: OpContext) -> None:
        self._for("reduce", tensor).reduce(tensor, root, op, ctx)

    def all_gather(self, output: Tensor, input: Tensor, ctx: OpContext) -> None:
        self._for("all_gather", output, input).all_gather(output, input, ctx)

    def reduce_scatter(self, output: Tensor, input: Tensor, op: ReduceOp, ctx: OpContext) -> None:
        self._for("reduce_scatter", output, input).reduce_scatter(output, input, op, ctx)

    def gather(self, output: Tensor | None, input: Tensor, root: int, ctx: OpContext) -> None:
        self._for("gather", output, input).gather(output, input, root, ctx)

    def scatter(self, output: Tensor, input: Tensor | None, root: int, ctx: OpContext) -> None:
        self._for("scatter", output, input).scatter(output, input, root, ctx)

    def all_to_all(self, output: Tensor, input: Tensor, output_splits: list[int], input_splits: list[int],
                   ctx: OpContext) -> None:
        self._for("all_to_all", output, input).all_to_all(output, input, output_splits, input_splits, ctx)

    def barrier(self, ctx: OpContext) -> None:
        self._for("barrier").barrier(ctx)

    def isend(self, tensor: Tensor, dst: int, tag: int, work: Work) -> None:
        self._for("isend", tensor).isend(tensor, dst, tag, work)

    def irecv(self, tensor: Tensor, src: int, tag: int, work: Work) -> None:
        self._for("irecv", tensor).irecv(tensor, src, tag, work)

    def start_p2p_batch(self, ops: list[P2PStart]) -> None:
        kinds = {tensor.device.type for _, tensor, _, _, _ in ops}
        if len(kinds) == 1:
            self._for("batch_isend_irecv", ops[0][1]).start_p2p_batch(ops)
        else:                       # one batch over two device types: each message on its own transport
            super().start_p2p_batch(ops)

    def abort(self, error: BaseException) -> None:
        for transport in self._by_device.values():
            transport.abort(error)

    def close(self) -> None:
        for transport in reversed(self._by_device.values()):
            transport.close()
