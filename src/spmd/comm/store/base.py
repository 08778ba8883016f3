"""Key/value stores for rendezvous: the Store interface, HashStore (in process) and PrefixStore.

Layer: comm. Values are bytes (str is UTF-8 encoded). `get` and `wait` block until the keys exist or the
store's timeout passes, then raise StoreTimeoutError naming the missing keys.
"""

from __future__ import annotations

import abc
import datetime
import threading

from spmd._core.deadline import Deadline, as_seconds
from spmd._core.errors import StoreTimeoutError

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


class HashStore(Store):
    """An in-process store: a dict behind a condition variable (threads transport, tests)."""

    def __init__(self, timeout: float | datetime.timedelta | None = None) -> None:
        super().__init__(timeout)
        self._data: dict[str, bytes] = {}
        self._changed = threading.Condition()

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
                missing = [key for key in keys if key not in self._data]
                if not missing:
                    return
                if deadline.expired():
                    raise missing_keys_error("HashStore", missing, deadline.timeout)
                self._changed.wait(min(deadline.remaining(), threading.TIMEOUT_MAX))   # inf: wait forever

    def check(self, keys: list[str]) -> bool:
        with self._changed:
            return all(key in self._data for key in keys)

    def delete_key(self, key: str) -> bool:
        with self._changed:
            return self._data.pop(key, None) is not None

    def num_keys(self) -> int:
        with self._changed:
            return len(self._data)


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
