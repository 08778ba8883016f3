"""Always-on diagnostics: call fingerprints, the per-group flight recorder, and stuck-collective reports; and
torch's debug level (DebugLevel), which they do not depend on.

Layer: comm.

Note: how a hang becomes an error
Every operation gets a Fingerprint (op, sequence number, shape, dtype, reduce op, root, call site). The
transport sends it in its own message header, so a peer that called something else is caught at the first
message, whatever the debug level. Every rank also keeps a FlightRecorder: its last few operations per group
and their state. When a collective times out, the waiting rank asks every rank, through the store, for its
recorder (a StatusService thread answers on each rank, even while that rank is busy computing), and the
timeout error lists who never entered the collective, what they last did, and where their rank's thread is
now (its innermost frames: a data loader's wait, a deadlocked lock, a forgotten `if rank == 0:`).
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import enum
import json
import math
import os
import sys
import threading
import time
import weakref
from importlib.util import find_spec
from typing import TYPE_CHECKING, Any

from spmd._core.errors import StoreError
from spmd.comm.store.base import Store

if TYPE_CHECKING:
    import torch

# torch's directory is found, not imported: spmdrun's agent reads ranks' statuses with this module and never
# imports torch (1.3 s of start-up per launch).
_SKIP_DIRS = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),   # spmd/
    os.path.dirname(os.path.abspath(find_spec("torch").origin)),   # torch/
)
_STDLIB_DIR = os.path.dirname(os.path.abspath(threading.__file__))
_STACK_FRAMES = 6


_BASENAMES: dict[str, str] = {}
_DTYPE_NAMES: dict[torch.dtype, str] = {}


def user_call_site() -> str:
    """file:line of the innermost frame outside spmd and torch: the user's line that issued the operation."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIP_DIRS):
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    path = frame.f_code.co_filename
    name = _BASENAMES.get(path)
    if name is None:
        name = _BASENAMES[path] = os.path.basename(path)
    return f"{name}:{frame.f_lineno}"


def where_thread_is(thread_id: int) -> list[str]:
    """Where thread `thread_id` is ("file.py:line in function", innermost first; empty if it has ended): the
    frames down to the user's code (neither spmd's, torch's nor the standard library's), spmd's own left out,
    then the user's calling frame; at most _STACK_FRAMES."""
    frame = sys._current_frames().get(thread_id)
    frames: list[str] = []
    user_frames = 0
    while frame is not None and len(frames) < _STACK_FRAMES and user_frames < 2:
        path = frame.f_code.co_filename
        is_user = not path.startswith((*_SKIP_DIRS, _STDLIB_DIR, "<frozen "))
        if is_user or (user_frames == 0 and not path.startswith(_SKIP_DIRS[0])):
            frames.append(f"{os.path.basename(path)}:{frame.f_lineno} in {frame.f_code.co_name}")
        user_frames += is_user
        frame = frame.f_back
    return frames


def dtype_name(dtype: torch.dtype) -> str:
    """The dtype as fingerprints spell it: "float32" for torch.float32."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


@dataclasses.dataclass(frozen=True, slots=True)
class Fingerprint:
    """What one rank called at one step of a group; ranks must agree on everything but `call_site`."""

    op: str                          # "all_reduce", "broadcast", ...
    seq: int                         # position of this collective in the group's program order (from 1)
    shape: tuple[int, ...] | None    # None where ranks may legally differ (all_to_all)
    dtype: str
    reduce_op: str | None = None
    root: int | None = None          # group rank of the root, for rooted ops
    call_site: str = ""

    def key(self) -> tuple[Any, ...]:
        """What the ranks must agree on. Of the shape only the element count: transports move a tensor flat, and
        torch's backends take an all_reduce of a 0-d tensor on one rank and of a [1] on another (DeepSpeed's
        pipeline engine issues one; torch checks shapes only under TORCH_DISTRIBUTED_DEBUG=DETAIL)."""
        count = None if self.shape is None else math.prod(self.shape)
        return (self.op, self.seq, count, self.dtype, self.reduce_op, self.root)

    def describe(self) -> str:
        parts = [f"{self.op} #{self.seq}"]
        if self.shape is not None:
            parts.append(f"shape={list(self.shape)}")
        if self.dtype:
            parts.append(f"dtype={self.dtype}")
        if self.reduce_op is not None:
            parts.append(f"op={self.reduce_op}")
        if self.root is not None:
            parts.append(f"root={self.root}")
        return " ".join(parts) + f" called at {self.call_site}"

    def encode(self) -> bytes:
        return json.dumps([self.op, self.seq, self.shape, self.dtype, self.reduce_op, self.root,
                           self.call_site]).encode()

    @classmethod
    def decode(cls, data: bytes) -> Fingerprint:
        op, seq, shape, dtype, reduce_op, root, call_site = json.loads(data)
        return cls(op, seq, None if shape is None else tuple(shape), dtype, reduce_op, root, call_site)


def mismatch_message(group_desc: str, mine: Fingerprint, my_rank: int, theirs: Fingerprint,
                     their_rank: int) -> str:
    return (
        f"collective mismatch in {group_desc}: rank {my_rank} called {mine.describe()}, but rank "
        f"{their_rank} called {theirs.describe()}. Every rank of a group must issue the same collectives "
        f"with the same shapes, dtypes, reduce ops and roots, in the same order."
    )


class OpState(enum.Enum):
    ENQUEUED = "enqueued"     # issued by the caller, waiting for earlier operations of the group
    RUNNING = "running"       # its transport exchange is under way
    COMPLETED = "completed"   # finished successfully
    FAILED = "failed"         # finished with an error


class OpRecord:
    """One entry of the flight recorder."""

    __slots__ = ("fingerprint", "finished_at", "started_at", "state")

    def __init__(self, fingerprint: Fingerprint) -> None:
        self.fingerprint = fingerprint
        self.state = OpState.ENQUEUED
        self.started_at = time.time()
        self.finished_at: float | None = None

    def finish(self, state: OpState) -> None:
        self.state = state
        self.finished_at = time.time()

    def as_dict(self) -> dict[str, Any]:
        fp = self.fingerprint
        return {"op": fp.op, "seq": fp.seq, "shape": fp.shape, "dtype": fp.dtype, "call_site": fp.call_site,
                "state": self.state.value, "started_at": self.started_at, "finished_at": self.finished_at}


class FlightRecorder:
    """The last `capacity` operations of each group on this rank (a bounded deque per group)."""

    def __init__(self, capacity: int = 32) -> None:
        self.capacity = capacity
        self._groups: dict[str, collections.deque[OpRecord]] = {}
        self._lock = threading.Lock()

    def record(self, group_name: str, fingerprint: Fingerprint) -> OpRecord:
        record = OpRecord(fingerprint)
        ring = self._groups.get(group_name)
        if ring is None:
            with self._lock:
                ring = self._groups.setdefault(group_name, collections.deque(maxlen=self.capacity))
        ring.append(record)
        return record

    def snapshot(self) -> dict[str, list[dict[str, Any]]]:
        with self._lock:
            groups = list(self._groups.items())
        return {name: [record.as_dict() for record in list(ring)] for name, ring in groups}


_DUMP_GEN = "spmd_debug/dump_gen"


def _dump_key(gen: int) -> str:
    return f"spmd_debug/dump/{gen}"


def _status_key(gen: int, rank: int) -> str:
    return f"spmd_debug/status/{gen}/{rank}"


class StatusService:
    """A daemon thread per rank that answers status requests with this rank's flight recorder and where the
    rank's own thread (the one that started the service: the one that initialized the rank) is.

    It waits on the store in slices of `poll_s`, so a stopped service's thread ends within that time.
    """

    def __init__(self, store: Store, rank: int, recorder: FlightRecorder, poll_s: float = 1.0,
                 owns_store: bool = False) -> None:
        self._store = store
        self._owns_store = owns_store   # a clone with its own connection, closed when the service ends
        self._rank = rank
        self._recorder = recorder
        self._rank_thread = threading.get_ident()
        self._poll_s = poll_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"spmd-status-rank{rank}", daemon=True)
        self._thread.start()
        if owns_store:
            _running_services.add(self)

    def stop(self) -> None:
        """End the service. With a store handle of its own, the handle is closed at once (failing the thread's
        wait) and the thread joined: a daemon thread still inside a store call when the interpreter exits can abort
        the process (torch's store client does), and one that outlives its world has nothing left to answer."""
        self._stopped.set()
        if self._owns_store and self._thread is not threading.current_thread():
            self._store.close()
            self._thread.join(timeout=self._poll_s)

    def _serve(self) -> None:
        try:
            gen = int(self._store.add(_DUMP_GEN, 0)) + 1
            while not self._stopped.is_set():
                try:
                    self._store.wait([_dump_key(gen)], timeout=self._poll_s)
                except TimeoutError:
                    continue
                status = {"rank": self._rank, "time": time.time(), "groups": self._recorder.snapshot(),
                          "stack": where_thread_is(self._rank_thread)}
                self._store.set(_status_key(gen, self._rank), json.dumps(status))
                gen += 1
        except (StoreError, OSError, ValueError):
            return   # the store is gone: the job is ending, nobody can ask any more
        finally:
            if self._owns_store:
                self._store.close()


# Services with a store handle of their own, stopped at interpreter exit when their world was never destroyed (a
# script that ends without destroy_process_group, as most torch scripts do): see StatusService.stop.
_running_services: weakref.WeakSet[StatusService] = weakref.WeakSet()


@atexit.register
def _stop_running_services() -> None:
    for service in list(_running_services):
        service.stop()


def collect_statuses(store: Store, ranks: list[int], wait_s: float = 3.0) -> dict[int, dict[str, Any] | None]:
    """Ask every rank in `ranks` for its flight recorder; None for a rank that did not answer in `wait_s`."""
    gen = int(store.add(_DUMP_GEN, 1))
    store.set(_dump_key(gen), b"1")
    deadline = time.monotonic() + wait_s
    statuses: dict[int, dict[str, Any] | None] = {}
    for rank in ranks:
        try:
            store.wait([_status_key(gen, rank)], timeout=max(0.01, deadline - time.monotonic()))
            statuses[rank] = json.loads(store.get(_status_key(gen, rank)))
        except TimeoutError:
            statuses[rank] = None
    return statuses


def _what_it_did(record: dict[str, Any], now: float) -> str:
    """A flight recorder entry as a status line says it: what a rank is still in, or what it last did."""
    if record["state"] in (OpState.ENQUEUED.value, OpState.RUNNING.value):
        return (f"is still in {record['op']} #{record['seq']} called at {record['call_site']} "
                f"(for {now - record['started_at']:.1f}s)")
    return (f"last {record['state']} {record['op']} #{record['seq']} called at {record['call_site']}, "
            f"{now - (record['finished_at'] or now):.1f}s ago")


def _now_at(status: dict[str, Any]) -> str:
    """Where a status reply says its rank's thread is, as a status line ends with it ("" if it did not say)."""
    return "; now at " + " <- ".join(status["stack"]) if status.get("stack") else ""


def describe_ranks(statuses: dict[int, dict[str, Any] | None]) -> list[str]:
    """One line per rank for a status request (spmdrun's SIGUSR1): on each of its groups what it is in or last
    did, and where its thread is now."""
    now = time.time()
    lines = []
    for rank, status in sorted(statuses.items()):
        if status is None:
            lines.append(f"rank {rank} did not answer (not initialized yet, dead, or stuck outside Python: "
                         f"py-spy dump --pid shows where)")
            continue
        done = [f"on group {name!r} {_what_it_did(records[-1], now)}"
                for name, records in status["groups"].items() if records]
        lines.append(f"rank {rank} " + ("; ".join(done) if done else "has issued no operation yet") + _now_at(status))
    return lines


def describe_stragglers(group_name: str, group_ranks: list[int], mine: Fingerprint,
                        statuses: dict[int, dict[str, Any] | None]) -> tuple[list[int], list[str]]:
    """Which ranks never entered `mine`, and one line per rank saying what it last did, and for those that
    never entered it, where they are now."""
    missing: list[int] = []
    lines: list[str] = []
    now = time.time()
    for rank in group_ranks:
        status = statuses.get(rank)
        if status is None:
            missing.append(rank)
            lines.append(f"rank {rank} did not answer the status request (dead, or stuck outside Python)")
            continue
        records = status["groups"].get(group_name, [])
        last = records[-1] if records else None
        if last is None:
            line = f"rank {rank} has not issued any operation on this group yet"
        else:
            line = f"rank {rank} {_what_it_did(last, now)}"
        if last is None or last["seq"] < mine.seq:
            missing.append(rank)
            line += _now_at(status)
        lines.append(line)
    return missing, lines


# -- torch's debug level ----------------------------------------------------------------------------------------

class DebugLevel(enum.Enum):
    """torch's TORCH_DISTRIBUTED_DEBUG levels. spmd's checks (fingerprints, flight recorder, stuck-collective
    reports, DDP's unused-parameter names) run at every level, what torch turns on with DETAIL included: the
    level is kept for code that reads or sets it."""

    OFF = 0
    INFO = 1
    DETAIL = 2


_DEBUG_ENV = "TORCH_DISTRIBUTED_DEBUG"
_debug_level: list[DebugLevel] = []     # set from the environment at the first get, or by set_debug_level


def get_debug_level() -> DebugLevel:
    """The debug level: set_debug_level's, else TORCH_DISTRIBUTED_DEBUG's (OFF when unset)."""
    if not _debug_level:
        set_debug_level_from_env()
    return _debug_level[0]


def set_debug_level(level: DebugLevel) -> None:
    if not isinstance(level, DebugLevel):
        raise TypeError(f"spmd.set_debug_level: takes a DebugLevel (OFF, INFO, DETAIL), got {level!r}")
    _debug_level[:] = [level]


def set_debug_level_from_env() -> None:
    """The level TORCH_DISTRIBUTED_DEBUG names (OFF, INFO or DETAIL, any case; unset: OFF)."""
    text = os.environ.get(_DEBUG_ENV, "OFF").strip().upper() or "OFF"
    if text not in DebugLevel.__members__:
        raise ValueError(f"spmd: {_DEBUG_ENV}={os.environ[_DEBUG_ENV]!r} is not a debug level; use OFF, INFO or "
                         f"DETAIL")
    set_debug_level(DebugLevel[text])
