"""Key/value stores for rendezvous: the Store interface, HashStore (in process) and PrefixStore.

Layer: comm. Values are bytes (str is UTF-8 encoded). `get` and `wait` block until the keys exist or the
store's timeout passes, then raise StoreTimeoutError naming the missing keys.

Every spmd store also serves torch's extended API: `append`, `list_keys`, `barrier` and the queues (`queue_push`,
`queue_pop`, `queue_len`). A queue lives beside the keys, under its own name: it is not a key (`get`, `num_keys`
and `list_keys` don't see it), but `check` and `wait` on its name see it while it holds a value.
"""

from __future__ import annotations

import abc
import collections
import datetime
import threading

from spmd._core.deadline import Deadline, as_seconds
from spmd._core.errors import QueueEmptyError, StoreTimeoutError

DEFAULT_STORE_TIMEOUT = 300.0

Value = bytes | bytearray | str


def to_bytes(value: Value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class Store(abc.ABC):
    """The store protocol every rendezvous uses; all methods are thread-safe."""

    def __init__(self, timeout: float | datetime.timedelta | None = None) -> None:
        self._timeout = as_seconds(timeout, DEFAULT_STORE_TIMEOUT, f"{type(self).__name__}: timeout")

    @property
    def timeout(self) -> float:
        """Seconds a blocking `get`/`wait` waits before raising."""
        return self._timeout

    def set_timeout(self, timeout: float | datetime.timedelta) -> None:
        self._timeout = as_seconds(timeout, DEFAULT_STORE_TIMEOUT, f"{type(self).__name__}.set_timeout: timeout")

    @abc.abstractmethod
    def set(self, key: str, value: Value) -> None:
        """Write `value` under `key`, replacing what was there."""

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """The value of `key`, waiting for it to be set (up to the store timeout)."""

    @abc.abstractmethod
    def add(self, key: str, amount: int) -> int:
        """Atomically add `amount` to the integer at `key` (0 if absent) and return the new value."""

    @abc.abstractmethod
    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        """Set `desired` if the current value is `expected` (or the key is absent and `expected` is empty).

        Returns the value stored afterwards; torch's quirk is kept: an absent key with a non-empty
        `expected` returns `expected` and sets nothing.
        """

    @abc.abstractmethod
    def wait(self, keys: list[str], timeout: float | datetime.timedelta | None = None) -> None:
        """Block until every key in `keys` exists, or raise StoreTimeoutError naming the missing ones."""

    @abc.abstractmethod
    def check(self, keys: list[str]) -> bool:
        """True if every key in `keys` exists now (never blocks)."""

    @abc.abstractmethod
    def delete_key(self, key: str) -> bool:
        """Remove `key`; True if it existed."""

    @abc.abstractmethod
    def num_keys(self) -> int:
        """How many keys the store holds."""

    # torch's extended API: every spmd store serves it; a Store subclass written before it existed still
    # instantiates, and says which call it lacks.
    def append(self, key: str, value: Value) -> None:
        """Append `value` to the bytes at `key` (creating it), in one step no other writer interleaves with."""
        raise self._not_served("append")

    def list_keys(self) -> list[str]:
        """Every key the store holds (queues are not keys)."""
        raise self._not_served("list_keys")

    def queue_push(self, key: str, value: Value) -> None:
        """Put `value` at the back of the queue named `key`."""
        raise self._not_served("queue_push")

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """Take the value at the front of queue `key`; one value goes to one caller. An empty queue makes it wait
        up to the store timeout (StoreTimeoutError), or with `block=False` raise QueueEmptyError at once."""
        raise self._not_served("queue_pop")

    def queue_len(self, key: str) -> int:
        """How many values queue `key` holds (0 for a queue never pushed to)."""
        raise self._not_served("queue_len")

    def has_extended_api(self) -> bool:
        """Whether the store serves append, list_keys and the queues: every spmd store does (torch's FileStore
        has no queues); a Store subclass that serves them says so by overriding this."""
        return False

    def _not_served(self, method: str) -> NotImplementedError:
        return NotImplementedError(f"{type(self).__name__}.{method}: this store does not serve torch's extended "
                                   f"store API (spmd's HashStore, FileStore, TCPStore and PrefixStore do)")

    def barrier(self, key: str, world_size: int, timeout: float | datetime.timedelta | None = None) -> None:
        """Block until `world_size` callers have called barrier with `key` (keys `key`/num_members and
        `key`/last_member, as torch's), or raise StoreTimeoutError after `timeout` (default: the store's)."""
        if world_size < 1:
            raise ValueError(f"{type(self).__name__}.barrier({key}): world_size must be >= 1, got {world_size}")
        if self.add(f"{key}/num_members", 1) == world_size:
            self.set(f"{key}/last_member", b"1")
        self.wait([f"{key}/last_member"], timeout)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(key) for key in keys]

    def multi_set(self, keys: list[str], values: list[Value]) -> None:
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)

    def clone(self) -> Store:
        """Another handle on the same store, usable concurrently from another thread (its own connection)."""
        return self

    def server_host(self) -> str | None:
        """The host of the store's server, as this client reaches it (None for a store without one): the
        transports publish the local address of the route towards it."""
        return None

    def close(self) -> None:
        """Release connections or files; the default has nothing to release."""


def missing_keys_error(store_name: str, missing: list[str], timeout: float) -> StoreTimeoutError:
    return StoreTimeoutError(
        f"{store_name}: timed out after {timeout:.1f}s waiting for key(s) {missing}. Another rank has "
        f"not set them: check that every rank reached the same point, or raise the timeout."
    )


def queue_timeout_error(store_name: str, key: str, timeout: float) -> StoreTimeoutError:
    return StoreTimeoutError(
        f"{store_name}: queue_pop({key}) timed out after {timeout:.1f}s: nothing was pushed to queue {key!r}; "
        f"check that the producing rank runs, or raise the timeout.")


def queue_empty_error(store_name: str, key: str) -> QueueEmptyError:
    return QueueEmptyError(f"{store_name}: queue_pop({key}, block=False): the queue is empty")


class HashStore(Store):
    """An in-process store: a dict behind a condition variable (threads transport, tests)."""

    def __init__(self, timeout: float | datetime.timedelta | None = None) -> None:
        super().__init__(timeout)
        self._data: dict[str, bytes] = {}
        self._queues: dict[str, collections.deque[bytes]] = {}   # only queues that hold a value
        self._changed = threading.Condition()

    def has_extended_api(self) -> bool:
        return True

    def _present(self, key: str) -> bool:
        return key in self._data or key in self._queues

    def set(self, key: str, value: Value) -> None:
        with self._changed:
            self._data[key] = to_bytes(value)
            self._changed.notify_all()

    def get(self, key: str) -> bytes:
        self.wait([key])
        with self._changed:
            return self._data[key]

    def add(self, key: str, amount: int) -> int:
        with self._changed:
            current = self._data.get(key, b"0")
            try:
                value = int(current) + amount
            except ValueError:
                raise ValueError(f"HashStore: add({key}): the value {current[:64]!r} is not an integer") from None
            self._data[key] = str(value).encode()
            self._changed.notify_all()
            return value

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        expected_b, desired_b = to_bytes(expected), to_bytes(desired)
        with self._changed:
            current = self._data.get(key)
            if current is None:
                if expected_b:
                    return expected_b
                self._data[key] = desired_b
            elif current == expected_b:
                self._data[key] = desired_b
            self._changed.notify_all()
            return self._data[key]

    def wait(self, keys: list[str], timeout: float | datetime.timedelta | None = None) -> None:
        deadline = Deadline(as_seconds(timeout, self._timeout, "HashStore.wait: timeout"))
        with self._changed:
            while True:
                missing = [key for key in keys if not self._present(key)]
                if not missing:
                    return
                if deadline.expired():
                    raise missing_keys_error("HashStore", missing, deadline.timeout)
                self._changed.wait(min(deadline.remaining(), threading.TIMEOUT_MAX))   # inf: wait forever

    def check(self, keys: list[str]) -> bool:
        with self._changed:
            return all(self._present(key) for key in keys)

    def delete_key(self, key: str) -> bool:
        with self._changed:
            return self._data.pop(key, None) is not None

    def num_keys(self) -> int:
        with self._changed:
            return len(self._data)

    def append(self, key: str, value: Value) -> None:
        with self._changed:
            self._data[key] = self._data.get(key, b"") + to_bytes(value)
            self._changed.notify_all()

    def list_keys(self) -> list[str]:
        with self._changed:
            return list(self._data)

    def queue_push(self, key: str, value: Value) -> None:
        with self._changed:
            self._queues.setdefault(key, collections.deque()).append(to_bytes(value))
            self._changed.notify_all()

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        deadline = Deadline(self._timeout)
        with self._changed:
            while key not in self._queues:
                if not block:
                    raise queue_empty_error("HashStore", key)
                if deadline.expired():
                    raise queue_timeout_error("HashStore", key, deadline.timeout)
                self._changed.wait(min(deadline.remaining(), threading.TIMEOUT_MAX))
            queue = self._queues[key]
            value = queue.popleft()
            if not queue:
                del self._queues[key]
            return value

    def queue_len(self, key: str) -> int:
        with self._changed:
            return len(self._queues.get(key, ()))


class PrefixStore(Store):
    """A view of another store with `prefix + "/"` put before every key (one namespace per group)."""

    def __init__(self, prefix: str, store: Store) -> None:
        super().__init__(store.timeout)
        self.prefix = prefix
        self.underlying_store = store
        self._owns_underlying = False   # True for a clone, whose underlying store is its own connection

    @property
    def timeout(self) -> float:
        return self.underlying_store.timeout

    def set_timeout(self, timeout: float | datetime.timedelta) -> None:
        self.underlying_store.set_timeout(timeout)

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    def set(self, key: str, value: Value) -> None:
        self.underlying_store.set(self._key(key), value)

    def get(self, key: str) -> bytes:
        return self.underlying_store.get(self._key(key))

    def add(self, key: str, amount: int) -> int:
        return self.underlying_store.add(self._key(key), amount)

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        return self.underlying_store.compare_set(self._key(key), expected, desired)

    def wait(self, keys: list[str], timeout: float | datetime.timedelta | None = None) -> None:
        self.underlying_store.wait([self._key(key) for key in keys], timeout)

    def check(self, keys: list[str]) -> bool:
        return self.underlying_store.check([self._key(key) for key in keys])

    def delete_key(self, key: str) -> bool:
        return self.underlying_store.delete_key(self._key(key))

    def num_keys(self) -> int:
        return self.underlying_store.num_keys()

    def append(self, key: str, value: Value) -> None:
        self.underlying_store.append(self._key(key), value)

    def list_keys(self) -> list[str]:
        """The keys under this prefix, without it."""
        start = f"{self.prefix}/"
        return [key[len(start):] for key in self.underlying_store.list_keys() if key.startswith(start)]

    def queue_push(self, key: str, value: Value) -> None:
        self.underlying_store.queue_push(self._key(key), value)

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        return self.underlying_store.queue_pop(self._key(key), block)

    def queue_len(self, key: str) -> int:
        return self.underlying_store.queue_len(self._key(key))

    def has_extended_api(self) -> bool:
        return self.underlying_store.has_extended_api()

    def server_host(self) -> str | None:
        return self.underlying_store.server_host()

    def clone(self) -> Store:
        clone = PrefixStore(self.prefix, self.underlying_store.clone())
        clone._owns_underlying = clone.underlying_store is not self.underlying_store
        return clone

    def close(self) -> None:
        """Close the underlying store only if this is a clone that opened it; a shared one stays open."""
        if self._owns_underlying:
            self.underlying_store.close()

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self.underlying_store.multi_get([self._key(key) for key in keys])

    def multi_set(self, keys: list[str], values: list[Value]) -> None:
        self.underlying_store.multi_set([self._key(key) for key in keys], values)
