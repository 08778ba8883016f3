"""ProcessGroup: a set of ranks, its transport, and the in-order executor its operations run on.

Layer: comm. Collectives on one group complete in the order they were issued, like a CUDA stream: a
synchronous call runs on the caller's thread when nothing is queued, and asynchronous calls run on one
executor thread per group. Any failure aborts the group on this rank and tells the peers (through the
transport), so they fail fast too; later operations raise GroupAbortedError naming the first failure.
Every collective is announced to the rank's CollectiveObservers as it is issued (see Note: observers).
"""

from __future__ import annotations

import collections
import enum
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch._library.opaque_object import MemberType, register_opaque_type

from spmd._core.compile import fx_name
from spmd._core.deadline import Deadline
from spmd._core.errors import CommError, CommTimeoutError, GroupAbortedError, SpmdError, StoreError
from spmd.comm.debug import (
    Fingerprint,
    FlightRecorder,
    OpRecord,
    OpState,
    collect_statuses,
    describe_stragglers,
)
from spmd.comm.group_methods import TorchGroupMethods
from spmd.comm.store.base import Store
from spmd.comm.transports.base import OpContext, Transport
from spmd.comm.work import Work, active_timer, caller_stream, charge_exposed

Body = Callable[[OpContext], None]
_set_grad_enabled = torch._C._set_grad_enabled


# Note: inference tensors
# Tensors made under torch.inference_mode() can be written in place only inside inference mode, which is a
# per-thread setting: a collective into one (Lightning validates under inference mode, so its metrics' states are
# such tensors) runs its body in inference mode, on whichever thread runs it (gloo writes from C++, where the rule
# does not reach). Any other op runs with inference mode off, even when its caller has it on, so the buffers a
# transport keeps from one op to the next are never inference tensors that a later op outside inference mode could
# not write. (A transport's writes into its own buffers inside inference mode are allowed: they are normal tensors.)


# Note: writing outside autograd
# A collective writes its results into the caller's tensors, which may require grad (a running loss summed for
# logging, a parameter broadcast): as gloo's C++ does, the write is none of autograd's business, so every body runs
# with grad mode off (an executor thread keeps it off; an op run on the caller's thread turns it off around the
# body). Autograd through a collective is the functional collectives' job, around the op, not inside it.


def _writes_inference_tensors(outputs: list | tuple) -> bool:
    for item in outputs:       # a loop, not any(): this runs for every collective
        if isinstance(item, Tensor):
            if item.is_inference():
                return True
        elif isinstance(item, (list, tuple)) and _writes_inference_tensors(item):
            return True
    return False


def _run_body(body: Body, ctx: OpContext, stream: torch.Stream | None) -> torch.Event | None:
    """Run `body`; on an accelerator stream, after that stream's pending work, returning the event that completes
    it (see Note: streams)."""
    if stream is None:
        body(ctx)
        return None
    with stream:
        body(ctx)
        return stream.record_event()


CollectiveObserver = Callable[["ProcessGroup", Fingerprint], None]


class CollectiveObservers:
    """The callbacks told of every collective one rank issues; all of that rank's groups share one (World.observers).

    Note: observers
    `ProcessGroup.run` calls each callback with the group and the op's Fingerprint on the issuing thread, before
    the op is queued, for every collective (point-to-point operations are not collectives and are not announced).
    Debug tools above comm (the tensor layer's CommDebugMode) count with it without comm knowing them. The tuple
    of callbacks is replaced, never mutated, so `run` reads it without a lock, and with no observer registered
    the hook costs one attribute read and a truth test. A callback that raises fails the collective before it
    is issued, on this rank only: keep callbacks to bookkeeping.
    """

    __slots__ = ("_lock", "callbacks")

    def __init__(self) -> None:
        self.callbacks: tuple[CollectiveObserver, ...] = ()
        self._lock = threading.Lock()

    def add(self, callback: CollectiveObserver) -> None:
        with self._lock:
            self.callbacks = (*self.callbacks, callback)

    def remove(self, callback: CollectiveObserver) -> None:
        """Forget one registration of `callback` (the latest); nothing if it is not registered."""
        with self._lock:
            callbacks = list(self.callbacks)
            for index in reversed(range(len(callbacks))):
                if callbacks[index] is callback:
                    del callbacks[index]
                    self.callbacks = tuple(callbacks)
                    return


class GroupState(enum.Enum):
    """Where a ProcessGroup is in its life on this rank."""

    OPEN = enum.auto()      # operations may be issued; they run one at a time, in program order
    ABORTED = enum.auto()   # an operation failed here or on a peer: new ones raise GroupAbortedError, queued ones fail
    CLOSED = enum.auto()    # destroyed: new operations raise; the executor finishes its queue, then exits


class ProcessGroup(TorchGroupMethods):
    """A group of ranks that communicate together (the role of torch's ProcessGroup); torch's methods
    (`allreduce`, `broadcast`, ...) come from TorchGroupMethods.

    Its `state` (GroupState) moves OPEN -> ABORTED on the first failure and OPEN or ABORTED -> CLOSED when
    it is destroyed; it never returns to OPEN.
    """

    def __init__(self, name: str, global_ranks: list[int], group_rank: int, transport: Transport,
                 store: Store, world_store: Store, timeout: float, recorder: FlightRecorder,
                 backend: str, observers: CollectiveObservers | None = None) -> None:
        self.name = name
        self.ranks = list(global_ranks)
        self.group_rank = group_rank
        # Attributes, not properties: torch.compile reads a group's attributes at compile time but cannot call the
        # properties of an opaque value (see _compiled_group).
        self.group_name = name                      # torch's ProcessGroup's name for it
        self.global_rank = self.ranks[group_rank]
        self.transport = transport
        self.store = store
        self.timeout = timeout
        self.backend = backend
        self.description = f"group '{name}' (ranks {self.ranks})"
        self.group_desc = "undefined"              # torch's description of the group (new_group's group_desc)
        self.bound_device_id: torch.device | None = None   # the device init_process_group's device_id bound
        self.host_name = socket.gethostname()      # errors name the host of the rank that raised them
        self._world_store = world_store
        self._recorder = recorder
        self.observers = observers if observers is not None else CollectiveObservers()
        self._seq = 0
        self._p2p_seq = 0
        self._p2p_names: dict[tuple[str, int, int], tuple[str, str]] = {}
        self._lock = threading.Lock()
        self._has_work = threading.Condition(self._lock)
        self._queue: collections.deque[tuple[OpRecord, Body, Work, torch.Stream | None]] = collections.deque()
        self._running: OpRecord | None = None        # the operation holding the transport (inline or executor)
        self._executor: threading.Thread | None = None
        self._error: BaseException | None = None      # the first failure, kept for later operations' errors
        self.state = GroupState.OPEN

    # A group is its own identity: equal only to itself. Said explicitly because torch.compile holds groups as
    # constants of its graphs, compared with __eq__ (see the registration at the end of this module).
    def __eq__(self, other: object) -> bool:
        return self is other

    __hash__ = object.__hash__

    def __fx_repr__(self) -> tuple[str, dict[str, Any]]:
        """How a compiled graph's code names this group (spmd._core.compile, Note: objects in compiled graphs)."""
        return fx_name(self)

    # the accessors of torch's ProcessGroup
    def rank(self) -> int:
        return self.group_rank

    def size(self) -> int:
        return len(self.ranks)

    def group_rank_of(self, global_rank: int, what: str) -> int:
        """The group rank of `global_rank`, or ValueError naming `what` (e.g. "broadcast on rank 3: src")."""
        if isinstance(global_rank, int) and not isinstance(global_rank, bool) and global_rank in self.ranks:
            return self.ranks.index(global_rank)
        raise ValueError(f"{what}: rank {global_rank!r} is not in {self.description}; pass one of its global "
                         f"ranks {self.ranks}, or a group rank 0..{self.size() - 1} as the group_ argument")

    # -- collectives ----------------------------------------------------------------------------------------

    def run(self, fingerprint: Fingerprint, body: Body, outputs: list, async_op: bool,
            device: torch.device | None = None, timeout: float | None = None) -> Work | None:
        """Issue one collective: record it, run `body` in program order, return a Work if `async_op`.

        `device`: where the op's tensors live; a queued op on an accelerator runs after the caller's stream.
        `timeout` (s): this op's bound instead of the group's (torch's barrier(timeout=...)).
        """
        observers = self.observers.callbacks
        if observers:
            for observer in observers:
                observer(self, fingerprint)
        record = self._recorder.record(self.name, fingerprint)
        work = Work(f"{fingerprint.op} #{fingerprint.seq} on {self.description}", outputs, record)
        with self._lock:
            self._raise_if_unusable(fingerprint)
            # async ops too on a transport that moves nothing (fake): no thread, so a FakeTensorMode (per
            # thread) still serves the op's tensors
            inline = (not async_op or not self.transport.moves_data) and self._running is None and not self._queue
            if inline:
                self._running = record
            else:
                self._queue.append((record, body, work, caller_stream(device), timeout))
                self._ensure_executor()
                self._has_work.notify()
        if inline:
            timer = active_timer()
            if timer is not None:
                started = time.perf_counter()
            try:
                self._execute(record, body, work, None, timeout)    # the caller's thread: its stream is current
            finally:
                if timer is not None:
                    charge_exposed(timer, started)
                with self._lock:
                    self._running = None
                    if self._queue:
                        self._has_work.notify()
        if async_op:
            return work
        work.wait()
        return None

    def next_fingerprint(self, op: str, shape: tuple[int, ...] | None, dtype: str, reduce_op: str | None = None,
                         root: int | None = None, call_site: str = "") -> Fingerprint:
        with self._lock:
            self._seq += 1
            seq = self._seq
        return Fingerprint(op, seq, shape, dtype, reduce_op, root, call_site)

    def p2p_names(self, op: str, peer: int, tag: int) -> tuple[str, str]:
        """(flight-recorder op, Work description) of `op` ("isend" or "irecv") with group rank `peer`; made
        once per (op, peer, tag), as a send's own cost is a few microseconds."""
        key = (op, peer, tag)
        names = self._p2p_names.get(key)
        if names is None:
            me, other = self.global_rank, self.ranks[peer]
            arrow = f"{me}->{other}" if op == "isend" else f"{other}->{me}"
            names = (f"{op} {arrow} tag {tag}", f"{op} {arrow} (tag {tag}) on {self.description}")
            if len(self._p2p_names) < 4096:     # tags are the user's: don't grow without bound
                self._p2p_names[key] = names
        return names

    def next_p2p_record(self, op: str, shape: tuple[int, ...], dtype: str, call_site: str) -> OpRecord:
        with self._lock:
            self._raise_if_unusable(None)
            self._p2p_seq += 1
            seq = self._p2p_seq
        return self._recorder.record(f"{self.name}/p2p", Fingerprint(op, seq, shape, dtype, call_site=call_site))

    def _raise_if_unusable(self, fingerprint: Fingerprint | None) -> None:
        what = f"{fingerprint.op} #{fingerprint.seq}" if fingerprint else "point-to-point operation"
        if self.state is GroupState.CLOSED:
            raise RuntimeError(f"{what} on {self.description}: the group was destroyed")
        if self.state is GroupState.ABORTED:
            raise GroupAbortedError(
                f"{what} on rank {self.global_rank}: {self.description} was aborted by an earlier failure "
                f"and can't run more operations. First failure: {self._error}") from self._error

    def _ensure_executor(self) -> None:
        if self._executor is None:
            self._executor = threading.Thread(target=self._drain, name=f"spmd-group-{self.name}-rank"
                                              f"{self.global_rank}", daemon=True)
            self._executor.start()

    def _drain(self) -> None:
        torch.set_grad_enabled(False)     # this thread only moves data (see Note: writing outside autograd)
        while True:
            with self._lock:
                while not self._queue or self._running is not None:
                    if self.state is GroupState.CLOSED:
                        return
                    self._has_work.wait()
                record, body, work, stream, timeout = self._queue.popleft()
                self._running = record
                error = self._error
            try:
                if error is not None:
                    work.to_failed(GroupAbortedError(f"{work.description}: the group was aborted: {error}"))
                else:
                    self._execute(record, body, work, stream, timeout)
            finally:
                # The op's tensors (its body's closure, the Work's outputs) must not stay alive while this thread
                # waits for the next op: FSDP frees its all-gather buffers as soon as the caller drops them.
                # Dropped before the group counts as idle, so the group's next op starts after they are gone.
                del record, body, work, stream, timeout
                with self._lock:
                    self._running = None

    # Note: streams. An op enqueued from stream S completes with respect to S, as with torch's NCCL
    # ProcessGroup, whatever thread runs it:
    # - CPU transports finish the data movement before the body returns; there is no stream, `stream` is
    #   None, and nothing here costs anything.
    # - For tensors on an accelerator, `run` captures the caller's current stream S when it queues the op
    #   (`caller_stream`). The executor makes S current on its own thread while the body runs, so the
    #   transport's kernels are ordered after S's pending work (the Transport contract: a device transport
    #   orders its work after the current stream and leaves that stream ordered after its completion). Then
    #   it records an event on S, which completes the Work, and `Work.wait()` makes the waiter's current
    #   stream wait on that event: a stream wait, not a host synchronize; no synchronize() is added anywhere.
    # - An op run inline (synchronous, nothing queued) runs on the caller's thread with S current already.
    # - Point-to-point ops call the transport from the caller's thread, so S is current there too; their
    #   Work is completed by the transport, which makes it stream-aware the same way.
    def _execute(self, record: OpRecord, body: Body, work: Work, stream: torch.Stream | None,
                 timeout: float | None) -> None:
        record.state = OpState.RUNNING
        ctx = OpContext(record.fingerprint, Deadline(self.timeout if timeout is None else timeout), self.description)
        try:
            if _writes_inference_tensors(work.outputs):
                with torch.inference_mode():    # see Note: inference tensors
                    ready = _run_body(body, ctx, stream)
            elif torch.is_inference_mode_enabled():
                with torch.inference_mode(False), torch.no_grad():     # see Note: writing outside autograd
                    ready = _run_body(body, ctx, stream)
            elif torch.is_grad_enabled():     # the common case of an op run inline: torch's raw switch (0.3 µs,
                _set_grad_enabled(False)      # its context managers 0.7-1.4 µs)
                try:
                    ready = _run_body(body, ctx, stream)
                finally:
                    _set_grad_enabled(True)
            else:
                ready = _run_body(body, ctx, stream)
        except BaseException as error:   # every failure must reach the Work and abort the group
            error = self._explain(error, record.fingerprint)
            self.abort(error)
            work.to_failed(error)
            return
        work.to_completed(ready)

    def _explain(self, error: BaseException, fingerprint: Fingerprint) -> BaseException:
        """Give a transport's error its context: rank, op, group, and for timeouts what the others are doing."""
        where = f"spmd: {fingerprint.describe()} on {self.description}, rank {self.global_rank} on {self.host_name}"
        if isinstance(error, CommTimeoutError):
            try:
                statuses = collect_statuses(self._world_store, self.ranks)
            except (StoreError, OSError) as store_error:
                reason = (f"timed out after {self.timeout:.1f}s; the store could not be asked what the other ranks "
                          f"are doing ({store_error})")
                return CommTimeoutError(f"{where}: {reason}", reason=reason)
            missing, lines = describe_stragglers(self.name, self.ranks, fingerprint, statuses)
            reason = f"timed out after {self.timeout:.1f}s. Ranks that never entered it: {missing}.\n  " + "\n  ".join(
                lines)
            return CommTimeoutError(f"{where}: {reason}", reason=reason)
        if isinstance(error, SpmdError):
            return type(error)(error.explained(where), reason=error.reason, seen_by=error.seen_by)
        if isinstance(error, (ValueError, TypeError)):
            return error
        return CommError(f"{where}: {type(error).__name__}: {error}")

    # -- point to point -------------------------------------------------------------------------------------

    def p2p_failed(self, record: OpRecord, error: BaseException) -> BaseException:
        error = self._explain(error, record.fingerprint)
        self.abort(error)
        return error

    def allocate_tensor(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A flat buffer of `numel` elements for this group's collectives: from its transport's own allocator where
        it has one for `device` (NCCL's registered memory), else a plain torch.empty."""
        made = self.transport.allocate_tensor(numel, dtype, device)
        return made if made is not None else torch.empty(numel, dtype=dtype, device=device)

    # -- lifetime -------------------------------------------------------------------------------------------

    def abort(self, error: BaseException | None = None) -> None:
        """Fail this group on this rank (and, through the transport, on its peers). The first failure wins; a
        failure while the closing group finishes its queue is reported too, and the group stays CLOSED. Without
        `error` (torch's `pg.abort()`), the failure is this call."""
        if error is None:
            error = GroupAbortedError(f"{self.description}: aborted by ProcessGroup.abort() on rank "
                                      f"{self.global_rank}", reason=f"aborted by ProcessGroup.abort() on rank "
                                      f"{self.global_rank}")
        with self._lock:
            if self._error is not None:
                return
            self._error = error
            if self.state is GroupState.OPEN:
                self.state = GroupState.ABORTED
            self._has_work.notify_all()
        self.transport.abort(error)

    def close(self) -> None:
        """Destroy the group on this rank (OPEN or ABORTED -> CLOSED): queued operations run (or fail, if it
        was aborted), then the transport is released. Closing a closed group does nothing."""
        with self._lock:
            if self.state is GroupState.CLOSED:
                return
            self.state = GroupState.CLOSED
            self._has_work.notify_all()
        if self._executor is not None and self._executor is not threading.current_thread():
            self._executor.join(timeout=self.timeout)
        self.transport.close()

    def __repr__(self) -> str:
        return f"ProcessGroup(name={self.name!r}, ranks={self.ranks}, rank={self.group_rank}, backend={self.backend})"


class NonMemberGroup:
    """What new_group returns on a rank outside the group: any operation on it raises ValueError."""

    def __init__(self, name: str, global_ranks: list[int], caller_rank: int) -> None:
        self.name = name
        self.ranks = list(global_ranks)
        self.caller_rank = caller_rank

    def not_member_error(self, op: str) -> ValueError:
        return ValueError(f"{op}: rank {self.caller_rank} is not in group '{self.name}' (ranks {self.ranks}); "
                          f"only its members may use it")

    def __repr__(self) -> str:
        return f"NonMemberGroup(name={self.name!r}, ranks={self.ranks})"


# torch.compile traces code that takes a group from a mesh (mesh.get_group() inside a compiled module) and passes
# it to a collective: the group is a constant of the graph (an opaque value, as torch registers its own groups),
# its queries answered at compile time (spmd._core.compile, Note: objects in compiled graphs).

register_opaque_type(ProcessGroup, typ="value", members={
    name: MemberType.USE_REAL for name in ("__eq__", "__hash__", "rank", "size", "group_name", "name", "ranks",
                                           "group_rank", "global_rank", "backend", "description")})
