"""torch's elastic `utils.distributed` path: a free port of this host, a socket holding one, and a job's store made
as torch's elastic launcher makes it. Layer: elastic."""

from __future__ import annotations

import contextlib
import datetime
import socket

from spmd._core.deadline import as_seconds
from spmd._core.errors import StoreTimeoutError
from spmd.comm.store.tcp import TCPStore

__all__ = ["create_c10d_store", "get_free_port", "get_socket_with_port"]

_INIT_KEY = "torchelastic/tcpstore/init"   # torch's key for the members' first barrier


def get_socket_with_port() -> socket.socket:
    """A socket listening on a port of localhost the OS picked: the port stays taken until the socket is closed."""
    for family, kind, proto, _, _ in socket.getaddrinfo("localhost", None, socket.AF_UNSPEC, socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            sock.bind(("localhost", 0))
            sock.listen(0)
            return sock
        except OSError:
            sock.close()
    raise RuntimeError("get_socket_with_port: no address of localhost could be bound")


def get_free_port() -> int:
    """A port of localhost nothing listens on now (another process may take it before its user binds it)."""
    with contextlib.closing(get_socket_with_port()) as sock:
        return sock.getsockname()[1]


def create_c10d_store(is_server: bool, server_addr: str, server_port: int = -1, world_size: int = 1,
                      timeout: float | datetime.timedelta = 600, wait_for_workers: bool = True, retries: int = 3,
                      use_libuv: bool | None = None) -> TCPStore:
    """A TCPStore served at `server_addr`:`server_port` (the server's side with `is_server`; -1: a port the OS
    picks, for a one-member store only, as in torch). With `wait_for_workers`, every member returns once all
    `world_size` have joined, or raises TimeoutError after `timeout` seconds naming how many did. `retries` and
    `use_libuv` are taken for torch's signature: port 0 leaves no port race to retry, and the server is spmd's."""
    if server_port == -1 and (world_size > 1 or not is_server):
        raise ValueError(f"create_c10d_store: server_port must be given for a store of {world_size} members "
                         f"(-1 lets the OS pick one only for a server alone)")
    seconds = as_seconds(timeout, 600.0, "create_c10d_store: timeout")
    store = TCPStore(server_addr, 0 if server_port == -1 else server_port, world_size, is_master=is_server,
                     timeout=seconds, wait_for_workers=False)
    if wait_for_workers:
        try:
            store.barrier(_INIT_KEY, world_size, seconds)
        except StoreTimeoutError as error:
            joined = int(store.get(f"{_INIT_KEY}/num_members"))
            store.close()
            raise TimeoutError(f"create_c10d_store: {joined} of {world_size} members joined the store at "
                               f"{server_addr}:{store.port} within {seconds:.1f}s") from error
    return store
