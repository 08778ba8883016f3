"""spmd.elastic.utils.distributed (torch's elastic utils.distributed): free ports, and stores made as torch's
elastic launcher makes them."""

from __future__ import annotations

import socket
import threading

import pytest

from spmd.elastic.utils.distributed import create_c10d_store, get_free_port, get_socket_with_port


def test_a_free_port_can_be_bound_and_a_socket_holds_its_port() -> None:
    port = get_free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))
    held = get_socket_with_port()
    try:
        with socket.create_connection(("localhost", held.getsockname()[1]), timeout=5):
            pass                                            # it listens
    finally:
        held.close()


def test_every_member_returns_once_all_joined() -> None:
    server = create_c10d_store(True, "127.0.0.1", get_free_port(), world_size=3, timeout=10, wait_for_workers=False)
    joined: list[object] = []
    clients = [threading.Thread(target=lambda: joined.append(create_c10d_store(False, "127.0.0.1", server.port,
                                                                                world_size=3, timeout=10)))
               for _ in range(2)]
    try:
        for thread in clients:
            thread.start()
        server.barrier("torchelastic/tcpstore/init", 3, 10)   # what the server's own wait_for_workers does
        for thread in clients:
            thread.join(timeout=15)
        assert len(joined) == 2
        assert server.get("torchelastic/tcpstore/init/num_members") == b"3"
    finally:
        for store in joined:
            store.close()           # type: ignore[attr-defined]
        server.close()


def test_a_lone_server_takes_a_port_the_os_picks_and_a_missing_member_times_out() -> None:
    alone = create_c10d_store(True, "127.0.0.1")
    assert alone.port > 0 and alone.num_keys() >= 1
    alone.close()
    with pytest.raises(TimeoutError, match="1 of 2 members joined"):
        create_c10d_store(True, "127.0.0.1", get_free_port(), world_size=2, timeout=0.2)
    with pytest.raises(ValueError, match="server_port must be given"):
        create_c10d_store(True, "127.0.0.1", world_size=2)
    with pytest.raises(ValueError, match="server_port must be given"):
        create_c10d_store(False, "127.0.0.1")
