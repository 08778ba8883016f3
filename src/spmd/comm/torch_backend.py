"""spmd as a torch.distributed backend named "spmd": a torch ProcessGroup whose every operation runs on an spmd
group, so torch's own code (DistributedSampler, torchmetrics, torch's DDP and FSDP2) sees spmd's world and moves
its bytes over spmd's transports.

Layer: comm. With torch_pg.py, the only library modules that import torch.distributed. It also answers what torch
was built with (NCCL, gloo, MPI, CUDA), so backend.py's names can say why one is unavailable.

Note: torch's default group over spmd
`spmd.init_process_group` (unless `torch_default_group=False`) calls `init_torch_default_group()`: it registers
the backend and initialises torch's default group with it, on an in-memory store (spmd's world is already
connected; torch's group needs no rendezvous of its own). So `torch.distributed.get_rank()` and
`get_world_size()` answer for spmd's world, and a collective torch issues on its default group runs on spmd's
default group. It is skipped where torch's default group already exists (a script that initialised torch
first), and where the world was given its store (thread ranks: one process, many worlds, while torch has one
default group per process).
`spmd.destroy_process_group()` destroys the torch group it made. torch's subgroups over the "spmd" backend map
to the spmd group of the same ranks, made by their members when spmd has none (torch creates a group on its
members only, and names it alike on each).

Note: spmd's world under torch's default group
The other way round, `torch.distributed.init_process_group("spmd")` after `import spmd` (torch's own DDP and
FSDP2 on spmd's transports, nothing else changed): torch hands the backend its store and the rank and size, and
`_create` builds spmd's world on that store (TorchStore below: spmd's rendezvous keys under torch's prefix for
the group), with the same "auto" transport spmd picks itself. The world then belongs to torch's group: torch's
`destroy_process_group()` shuts the group down, which destroys the world; `spmd.destroy_process_group()` takes
torch's group down with it. The backend is known to torch from `import spmd` on (torch_hook.py).

Note: torch's batch_isend_irecv over a transport that pairs messages by order
torch starts the messages of one batch_isend_irecv together (one NCCL group) only on its own ProcessGroup type; on
any other, this one included, it issues them one by one. Over a transport that pairs messages by their order and
whose sends wait for their receives (torch's NCCL: `Transport.matches_by_tag` False), two ranks that each send a
large tensor to the other, then receive, would then wait on their sends forever. So while torch's
batch_isend_irecv runs (found on the caller's stack, with its list of operations), this group's send and recv
collect their message instead of starting it, and the last one starts them all as one spmd batch_isend_irecv,
which starts them together as torch's own group would. The Works torch hands back stand for the collected
messages. Messages left collected when torch's call failed midway start with the next batch, or when one of their
Works is asked about (torch had started them already).
"""

from __future__ import annotations

import contextlib
import datetime
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from spmd._core.compile import disable_once_dynamo_imported
from spmd._core.deadline import Deadline, as_seconds
from spmd._core.errors import StoreError
from spmd.comm import torch_hook
from spmd.comm.store.base import Store, Value, missing_keys_error, queue_empty_error, queue_timeout_error, to_bytes

if TYPE_CHECKING:
    from spmd.comm.group import ProcessGroup
    from spmd.comm.reduce_op import ReduceOp
    from spmd.comm.work import Work

BACKEND = "spmd"
# Note: what this module imports
# torch_hook.py imports this module the moment torch's own import finishes, which may be inside the import of any
# spmd module that imports torch first (spmd.comm.world, spmd.comm.reduce_op, ...): that module is not whole yet.
# So at import this module needs only modules that never import torch (the store's base, _core); the groups'
# modules are bound at the first group (_bind_spmd), when every module is whole.
collectives: Any = None
p2p: Any = None
_group_class: Any = None         # spmd.comm.group.ProcessGroup
_check_reduce_op: Any = None
_reduce_op_of: Any = None        # spmd.comm.group_methods.reduce_op_of
_registered = threading.Lock()
_state: dict[str, Any] = {"registered": False, "owned": None, "world_owner": None, "bound": False}


def _reduce_op(opts: Any, name: str, group: ProcessGroup, tensors: list[Tensor]) -> ReduceOp:
    """spmd's op for the one in torch's `opts` (a ReduceOp object, whose `.op` is the enum value; SUM without
    opts), checked against every tensor of the call before any of them is sent."""
    where = f"spmd backend: {name} on rank {group.global_rank} of {group.description}"
    op = _reduce_op_of(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, where)
    for tensor in tensors:
        _check_reduce_op(op, tensor.dtype, where)
    return op


class _SpmdWork(dist.Work):
    """torch's Work over an spmd Work (None: the op already finished), whose result is its outputs: `wait()` raises
    the op's error, as gloo's Work does, and `get_future()` fails where the op failed. (torch's Work around a future
    can't: a torch Python Future's exception is its value to C++, so a failed op looked successful to torch's
    collectives and to DDP's reducer.)"""

    def __init__(self, work: Work | None, outputs: list[Tensor]) -> None:
        super().__init__()
        self._work = work
        self._outputs = outputs

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if self._work is not None:
            seconds = timeout.total_seconds() if timeout is not None else 0.0
            self._work.wait(seconds if seconds > 0 else None)      # torch's default, 0, means no bound
        return True

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()

    def is_success(self) -> bool:
        return self._work is None or self._work.exception() is None

    def exception(self) -> BaseException | None:
        return None if self._work is None else self._work.exception()

    def result(self) -> list[Tensor]:
        self.wait()
        return self._outputs

    def synchronize(self) -> None:
        self.wait()

    def block_current_stream(self) -> None:
        """As spmd's Work.block_current_stream (torch's base fails for a Python Work: no stream block to make)."""
        self.wait()

    def source_rank(self) -> int:
        """The group rank a receive's message came from (spmd's Work.source_rank)."""
        if self._work is None:
            raise ValueError("source_rank() is a receive's; this Work is not one")
        return self._work.source_rank()

    def get_future(self) -> torch.futures.Future:
        if self._work is None:
            done: torch.futures.Future = torch.futures.Future()
            done.set_result(self._outputs)
            return done
        return self._work.get_future().then(_value_or_raise)


class _CoalescedWork(dist.Work):
    """torch's Work over the operations of one coalescing block: done when every one is, failed where one failed."""

    def __init__(self, works: list[_SpmdWork]) -> None:
        super().__init__()
        self._works = works

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        for work in self._works:
            work.wait(timeout)
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)

    def is_success(self) -> bool:
        return all(work.is_success() for work in self._works)

    def exception(self) -> BaseException | None:
        return next((error for error in (work.exception() for work in self._works) if error is not None), None)

    def result(self) -> list[Tensor]:
        self.wait()
        return [tensor for work in self._works for tensor in work._outputs]

    def synchronize(self) -> None:
        self.wait()

    def block_current_stream(self) -> None:
        """As spmd's Work.block_current_stream (torch's base fails for a Python Work: no stream block to make)."""
        self.wait()

    def get_future(self) -> torch.futures.Future:
        outputs = [tensor for work in self._works for tensor in work._outputs]

        def all_done(done: torch.futures.Future) -> list[Tensor]:
            for future in done.wait():
                future.wait()          # raises where an operation failed, failing this future
            return outputs

        return torch.futures.collect_all([work.get_future() for work in self._works]).then(all_done)


class _Batch:
    """The messages torch's batch_isend_irecv issued on this thread so far (see Note: torch's batch_isend_irecv over a
    transport that pairs messages by order): `call` is its frame (held until they start), `expected` its length."""

    def __init__(self, call: Any, expected: int) -> None:
        self.call: Any = call
        self.expected = expected
        self.messages: list[tuple[str, Tensor, ProcessGroup, int, int, _CollectedWork]] = []
        self._lock = threading.Lock()
        self._started = False

    def start(self) -> None:
        """Start the collected messages together, once; a failure to start fails each of their Works, and is
        raised."""
        with self._lock:         # held while starting: a Work asked about from another thread waits for its start
            if self._started:
                return
            self._started, self.call = True, None
            operations = [p2p.P2POp(p2p.isend if op == "isend" else p2p.irecv, tensor, group=group, group_peer=peer,
                                    tag=tag) for op, tensor, group, peer, tag, _ in self.messages]
            try:
                works = p2p.batch_isend_irecv(operations)
            except BaseException as failure:
                for *_, collected in self.messages:
                    collected._failure = failure
                raise
            for (*_, collected), work in zip(self.messages, works, strict=True):
                collected._work = work


class _CollectedWork(_SpmdWork):
    """torch's Work for a message collected into a batch: the spmd Work of the message once the batch started (asking
    about it starts the batch, if it has not)."""

    def __init__(self, batch: _Batch, outputs: list[Tensor]) -> None:
        super().__init__(None, outputs)
        self._batch = batch
        self._failure: BaseException | None = None

    def _started(self) -> BaseException | None:
        try:
            self._batch.start()
        except BaseException as failure:     # also kept as this Work's failure
            return failure
        return self._failure

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        failure = self._started()
        if failure is not None:
            raise failure
        return super().wait(timeout)

    def is_completed(self) -> bool:
        return self._started() is not None or super().is_completed()

    def is_success(self) -> bool:
        return self._started() is None and super().is_success()

    def exception(self) -> BaseException | None:
        return self._started() or super().exception()

    def get_future(self) -> torch.futures.Future:
        failure = self._started()
        if failure is None:
            return super().get_future()
        failed: torch.futures.Future = torch.futures.Future()
        failed.set_exception(failure)
        return failed


_collecting = threading.local()      # .batch: the _Batch torch's batch_isend_irecv is issuing on this thread
_TORCH_C10D_FILE = "distributed_c10d.py"


def _torch_batch_call() -> Any:
    """The frame of torch's batch_isend_irecv, where it is this call's caller (through torch's isend or irecv)."""
    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return None
        code = frame.f_code
        if code.co_name == "batch_isend_irecv" and code.co_filename.endswith(_TORCH_C10D_FILE):
            return frame
        frame = frame.f_back
    return None


def _collect(op: str, tensor: Tensor, group: ProcessGroup, peer: int, tag: int) -> _CollectedWork | None:
    """This message collected into the batch torch's batch_isend_irecv is issuing, started with the batch's last;
    None where torch's batch_isend_irecv is not the caller (the message starts now)."""
    call = _torch_batch_call()
    operations = call.f_locals.get("p2p_op_list") if call is not None else None
    if not isinstance(operations, list):
        return None
    batch: _Batch | None = getattr(_collecting, "batch", None)
    if batch is None or batch.call is not call:
        if batch is not None:
            batch.start()               # left from a call of torch's that failed midway
        batch = _collecting.batch = _Batch(call, len(operations))
    collected = _CollectedWork(batch, [tensor])
    batch.messages.append((op, tensor, group, peer, tag, collected))
    if len(batch.messages) >= batch.expected:
        _collecting.batch = None
        batch.start()
    return collected


def _value_or_raise(future: torch.futures.Future) -> Any:
    """A child future's value: the parent's, or its error raised, which torch's C++ side sees as a failure."""
    return future.wait()


def _group_class_ready() -> type[SpmdProcessGroup]:
    """The group class, ready for a first group: the spmd modules it runs on bound (_bind_spmd), and every method it
    and its Work define made opaque to torch.compile once dynamo is imported (so that neither importing this
    module, which `import spmd` does, nor a group imports dynamo): torch's code calls a group's operations from code
    dynamo may be tracing (torch's DDP, compiled whole, broadcasts its buffers before each forward), and a group is
    an opaque object there, whose attributes (the spmd group) dynamo refuses to read, failing the compile. Eager,
    an operation is a graph break, as a C++ backend's is."""
    with _registered:
        if not _state["bound"]:
            _bind_spmd()
            for cls in (SpmdProcessGroup, _SpmdWork, _CoalescedWork, _CollectedWork):
                disable_once_dynamo_imported(cls, [name for name, value in vars(cls).items()
                                                   if callable(value) and not name.startswith("__")])
            _state["bound"] = True
    return SpmdProcessGroup


def _bind_spmd() -> None:
    """Bind the spmd modules the groups run on (see Note: what this module imports)."""
    global collectives, p2p, _group_class, _check_reduce_op, _reduce_op_of
    from spmd.comm import collectives as collectives_module
    from spmd.comm import p2p as p2p_module
    from spmd.comm.group import ProcessGroup
    from spmd.comm.group_methods import reduce_op_of
    from spmd.comm.reduce_op import check_reduce_op

    collectives, p2p, _group_class, _check_reduce_op = collectives_module, p2p_module, ProcessGroup, check_reduce_op
    _reduce_op_of = reduce_op_of


class SpmdProcessGroup(dist.ProcessGroup):
    """torch's ProcessGroup interface over one spmd group (see Note: torch's default group over spmd). With
    `owns_world`, the group is torch's default group and spmd's world was built for it (see Note: spmd's world
    under torch's default group)."""

    def __init__(self, group: ProcessGroup, owns_world: bool = False) -> None:
        super().__init__(group.rank(), group.size())
        self.spmd_group = group
        self.owns_world = owns_world
        self._torch_group_name = ""
        self._coalesced: list[_SpmdWork] | None = None     # the works issued since _start_coalescing

    def _issued(self, work: Work | None, outputs: list[Tensor]) -> _SpmdWork:
        """torch's Work for an operation this group just issued (kept for _end_coalescing while coalescing)."""
        issued = _SpmdWork(work, outputs)
        if self._coalesced is not None:
            self._coalesced.append(issued)
        return issued

    # torch's _coalescing_manager(group, device) brackets a block of operations (DeepSpeed's all_gather_coalesced):
    # spmd runs each as it is issued, and the block's Work is done when all of them are
    def _start_coalescing(self, device: torch.device) -> None:
        self._coalesced = []

    def _end_coalescing(self, device: torch.device) -> _CoalescedWork:
        works, self._coalesced = self._coalesced or [], None
        return _CoalescedWork(works)

    def shutdown(self) -> None:
        """torch's destroy_process_group: the world goes with the default group that owns it."""
        if self.owns_world:
            from spmd.comm.world import destroy_process_group

            self.owns_world = False
            _state["world_owner"] = None
            destroy_process_group()

    def getBackendName(self) -> str:
        return BACKEND

    # torch takes a ProcessGroup that a backend's creator returns as the group itself and registers no backend on
    # it, so torch's own `_device_types` (its backends' devices) would be empty and `_get_backend` would raise;
    # torch's Python code picks devices through them (set_model_state_dict's broadcast_from_rank0, so accelerate's
    # FSDP2 resume; dcp.async_save; _get_pg_default_device). The group serves its transport's devices itself.
    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device(device) for device in self.spmd_group.transport.devices]

    def _get_backend_name(self) -> str:
        """torch's own code asks a group's backend name only to learn whether it is a CPU group (`== "gloo"`: a
        ShardedTensor with no shard on this rank takes that device, else CUDA's; SyncBatchNorm picks its gather):
        a group whose transport moves only CPU tensors (an accelerator's through host copies at most, as gloo's)
        answers as gloo's does. `dist.get_backend()` still names "spmd" (torch keeps the name a group was made
        with)."""
        transport = self.spmd_group.transport
        return "gloo" if set(transport.devices) - set(transport.staged_devices) == {"cpu"} else BACKEND

    def _get_backend(self, device: torch.device | str) -> SpmdProcessGroup:
        device_type = torch.device(device).type
        if device_type not in self.spmd_group.transport.devices:
            raise RuntimeError(f"spmd backend: group {self.spmd_group.description} moves "
                               f"{', '.join(self.spmd_group.transport.devices)} tensors, not {device_type} ones")
        return self

    def supports_tensor_alloc(self, device: torch.device | str) -> bool:
        """A backend's query (FSDP2's buffers from the process group's allocator): spmd allocates none itself."""
        return False

    # torch keeps a group's name in its backends, which a Python ProcessGroup has none of: without these, torch's
    # functional collectives (and so its DTensor and FSDP2) fail with "ProcessGroup name not set"
    def setGroupName(self, name: str) -> None:
        self._torch_group_name = name

    def getGroupName(self) -> str:
        return self._torch_group_name

    def allreduce(self, tensors: list[Tensor], opts: Any = None) -> Any:
        op = _reduce_op(opts, "allreduce", self.spmd_group, tensors)
        works = [collectives.all_reduce(t, op=op, group=self.spmd_group, async_op=True) for t in tensors]
        return self._issued(works[-1] if works else None, tensors)

    def allreduce_coalesced(self, tensors: list[Tensor], opts: Any = None) -> Any:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: list[Tensor], opts: Any = None) -> Any:
        root = opts.rootRank if opts is not None else 0
        works = [collectives.broadcast(t, group=self.spmd_group, group_src=root, async_op=True) for t in tensors]
        return self._issued(works[-1] if works else None, tensors)

    def reduce(self, tensors: list[Tensor], opts: Any = None) -> Any:
        op = _reduce_op(opts, "reduce", self.spmd_group, tensors)
        works = [collectives.reduce(t, group=self.spmd_group, group_dst=opts.rootRank, op=op, async_op=True)
                 for t in tensors]
        return self._issued(works[-1] if works else None, tensors)

    def allgather(self, output_lists: list[list[Tensor]], inputs: list[Tensor], opts: Any = None) -> Any:
        for outputs, tensor in zip(output_lists, inputs, strict=True):
            collectives.all_gather(outputs, tensor, group=self.spmd_group)
        return self._issued(None, [t for outputs in output_lists for t in outputs])

    def all_gather_single(self, output: Tensor, input: Tensor, opts: Any = None) -> Any:
        work = collectives.all_gather_into_tensor(output, input, group=self.spmd_group, async_op=True)
        return self._issued(work, [output])

    def all_gather_single_coalesced(self, outputs: list[Tensor], inputs: list[Tensor], opts: Any = None) -> Any:
        """What torch's functional all_gather calls (its C++ can't reach all_gather_single of a Python group)."""
        for output, tensor in zip(outputs, inputs, strict=True):
            collectives.all_gather_into_tensor(output, tensor, group=self.spmd_group)
        return self._issued(None, outputs)

    def reduce_scatter(self, outputs: list[Tensor], input_lists: list[list[Tensor]], opts: Any = None) -> Any:
        op = _reduce_op(opts, "reduce_scatter", self.spmd_group, outputs)
        for output, inputs in zip(outputs, input_lists, strict=True):
            collectives.reduce_scatter(output, inputs, op=op, group=self.spmd_group)
        return self._issued(None, outputs)

    def reduce_scatter_single(self, output: Tensor, input: Tensor, opts: Any = None) -> Any:
        op = _reduce_op(opts, "reduce_scatter_single", self.spmd_group, [input])
        work = collectives.reduce_scatter_tensor(output, input, op=op, group=self.spmd_group, async_op=True)
        return self._issued(work, [output])

    def reduce_scatter_single_coalesced(self, outputs: list[Tensor], inputs: list[Tensor], opts: Any = None) -> Any:
        op = _reduce_op(opts, "reduce_scatter_single_coalesced", self.spmd_group, inputs)
        for output, tensor in zip(outputs, inputs, strict=True):
            collectives.reduce_scatter_tensor(output, tensor, op=op, group=self.spmd_group)
        return self._issued(None, outputs)

    def all_to_all_single(self, output: Tensor, input: Tensor, output_splits: list[int] | None,
                          input_splits: list[int] | None, opts: Any = None) -> Any:
        work = collectives.all_to_all_single(output, input, output_splits or None, input_splits or None,
                                             group=self.spmd_group, async_op=True)
        return self._issued(work, [output])

    def alltoall(self, outputs: list[Tensor], inputs: list[Tensor], opts: Any = None) -> Any:
        collectives.all_to_all(outputs, inputs, group=self.spmd_group)
        return self._issued(None, outputs)

    def gather(self, output_lists: list[list[Tensor]], inputs: list[Tensor], opts: Any = None) -> Any:
        root = opts.rootRank
        gathered = output_lists[0] if self.spmd_group.rank() == root else None
        collectives.gather(inputs[0], gathered, group=self.spmd_group, group_dst=root)
        return self._issued(None, gathered or [])

    def scatter(self, outputs: list[Tensor], input_lists: list[list[Tensor]], opts: Any = None) -> Any:
        root = opts.rootRank
        pieces = input_lists[0] if self.spmd_group.rank() == root else None
        collectives.scatter(outputs[0], pieces, group=self.spmd_group, group_src=root)
        return self._issued(None, outputs)

    def barrier(self, opts: Any = None) -> Any:
        collectives.barrier(group=self.spmd_group)
        return self._issued(None, [])

    def send(self, tensors: list[Tensor], dst: int, tag: int) -> Any:
        if not self.spmd_group.transport.matches_by_tag:
            collected = _collect("isend", tensors[0], self.spmd_group, dst, tag)
            if collected is not None:
                return collected
        work = p2p.isend(tensors[0], group=self.spmd_group, group_dst=dst, tag=tag)
        return self._issued(work, tensors)

    def recv(self, tensors: list[Tensor], src: int, tag: int) -> Any:
        if not self.spmd_group.transport.matches_by_tag:
            collected = _collect("irecv", tensors[0], self.spmd_group, src, tag)
            if collected is not None:
                return collected
        work = p2p.irecv(tensors[0], group=self.spmd_group, group_src=src, tag=tag)
        return self._issued(work, tensors)


def _create(options: Any, backend_options: Any) -> SpmdProcessGroup:
    """torch's (extended) backend constructor: spmd's world for torch's default group when spmd has none yet, else
    the spmd group of the same global ranks, made by the members if spmd has none (see the Notes)."""
    from spmd.comm.world import current_world, init_process_group, is_initialized

    group_class = _group_class_ready()
    if not is_initialized():
        if dist.is_initialized():
            raise RuntimeError(f"spmd backend: torch asked for a group of ranks {list(options.global_ranks_in_group)}"
                               f" over 'spmd', but this rank has no spmd world; initialise torch's default group "
                               f"with backend 'spmd' (or call spmd.init_process_group() first)")
        init_process_group("auto", store=TorchStore(options.store), rank=options.group_rank,
                           world_size=options.group_size, timeout=options.timeout, torch_default_group=False)
        owner = group_class(current_world().default_group, owns_world=True)
        _state["world_owner"] = owner
        return owner
    world = current_world()
    ranks = list(options.global_ranks_in_group) or list(range(options.group_size))
    for group in world.groups:
        if isinstance(group, _group_class) and list(group.ranks) == ranks:
            return group_class(group)
    made = world.create_group(ranks, world.timeout, world.backend, name=f"torch/{options.group_id}")
    assert isinstance(made, _group_class)     # torch asks only the members
    return group_class(made)


# Note: torch's view of spmd's subgroups
# torch's code handed one of spmd's groups (a library's collective on the group of an spmd mesh: torchao's float8
# all-gather reduces its scale over the mesh FSDP's all-gather extension gets) needs a torch ProcessGroup.
# `torch_group` gives the SpmdProcessGroup standing for an spmd group, entered in torch's group maps and in the
# registry its functional collectives resolve names in, as torch's new_group enters one; no collective is run,
# the spmd group exists. It does so only while torch's default group is spmd's world's (else torch's world is
# not spmd's, and there is nothing to enter the group in). spmd's own operations take either (resolve_group).

def is_torch_parallel_style(value: object) -> bool:
    """Whether `value` is one of torch's tensor-parallel styles (torchao's float8 styles subclass them); torch's
    module is looked up, not imported: no such value exists before it is."""
    module = sys.modules.get("torch.distributed.tensor.parallel.style")
    return module is not None and isinstance(value, module.ParallelStyle)


def torch_group(group: ProcessGroup) -> dist.ProcessGroup | None:
    """The torch ProcessGroup standing for spmd's `group` in torch's world (Note: torch's view of spmd's
    subgroups); None while torch's default group is not spmd's world's."""
    from spmd.comm.world import current_world, is_initialized

    world = dist.group.WORLD if dist.is_initialized() else None
    if not isinstance(world, SpmdProcessGroup) or not is_initialized() \
            or current_world().default_group is not world.spmd_group:
        return None
    if group is world.spmd_group:
        return world
    twin = _twins.get(group)
    if twin is None or twin not in dist.distributed_c10d._world.pg_names:    # torch's world was made anew
        twin = _group_class_ready()(group)
        name = f"spmd/{group.name}"
        twin._set_group_name(name)
        dist.distributed_c10d._register_pg_in_world(
            twin, BACKEND, dist.distributed_c10d._world.pg_map[world][1], name, BACKEND,
            {rank: index for index, rank in enumerate(group.ranks)})
        _twins[group] = twin
    return twin


_twins: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()     # spmd group -> its torch_group


def subclass_all_gathered(tensor: Tensor, group: ProcessGroup) -> Tensor | None:
    """Every rank's `tensor`, a compressed tensor subclass (torchao's NF4 weights), concatenated along dim 0 by its
    own handling of torch's functional all-gather, as torch's DTensor gathers one: the subclass gathers its inner
    tensors over torch's view of `group` and builds the whole (an NF4 weight stays NF4). None where torch's
    default group is not spmd's world, or the subclass has no such handling."""
    twin = torch_group(group)
    if twin is None:
        return None
    functional = torch.ops._c10d_functional
    try:
        gathered = functional.all_gather_into_tensor(tensor, group.size(), twin.group_name)
        return functional.wait_tensor(gathered)
    except NotImplementedError:
        return None


def release_torch_default_group() -> None:
    """spmd.destroy_process_group() of a world torch's default group owns: take torch's group down too, without
    its shutdown destroying the world a second time (see Note: spmd's world under torch's default group)."""
    owner, _state["world_owner"] = _state["world_owner"], None
    if owner is not None and dist.is_initialized() and dist.group.WORLD is owner:
        owner.owns_world = False
        dist.destroy_process_group()


class TorchStore(Store):
    """spmd's Store interface over a torch store (torch's TCPStore, or the PrefixStore torch hands a backend):
    spmd's world rendezvouses through it when torch made the job's store (see Note: spmd's world under torch's
    default group, and world.rendezvous under torchrun). torch's timeouts become spmd's, naming the keys."""

    def __init__(self, store: Any, timeout: float | datetime.timedelta | None = None) -> None:
        super().__init__(timeout if timeout is not None else store.timeout)
        self._torch_store = store
        self._closed = threading.Event()

    @property
    def torch_store(self) -> Any:
        if self._closed.is_set():
            raise StoreError("torch's store: used after close()")
        return self._torch_store

    def close(self) -> None:
        """Stop using torch's store (torch's client has no close): calls fail from now on, a wait at once."""
        self._closed.set()

    def set_timeout(self, timeout: float | datetime.timedelta) -> None:
        super().set_timeout(timeout)
        self.torch_store.set_timeout(datetime.timedelta(seconds=self.timeout))

    def set(self, key: str, value: Value) -> None:
        self.torch_store.set(key, to_bytes(value))

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self.torch_store.get(key)

    def add(self, key: str, amount: int) -> int:
        return self.torch_store.add(key, amount)

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        return self.torch_store.compare_set(key, to_bytes(expected), to_bytes(desired))

    def wait(self, keys: list[str], timeout: float | datetime.timedelta | None = None) -> None:
        """Poll with check() at a growing pause (up to 20 ms), not torch's wait: its client warns on stderr at
        every timeout, and blocks in C++ where close() can't reach it."""
        seconds = as_seconds(timeout, self.timeout, "TorchStore.wait: timeout")
        deadline = Deadline(seconds)
        pause = 0.0005
        while not self.torch_store.check(keys):
            if deadline.expired():
                missing = [key for key in keys if not self.torch_store.check([key])]
                raise missing_keys_error("torch's store", missing, seconds)
            if self._closed.wait(min(pause, deadline.remaining())):
                raise StoreError(f"torch's store: wait for {keys} interrupted by close()")
            pause = min(pause * 2, 0.02)

    def check(self, keys: list[str]) -> bool:
        return self.torch_store.check(keys)

    def delete_key(self, key: str) -> bool:
        return self.torch_store.delete_key(key)

    def num_keys(self) -> int:
        return self.torch_store.num_keys()

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.wait(keys)
        return self.torch_store.multi_get(keys)

    def multi_set(self, keys: list[str], values: list[Value]) -> None:
        self.torch_store.multi_set(keys, [to_bytes(value) for value in values])

    def append(self, key: str, value: Value) -> None:
        self.torch_store.append(key, to_bytes(value))

    def list_keys(self) -> list[str]:
        return self.torch_store.list_keys()

    def queue_push(self, key: str, value: Value) -> None:
        self.torch_store.queue_push(key, to_bytes(value))

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """Polled as `wait` is (torch's blocking pop waits in C++ where close() can't reach it)."""
        deadline = Deadline(self.timeout)
        pause = 0.0005
        while True:
            try:
                return self.torch_store.queue_pop(key, False)
            except dist.QueueEmptyError:
                if not block:
                    raise queue_empty_error("torch's store", key) from None
            if deadline.expired():
                raise queue_timeout_error("torch's store", key, deadline.timeout)
            if self._closed.wait(min(pause, deadline.remaining())):
                raise StoreError(f"torch's store: queue_pop({key}) interrupted by close()")
            pause = min(pause * 2, 0.02)

    def queue_len(self, key: str) -> int:
        return self.torch_store.queue_len(key)

    def has_extended_api(self) -> bool:
        return self.torch_store.has_extended_api()

    def clone(self) -> Store:
        return TorchStore(self.torch_store.clone(), self.timeout)

    def server_host(self) -> str | None:
        store = self._torch_store
        while isinstance(store, dist.PrefixStore):
            store = store.underlying_store
        return store.host if isinstance(store, dist.TCPStore) else None


def torchrun_agent_store(host: str, port: int, timeout: float, attempt: int) -> Store:
    """A client of the TCPStore torchrun's agent serves at host:port for its workers (TORCHELASTIC_USE_AGENT_STORE),
    under a prefix of this restart attempt's own, as torch's workers use it."""
    client = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout))
    return TorchStore(dist.PrefixStore(f"/spmd/attempt_{attempt}", client), timeout)


def register() -> None:
    """Register the "spmd" backend with torch (once per process)."""
    with _registered:
        if not _state["registered"]:
            dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
            _state["registered"] = True


def init_torch_default_group(rank: int, world_size: int, timeout: float) -> bool:
    """Initialise torch's default group over spmd's world, unless torch already has one; True if it did (see
    Note: torch's default group over spmd)."""
    if dist.is_initialized():
        return False
    register()
    _group_class_ready()
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout))
    _state["owned"] = dist.group.WORLD
    return True


def destroy_torch_default_group() -> bool:
    """Destroy torch's default group if init_torch_default_group made it (and it is still torch's); True if it
    did."""
    owned, _state["owned"] = _state["owned"], None
    if owned is not None and dist.is_initialized() and dist.group.WORLD is owned:
        dist.destroy_process_group()
        return True
    return False


# -- torch.compile's graph split for spmd's DDP -----------------------------------------------------------------

# Note: spmd's DDP under torch.compile
# torch's DDP announces itself to dynamo while its module runs: a class attribute of torch's DDP that dynamo reads,
# through `_get_active_ddp_module()`, whenever it converts a frame. Finding one, dynamo reads its
# `bucket_bytes_cap` and hands the frame's graph to DDPOptimizer, which cuts it into subgraphs holding about that
# many bytes of parameters each (in the reverse order of use, as DDP's buckets) and compiles each on its own, with
# the user's backend. A compiled backward then runs subgraph by subgraph, and the gradients of the last layers
# reach their accumulators (and DDP's hooks) while the earlier layers' backward still computes; uncut, a compiled
# backward yields every gradient at its end, after all of the compute.
# spmd's DDP makes the same announcement (`announced_to_dynamo_as_ddp`) around its module's call, with a stand-in
# that holds only the cap (all dynamo reads), so the frames it compiles there are cut the same way and spmd's
# reducer launches a bucket's all-reduce between backward subgraphs. DDPOptimizer refuses a cap below its first
# bucket (1 MiB, torch's and spmd's first bucket too): a smaller cap is announced as 1 MiB. The attribute is
# process-wide, as in torch: thread ranks compiling at once may cut at another rank's cap.

_DDPOPTIMIZER_FIRST_BUCKET_BYTES = 1 << 20


@contextlib.contextmanager
def announced_to_dynamo_as_ddp(bucket_bytes_cap: int) -> Iterator[None]:
    """While the block runs, frames that torch.compile converts are cut at DDP bucket boundaries of
    `bucket_bytes_cap` bytes (Note: spmd's DDP under torch.compile)."""
    from torch.nn.parallel.distributed import DistributedDataParallel as TorchDDP

    previous = TorchDDP._active_ddp_module
    TorchDDP._active_ddp_module = _DynamoDDPView(max(bucket_bytes_cap, _DDPOPTIMIZER_FIRST_BUCKET_BYTES))
    try:
        yield
    finally:
        TorchDDP._active_ddp_module = previous


class _DynamoDDPView:
    """What dynamo reads of an active DDP module: its bucket cap."""

    def __init__(self, bucket_bytes_cap: int) -> None:
        self.bucket_bytes_cap = bucket_bytes_cap


# -- what torch was built with: the facts behind spmd's backend names (backend.py) ------------------------------

def torch_nccl_built() -> bool:
    """Whether torch was built with NCCL (torch's CPU wheels are not)."""
    return dist.is_available() and dist.is_nccl_available()


def torch_gloo_built() -> bool:
    """Whether torch was built with gloo."""
    return dist.is_available() and dist.is_gloo_available()


def torch_mpi_built() -> bool:
    """Whether torch was built with MPI (only from-source builds are)."""
    return dist.is_available() and dist.is_mpi_available()


def cuda_usable() -> bool:
    """Whether this process sees a CUDA device."""
    return torch.cuda.is_available()


torch_hook.register_or_warn(register)   # this module's import imported torch: torch_hook left it to us
