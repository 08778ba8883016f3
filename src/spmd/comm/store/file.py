"""FileStore: a store kept in one shared file, for jobs whose ranks share a file system but not a network port.

Layer: comm. The file is an append-only log of records (set key=value, extend a value, delete key, push to a
queue, pop the front of a queue); every instance replays the
log into a dict and reads only what was appended since. Writers hold an exclusive `flock` while they read the
tail and append, readers a shared one, so processes (and clones inside one process) never see a torn record.
A blocking `get`/`wait` polls the file with a short backoff. Each instance joining adds 1 to a user counter and
each closing adds 1 to a done counter; when `world_size` users (and any late joiner) have closed, the last one
deletes the file.
Like torch's, a fresh store holds one key (the user counter), so `num_keys()` starts at 1.

Note: compaction
A log that only grows would take every `add` to a counter (a barrier's, a rendezvous round's) as one more record
for the life of the job. When a writer's append leaves the log over COMPACT_MIN_BYTES and over COMPACT_RATIO
times the size of one record per live key, the writer, still holding the exclusive lock, writes those records
to a new file beside it, appends a "moved" record to the old log and renames the new file over the path. An
instance reading a moved record (it always reads the tail once it holds the lock, and a poll sees the file grow)
opens the file the path names and replays it from the start. Nobody reads the moved record before the rename:
the compactor holds the exclusive lock throughout. A compactor killed before the rename leaves the old log whole
with a moved record in it that readers ignore, since the path still names that file; killed after it, every
reader follows the record. Only the holder of the lock on the file the path names compacts, so nothing is
appended to a file already replaced.
"""

from __future__ import annotations

import contextlib
import datetime
import enum
import fcntl
import os
import struct
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator

from spmd._core.deadline import Deadline, as_seconds
from spmd._core.errors import StoreError
from spmd.comm.store.base import Store, Value, missing_keys_error, queue_empty_error, queue_timeout_error, to_bytes

_RECORD = struct.Struct("!BII")   # kind, key length, value length
_SET, _DELETE, _MOVED, _PUSH, _POP, _APPEND = 1, 2, 3, 4, 5, 6   # _MOVED: the log continues in the file now at
                                                                 # the path (Note: compaction); _POP: take a
                                                                 # queue's front value; _APPEND: extend a value
_USERS_KEY = "spmd_filestore/users"
_DONE_KEY = "spmd_filestore/done"
_POLL_FIRST_S = 0.001
_POLL_MAX_S = 0.02
COMPACT_MIN_BYTES = 1 << 20     # see Note: compaction
COMPACT_RATIO = 4


class _Tail(enum.Enum):
    """What reading a log's tail found."""

    APPLIED = enum.auto()      # complete records, all applied
    INCOMPLETE = enum.auto()   # no complete record (a writer's append is still arriving)
    MOVED = enum.auto()        # a moved record: the log continues in the file that replaced this one


def _record(kind: int, key: bytes, value: bytes = b"") -> bytes:
    return _RECORD.pack(kind, len(key), len(value)) + key + value


class FileStore(Store):
    """A store in the file `file_name`, shared by every process (and thread) that opens the same path.

    `world_size` is how many instances will use the file; when that many have closed it (and no instance that
    joined later is still open), it is deleted (-1: never delete, the caller owns the file). Clones share the
    file but are not counted as users.
    """

    def __init__(self, file_name: str, world_size: int = -1,
                 timeout: float | datetime.timedelta | None = None) -> None:
        super().__init__(timeout)
        if world_size == 0 or world_size < -1:
            raise ValueError(f"FileStore: world_size must be >= 1, or -1 for unknown; got {world_size}")
        self.path = file_name
        self.world_size = world_size
        self._open(counted=True)
        self.add(_USERS_KEY, 1)

    def _open(self, counted: bool) -> None:
        self._counted = counted
        self._closed = False
        self._lock = threading.Lock()      # flock does not exclude threads sharing one descriptor
        self._open_descriptor()

    def _open_descriptor(self) -> None:
        """Open the file the path names now, to be read from its start."""
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        except OSError as error:
            raise StoreError(f"FileStore: cannot open {self.path!r}: {error}") from error
        self._data: dict[bytes, bytes] = {}
        self._queues: dict[bytes, deque[bytes]] = {}   # only queues that hold a value
        self._offset = 0
        self._compact_at = COMPACT_MIN_BYTES
        self._pid = os.getpid()
        self._finalizer = weakref.finalize(self, os.close, self._fd)

    def _replaced(self) -> bool:
        """Whether a compaction renamed a new file over the path (a deleted path is not replaced)."""
        try:
            return os.stat(self.path).st_ino != os.fstat(self._fd).st_ino
        except FileNotFoundError:
            return False

    def _reopen(self) -> None:
        """Move to the file that replaced ours (see Note: compaction)."""
        self._finalizer()
        self._open_descriptor()

    def _own_descriptor(self) -> None:
        """In a forked child, trade the parent's descriptor (whose flock the two would share) for a new one."""
        if os.getpid() != self._pid and not self._closed:
            self._counted = False   # the parent's instance is the counted user
            self._lock = threading.Lock()
            self._reopen()

    def has_extended_api(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"FileStore({self.path!r}, world_size={self.world_size})"

    def clone(self) -> FileStore:
        """Another handle on the same file with its own descriptor (so its own lock); not counted as a user."""
        clone = FileStore.__new__(FileStore)
        Store.__init__(clone, self.timeout)
        clone.path, clone.world_size = self.path, self.world_size
        clone._open(counted=False)
        return clone

    def close(self) -> None:
        """Release the file; it is deleted once `world_size` counted instances, and every one that joined, closed.

        (An instance that joined late, say a rank re-initialising before a slow one closed, keeps it alive.)
        """
        if self._closed:
            return
        self._own_descriptor()
        try:
            if self._counted:
                with self._locked(exclusive=True, may_compact=False):   # it may delete the file
                    done = int(self._data.get(_DONE_KEY.encode(), b"0")) + 1
                    self._append(_record(_SET, _DONE_KEY.encode(), str(done).encode()))
                    users = int(self._data.get(_USERS_KEY.encode(), b"0"))
                    if 0 < self.world_size <= done and done >= users:
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(self.path)
        finally:
            self._closed = True
            self._finalizer()

    # The log.

    @contextlib.contextmanager
    def _locked(self, exclusive: bool, may_compact: bool = True) -> Iterator[None]:
        self._own_descriptor()
        with self._lock:
            if self._closed:
                raise StoreError(f"FileStore {self.path!r}: used after close()")
            self._lock_current(fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            try:
                yield
                if exclusive and may_compact and self._offset >= self._compact_at:
                    self._compact()
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _lock_current(self, mode: int) -> None:
        """flock the log and apply its tail, moving to the file that replaced ours first if it was compacted."""
        while True:
            fcntl.flock(self._fd, mode)
            if self._read_tail() is not _Tail.MOVED:
                return
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            self._reopen()

    def _compact(self) -> None:
        """Rewrite the log as one record per live key if it is much longer (see Note: compaction). The caller
        holds the exclusive lock; afterwards this instance has the new file open, unlocked."""
        live = b"".join([*(_record(_SET, key, value) for key, value in self._data.items()),
                         *(_record(_PUSH, key, value) for key, queue in self._queues.items() for value in queue)])
        self._compact_at = max(COMPACT_MIN_BYTES, COMPACT_RATIO * len(live))
        if self._offset < self._compact_at:
            return
        temporary = f"{self.path}.compact-{os.getpid()}-{threading.get_ident()}"
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                view = memoryview(live)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            self._append(_record(_MOVED, b""))
            os.rename(temporary, self.path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            self._compact_at = 2 * self._offset   # a full disk or a read-only directory: the log stays whole;
            return                                # try again once it has doubled
        data, queues, compact_at = self._data, self._queues, self._compact_at
        self._reopen()             # closing the old file releases its lock
        self._data, self._queues, self._offset, self._compact_at = data, queues, len(live), compact_at

    def _read_tail(self) -> _Tail:
        """Apply the records appended since the last read (the caller holds the file lock)."""
        size = os.fstat(self._fd).st_size
        while self._offset < size:
            tail = self._apply(os.pread(self._fd, size - self._offset, self._offset))
            if tail is not _Tail.APPLIED:
                return tail
        return _Tail.APPLIED

    def _apply(self, tail: bytes) -> _Tail:
        """Apply the complete records at the start of `tail`, up to a moved record that holds."""
        pos, data, queues = 0, self._data, self._queues
        while pos + _RECORD.size <= len(tail):
            kind, key_len, value_len = _RECORD.unpack_from(tail, pos)
            end = pos + _RECORD.size + key_len + value_len
            if end > len(tail):
                break
            key = tail[pos + _RECORD.size:pos + _RECORD.size + key_len]
            if kind == _SET:
                data[key] = tail[pos + _RECORD.size + key_len:end]
            elif kind == _APPEND:
                data[key] = data.get(key, b"") + tail[pos + _RECORD.size + key_len:end]
            elif kind == _DELETE:
                data.pop(key, None)
            elif kind == _PUSH:
                queues.setdefault(key, deque()).append(tail[pos + _RECORD.size + key_len:end])
            elif kind == _POP:
                queue = queues[key]     # a writer appends a pop only for a queue it saw holding a value
                queue.popleft()
                if not queue:
                    del queues[key]
            elif self._replaced():             # _MOVED, and the rename after it happened
                return _Tail.MOVED
            pos = end
        self._offset += pos
        return _Tail.APPLIED if pos > 0 else _Tail.INCOMPLETE

    def _append(self, records: bytes) -> None:
        """Append `records` (the caller holds the exclusive lock and has read the tail) and apply them."""
        view = memoryview(records)
        while view:
            view = view[os.write(self._fd, view):]
        self._read_tail()

    def _snapshot(self, keys: list[bytes], queues: bool = False) -> list[bytes | None]:
        """The current values of `keys` (None where absent; with `queues`, b"" for a queue holding a value),
        reading the file only if it grew."""
        self._own_descriptor()
        with self._lock:
            if self._closed:
                raise StoreError(f"FileStore {self.path!r}: used after close()")
            if os.fstat(self._fd).st_size != self._offset:
                self._lock_current(fcntl.LOCK_SH)          # reads the tail
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            if queues:
                return [self._data.get(key, b"" if key in self._queues else None) for key in keys]
            return [self._data.get(key) for key in keys]

    # The Store API.

    def set(self, key: str, value: Value) -> None:
        with self._locked(exclusive=True):
            self._append(_record(_SET, key.encode(), to_bytes(value)))

    def get(self, key: str) -> bytes:
        return self._wait_for([key.encode()], self.timeout)[0]

    def add(self, key: str, amount: int) -> int:
        key_b = key.encode()
        with self._locked(exclusive=True):
            current = self._data.get(key_b, b"0")
            try:
                value = int(current) + int(amount)
            except ValueError:
                raise ValueError(f"FileStore {self.path!r}: add({key}): the value {current[:64]!r} is not an "
                                 f"integer") from None
            self._append(_record(_SET, key_b, str(value).encode()))
        return value

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        key_b, expected_b, desired_b = key.encode(), to_bytes(expected), to_bytes(desired)
        with self._locked(exclusive=True):
            current = self._data.get(key_b)
            if current is None and expected_b:
                return expected_b     # torch's quirk: absent key, non-empty expected -> expected, nothing set
            if current is None or current == expected_b:
                self._append(_record(_SET, key_b, desired_b))
                return desired_b
            return current

    def wait(self, keys: list[str], timeout: float | datetime.timedelta | None = None) -> None:
        self._wait_for([key.encode() for key in keys], as_seconds(timeout, self.timeout, "FileStore.wait: timeout"),
                       queues=True)

    def _wait_for(self, keys: list[bytes], timeout: float, queues: bool = False) -> list[bytes]:
        """The values of `keys`, polling the file with a growing pause until all exist (with `queues`, a queue
        holding a value counts) or `timeout` passes."""
        deadline = Deadline(timeout)
        delay = _POLL_FIRST_S
        while True:
            found = self._snapshot(keys, queues)
            if all(value is not None for value in found):
                return [value for value in found if value is not None]
            if deadline.expired():
                missing = [key.decode() for key, value in zip(keys, found) if value is None]
                raise missing_keys_error(f"FileStore {self.path!r}", missing, timeout)
            time.sleep(min(delay, deadline.remaining()))
            delay = min(delay * 2, _POLL_MAX_S)

    def check(self, keys: list[str]) -> bool:
        return all(value is not None for value in self._snapshot([key.encode() for key in keys], queues=True))

    def delete_key(self, key: str) -> bool:
        key_b = key.encode()
        with self._locked(exclusive=True):
            if key_b not in self._data:
                return False
            self._append(_record(_DELETE, key_b))
            return True

    def num_keys(self) -> int:
        with self._locked(exclusive=False):
            return len(self._data)

    def append(self, key: str, value: Value) -> None:
        with self._locked(exclusive=True):
            self._append(_record(_APPEND, key.encode(), to_bytes(value)))

    def list_keys(self) -> list[str]:
        with self._locked(exclusive=False):
            return [key.decode() for key in self._data]

    def queue_push(self, key: str, value: Value) -> None:
        with self._locked(exclusive=True):
            self._append(_record(_PUSH, key.encode(), to_bytes(value)))

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        key_b = key.encode()
        deadline = Deadline(self.timeout)
        delay = _POLL_FIRST_S
        while True:
            if self._snapshot([key_b], queues=True)[0] is not None:   # seen without the exclusive lock first
                with self._locked(exclusive=True):
                    queue = self._queues.get(key_b)
                    if queue:                                     # not taken meanwhile by another process
                        value = queue[0]
                        self._append(_record(_POP, key_b))
                        return value
            if not block:
                raise queue_empty_error(f"FileStore {self.path!r}", key)
            if deadline.expired():
                raise queue_timeout_error(f"FileStore {self.path!r}", key, deadline.timeout)
            time.sleep(min(delay, deadline.remaining()))
            delay = min(delay * 2, _POLL_MAX_S)

    def queue_len(self, key: str) -> int:
        with self._locked(exclusive=False):
            return len(self._queues.get(key.encode(), ()))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._wait_for([key.encode() for key in keys], self.timeout)

    def multi_set(self, keys: list[str], values: list[Value]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"FileStore.multi_set: {len(keys)} keys but {len(values)} values")
        records = b"".join(_record(_SET, key.encode(), to_bytes(value)) for key, value in zip(keys, values))
        with self._locked(exclusive=True):
            self._append(records)
