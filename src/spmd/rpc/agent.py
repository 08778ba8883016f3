"""The RPC agent of one worker: messages to and from every other worker over a socket per pair (channel.py),
requests run on a pool of threads, calls completed through torch Futures.

Layer: rpc (over comm). A message is a tuple, written on the socket to its peer (channel.py): its header (two
int64: the body's length, -1 when the sender stops, and its tensor count), its body, then its tensors
(wire.py). Only members of the job's group, which authenticated when they connected, can send one: the agent
unpickles what they send, as the object collectives do (see README: Security).

Note: the agent's threads
  - one receiver per peer, each waiting for that peer's next message (messages of one pair arrive in order);
    a request goes to the pool, a response completes its call's Future, a STOP ends the receiver;
  - a call or a response is sent by the thread that makes it, one message to a peer at a time (a lock per peer
    keeps a message's pieces together); one sender thread sends what code that must not block queues (an
    RRef's __del__) and the STOPs;
  - the pool (`num_worker_threads`) running requests; a request may itself call other workers;
  - one timer failing calls that ran past their deadline.
All of them run in the worker's context (contextvars), so on thread ranks each sees its own world and agent.
A peer found dead (its socket ends or fails) fails every call waiting on it, naming it.

Note: a peer that does not read
A peer alive but not reading (stopped, stuck, in a debugger) must not hold a caller past its call's timeout, nor
a pool thread past the agent's rpc_timeout. So a call or a response, sent with its deadline, waits for the peer's
send lock only until then (having sent nothing, it fails by its timer); stops writing at the deadline, and the
rest of the message, copied at once, is written by a thread of its own holding that lock until the message is
whole (the peer's stream stays in step: the next message follows it); and waits for the ack of tensors by
reference only until then, the pending ack holding them until the ack or the peer's loss. A timed-out call may
still run on its worker once it reads, as in torch. Messages queued for the sender thread (acks, releases,
STOPs) have no deadline.

Note: graceful shutdown
  1. wait for this worker's own calls and queued messages;
  2. barrier through the store: every worker got there, so no call is in flight anywhere (a call served here
     that calls on is the caller's own call, finished before the caller reaches step 1), while the receivers
     and the pool keep serving until then;
  3. send STOP to every peer, wait for every peer's STOP (all messages before it handled), stop the pool, close
     the sockets and release what init_rpc set up.
"""

from __future__ import annotations

import collections
import contextvars
import dataclasses
import enum
import heapq
import itertools
import pickle
import struct
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from spmd._core.errors import SpmdError, StoreTimeoutError
from spmd.comm.store import Store
from spmd.comm.transports.base import TransportSpec
from spmd.rpc import wire
from spmd.rpc.channel import ONE_COPY_BYTES, Channels
from spmd.rpc.functions import is_async_execution
from spmd.rpc.pool import HandlerPool

_STOP = -1
_SHUTDOWN_SLICE_S = 1.0     # a graceful shutdown looks again for peers found dead this often
_HEADER = struct.Struct("<qqq")  # a message's body length (or _STOP, _ACK), its tensors sent apart, its ack id
_ADDRESS = struct.Struct("<q")   # per tensor sent apart: its address (by reference), or 0 (its bytes follow)
_ACK = -2
DESTINATION: contextvars.ContextVar[int | None] = contextvars.ContextVar("spmd_rpc_destination", default=None)
"""The rank a request being pickled goes to (set while `call` encodes it)."""
_Payload = tuple[bytes, list[torch.Tensor]]
_STOP_MESSAGE: _Payload = (b"stop", [])     # queued (by identity) in place of a message: send the STOP header


@dataclasses.dataclass(frozen=True)
class _AckMessage:
    """Queued in place of a message: acknowledge message `ack_id`, whose tensors by reference are copied."""

    ack_id: int


@dataclasses.dataclass
class _PendingAck:
    """A message sent with tensors by reference, whose sender waits (holding them) for the peer's ack. A call's
    sender stops waiting at the call's deadline; the message's tensors then stay held here until the ack or the
    peer's loss, so the peer never reads freed memory."""

    peer: int
    payload: _Payload
    done: threading.Event = dataclasses.field(default_factory=threading.Event)


class PeerState(enum.Enum):
    OPEN = "open"
    STOPPED = "stopped"     # sent STOP: shut down
    LOST = "lost"           # its transport failed


@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    """A worker of the RPC group (torch's name): its unique name and its id (its rank)."""

    name: str
    id: int

    def __repr__(self) -> str:
        return f"WorkerInfo(id={self.id}, name={self.name})"


@dataclasses.dataclass
class _Call:
    future: torch.futures.Future
    dst: int
    what: str


class RemoteException(SpmdError):
    """A call failed on the worker that ran it, with an exception that could not travel back as itself."""


def _error_message(worker: WorkerInfo, what: str, error: BaseException) -> str:
    return f"{what} on worker {worker.name} (rank {worker.id}) failed: {type(error).__name__}: {error}"


class RpcAgent:
    """One worker's agent; see the Notes above."""

    def __init__(self, name: str, rank: int, world_size: int, spec: TransportSpec, store: Store, prefix: str,
                 num_worker_threads: int, rpc_timeout: float, release: Callable[[], None],
                 connect_timeout: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.store = store
        self.prefix = prefix
        self.rpc_timeout = rpc_timeout
        self._release = release
        self._connect_timeout = connect_timeout
        store.set(f"{prefix}/name/{rank}", name)
        names = [store.get(f"{prefix}/name/{peer}").decode() for peer in range(world_size)]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"init_rpc on rank {rank}: worker names must be unique; {repeated} is used by ranks "
                             f"{[r for r, n in enumerate(names) if n in repeated]}")
        self.workers = [WorkerInfo(n, r) for r, n in enumerate(names)]
        self.me = self.workers[rank]
        self._by_name = {info.name: info for info in self.workers}
        self._lock = threading.Lock()
        self._calls: dict[int, _Call] = {}
        self._call_ids = itertools.count(1)
        self._peers = {peer: PeerState.OPEN for peer in range(world_size) if peer != rank}
        self._send_locks = {peer: threading.Lock() for peer in self._peers}
        self._peer_errors: dict[int, BaseException] = {}
        self._outbox: collections.deque[tuple[int, _Payload | _AckMessage]] = collections.deque()
        self._acks: dict[int, _PendingAck] = {}
        self._ack_ids = itertools.count(1)
        self._outbox_ready = threading.Condition(self._lock)
        self._sending = 0            # messages taken from the outbox and not yet handed to the transport
        self._deadlines: list[tuple[float, int]] = []
        self._timer_wake = threading.Condition(self._lock)
        self._running = self._sender_running = True
        self._pool = HandlerPool(num_worker_threads, f"spmd-rpc{rank}")
        self.channels = Channels(spec, connect_timeout)
        self._context = contextvars.copy_context()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """Start the threads (Note: the agent's threads), in a copy of the caller's context."""
        self._context = contextvars.copy_context()
        self._threads = [self._thread(self._receive, f"spmd-rpc{self.rank}-from{peer}", peer) for peer in self._peers]
        self._threads.append(self._thread(self._send_loop, f"spmd-rpc{self.rank}-send"))
        self._threads.append(self._thread(self._time_out_calls, f"spmd-rpc{self.rank}-timer"))
        for thread in self._threads:
            thread.start()

    def wait_for_every_worker_serving(self) -> None:
        """The end of init_rpc, as torch's ends: every worker's agent serves before any returns, so a worker's
        first call finds its peer past init_rpc (within its connect timeout, else a TimeoutError naming the
        workers that did not get there)."""
        keys = [f"{self.prefix}/serving/{peer}" for peer in range(self.world_size)]
        self.store.set(keys[self.rank], "1")
        try:
            self.store.wait(keys, self._connect_timeout)
        except StoreTimeoutError:
            late = [self.workers[peer].name for peer, key in enumerate(keys) if not self.store.check([key])]
            raise TimeoutError(f"init_rpc on worker {self.me.name}: workers {late} did not finish init_rpc within "
                               f"{self._connect_timeout:.0f}s") from None

    def _thread(self, target: Callable[..., None], name: str, *args: Any) -> threading.Thread:
        return threading.Thread(target=self._context.copy().run, args=(target, *args), name=name, daemon=True)

    # -- names -----------------------------------------------------------------------------------------------

    def worker(self, to: str | int | WorkerInfo) -> WorkerInfo:
        """The worker `to` names (its name, rank or WorkerInfo)."""
        if isinstance(to, WorkerInfo):
            return to
        if isinstance(to, str):
            info = self._by_name.get(to)
            if info is None:
                raise ValueError(f"rpc on worker {self.me.name}: no worker named {to!r}; the workers are "
                                 f"{[w.name for w in self.workers]}")
            return info
        if isinstance(to, int) and not isinstance(to, bool) and 0 <= to < self.world_size:
            return self.workers[to]
        raise ValueError(f"rpc on worker {self.me.name}: {to!r} names no worker (a name, a rank below "
                         f"{self.world_size} or a WorkerInfo)")

    # -- calls -----------------------------------------------------------------------------------------------

    def call(self, to: WorkerInfo, function: Callable[..., Any], args: tuple, kwargs: dict, timeout: float,
             what: str) -> torch.futures.Future:
        """Run function(*args, **kwargs) on `to`; a Future of its result (or its error). `timeout` seconds (0:
        none) until the call fails with a TimeoutError."""
        future: torch.futures.Future = torch.futures.Future()
        call_id = next(self._call_ids)
        if to.id == self.rank:                     # to itself: through the pool, as a peer's request would run
            with self._lock:
                self._check_running(what)
                self._register_call(call_id, _Call(future, to.id, what), timeout)
            self._pool.submit(self._context.copy().run, self._run_local, call_id, function, args, kwargs)
            return future
        token = DESTINATION.set(to.id)       # for what pickles itself differently toward its owner (an RRef)
        try:
            payload = wire.encode(("request", call_id, function, args, kwargs))
        finally:
            DESTINATION.reset(token)
        with self._lock:
            self._check_running(what)
            lost = self._peer_errors.get(to.id)
            if lost is None:
                self._register_call(call_id, _Call(future, to.id, what), timeout)
        if lost is not None:
            future.set_exception(RuntimeError(_error_message(to, what, lost)))
        else:    # past the deadline (a peer alive but not reading), the timer fails the call
            self._transmit(to.id, payload, time.monotonic() + timeout if timeout > 0 else None)
        return future

    def notify(self, to: WorkerInfo, function: Callable[..., Any], args: tuple) -> None:
        """Run function(*args) on `to`, expecting no answer (an RRef's release); only queues, so it may be
        called from __del__. Dropped once the agent stopped."""
        if to.id == self.rank:
            self._pool.submit(self._context.copy().run, function, *args)
            return
        self._queue(to.id, wire.encode(("notify", 0, function, args, {})))

    def _queue(self, peer: int, message: _Payload | _AckMessage) -> None:
        """Have the sender thread send `message` (never blocks); dropped once the agent stopped."""
        with self._lock:
            if self._running and peer not in self._peer_errors:
                self._outbox.append((peer, message))
                self._outbox_ready.notify()

    def _register_call(self, call_id: int, call: _Call, timeout: float) -> None:
        """Track `call` until it completes, fails with its peer or (timeout > 0) runs past its deadline. Under
        the agent's lock."""
        self._calls[call_id] = call
        if timeout > 0:
            heapq.heappush(self._deadlines, (time.monotonic() + timeout, call_id))
            self._timer_wake.notify()

    def _check_running(self, what: str) -> None:
        if not self._running:
            raise RuntimeError(f"{what} on worker {self.me.name}: RPC was shut down on this worker")

    def _run_local(self, call_id: int, function: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        try:
            result = function(*args, **kwargs)
        except BaseException as error:      # the caller gets it through the future
            self._finish_local(call_id, error=error)
            return
        if isinstance(result, torch._C.Future) and is_async_execution(function):
            result.add_done_callback(lambda done: self._finish_local_from(call_id, done))
        else:
            self._finish_local(call_id, value=result)

    def _finish_local_from(self, call_id: int, done: torch.futures.Future) -> None:
        try:
            value = done.wait()
        except BaseException as error:
            self._finish_local(call_id, error=error)
            return
        self._finish_local(call_id, value=value)

    def _finish_local(self, call_id: int, value: Any = None, error: BaseException | None = None) -> None:
        """A call to this worker itself is done: complete its Future (unless it timed out already)."""
        with self._lock:
            call = self._calls.pop(call_id, None)
            self._outbox_ready.notify_all()
        if call is None:
            return
        if error is not None:
            call.future.set_exception(error)
        else:
            call.future.set_result(value)

    # -- the threads -----------------------------------------------------------------------------------------

    def _send_loop(self) -> None:
        while True:
            with self._lock:
                while not self._outbox and self._sender_running:
                    self._outbox_ready.wait()
                if not self._outbox:
                    return
                dst, payload = self._outbox.popleft()
                self._sending += 1
            self._transmit(dst, payload)
            with self._lock:
                self._sending -= 1
                self._outbox_ready.notify_all()

    def _transmit(self, dst: int, payload: _Payload | _AckMessage, deadline: float | None = None) -> None:
        """Write one message to `dst` (the header, the body and the tensors' addresses, then the bytes of the
        tensors sent by value; a STOP or an ack: the header alone). On the calling thread (a hand-off to the
        sender costs two thread wake-ups), one message to a peer at a time; with tensors by reference, then wait
        for the peer's ack before letting go of them (see Note: large tensors by reference in channel.py).
        With a `deadline` (time.monotonic(): a call's, a response's), the caller stops at it (see Note: a peer
        that does not read)."""
        lock = self._send_locks[dst]
        if not lock.acquire(timeout=-1 if deadline is None else max(0.0, deadline - time.monotonic())):
            return                       # nothing was sent: the call fails at its deadline
        ack_id, pending = 0, None
        if isinstance(payload, tuple) and payload is not _STOP_MESSAGE and dst in self.channels.reads_me and \
                any(tensor.nbytes >= ONE_COPY_BYTES for tensor in payload[1]):
            ack_id = next(self._ack_ids)
            with self._lock:
                self._acks[ack_id] = pending = _PendingAck(dst, payload)
                if dst in self._peer_errors:      # lost already: nobody will ack
                    pending.done.set()
        unsent: list[memoryview] = []
        try:
            unsent = self._transmit_locked(dst, payload, ack_id, deadline)
        finally:
            if unsent:
                self._finish_later(dst, unsent, lock)
            else:
                lock.release()
        if pending is not None:          # set by the ack, or when the peer is lost
            pending.done.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def _finish_later(self, dst: int, unsent: list[memoryview], lock: threading.Lock) -> None:
        """The rest of a message its sender's deadline cut short: copied now (the sender's tensors may change once
        it returns), written by a thread of its own, which holds the peer's send lock until the message is whole."""
        copies = [bytes(view) for view in unsent]

        def finish() -> None:
            try:
                self.channels.send(dst, *copies)
            except Exception as error:     # the peer is gone: its calls fail
                self._lose(dst, error)
            finally:
                lock.release()

        self._thread(finish, f"spmd-rpc{self.rank}-finish-to{dst}").start()

    def _transmit_locked(self, dst: int, payload: _Payload | _AckMessage, ack_id: int,
                         deadline: float | None) -> list[memoryview]:
        """Write the message; what a `deadline` left unwritten (see _transmit)."""
        try:
            if payload is _STOP_MESSAGE:
                self.channels.send(dst, _HEADER.pack(_STOP, 0, 0))
                return []
            if isinstance(payload, _AckMessage):
                self.channels.send(dst, _HEADER.pack(_ACK, 0, payload.ack_id))
                return []
            body, tensors = payload
            by_reference = [bool(ack_id) and tensor.nbytes >= ONE_COPY_BYTES for tensor in tensors]
            addresses = b"".join(_ADDRESS.pack(tensor.data_ptr() if ref else 0)
                                 for tensor, ref in zip(tensors, by_reference, strict=True))
            pieces = [_HEADER.pack(len(body), len(tensors), ack_id) + body + addresses,
                      *(wire.byte_view(tensor) for tensor, ref in zip(tensors, by_reference, strict=True)
                        if not ref and tensor.numel())]
            if deadline is None:
                self.channels.send(dst, *pieces)
                return []
            return self.channels.send_until(dst, pieces, deadline)
        except Exception as error:     # the peer is gone: its calls fail
            self._lose(dst, error)
            return []

    def _receive(self, peer: int) -> None:
        header = bytearray(_HEADER.size)
        while True:
            try:
                self.channels.receive_into(peer, memoryview(header))
                size, count, ack_id = _HEADER.unpack(header)
                if size == _STOP:
                    with self._lock:
                        self._peers[peer] = PeerState.STOPPED
                    return
                if size == _ACK:
                    self._acked(ack_id)
                    continue
                body = bytearray(size + count * _ADDRESS.size)
                self.channels.receive_into(peer, memoryview(body))
                pickled, metas = wire.metas_of(body[:size])
                tensors = [wire.tensor_of(meta) for meta in metas]
                apart = [tensor for tensor, meta in zip(tensors, metas, strict=True) if meta[3] is None]
                if count != len(apart):
                    raise RuntimeError(f"a message from worker {self.workers[peer].name} is malformed")
                for index, tensor in enumerate(apart):
                    (address,) = _ADDRESS.unpack_from(body, size + index * _ADDRESS.size)
                    if address:
                        self.channels.read(peer, address, tensor.data_ptr(), tensor.nbytes)
                    else:
                        self.channels.receive_into(peer, wire.byte_view(tensor))
                if ack_id:
                    self._queue(peer, _AckMessage(ack_id))
            except Exception as error:      # the peer (or this worker's agent) is gone
                self._lose(peer, error)
                return
            if not self._dispatch(peer, pickled, metas, tensors):
                return

    def _dispatch(self, peer: int, pickled: bytes, metas: list[wire.Meta], tensors: list[torch.Tensor]) -> bool:
        """Hand one message on; False if it can't be read. (Its own frame, so that the receiver holds nothing of
        it while it waits for the next: an RRef among the arguments must die with the request.)"""
        try:
            kind, call_id, *rest = wire.decode(pickled, metas, tensors)
        except Exception as error:
            self._lose(peer, RuntimeError(f"a message from worker {self.workers[peer].name} could not be "
                                          f"unpickled: {type(error).__name__}: {error}"))
            return False
        if kind in ("request", "notify"):
            self._pool.submit(self._context.copy().run, self._serve, peer, kind, call_id, *rest)
        else:
            self._complete(call_id, kind, rest[0])
        return True

    def _serve(self, peer: int, kind: str, call_id: int, function: Callable[..., Any], args: tuple,
               kwargs: dict) -> None:
        try:
            result = function(*args, **kwargs)
        except BaseException as error:       # sent back to the caller
            if kind == "request":
                self._respond(peer, call_id, error=error)
            return
        if kind != "request":
            return
        if isinstance(result, torch._C.Future) and is_async_execution(function):
            result.add_done_callback(lambda done: self._respond_done(peer, call_id, done))
        else:
            self._respond(peer, call_id, value=result)

    def _respond_done(self, peer: int, call_id: int, done: torch.futures.Future) -> None:
        try:
            value = done.wait()
        except BaseException as error:
            self._respond(peer, call_id, error=error)
            return
        self._respond(peer, call_id, value=value)

    def _respond(self, peer: int, call_id: int, value: Any = None, error: BaseException | None = None) -> None:
        if error is None:
            try:
                payload = wire.encode(("ok", call_id, value))
            except Exception as failure:       # the result can't travel: the caller gets why
                error = failure
        if error is not None:
            text = "".join(traceback.format_exception(error))
            try:
                payload = wire.encode(("error", call_id, (error, text)))
                pickle.loads(pickle.dumps(error))       # it must come back to life on the caller too
            except Exception:
                payload = wire.encode(("error", call_id, (None, text)))
        if peer not in self._peer_errors:    # a caller alive but not reading holds this pool thread rpc_timeout at most
            self._transmit(peer, payload, time.monotonic() + self.rpc_timeout if self.rpc_timeout > 0 else None)

    def _complete(self, call_id: int, kind: str, body: Any) -> None:
        with self._lock:
            call = self._calls.pop(call_id, None)
            self._outbox_ready.notify_all()
        if call is None:                      # timed out already
            return
        if kind == "ok":
            call.future.set_result(body)
            return
        error, text = body
        where = self.workers[call.dst]
        if isinstance(error, BaseException):
            error.add_note(f"raised by {call.what} on worker {where.name} (rank {where.id}); its traceback there:"
                           f"\n{text}")
            call.future.set_exception(error)
        else:
            call.future.set_exception(RemoteException(f"{call.what} on worker {where.name} (rank {where.id}) "
                                                      f"failed:\n{text}"))

    def _acked(self, ack_id: int) -> None:
        with self._lock:
            pending = self._acks.pop(ack_id, None)
        if pending is not None:
            pending.done.set()

    def _lose(self, peer: int, error: BaseException) -> None:
        """Peer `peer` is gone: every call waiting on it fails, naming it; senders waiting for its acks go on."""
        with self._lock:
            for ack_id in [a for a, pending in self._acks.items() if pending.peer == peer]:
                self._acks.pop(ack_id).done.set()
            if self._peers.get(peer) is PeerState.STOPPED or peer in self._peer_errors:
                return
            self._peers[peer] = PeerState.LOST
            self._peer_errors[peer] = error
            failed = [(call_id, call) for call_id, call in self._calls.items() if call.dst == peer]
            for call_id, _ in failed:
                del self._calls[call_id]
            self._outbox_ready.notify_all()
        for _, call in failed:
            call.future.set_exception(RuntimeError(_error_message(self.workers[peer], call.what, error)))

    def _time_out_calls(self) -> None:
        with self._lock:
            while self._running:
                now = time.monotonic()
                expired = []
                while self._deadlines and self._deadlines[0][0] <= now:
                    _, call_id = heapq.heappop(self._deadlines)
                    call = self._calls.pop(call_id, None)
                    if call is not None:
                        expired.append(call)
                if expired:
                    self._outbox_ready.notify_all()
                    self._lock.release()
                    try:
                        for call in expired:
                            where = self.workers[call.dst]
                            call.future.set_exception(TimeoutError(
                                f"{call.what} on worker {where.name} (rank {where.id}) ran past its timeout"))
                    finally:
                        self._lock.acquire()
                    continue
                self._timer_wake.wait(self._deadlines[0][0] - now if self._deadlines else None)

    # -- shutdown --------------------------------------------------------------------------------------------

    def _wait_for_every_worker(self, timeout: float) -> None:
        """Step 2 of a graceful shutdown: every live worker got there (a worker found dead is not waited for);
        TimeoutError naming the others after `timeout` seconds (0: no limit)."""
        keys = {peer: f"{self.prefix}/done/{peer}" for peer in range(self.world_size)}
        self.store.set(keys[self.rank], "1")
        started = time.monotonic()
        while True:
            with self._lock:
                waiting = [peer for peer in keys if peer != self.rank and peer not in self._peer_errors]
            try:
                self.store.wait([keys[peer] for peer in waiting], _SHUTDOWN_SLICE_S)
                return
            except StoreTimeoutError:
                if timeout > 0 and time.monotonic() - started > timeout:
                    late = [self.workers[peer].name for peer in waiting if not self.store.check([keys[peer]])]
                    raise TimeoutError(f"rpc.shutdown on worker {self.me.name}: workers {late} did not reach "
                                       f"shutdown within {timeout:.0f}s") from None

    def shutdown(self, graceful: bool, timeout: float) -> None:
        """Stop this worker (Note: graceful shutdown); `timeout` bounds the barrier (0: none). Not graceful, or
        past the timeout (then raised after): the sockets are shut at once, failing every call still waiting."""
        late: TimeoutError | None = None
        if graceful:
            with self._lock:
                while self._calls or self._outbox or self._sending:
                    self._outbox_ready.wait()
            try:
                self._wait_for_every_worker(timeout)
            except TimeoutError as error:
                late = error
        if graceful and late is None:
            with self._lock:
                for peer in self._peers:
                    if peer not in self._peer_errors:
                        self._outbox.append((peer, _STOP_MESSAGE))
                self._outbox_ready.notify()
        else:
            self.channels.wake_receivers()    # each receiver finds its socket ended: calls still waiting fail
        for thread in self._threads[:len(self._peers)]:      # the receivers: each ends at its peer's STOP
            thread.join()
        self._pool.shutdown()
        with self._lock:
            self._running = self._sender_running = False
            self._outbox_ready.notify_all()
            self._timer_wake.notify_all()
            failed = list(self._calls.values())
            self._calls.clear()
        for thread in self._threads[len(self._peers):]:
            thread.join()
        for call in failed:
            call.future.set_exception(RuntimeError(f"{call.what}: RPC was shut down on worker {self.me.name}"))
        self.channels.close()
        self._release()
        if late is not None:
            raise late
