"""Stores: the shared Store contract on every store, then TCPStore's and FileStore's own promises.

The contract tests run on HashStore, PrefixStore (over a TCPStore), TCPStore and FileStore through one fixture;
the TCPStore tests cover the server (parked waits, hundreds of clients, strangers, tokens, ports, a dying
server) and the process tests check that real processes sharing a store lose no increment.
"""

from __future__ import annotations

import datetime
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from spmd._core.errors import QueueEmptyError, StoreError, StoreTimeoutError
from spmd.comm.store import file as file_store
from spmd.comm.store import tcp_server as tcp_store_server
from spmd.comm.store import tcp_wire as wire
from spmd.comm.store.base import HashStore, PrefixStore, Store
from spmd.comm.store.file import FileStore
from spmd.comm.store.tcp import TCPStore

STORE_KINDS = ["hash", "prefix", "tcp", "file"]


def _until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait for a condition another thread or process brings about (a poll on state, not a guess at timing)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.001)


def _in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, list[BaseException]]:
    """Start `fn` on a thread; the list receives what it raises."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, errors


def _master(timeout: float = 10.0, **kwargs: object) -> TCPStore:
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout, **kwargs)


def _parked(master: TCPStore, key: str) -> Callable[[], bool]:
    """True once the master's server holds a parked get/wait on `key` (the client is blocked in it)."""
    return lambda: key.encode() in master._server._watchers


@pytest.fixture(autouse=True)
def _no_env_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPMD_STORE_TOKEN", raising=False)


@pytest.fixture(params=STORE_KINDS)
def store(request: pytest.FixtureRequest, tmp_path: os.PathLike[str]) -> Iterator[Store]:
    opened: list[Store] = []
    if request.param == "hash":
        opened.append(HashStore(timeout=10))
    elif request.param == "prefix":
        master = _master()
        opened += [master, PrefixStore("job", master)]
    elif request.param == "tcp":
        master = _master()
        opened += [master, TCPStore("127.0.0.1", master.port, timeout=10)]
    else:
        opened.append(FileStore(os.path.join(tmp_path, "store"), timeout=10))
    try:
        yield opened[-1]
    finally:
        for each in reversed(opened):
            each.close()


# The contract every store keeps.

def test_set_get_overwrite_and_binary_values(store: Store) -> None:
    store.set("k", "text")
    assert store.get("k") == b"text"
    store.set("k", b"\x00\xffbinary")
    assert store.get("k") == b"\x00\xffbinary"
    store.set("empty", b"")
    assert store.get("empty") == b""
    big = bytes(range(256)) * 4096   # 1 MiB, every byte value
    store.set("big", bytearray(big))
    assert store.get("big") == big


def test_add_counts_and_rejects_non_integers(store: Store) -> None:
    assert store.add("n", 5) == 5
    assert store.add("n", -7) == -2
    assert store.add("n", 0) == -2
    assert store.get("n") == b"-2"
    store.set("word", "abc")
    with pytest.raises(ValueError, match="not an integer"):
        store.add("word", 1)
    assert store.get("word") == b"abc"


def test_compare_set_keeps_torch_quirks(store: Store) -> None:
    # Absent key and non-empty expected: returns expected, sets nothing.
    assert store.compare_set("k", "old", "new") == b"old"
    assert not store.check(["k"])
    # Absent key and empty expected: sets desired.
    assert store.compare_set("k", "", "first") == b"first"
    assert store.get("k") == b"first"
    # Present and matching: swaps; present and not matching: returns the current value untouched.
    assert store.compare_set("k", "first", "second") == b"second"
    assert store.compare_set("k", "first", "third") == b"second"
    assert store.get("k") == b"second"


def test_wait_check_and_blocking_get_answered_when_set(store: Store) -> None:
    assert not store.check(["a", "b"])
    other = store.clone()
    try:
        results: list[bytes] = []
        reader = threading.Thread(target=lambda: results.append(other.get("b")))
        reader.start()
        store.set("a", "1")
        assert store.check(["a"]) and not store.check(["a", "b"])
        store.set("b", "2")
        reader.join(timeout=10)
        assert results == [b"2"]
        store.wait(["a", "b"], timeout=datetime.timedelta(seconds=1))
        assert store.check(["a", "b"])
    finally:
        other.close()


def test_get_of_missing_key_times_out_naming_it(store: Store) -> None:
    store.set_timeout(0.2)
    assert store.timeout == pytest.approx(0.2)
    start = time.monotonic()
    with pytest.raises(StoreTimeoutError, match="never/set/key"):
        store.get("never/set/key")
    assert 0.15 <= time.monotonic() - start < 5
    store.set("present", "x")
    with pytest.raises(StoreTimeoutError) as caught:
        store.wait(["present", "absent"], timeout=0.05)
    assert "absent" in str(caught.value) and "present" not in str(caught.value)
    assert isinstance(caught.value, TimeoutError)


def test_delete_key_and_num_keys(store: Store) -> None:
    base = store.num_keys()
    store.set("x", "1")
    store.add("y", 1)
    assert store.num_keys() == base + 2
    assert store.delete_key("x") is True
    assert store.delete_key("x") is False
    assert not store.check(["x"])
    assert store.num_keys() == base + 1
    store.set("x", "again")
    assert store.get("x") == b"again"


def test_multi_get_and_multi_set(store: Store) -> None:
    store.multi_set(["a", "b", "c"], ["1", b"2", "3"])
    assert store.multi_get(["c", "a", "b"]) == [b"3", b"1", b"2"]
    with pytest.raises(ValueError):
        store.multi_set(["a", "b"], ["only one"])
    store.set_timeout(0.1)
    with pytest.raises(StoreTimeoutError, match="missing"):
        store.multi_get(["a", "missing"])


def test_concurrent_adds_from_threads_lose_nothing(store: Store) -> None:
    threads, per_thread = 8, 100
    handles = [store.clone() for _ in range(threads)]

    def bump(handle: Store) -> None:
        for _ in range(per_thread):
            handle.add("counter", 1)

    workers = [threading.Thread(target=bump, args=(handle,)) for handle in handles]
    try:
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=30)
        assert store.get("counter") == str(threads * per_thread).encode()
    finally:
        for handle in handles:
            if handle is not store:
                handle.close()


def test_append_extends_or_creates_and_wakes_a_blocked_get(store: Store) -> None:
    base = set(store.list_keys())
    store.append("log", "a")
    store.append("log", b"\x00b")
    assert store.get("log") == b"a\x00b"
    store.set("plain", "x")
    assert set(store.list_keys()) - base == {"log", "plain"}
    other = store.clone()
    try:
        results: list[bytes] = []
        reader = threading.Thread(target=lambda: results.append(other.get("fresh")))
        reader.start()
        store.append("fresh", "first")
        reader.join(timeout=10)
        assert results == [b"first"]
    finally:
        other.close()


def test_queues_are_fifo_beside_the_keys(store: Store) -> None:
    assert store.has_extended_api()
    keys = store.num_keys()
    assert store.queue_len("q") == 0 and not store.check(["q"])
    for value in ("1", b"2", "3"):
        store.queue_push("q", value)
    assert store.queue_len("q") == 3
    assert store.check(["q"])                       # check and wait see a queue holding a value
    store.wait(["q"], timeout=1)
    assert store.num_keys() == keys and "q" not in store.list_keys()   # a queue is not a key
    assert [store.queue_pop("q"), store.queue_pop("q", block=False), store.queue_pop("q")] == [b"1", b"2", b"3"]
    assert store.queue_len("q") == 0 and not store.check(["q"])
    with pytest.raises(QueueEmptyError, match="queue_pop"):
        store.queue_pop("q", block=False)
    store.set_timeout(0.1)
    with pytest.raises(StoreTimeoutError, match=r"nothing was pushed to queue '(job/)?q'"):
        store.queue_pop("q")


def test_each_pushed_value_goes_to_one_blocked_popper(store: Store) -> None:
    handles = [store.clone() for _ in range(3)]
    popped: list[bytes] = []
    threads = [threading.Thread(target=lambda handle=handle: popped.append(handle.queue_pop("jobs")))
               for handle in handles]
    try:
        for thread in threads:
            thread.start()
        for i in range(3):
            store.queue_push("jobs", f"job{i}")
        for thread in threads:
            thread.join(timeout=10)
        assert sorted(popped) == [b"job0", b"job1", b"job2"]
        assert store.queue_len("jobs") == 0
    finally:
        for handle in handles:
            if handle is not store:
                handle.close()


def test_barrier_releases_when_world_size_callers_arrived(store: Store) -> None:
    handles = [store.clone() for _ in range(3)]
    threads_errors = [_in_thread(lambda handle=handle: handle.barrier("step", 3, timeout=10)) for handle in handles]
    for thread, errors in threads_errors:
        thread.join(timeout=15)
        assert not thread.is_alive() and not errors
    with pytest.raises(StoreTimeoutError, match="lonely/last_member"):
        store.barrier("lonely", 2, timeout=0.1)
    with pytest.raises(ValueError, match="world_size"):
        store.barrier("bad", 0)
    for handle in handles:
        if handle is not store:
            handle.close()


def test_same_results_as_torch_store(store: Store) -> None:
    import torch.distributed as torch_dist

    script: list[tuple[str, tuple[object, ...]]] = [
        ("compare_set", ("k", "old", "new")), ("check", (["k"],)), ("compare_set", ("k", "", "first")),
        ("compare_set", ("k", "first", "second")), ("compare_set", ("k", "first", "third")), ("get", ("k",)),
        ("add", ("n", 5)), ("add", ("n", -7)), ("get", ("n",)), ("set", ("s", "text")), ("set", ("b", b"\x00\x01")),
        ("multi_get", (["s", "b", "n"],)), ("check", (["s", "n"],)), ("check", (["s", "zz"],)),
        ("delete_key", ("zz",)), ("delete_key", ("s",)), ("check", (["s"],)), ("num_keys", ()),
        ("multi_set", (["x", "y"], ["1", "2"])), ("num_keys", ()), ("add", ("x", 10)), ("multi_get", (["y", "x"],)),
        ("append", ("x", "!")), ("append", ("new", "a")), ("get", ("x",)), ("get", ("new",)), ("queue_len", ("q",)),
        ("queue_push", ("q", "1")), ("queue_push", ("q", b"\x002")), ("queue_len", ("q",)), ("check", (["q"],)),
        ("num_keys", ()), ("queue_pop", ("q",)), ("queue_pop", ("q", False)), ("check", (["q", "x"],)),
        ("queue_len", ("q",)), ("has_extended_api", ()),
    ]
    oracle = torch_dist.HashStore()
    base = store.num_keys()
    for name, args in script:
        ours, theirs = getattr(store, name)(*args), getattr(oracle, name)(*args)
        if name == "num_keys":
            ours -= base   # TCPStore and FileStore hold one internal key, as torch's do
        assert ours == theirs, f"{name}{args}: spmd {ours!r}, torch {theirs!r}"
    internal = {"spmd_store/joined", "spmd_filestore/users"}
    assert sorted(set(store.list_keys()) - internal) == sorted(oracle.list_keys())
    with pytest.raises(QueueEmptyError):
        store.queue_pop("q", False)
    with pytest.raises(torch_dist.QueueEmptyError):
        oracle.queue_pop("q", False)


def test_prefix_store_namespaces_keys() -> None:
    base = HashStore()
    job = PrefixStore("job", base)
    job.set("k", "v")
    assert base.get("job/k") == b"v"
    assert not base.check(["k"])
    nested = PrefixStore("group", job)
    nested.add("n", 2)
    assert base.get("job/group/n") == b"2"
    assert nested.clone().get("n") == b"2"


# TCPStore.

def test_tcp_port_zero_and_attributes() -> None:
    master = _master(timeout=datetime.timedelta(seconds=7))
    try:
        assert master.port > 0 and master.is_master and master.host == "127.0.0.1"
        assert master.timeout == 7.0 and master.world_size is None
        client = TCPStore("127.0.0.1", master.port, world_size=2)
        assert client.port == master.port and not client.is_master and client.timeout == 300
        client.close()
    finally:
        master.close()


@pytest.mark.skipif(not socket.has_dualstack_ipv6(), reason="this host has no dual-stack IPv6")
def test_tcp_master_serves_ipv4_and_ipv6_clients() -> None:
    master = _master()
    try:
        over_v6 = TCPStore("::1", master.port, timeout=5)
        over_v6.set("k", "v6")
        over_v4 = TCPStore("127.0.0.1", master.port, timeout=5)
        assert over_v4.get("k") == b"v6"
        over_v6.close()
        over_v4.close()
    finally:
        master.close()


def test_tcp_hundreds_of_clients_all_parked_then_released() -> None:
    master = _master(timeout=30)
    clients = [master.clone() for _ in range(200)]
    got: list[bytes] = []
    lock = threading.Lock()

    def blocked_get(client: TCPStore) -> None:
        value = client.get("go")
        with lock:
            got.append(value)

    threads = [threading.Thread(target=blocked_get, args=(client,)) for client in clients]
    try:
        for thread in threads:
            thread.start()
        _until(lambda: len(master._server._watchers.get(b"go", ())) == len(clients), timeout=20)
        # 200 clients are parked on the server; others are still served at once.
        start = time.monotonic()
        master.set("other", "x")
        assert master.get("other") == b"x"
        assert time.monotonic() - start < 1.0
        master.set("go", "now")
        for thread in threads:
            thread.join(timeout=20)
        assert got == [b"now"] * len(clients)
    finally:
        for client in clients:
            client.close()
        master.close()


def test_tcp_parked_wait_needs_every_key_present_at_once() -> None:
    master = _master()
    client = TCPStore("127.0.0.1", master.port, timeout=10)
    waiter, errors = _in_thread(lambda: client.wait(["a", "b"]))
    try:
        _until(_parked(master, "b"))
        master.set("a", "1")
        master.delete_key("a")   # seen, then gone again before "b" arrives
        master.set("b", "1")
        _until(_parked(master, "a"))   # the server parked the wait again, now on "a" only
        assert waiter.is_alive()
        master.set("a", "2")
        waiter.join(timeout=10)
        assert not waiter.is_alive() and not errors
        assert not master._server._watchers
    finally:
        client.close()
        master.close()


def test_tcp_parked_poppers_get_one_value_each_and_the_rest_stay_parked() -> None:
    master = _master()
    clients = [TCPStore("127.0.0.1", master.port, timeout=10) for _ in range(2)]
    popped: list[bytes] = []
    threads = [threading.Thread(target=lambda client=client: popped.append(client.queue_pop("jobs")))
               for client in clients]
    try:
        for thread in threads:
            thread.start()
        _until(lambda: len(master._server._watchers.get(b"jobs", ())) == 2)
        master.queue_push("jobs", "a")
        _until(lambda: len(popped) == 1)
        assert master.queue_len("jobs") == 0
        assert len(master._server._watchers.get(b"jobs", ())) == 1   # the other popper still waits
        master.set("jobs", "a key of the same name wakes no popper")
        master.queue_push("jobs", "b")
        for thread in threads:
            thread.join(timeout=10)
        assert sorted(popped) == [b"a", b"b"]
    finally:
        for client in clients:
            client.close()
        master.close()


def test_tcp_wait_for_workers() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    made: list[TCPStore] = []
    errors: list[BaseException] = []

    def start_master() -> None:
        try:
            made.append(TCPStore("127.0.0.1", port, world_size=3, is_master=True, timeout=20))
        except BaseException as error:
            errors.append(error)

    # Workers start before the master: their connection set-up retries until it is up.
    workers = [threading.Thread(target=lambda: made.append(TCPStore("127.0.0.1", port, timeout=20)))
               for _ in range(2)]
    for worker in workers:
        worker.start()
    master_thread = threading.Thread(target=start_master)
    master_thread.start()
    for thread in [*workers, master_thread]:
        thread.join(timeout=30)
    try:
        assert not errors and len(made) == 3
        master = next(store for store in made if store.is_master)
        assert master.get("spmd_store/joined") == b"3"
    finally:
        for each in sorted(made, key=lambda store: store.is_master):
            each.close()


def test_tcp_wait_for_workers_times_out_with_a_count() -> None:
    with pytest.raises(StoreError, match="only 1 of 2 clients joined"):
        TCPStore("127.0.0.1", 0, world_size=2, is_master=True, timeout=0.2)


def test_tcp_port_in_use_is_a_clear_error() -> None:
    master = _master()
    try:
        with pytest.raises(StoreError, match=f"port {master.port} on 127.0.0.1 is already in use.*MASTER_PORT"):
            TCPStore("127.0.0.1", master.port, is_master=True, wait_for_workers=False)
        assert master.add("still-serving", 1) == 1
    finally:
        master.close()


def test_tcp_client_without_server_fails_naming_the_address() -> None:
    with socket.socket() as held:     # bound, never listening: connections are refused and no one else takes it
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(StoreError, match=f"could not connect to the store server at 127.0.0.1:{port} within"):
            TCPStore("127.0.0.1", port, timeout=0.3)
    assert 0.25 <= time.monotonic() - start < 5


def test_tcp_bad_arguments() -> None:
    with pytest.raises(ValueError, match="port 0"):
        TCPStore("127.0.0.1", 0)
    with pytest.raises(ValueError, match="world_size"):
        TCPStore("127.0.0.1", 0, world_size=0, is_master=True)


def test_tcp_token_refuses_wrong_and_missing_accepts_right(monkeypatch: pytest.MonkeyPatch) -> None:
    master = _master(token="s3cret")
    try:
        start = time.monotonic()
        with pytest.raises(StoreError, match="refused this client: wrong token"):
            TCPStore("127.0.0.1", master.port, timeout=10, token="guess")
        with pytest.raises(StoreError, match="refused this client: no token"):
            TCPStore("127.0.0.1", master.port, timeout=10)
        assert time.monotonic() - start < 5   # refused at once, not retried until the timeout
        right = TCPStore("127.0.0.1", master.port, timeout=10, token="s3cret")
        right.set("k", "v")
        monkeypatch.setenv("SPMD_STORE_TOKEN", "s3cret")
        from_env = TCPStore("127.0.0.1", master.port, timeout=10)
        assert from_env.get("k") == b"v"
        assert from_env.clone().get("k") == b"v"
        right.close()
        from_env.close()
    finally:
        master.close()


def _raw_connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    return sock


def test_tcp_server_drops_strangers_before_reading_their_requests() -> None:
    master = _master(token="s3cret")
    try:
        # A SET before any HELLO: dropped, nothing written.
        with _raw_connect(master.port) as stranger:
            key, value = b"evil", b"x"
            body = struct.pack("!I", len(key)) + key + struct.pack("!I", len(value)) + value
            stranger.sendall(struct.pack("!IB", len(body), 2) + body)
            assert stranger.recv(100) == b""
        # A huge frame announced before HELLO: dropped without waiting for its body.
        with _raw_connect(master.port) as stranger:
            stranger.sendall(struct.pack("!IB", 1 << 30, 1))
            assert stranger.recv(100) == b""
        # Plain garbage (an HTTP request): dropped.
        with _raw_connect(master.port) as stranger:
            stranger.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert stranger.recv(100) == b""
        assert not master.check(["evil"])
        assert master.add("served", 1) == 1
    finally:
        master.close()


def test_tcp_server_drops_silent_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tcp_store_server, "_HELLO_TIMEOUT_S", 0.2)
    master = _master()
    try:
        start = time.monotonic()          # before connecting: the server's HELLO deadline starts at its accept
        with _raw_connect(master.port) as silent:
            assert silent.recv(100) == b""   # dropped without ever having said HELLO
            assert 0.1 < time.monotonic() - start < 5
        assert master.add("served", 1) == 1   # its own connection said HELLO at once and stays
    finally:
        master.close()


@pytest.mark.parametrize("blocked_in", ["get", "queue_pop"])
def test_tcp_client_blocked_in_get_fails_when_master_closes(blocked_in: str) -> None:
    master = _master(timeout=60)
    client = TCPStore("127.0.0.1", master.port, timeout=60)
    reader, errors = _in_thread(lambda: getattr(client, blocked_in)("never"))
    try:
        _until(_parked(master, "never"))
        start = time.monotonic()
        master.close()
        reader.join(timeout=10)
        assert time.monotonic() - start < 5
        assert len(errors) == 1 and type(errors[0]) is StoreError
        assert "lost the connection" in str(errors[0]) and f"127.0.0.1:{master.port}" in str(errors[0])
        with pytest.raises(StoreError, match="closed store"):
            client.set("k", "v")
        assert not master._server._thread.is_alive()
    finally:
        client.close()
        master.close()


def test_tcp_close_interrupts_own_blocked_call_and_clone_close_keeps_server() -> None:
    master = _master(timeout=60)
    clone = master.clone()
    reader, errors = _in_thread(lambda: clone.wait(["never"]))
    try:
        _until(_parked(master, "never"))
        clone.close()
        reader.join(timeout=10)
        assert len(errors) == 1 and type(errors[0]) is StoreError and "close() was called" in str(errors[0])
        assert master.add("alive", 1) == 1   # the clone's close left the server up
        assert not master._server._watchers   # and the server forgot the dropped client's wait
    finally:
        master.close()


# Child processes import the store modules without running spmd/__init__, which imports torch (about 3 s per
# process on this machine); the stores themselves need only the standard library.
_LIGHT_IMPORT = textwrap.dedent("""
    import importlib.util, sys, types
    _spmd = types.ModuleType("spmd")
    _spmd.__path__ = list(importlib.util.find_spec("spmd").submodule_search_locations)
    sys.modules["spmd"] = _spmd
""")

_MASTER_SCRIPT = _LIGHT_IMPORT + textwrap.dedent("""
    import os, signal, sys, time
    from spmd.comm.store.tcp import TCPStore
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=60)
    print(store.port, flush=True)
    while b"blocked" not in store._server._watchers:   # until the test's client is parked in get()
        time.sleep(0.002)
    os.kill(os.getpid(), signal.SIGKILL)
""")

_WORKER_SCRIPT = _LIGHT_IMPORT + textwrap.dedent("""
    import sys
    from spmd.comm.store import file as file_store
    from spmd.comm.store.file import FileStore
    from spmd.comm.store.tcp import TCPStore
    file_store.COMPACT_MIN_BYTES = 4096
    port, path, count, name = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
    tcp, file = TCPStore("127.0.0.1", port, timeout=60), FileStore(path, timeout=60)
    tcp.set("ready/" + name, "1")
    tcp.get("go")   # every worker starts adding at once, so their adds interleave
    for _ in range(count):
        tcp.add("counter", 1)
        file.add("counter", 1)
    for _ in range(count // 10):   # each value of the queues goes to one worker
        tcp.append("popped", tcp.queue_pop("jobs") + b",")
        file.append("popped", file.queue_pop("jobs") + b",")
    tcp.close()
    file.close()
""")


def _python(script: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _stop(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        proc.stdout.close()   # type: ignore[union-attr]
        proc.stderr.close()   # type: ignore[union-attr]


def test_processes_adding_to_tcp_and_file_stores_lose_nothing(tmp_path: os.PathLike[str],
                                                              small_compactions: None) -> None:
    """Also across the FileStore's compactions (the workers compact from 4 KiB too: about 36 KiB are added), and
    no value of a queue goes to two workers or none."""
    master = _master(timeout=60)
    path = os.path.join(tmp_path, "store")
    checker = FileStore(path, timeout=60)
    jobs = [f"job{i}" for i in range(4 * 30)]
    for job in jobs:
        master.queue_push("jobs", job)
        checker.queue_push("jobs", job)
    procs = [_python(_WORKER_SCRIPT, str(master.port), path, "300", str(i)) for i in range(4)]
    try:
        master.wait([f"ready/{i}" for i in range(4)])
        master.set("go", "1")
        for proc in procs:
            _, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err
        assert master.get("counter") == b"1200"
        assert checker.get("counter") == b"1200"
        for store in (master, checker):
            assert sorted(store.get("popped").decode().split(",")[:-1]) == sorted(jobs)
            assert store.queue_len("jobs") == 0
        assert os.path.getsize(path) < 3 * 4096
    finally:
        _stop(procs)
        checker.close()
        master.close()


_SETTER_SCRIPT = textwrap.dedent("""
    import os, sys
    from spmd.comm.store.tcp import TCPStore
    store = TCPStore("127.0.0.1", int(sys.argv[1]), timeout=60)
    for i in range(2000):
        store.set(f"k/{i}", str(i))
    store.multi_set(["last/a", "last/b"], ["a", "b"])
    os._exit(0)   # no close(), no finalizer: what the kernel sent before the exit must still be applied
""")


def test_unanswered_sets_are_applied_in_order_even_if_the_process_exits_at_once() -> None:
    master = _master(timeout=60)
    proc = _python(_SETTER_SCRIPT, str(master.port))
    try:
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert master.multi_get(["last/a", "last/b"]) == [b"a", b"b"]
        assert all(master.get(f"k/{i}") == str(i).encode() for i in range(2000))
    finally:
        _stop([proc])
        master.close()


def test_unanswered_set_is_seen_by_its_own_next_call_and_its_failure_reported_by_it() -> None:
    master = _master()
    client = TCPStore("127.0.0.1", master.port, timeout=10)
    try:
        for i in range(100):
            client.set("k", str(i))
            assert client.compare_set("k", str(i), "seen") == b"seen"   # the set before it was applied first

        def broken(conn: object, fields: list[bytes]) -> None:
            raise RuntimeError("injected")

        master._server._handlers[wire.SET] = broken
        client.set("lost", "v")   # returns: the failure comes back later
        with pytest.raises(StoreError, match=r"an earlier request .* set failed: server error: RuntimeError\('injected'"
                                             r"\) \(reported by add\(n\), which was served\)"):
            client.add("n", 1)
        assert client.add("n", 1) == 2   # the connection stays usable and in step
        assert not client.check(["lost"])
    finally:
        client.close()
        master.close()


def test_client_of_killed_master_process_fails_not_hangs() -> None:
    proc = _python(_MASTER_SCRIPT)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "the master process did not start"
        port = int(proc.stdout.readline())   # type: ignore[union-attr]
        client = TCPStore("127.0.0.1", port, timeout=60)
        start = time.monotonic()
        with pytest.raises(StoreError, match=f"lost the connection to the store server at 127.0.0.1:{port}"):
            client.get("blocked")
        assert time.monotonic() - start < 10
        assert proc.wait(timeout=10) == -signal.SIGKILL
        client.close()
    finally:
        _stop([proc])


# FileStore.

def test_file_store_deleted_when_world_size_users_closed(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(tmp_path, "rendezvous")
    first, second = FileStore(path, world_size=2), FileStore(path, world_size=2)
    clone = first.clone()
    first.set("k", "v")
    assert second.get("k") == b"v" and clone.get("k") == b"v"
    assert first.get("spmd_filestore/users") == b"2"   # the clone is not a user
    clone.close()
    first.close()
    assert os.path.exists(path)
    with pytest.raises(StoreError, match="after close"):
        first.get("k")
    second.close()
    assert not os.path.exists(path)
    second.close()   # closing twice is harmless


def test_file_store_kept_while_a_late_joiner_uses_it(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(tmp_path, "rendezvous")
    first, second = FileStore(path, world_size=2), FileStore(path, world_size=2)
    first.close()
    again = FileStore(path, world_size=2)   # re-joins before `second` closed
    second.close()
    assert os.path.exists(path)
    again.set("k", "v")
    again.close()
    assert not os.path.exists(path)


def test_file_store_kept_when_world_size_unknown(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(tmp_path, "kept")
    store = FileStore(path)
    store.set("k", "v")
    store.close()
    reopened = FileStore(path, timeout=1)
    assert reopened.get("k") == b"v"
    reopened.close()


@pytest.fixture
def small_compactions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compact FileStore logs from 4 KiB (see file.py, Note: compaction)."""
    monkeypatch.setattr(file_store, "COMPACT_MIN_BYTES", 4096)


def test_a_file_store_log_is_compacted_and_every_instance_follows(tmp_path: os.PathLike[str],
                                                                  small_compactions: None) -> None:
    path = os.path.join(tmp_path, "store")
    first, second = FileStore(path, world_size=2, timeout=5), FileStore(path, world_size=2, timeout=5)
    clone = second.clone()
    first.set("gone", "x")
    first.delete_key("gone")
    for value in ("q1", "q2", "q3"):
        first.queue_push("q", value)
    assert second.queue_pop("q") == b"q1"
    largest = 0
    for i in range(3000):                       # about 90 KiB of records without compaction
        (first if i % 2 else second).add("counter", 1)
        if i % 100 == 0:
            clone.set(f"key/{i}", str(i))
        largest = max(largest, os.path.getsize(path))
    assert largest < 3 * 4096, largest
    for store in (first, second, clone):
        assert store.get("counter") == b"3000"
        assert store.get("key/2900") == b"2900" and not store.check(["gone"])
        assert store.num_keys() == 1 + 1 + 30   # users, counter, the keys ("gone" stays deleted)
        assert store.queue_len("q") == 2
    assert [clone.queue_pop("q"), first.queue_pop("q", block=False)] == [b"q2", b"q3"]   # in order, once each
    assert second.queue_len("q") == 0
    assert os.listdir(tmp_path) == ["store"]   # no temporary file left beside it
    clone.close()
    first.close()
    second.close()
    assert not os.path.exists(path)             # the users' count survived the compactions


def test_a_compaction_that_fails_leaves_the_log_whole(tmp_path: os.PathLike[str], small_compactions: None,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    attempts = []

    def refuse(source: str, target: str) -> None:
        attempts.append(source)
        raise OSError(28, "No space left on device")

    path = os.path.join(tmp_path, "store")
    store = FileStore(path, timeout=5)
    monkeypatch.setattr(file_store.os, "rename", refuse)
    for _ in range(500):
        store.add("counter", 1)
    assert os.path.getsize(path) > 4096         # not compacted
    assert 1 <= len(attempts) <= 3, attempts    # tried again only once the log doubled
    assert os.listdir(tmp_path) == ["store"]
    reader = FileStore(path, timeout=5)
    assert reader.get("counter") == b"500"
    reader.close()
    store.close()


def test_file_store_bad_arguments(tmp_path: os.PathLike[str]) -> None:
    with pytest.raises(ValueError, match="world_size"):
        FileStore(os.path.join(tmp_path, "x"), world_size=0)
    with pytest.raises(StoreError, match="cannot open"):
        FileStore(os.path.join(tmp_path, "no", "such", "dir"))


def _fork(child: Callable[[], None]) -> int:
    """Run `child` in a forked process (exit code 0 if it returned, 1 if it raised); returns the pid."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            child()
            code = 0
        finally:
            os._exit(code)
    return pid


def _reap(pid: int, timeout: float = 20.0) -> int:
    """The exit code of the forked `pid`, killing it if it runs past `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return -signal.SIGKILL
        time.sleep(0.005)


def test_forked_child_gets_its_own_connections(tmp_path: os.PathLike[str]) -> None:
    master = _master()
    client = TCPStore("127.0.0.1", master.port, timeout=10)
    files = FileStore(os.path.join(tmp_path, "store"), world_size=1, timeout=10)

    def child() -> None:
        try:
            client.get("x")
        except StoreError as error:
            assert "forked" in str(error)
        else:
            raise AssertionError("the parent's connection was usable in the child")
        client.clone().set("from-child", "1")
        client.close()    # must not cut the parent's connection
        for _ in range(200):
            files.add("counter", 1)
        files.close()     # not a counted user in the child: the file stays

    pid = _fork(child)
    try:
        try:
            for _ in range(200):   # while the child adds to the same file through its own descriptor
                files.add("counter", 1)
        finally:
            code = _reap(pid)
        assert code == 0
        assert client.get("from-child") == b"1"
        assert files.get("counter") == b"400"
    finally:
        files.close()
        client.close()
        master.close()
    assert not os.path.exists(os.path.join(tmp_path, "store"))


class _CoreOnly(Store):
    """A Store subclass written against the core API only (before the extended one existed)."""

    def __init__(self) -> None:
        super().__init__(timeout=5)
        self._inner = HashStore(timeout=5)

    def set(self, key: str, value: object) -> None:
        self._inner.set(key, value)           # type: ignore[arg-type]

    def get(self, key: str) -> bytes:
        return self._inner.get(key)

    def add(self, key: str, amount: int) -> int:
        return self._inner.add(key, amount)

    def compare_set(self, key: str, expected: object, desired: object) -> bytes:
        return self._inner.compare_set(key, expected, desired)   # type: ignore[arg-type]

    def wait(self, keys: list[str], timeout: object = None) -> None:
        self._inner.wait(keys, timeout)       # type: ignore[arg-type]

    def check(self, keys: list[str]) -> bool:
        return self._inner.check(keys)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()


def test_a_store_written_against_the_core_api_still_works_and_names_what_it_lacks() -> None:
    store = _CoreOnly()
    assert not store.has_extended_api() and not PrefixStore("p", store).has_extended_api()
    assert HashStore().has_extended_api() and PrefixStore("p", HashStore()).has_extended_api()
    store.barrier("b", 1, timeout=1)                         # the barrier needs only the core
    with pytest.raises(NotImplementedError, match=r"_CoreOnly\.queue_push: this store does not serve"):
        store.queue_push("q", "v")
