"""The Transport protocol: the byte-moving primitives a backend supplies to a process group.

Layer: comm. A ProcessGroup validates and orders operations; its Transport only moves and combines bytes.

Contract for every collective method:
- it is called on the group's executor, one collective at a time, in program order, on every rank;
- tensors are flat (1-D), contiguous, and already validated (dtypes agree, sizes fit);
- it raises CommTimeoutError when `ctx.deadline` passes, PeerLostError when a peer dies,
  CollectiveMismatchError when a peer's fingerprint differs from `ctx.fingerprint`;
- a reduction combines each element in one fixed order, so every rank gets the same bits; a transport that
  combines buffers itself does so with `reduce_op.reduce_into`. AVG arrives as AVG: one `reduce_into` over
  all operands divides once itself; a reduction made of several steps combines with `reduce_op.partial_op(op)`
  and divides once at the end with `reduce_op.finish_average`.
Point-to-point methods may run concurrently with collectives and with each other; they complete the
Work they are given, and messages between one pair of ranks with one tag arrive in the order sent.

Devices: `devices` names the device types whose tensors the transport moves (every transport declares it);
the group rejects a tensor on any other device before anything is sent. The first one listed is where
object collectives stage their bytes. On a machine with an accelerator, spmd's own host transports are wrapped
to move the accelerator's tensors through host copies (staged.py).

Streams: a transport that moves device tensors is called with the caller's stream S current (the group
makes it current on its executor thread too). It orders its device work after S's pending work and leaves S
ordered after its own completion (a stream wait, never a host synchronize), so an op enqueued from S
completes with respect to S. Returning from a method means the op is enqueued on the device, not finished.
CPU transports finish the work before they return and have nothing to order.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib

import torch
from torch import Tensor

from spmd._core.deadline import Deadline
from spmd.comm.debug import Fingerprint
from spmd.comm.reduce_op import ReduceOp
from spmd.comm.store.base import Store
from spmd.comm.work import Work

P2PStart = tuple[str, Tensor, int, int, Work]   # ("isend" or "irecv", tensor, group rank of the peer, tag, Work)


@dataclasses.dataclass(slots=True)
class OpContext:
    """What a transport knows about the operation it runs."""

    fingerprint: Fingerprint
    deadline: Deadline
    group_desc: str          # "group 'default' (ranks [0, 1])", for error messages


@dataclasses.dataclass(frozen=True)
class TransportSpec:
    """Everything a transport needs to connect one group's ranks."""

    store: Store                  # prefixed with the group's name: keys here are private to the group
    group_name: str
    group_rank: int               # this process's rank inside the group
    global_ranks: tuple[int, ...] # global rank of each group rank
    hosts: tuple[str, ...]        # host identity of each group rank (ranks on one host can share memory)
    timeout: float                # seconds; connection set-up and every operation are bounded by it
    token: bytes                  # shared secret: peers present it before any byte of theirs is used
    host_names: tuple[str, ...] = ()  # hostname of each group rank, for messages (empty: not known)

    @property
    def group_size(self) -> int:
        return len(self.global_ranks)

    def where(self, group_rank: int) -> str:
        """'rank 2 on hostB': a group rank as messages name it (its global rank, and its host when known)."""
        rank = f"rank {self.global_ranks[group_rank]}"
        return f"{rank} on {self.host_names[group_rank]}" if self.host_names else rank

    @property
    def global_rank(self) -> int:
        return self.global_ranks[self.group_rank]


class Transport(abc.ABC):
    """One group's connection to its peers. See the module docstring for the contract."""

    name: str = "abstract"
    devices: tuple[str, ...] = ()   # device types it moves, e.g. ("cpu",); every transport declares its own
    staged_devices: tuple[str, ...] = ()   # those of `devices` it moves through host copies (staged.py)
    moves_data: bool = True         # False: the fake transport, which reads and writes no peer's data
    matches_by_tag: bool = True     # False: messages pair by their order alone and sends wait for receives (NCCL)

    def __init__(self, spec: TransportSpec) -> None:
        if not self.devices:
            raise TypeError(f"{type(self).__name__} must declare the device types it moves (devices = (...))")
        self.spec = spec
        self.group_rank = spec.group_rank
        self.group_size = spec.group_size

    @abc.abstractmethod
    def all_reduce(self, tensor: Tensor, op: ReduceOp, ctx: OpContext) -> None:
        """tensor <- reduce over ranks of tensor, on every rank."""

    @abc.abstractmethod
    def broadcast(self, tensor: Tensor, root: int, ctx: OpContext) -> None:
        """tensor <- root's tensor."""

    @abc.abstractmethod
    def reduce(self, tensor: Tensor, root: int, op: ReduceOp, ctx: OpContext) -> None:
        """On root, tensor <- reduce over ranks; other ranks' tensors are left as they were."""

    @abc.abstractmethod
    def all_gather(self, output: Tensor, input: Tensor, ctx: OpContext) -> None:
        """output (group_size * input.numel()) <- concatenation of every rank's input, in rank order."""

    @abc.abstractmethod
    def reduce_scatter(self, output: Tensor, input: Tensor, op: ReduceOp, ctx: OpContext) -> None:
        """output <- reduce over ranks of this rank's block of input (group_size equal blocks)."""

    @abc.abstractmethod
    def gather(self, output: Tensor | None, input: Tensor, root: int, ctx: OpContext) -> None:
        """On root, output <- concatenation of every rank's input; output is None elsewhere."""

    @abc.abstractmethod
    def scatter(self, output: Tensor, input: Tensor | None, root: int, ctx: OpContext) -> None:
        """output <- block `group_rank` of root's input (equal blocks); input is None off root."""

    @abc.abstractmethod
    def all_to_all(self, output: Tensor, input: Tensor, output_splits: list[int], input_splits: list[int],
                   ctx: OpContext) -> None:
        """Rank j's output block i (output_splits[i] elements) <- rank i's input block j; splits in elements."""

    @abc.abstractmethod
    def barrier(self, ctx: OpContext) -> None:
        """Return once every rank has entered the barrier."""

    @abc.abstractmethod
    def isend(self, tensor: Tensor, dst: int, tag: int, work: Work) -> None:
        """Start sending tensor to group rank dst; complete `work` once tensor may be reused."""

    @abc.abstractmethod
    def irecv(self, tensor: Tensor, src: int, tag: int, work: Work) -> None:
        """Start receiving the next message from group rank src with `tag` into tensor; complete `work` then."""

    def start_p2p_batch(self, ops: list[P2PStart]) -> None:
        """Start the sends and receives of one batch_isend_irecv, in order. A transport whose sends are buffered
        (spmd's) starts them one by one; one whose large sends wait for their receives (NCCL) starts them as one
        group, so ranks that each send before they receive (a ring, a pipeline's two directions) go on."""
        for op, tensor, peer, tag, work in ops:
            (self.isend if op == "isend" else self.irecv)(tensor, peer, tag, work)

    def allocate_tensor(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor | None:
        """A flat buffer from this transport's own allocator, where its collectives on it run faster (NCCL's
        registered memory: torch's `supports_tensor_alloc` / `allocate_tensor`); None where it has none, as spmd's
        own transports: a caller then allocates as usual."""
        return None

    @abc.abstractmethod
    def abort(self, error: BaseException) -> None:
        """Fail every operation in flight with `error` and tell the peers, so they fail fast too."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release sockets, threads and shared memory (normal shutdown; peers are closing too)."""


_TRANSPORTS: dict[str, str] = {            # backend -> "module:class", imported when a group first needs it
    "threads": "spmd.comm.transports.threads:ThreadsTransport",
    "tcp": "spmd.comm.transports.tcp.transport:TcpTransport",
    "shm": "spmd.comm.transports.shm.local:LocalShmTransport",
    "torch:gloo": "spmd.comm.transports.torch_pg:TorchGlooTransport",
    "torch:nccl": "spmd.comm.transports.torch_pg:TorchNcclTransport",
    "fake": "spmd.comm.transports.fake:FakeTransport",
}
_SPMD_HOST_TRANSPORTS = ("threads", "tcp", "shm")  # spmd's own transports of host tensors
_ACROSS_HOSTS: dict[str, str] = {          # what a backend builds instead for a group whose ranks span hosts
    "shm": "spmd.comm.transports.shm.hierarchical:HierarchicalTransport",
}


def deliver_into(destination: Tensor, message: Tensor) -> None:
    """Copy a received `message` into the receiver's tensor, which may be an inference tensor (made under
    torch.inference_mode(), writable only inside it; see group.py, Note: inference tensors) while the thread
    delivering it (a sender's or a progress thread) is outside inference mode, or a tensor that requires grad."""
    if destination.is_inference() and not torch.is_inference_mode_enabled():
        with torch.inference_mode():
            destination.copy_(message)
    elif destination.requires_grad:
        with torch.no_grad():        # a receive buffer that requires grad is written as data, as gloo does
            destination.copy_(message)
    else:
        destination.copy_(message)


def available_backends() -> list[str]:
    return [*_TRANSPORTS, "auto"]


def resolve_backend(backend: str, hosts: tuple[str, ...]) -> str:
    """The concrete transport name for `backend`.

    "auto" picks shm whenever ranks share a host (inside one host it is pure shared memory; across hosts the
    shm transport reduces inside each host and crosses hosts over tcp), and tcp when every rank is alone.
    """
    if backend == "auto":
        backend = "shm" if len(set(hosts)) < len(hosts) or len(hosts) == 1 else "tcp"
    if backend not in _TRANSPORTS:
        raise ValueError(f"spmd: unknown backend {backend!r}; choose one of {available_backends()}")
    return backend


def create_transport(backend: str, spec: TransportSpec, stage_accelerator: bool = True) -> Transport:
    """Build and connect the transport named `backend` for one group (collective over the group's ranks).

    "shm" builds LocalShmTransport for a group on one host and HierarchicalTransport for one spanning hosts;
    named "shm" and "shm+tcp" (what get_backend reports). A device map ("cpu:tcp,cuda:torch:nccl") builds a
    DeviceMapTransport over one transport per entry (each moving only its entry's device type). spmd's own host
    transports, on a machine with an accelerator, move the accelerator's tensors too, through host copies, unless
    `stage_accelerator` is False (torch's gloo, asked for by name, stays torch's: host tensors only).
    """
    from spmd.comm.transports import device_map, staged

    if device_map.is_device_map(backend):
        return device_map.DeviceMapTransport(spec, device_map.parse_device_map(backend))
    name = resolve_backend(backend, spec.hosts)
    path = _TRANSPORTS[name]
    if len(set(spec.hosts)) > 1:
        path = _ACROSS_HOSTS.get(name, path)
    module_name, class_name = path.split(":")
    transport_class = getattr(importlib.import_module(module_name), class_name)
    transport = transport_class(spec)
    return staged.stage_accelerator(transport) if stage_accelerator and name in _SPMD_HOST_TRANSPORTS else transport
