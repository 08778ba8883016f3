"""torch's RPC framework over spmd's transports: init_rpc / shutdown, rpc_sync / rpc_async / remote, RRef, and
the worker names (get_worker_info).

Layer: rpc. Every worker calls init_rpc (collective); the agent (agent.py) carries the calls. Inside a
distributed autograd context a call also records the edges its gradients flow back along (dist_autograd.py).

Note: an RRef's life
The owner keeps an RRef's value in its table, counting the RRefs that name it on any worker: the one remote()
returns counts from the start; pickling one to send it on counts the copy first (on the owner, before the copy
exists, so the count never drops to zero while a copy is on its way); a UserRRef's deletion, and the owner's own
RRef(value)'s, count down, and at zero the owner drops the value. Values still counted when RPC shuts down go
with the agent.
"""

from __future__ import annotations

import contextvars
import datetime
import itertools
import threading
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch

from spmd.comm.world import World, current_world, is_initialized, rendezvous
from spmd.rpc import dist_autograd
from spmd.rpc.agent import DESTINATION, RpcAgent, WorkerInfo
from spmd.rpc.options import BackendType, RpcBackendOptions, TensorPipeRpcBackendOptions

T = TypeVar("T")
UNSET_RPC_TIMEOUT = -1.0      # torch's: "the timeout the agent was initialised with"

_agent: contextvars.ContextVar[RpcAgent | None] = contextvars.ContextVar("spmd_rpc_agent", default=None)
# Threads the user starts find the agent through this fallback, while the process holds exactly one (a worker per
# process); with several thread-rank workers in one process it stays ambiguous, and each uses its context.
_process_agents: list[RpcAgent] = []
_process_agents_lock = threading.Lock()


def _current(what: str) -> RpcAgent:
    agent = _agent.get()
    if agent is None:
        with _process_agents_lock:
            agent = _process_agents[0] if len(_process_agents) == 1 else None
    if agent is None:
        raise RuntimeError(f"rpc.{what}: RPC is not initialised on this worker; call spmd.rpc.init_rpc first")
    return agent


def is_available() -> bool:
    return True


def init_rpc(name: str, backend: BackendType | None = None, rank: int = -1, world_size: int | None = None,
             rpc_backend_options: RpcBackendOptions | None = None) -> None:
    """Join the RPC group as worker `name` (unique). Collective over every worker. With an spmd world initialised
    on this rank and `rank` / `world_size` its own (or not given), the workers are its ranks, over a group of its
    transport; otherwise they rendezvous through the options' init_method (default env://: RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT, as spmdrun sets them) on a world of their own, apart from spmd's: the training's
    groups may be a subset of the RPC workers (the DDP + RPC tutorial's trainers). Returns once every worker's
    agent serves (as torch's ends with a barrier)."""
    if _agent.get() is not None:
        raise RuntimeError(f"init_rpc on worker {name!r}: RPC is already initialised on this worker; call "
                           f"spmd.rpc.shutdown() first")
    if not isinstance(name, str) or not name:
        raise ValueError(f"init_rpc: the worker name must be a non-empty string, got {name!r}")
    if backend is not None and backend is not BackendType.TENSORPIPE:
        raise ValueError(f"init_rpc: backend {backend!r} is not served; spmd's agent stands for TENSORPIPE")
    options = rpc_backend_options or TensorPipeRpcBackendOptions()
    world: World | None = current_world() if is_initialized() else None
    if world is not None and rank in (-1, world.rank) and world_size in (None, world.world_size):
        connect_timeout = world.timeout          # the job's: the workers connect as its groups do
        name_of_group = world.next_group_name()  # collective, like new_group: the agent's sockets are its group
        spec = world.transport_spec(list(range(world.world_size)), name_of_group, connect_timeout)
        prefix = f"{world.prefix}/rpc/{name_of_group}"

        def release() -> None:
            pass                                  # the world is the job's; the agent closes its own sockets
    else:
        connect_timeout = options.rpc_timeout or 600.0     # as long as the rendezvous may take
        store, rank, size = rendezvous(options.init_method or "env://", rank, -1 if world_size is None else world_size,
                                       connect_timeout)
        # the count of this rank's inits over the store names the same generation on every rank (as World's)
        generation = store.add(f"spmd-rpc/inits/rank{rank}", 1)
        world = World(rank, size, store, "auto", _agent_timeout(), owns_store=True, prefix=f"spmd-rpc/{generation}")
        spec = world.default_group.transport.spec
        prefix = f"{world.prefix}/rpc"
        release = world.destroy
    try:
        agent = RpcAgent(name, world.rank, world.world_size, spec, world.store, prefix, options.num_worker_threads,
                         options.rpc_timeout, release, connect_timeout)
    except BaseException:
        release()
        raise
    _agent.set(agent)
    with _process_agents_lock:
        _process_agents.append(agent)
    agent.start()        # its threads copy this context, where the agent is set
    try:
        agent.wait_for_every_worker_serving()
    except BaseException:
        shutdown(graceful=False)
        raise


def _agent_timeout() -> float:
    """The timeout of the world init_rpc makes for itself: its group lives as long as the job (each call has its
    own timeout; a dead peer fails its calls as its socket ends)."""
    return 10 * 365 * 24 * 3600.0


def shutdown(graceful: bool = True, timeout: float = 0) -> None:
    """Leave RPC: with `graceful`, once every worker got here (every call anywhere done); `timeout` bounds that
    wait (0: none)."""
    agent = _current("shutdown")
    try:
        agent.shutdown(graceful, timeout)
    finally:
        _agent.set(None)
        with _process_agents_lock:
            if agent in _process_agents:
                _process_agents.remove(agent)


def get_worker_info(worker_name: str | None = None) -> WorkerInfo:
    """The WorkerInfo of `worker_name`, or of this worker."""
    agent = _current("get_worker_info")
    return agent.me if worker_name is None else agent.worker(worker_name)


def _timeout(agent: RpcAgent, timeout: float | datetime.timedelta) -> float:
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    if seconds == UNSET_RPC_TIMEOUT:
        return agent.rpc_timeout
    if seconds < 0 or seconds != seconds:
        raise ValueError(f"rpc: timeout must be 0 (none) or positive seconds, got {timeout!r}")
    return seconds


def rpc_async(to: str | int | WorkerInfo, func: Callable[..., T], args: tuple | None = None,
              kwargs: dict | None = None, timeout: float = UNSET_RPC_TIMEOUT) -> torch.futures.Future[T]:
    """Run func(*args, **kwargs) on worker `to`; a Future of its result. Inside a distributed autograd context,
    gradients flow back along the call."""
    agent = _current("rpc_async")
    worker = agent.worker(to)
    what = f"rpc_async({_name(func)})"
    return dist_autograd.call(agent, worker, func, tuple(args or ()), dict(kwargs or {}), _timeout(agent, timeout),
                              what)


def rpc_sync(to: str | int | WorkerInfo, func: Callable[..., T], args: tuple | None = None,
             kwargs: dict | None = None, timeout: float = UNSET_RPC_TIMEOUT) -> T:
    """rpc_async(...).wait(): func's result, or its exception raised here."""
    return rpc_async(to, func, args, kwargs, timeout).wait()


def remote(to: str | int | WorkerInfo, func: Callable[..., T], args: tuple | None = None, kwargs: dict | None = None,
           timeout: float = UNSET_RPC_TIMEOUT) -> RRef[T]:
    """Run func(*args, **kwargs) on worker `to` and keep the result there; returns at once an RRef to it."""
    agent = _current("remote")
    owner = agent.worker(to)
    rref_id = (agent.rank, next(_rref_ids))
    created = agent.call(owner, _owner_create, (rref_id, func, tuple(args or ()), dict(kwargs or {})), {},
                         _timeout(agent, timeout), f"remote({_name(func)})")
    return RRef._user(owner, rref_id, created)


def _name(func: Callable[..., Any]) -> str:
    return getattr(func, "__qualname__", None) or repr(func)


# -- RRefs (Note: an RRef's life) ------------------------------------------------------------------------------

_rref_ids = itertools.count(1)


class _OwnerTable:
    """The values this worker owns, with how many RRefs name each."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)       # notified when a count changes or a value is dropped
        self.values: dict[tuple[int, int], torch.futures.Future] = {}
        self.counts: dict[tuple[int, int], int] = {}

    def slot(self, rref_id: tuple[int, int]) -> torch.futures.Future:
        with self.lock:
            slot = self.values.get(rref_id)
            if slot is None:
                slot = self.values[rref_id] = torch.futures.Future()
            return slot

    def count(self, rref_id: tuple[int, int], by: int) -> None:
        dropped = None
        with self.lock:
            left = self.counts.get(rref_id, 0) + by
            if left > 0:
                self.counts[rref_id] = left
            else:
                self.counts.pop(rref_id, None)
                dropped = self.values.pop(rref_id, None)
            self.changed.notify_all()
        # the value is freed here, outside the lock: RRefs it holds (a module's parameter_rrefs()) release their
        # own counts through this table as they go
        del dropped


_tables: weakref.WeakKeyDictionary[RpcAgent, _OwnerTable] = weakref.WeakKeyDictionary()
_tables_lock = threading.Lock()


def _table(agent: RpcAgent | None = None) -> _OwnerTable:
    """This worker's table of owned values."""
    agent = agent or _current("RRef")
    with _tables_lock:
        table = _tables.get(agent)
        if table is None:
            table = _tables[agent] = _OwnerTable()
        return table


def _owner_create(rref_id: tuple[int, int], func: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    table = _table()
    table.count(rref_id, 1)
    slot = table.slot(rref_id)
    try:
        slot.set_result(func(*args, **kwargs))
    except BaseException as error:
        slot.set_exception(error)
        raise


def _owner_value(rref_id: tuple[int, int]) -> Any:
    return _table().slot(rref_id).wait()


def _owner_count(rref_id: tuple[int, int], by: int) -> None:
    _table().count(rref_id, by)


def _owner_method(rref_id: tuple[int, int], method: str, args: tuple, kwargs: dict) -> Any:
    value = _owner_value(rref_id)
    return getattr(type(value), method)(value, *args, **kwargs)


class RRef(Generic[T]):
    """A reference to a value on its owner worker (torch's name). `RRef(value)` makes this worker the owner;
    remote() returns one owned by the worker that ran the function."""

    def __init__(self, value: T, type_hint: type | None = None) -> None:
        agent = _current("RRef")
        self._owner = agent.me
        self._id = (agent.rank, next(_rref_ids))
        table = _table()
        table.count(self._id, 1)
        table.slot(self._id).set_result(value)
        self._created: torch.futures.Future | None = None
        self._agent = agent

    @classmethod
    def _user(cls, owner: WorkerInfo, rref_id: tuple[int, int], created: torch.futures.Future | None) -> RRef[T]:
        rref = cls.__new__(cls)
        rref._owner, rref._id, rref._created = owner, rref_id, created
        rref._agent = _current("RRef")
        return rref

    def owner(self) -> WorkerInfo:
        return self._owner

    def owner_name(self) -> str:
        return self._owner.name

    def is_owner(self) -> bool:
        return self._owner.id == self._agent.rank

    def confirmed_by_owner(self) -> bool:
        return self._created is None or self._created.done()

    def local_value(self) -> T:
        """The value, on its owner only."""
        if not self.is_owner():
            raise RuntimeError(f"RRef.local_value on worker {self._agent.me.name}: the value lives on "
                               f"{self._owner.name}; use to_here()")
        return _owner_value(self._id)

    def to_here(self, timeout: float = UNSET_RPC_TIMEOUT) -> T:
        """A copy of the value, fetched from its owner (the value itself on the owner)."""
        if self.is_owner():
            return _owner_value(self._id)
        return self._agent.call(self._owner, _owner_value, (self._id,), {}, _timeout(self._agent, timeout),
                                "RRef.to_here").wait()

    def _get_future(self) -> torch.futures.Future:
        """Done when the owner has created the value (torch's name)."""
        if self._created is not None:
            return self._created
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(None)
        return done

    def rpc_sync(self, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        """`rref.rpc_sync().method(*args)`: method of the value, run on its owner, result here."""
        return _Proxy(self, "sync", timeout)

    def rpc_async(self, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        return _Proxy(self, "async", timeout)

    def remote(self, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        return _Proxy(self, "remote", timeout)

    def __reduce__(self) -> tuple:
        if self.is_owner():
            _table().count(self._id, 1)
        elif DESTINATION.get() == self._owner.id:
            # going to its owner: the owner counts the copy as it unpickles it, before it reads any later message
            # of ours (a release of this RRef among them), so no fork call is needed
            return _unpickle_at_owner, (self._owner, self._id)
        else:
            self._agent.call(self._owner, _owner_count, (self._id, 1), {}, self._agent.rpc_timeout,
                             "RRef fork").wait()
        return _unpickle_rref, (self._owner, self._id)

    def __del__(self) -> None:
        agent = getattr(self, "_agent", None)
        if agent is None or not agent._running:
            return
        if self.is_owner():
            _table(agent).count(self._id, -1)
        elif self._created is not None and not self._created.done():
            # the owner has not made the value yet: count down once it has, not before (it would count from 0)
            owner, rref_id = self._owner, self._id
            self._created.add_done_callback(lambda _: agent.notify(owner, _owner_count, (rref_id, -1)))
        else:
            agent.notify(self._owner, _owner_count, (self._id, -1))

    def __repr__(self) -> str:
        return f"{'OwnerRRef' if self.is_owner() else 'UserRRef'}(owner={self._owner.name}, id={self._id})"


def _unpickle_at_owner(owner: WorkerInfo, rref_id: tuple[int, int]) -> RRef:
    _table().count(rref_id, 1)
    return RRef._user(owner, rref_id, None)


def _unpickle_rref(owner: WorkerInfo, rref_id: tuple[int, int]) -> RRef:
    return RRef._user(owner, rref_id, None)


class _Proxy:
    """rref.rpc_sync() / rpc_async() / remote(): attribute access names a method of the value's type."""

    def __init__(self, rref: RRef, mode: str, timeout: float) -> None:
        self._rref, self._mode, self._timeout = rref, mode, timeout

    def __getattr__(self, method: str) -> Callable[..., Any]:
        rref, mode, timeout = self._rref, self._mode, self._timeout

        def invoke(*args: Any, **kwargs: Any) -> Any:
            call_args = (rref._id, method, args, kwargs)
            if mode == "remote":
                return remote(rref.owner(), _owner_method, call_args, timeout=timeout)
            future = rpc_async(rref.owner(), _owner_method, call_args, timeout=timeout)
            return future.wait() if mode == "sync" else future

        return invoke
