"""The tcp transport's own guarantees: authenticated connections, zero-copy tensor bytes, P2P safety, clean
shutdown, fast failure; and, in real processes, the same results as torch's gloo on the same inputs.

The collective semantics themselves are covered by test_matrix.py (which runs tcp too); failures shared with
other transports by test_failures.py.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest
import torch

import spmd
from spmd._core.deadline import Deadline
from spmd._core.errors import CommError, CommTimeoutError, PeerLostError
from spmd.comm.debug import Fingerprint
from spmd.comm.reduce_op import ReduceOp
from spmd.comm.store.base import HashStore, PrefixStore
from spmd.comm.transports.base import OpContext, TransportSpec
from spmd.comm.transports.tcp import algorithms, wire
from spmd.comm.transports.tcp.transport import TcpTransport
from spmd.testing import run_ranks
from tests.procpool import ProcPool, free_port

TOKEN = b"0123456789abcdef-group-token"
ALL_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int8, torch.int16, torch.int32,
              torch.int64, torch.uint8, torch.bool, torch.complex64]


def _spec(store: HashStore, rank: int, size: int, timeout: float = 20.0,
          hosts: tuple[str, ...] | None = None) -> TransportSpec:
    return TransportSpec(store=PrefixStore("g", store), group_name="g", group_rank=rank,
                         global_ranks=tuple(range(size)), hosts=hosts or ("host",) * size, timeout=timeout,
                         token=TOKEN)


def _ctx(seq: int, numel: int) -> OpContext:
    return OpContext(Fingerprint("all_reduce", seq, (numel,), "float32", "SUM", call_site="test_tcp.py:1"),
                     Deadline(20.0), "group 'g'")


def _all_reduce_pair(transports: list[TcpTransport]) -> list[torch.Tensor]:
    tensors = [torch.full((5,), float(rank + 1)) for rank in range(len(transports))]
    threads = [threading.Thread(target=t.all_reduce, args=(x, ReduceOp.SUM, _ctx(1, 5)))
               for t, x in zip(transports, tensors)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    return tensors


def _closed_by_peer(sock: socket.socket, timeout: float = 10.0) -> bool:
    """True if the other end closed `sock` (EOF or reset) within `timeout`."""
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_strangers_are_dropped_and_the_group_still_connects() -> None:
    store = HashStore(timeout=20)
    made: dict[int, TcpTransport] = {}
    first = threading.Thread(target=lambda: made.__setitem__(0, TcpTransport(_spec(store, 0, 2))))
    first.start()
    host, port = store.get("g/tcp/addr/0").decode().rsplit(":", 1)
    address = (host, int(port))
    silent = socket.create_connection(address)                    # says nothing: must not hold up the group
    nonce = b"n" * wire.NONCE_BYTES
    strangers = {
        "garbage": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 64,
        "oversized name": struct.pack("<8sIH16s", wire.MAGIC, 1, 60000, nonce) + b"x" * 64,
        "wrong group": wire.hello_frame(1, "other-group", nonce),
        "impossible rank": wire.hello_frame(7, "g", nonce),
    }
    dropped = {}
    for name, frame in strangers.items():
        with socket.create_connection(address) as stranger:
            stranger.sendall(frame)
            dropped[name] = _closed_by_peer(stranger)
    with socket.create_connection(address) as stranger:      # a plausible hello, then a proof without the token
        hello = wire.hello_frame(1, "g", nonce)
        stranger.sendall(hello)
        challenge = wire.recv_bytes(stranger, wire.CHALLENGE_LEN)
        assert wire.check_challenge(challenge, TOKEN, hello) is not None    # rank 0 proved itself ...
        assert TOKEN not in challenge                                       # ... without showing the token
        stranger.sendall(wire.proof_frame(b"not-the-token", hello, challenge[len(wire.MAGIC):][:wire.NONCE_BYTES]))
        dropped["wrong token"] = _closed_by_peer(stranger)
    assert dropped == dict.fromkeys([*strangers, "wrong token"], True)
    made[1] = TcpTransport(_spec(store, 1, 2))
    first.join(timeout=20)
    try:
        assert [t.tolist() for t in _all_reduce_pair([made[0], made[1]])] == [[3.0] * 5] * 2
        with pytest.raises(ConnectionRefusedError):     # set-up is over: nobody listens any more
            socket.create_connection(address, timeout=5).close()
    finally:
        for transport in made.values():
            transport.close()
        silent.close()


def test_a_fake_peer_learns_nothing_of_the_token_and_is_named() -> None:
    """Whatever listens at a published address without the token gets a hello with no secret in it, and the
    connecting rank refuses to go on: it sends no proof and no data."""
    received = bytearray()
    with socket.create_server(("127.0.0.1", 0)) as fake:
        store = HashStore(timeout=20)
        store.set("g/tcp/addr/0", f"127.0.0.1:{fake.getsockname()[1]}")

        def impersonate() -> None:
            conn, _ = fake.accept()
            with conn:
                conn.settimeout(10)
                received.extend(conn.recv(4096))
                conn.sendall(wire.MAGIC + b"x" * (wire.CHALLENGE_LEN - len(wire.MAGIC)))
                while chunk := conn.recv(4096):
                    received.extend(chunk)

        server = threading.Thread(target=impersonate)
        server.start()
        with pytest.raises(CommError, match=r"is not rank 0 of this group \(it could not prove"):
            TcpTransport(_spec(store, 1, 2))
        server.join(timeout=20)
    assert received.startswith(wire.MAGIC) and TOKEN not in received
    assert len(received) == len(wire.hello_frame(1, "g", b"n" * wire.NONCE_BYTES))    # the hello, nothing after


def test_ranks_on_different_hosts_listen_on_every_interface() -> None:
    store = HashStore(timeout=20)
    made: dict[int, TcpTransport] = {}
    hosts = ("node-a", "node-b")       # not resolvable: the address falls back to this host's name
    first = threading.Thread(target=lambda: made.__setitem__(0, TcpTransport(_spec(store, 0, 2, hosts=hosts))))
    first.start()
    made[1] = TcpTransport(_spec(store, 1, 2, hosts=hosts))
    first.join(timeout=20)
    try:
        assert not store.get("g/tcp/addr/0").decode().startswith("127.0.0.1:")
        assert [t.tolist() for t in _all_reduce_pair([made[0], made[1]])] == [[3.0] * 5] * 2
    finally:
        for transport in made.values():
            transport.close()


def test_the_published_address_can_be_set_for_groups_spanning_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPMD_SOCKET_ADDR", "127.0.0.2")      # loopback too, but not what the guess would give
    store = HashStore(timeout=20)
    made: dict[int, TcpTransport] = {}
    hosts = ("node-a", "node-b")
    first = threading.Thread(target=lambda: made.__setitem__(0, TcpTransport(_spec(store, 0, 2, hosts=hosts))))
    first.start()
    made[1] = TcpTransport(_spec(store, 1, 2, hosts=hosts))
    first.join(timeout=20)
    try:
        assert store.get("g/tcp/addr/0").decode().startswith("127.0.0.2:")
        assert [t.tolist() for t in _all_reduce_pair([made[0], made[1]])] == [[3.0] * 5] * 2
    finally:
        for transport in made.values():
            transport.close()


def test_set_up_times_out_naming_the_missing_rank() -> None:
    start = time.monotonic()
    with pytest.raises(CommTimeoutError, match=r"(rank 1, )?rank 2 did not connect"):
        _two_of_three()
    assert time.monotonic() - start < 10


def _two_of_three() -> None:
    """Ranks 0 and 1 of a 3-rank group set up their transports; rank 2 never comes. Raises rank 0's error."""
    store = HashStore(timeout=20)
    made: list[TcpTransport] = []
    errors: list[BaseException] = []

    def make(rank: int) -> None:
        try:
            made.append(TcpTransport(_spec(store, rank, 3, timeout=1.0)))
        except BaseException as error:   # collected for the assertion below
            errors.append(error)

    threads = [threading.Thread(target=make, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    for transport in made:
        transport.close()
    raise next(e for e in errors if "did not connect" in str(e))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_byte_view_is_zero_copy_for_every_dtype(dtype: torch.dtype) -> None:
    base = torch.zeros(9, dtype=dtype)
    piece = base[2:7] if not dtype.is_complex else torch.view_as_real(base)[2:7].reshape(-1)
    view = wire.byte_view(piece)
    assert len(view) == piece.numel() * piece.element_size()
    assert view.obj.__array_interface__["data"][0] == piece.data_ptr()
    view[:] = b"\x01" * len(view)
    assert piece.view(torch.uint8).eq(1).all()
    assert wire.byte_view(torch.empty(0, dtype=dtype)).nbytes == 0
    leaf = torch.zeros(3, requires_grad=True) if dtype.is_floating_point else None
    if leaf is not None:
        assert len(wire.byte_view(leaf)) == 3 * leaf.element_size()


def test_p2p_size_or_dtype_mismatch_is_an_error_not_an_overflow() -> None:
    def body(rank: int, size: int) -> None:
        if rank == 0:
            spmd.send(torch.arange(8.0), dst=1)
            spmd.send(torch.arange(4.0), dst=1)
            spmd.send(torch.ones(3, dtype=torch.int64), dst=1)
            spmd.send(torch.arange(4.0) + 10, dst=1)
            return
        buffer = torch.zeros(6)
        small = buffer[1:5]
        with pytest.raises(CommError, match=r"32 bytes of torch\.float32, but the receive buffer holds 16"):
            spmd.recv(small, src=0)
        assert buffer.eq(0).all()                               # nothing written past (or into) the buffer
        spmd.recv(small, src=0)                                 # the stream is still in step
        assert small.tolist() == [0.0, 1.0, 2.0, 3.0]
        with pytest.raises(CommError, match=r"torch\.int64"):
            spmd.recv(torch.zeros(6), src=0)
        late = torch.zeros(4)
        spmd.recv(late, src=0)
        assert late.tolist() == [10.0, 11.0, 12.0, 13.0]

    run_ranks(body, 2, timeout=60, backend="tcp")


def test_p2p_receives_into_tensors_of_any_shape() -> None:
    def body(rank: int, size: int) -> None:
        block = torch.arange(24.0).reshape(2, 3, 4)
        if rank == 0:
            spmd.send(block, dst=1, tag=1)
            spmd.send(torch.ones(1), dst=1, tag=2)
            spmd.recv(torch.empty(1), src=1, tag=3)      # rank 1 posted its receive before this send
            spmd.send(block * 2, dst=1, tag=4)
            return
        early = torch.empty(2, 3, 4)
        spmd.recv(torch.empty(1), src=0, tag=2)          # tag 1's message has arrived before its receive
        spmd.recv(early, src=0, tag=1)
        posted = torch.empty(2, 3, 4)
        work = spmd.irecv(posted, src=0, tag=4)
        spmd.send(torch.ones(1), dst=0, tag=3)
        work.wait()
        assert early.equal(block) and posted.equal(block * 2)

    run_ranks(body, 2, timeout=60, backend="tcp")


def test_large_isends_keep_their_order_with_small_ones() -> None:
    sizes = [10, 300_000, 5, 1_000_000, 7, 70_000]       # inline and sender-thread sends interleaved

    def body(rank: int, size: int) -> None:
        if rank == 0:
            works = [spmd.isend(torch.full((n,), float(k)), dst=1, tag=3) for k, n in enumerate(sizes)]
            for work in works:
                work.wait()
            return
        for k, n in enumerate(sizes):
            t = torch.empty(n)
            spmd.recv(t, src=0, tag=3)
            assert t.eq(float(k)).all(), k

    run_ranks(body, 2, timeout=60, backend="tcp")


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_all_reduce_beyond_the_doubling_limit_runs_the_ring(world_size: int) -> None:
    numel = (algorithms.DOUBLING_BYTES // 4) + 4099        # past recursive doubling: uneven ring blocks

    def body(rank: int, size: int) -> None:
        t = torch.arange(numel, dtype=torch.float32) % 7 + rank
        spmd.all_reduce(t)
        expected = (torch.arange(numel, dtype=torch.float32) % 7) * size + sum(range(size))
        assert torch.equal(t, expected)
        def ints(q: int) -> torch.Tensor:
            return torch.arange(numel // 2, dtype=torch.int64) * (q + 1) % 1000

        m = ints(rank)
        spmd.all_reduce(m, op=spmd.ReduceOp.MAX)
        assert torch.equal(m, torch.stack([ints(q) for q in range(size)]).amax(0))

    run_ranks(body, world_size, timeout=90, backend="tcp")


def _spmd_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("spmd-tcp")]


def test_no_threads_or_sockets_left_after_destroy() -> None:
    before = _spmd_threads()

    def body(rank: int, size: int) -> None:
        pair = spmd.new_group([1, 2])
        if rank in (1, 2):
            spmd.all_reduce(torch.ones(100_000), group=pair)
            work = spmd.isend(torch.ones(500_000), dst=3 - rank, group=pair)   # starts a sender thread
            spmd.recv(torch.empty(500_000), src=3 - rank, group=pair)
            work.wait()
        spmd.barrier()

    run_ranks(body, 3, timeout=60, backend="tcp")
    assert _spmd_threads() == before


def test_a_peer_that_left_fails_only_what_needs_it() -> None:
    def body(rank: int, size: int) -> None:
        pair = spmd.new_group([0, 1])
        spmd.barrier()
        if rank == 0:
            spmd.destroy_process_group(pair)
        elif rank == 1:
            with pytest.raises(PeerLostError, match=r"rank 0 on \S+ has left"):
                spmd.all_reduce(torch.ones(3), group=pair)
        spmd.barrier()                               # the default group is unaffected
        t = torch.ones(2)
        spmd.all_reduce(t)
        assert t.tolist() == [3.0, 3.0]

    run_ranks(body, 3, timeout=60, comm_timeout=60, backend="tcp")


# -- real processes: env:// over TCPStore, and parity with torch gloo ---------------------------------------------


def _gloo_parity(rank: int, world_size: int, gloo_port: int) -> list[str]:
    """Run the same ops on the same inputs through spmd (tcp, env:// over TCPStore) and torch gloo."""
    import torch.distributed as tdist

    spmd.init_process_group("tcp", timeout=60, torch_default_group=False)
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=rank, world_size=world_size)
    failures = []
    try:
        generator = torch.Generator().manual_seed(rank)
        cases = {
            "all_reduce sum f32 1MiB+": lambda d: _ar(d, torch.randn(262147, generator=generator), "SUM"),
            "all_reduce max i64": lambda d: _ar(d, torch.randint(-9, 9, (1001,), generator=generator), "MAX"),
            "all_reduce product f64": lambda d: _ar(d, torch.rand(33, generator=generator, dtype=torch.float64),
                                                    "PRODUCT"),
            "all_reduce avg bf16": lambda d: _ar(d, torch.randn(70001, generator=generator).bfloat16(), "AVG"),
            "all_gather_into_tensor": lambda d: _ag(d, torch.randn(40000, generator=generator), world_size),
            "reduce_scatter_tensor": lambda d: _rs(d, torch.randn(world_size * 30001, generator=generator),
                                                   world_size),
            "broadcast": lambda d: _bc(d, torch.randn(100003, generator=generator)),
            "all_to_all_single uneven": lambda d: _a2a(d, rank, world_size),
        }
        for name, case in cases.items():
            state = generator.get_state()
            mine = case(spmd)
            generator.set_state(state)
            theirs = case(tdist)
            exact = mine.dtype in (torch.int64,) or name.startswith(("all_gather", "broadcast", "all_to_all"))
            # Sums of 2-4 fp32 values in a different order differ in the last bits only.
            tol = {} if not exact else {"rtol": 0, "atol": 0}
            if mine.dtype is torch.bfloat16:
                tol = {"rtol": 1e-2, "atol": 1e-2}
            try:
                torch.testing.assert_close(mine, theirs, **tol)
            except AssertionError as error:
                failures.append(f"rank {rank} {name}: {error}")
    finally:
        tdist.destroy_process_group()
        spmd.destroy_process_group()
    return failures


def _ar(dist, t: torch.Tensor, op: str) -> torch.Tensor:
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
    return t


def _ag(dist, t: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.empty(n * t.numel())
    dist.all_gather_into_tensor(out, t)
    return out


def _rs(dist, t: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.empty(t.numel() // n)
    dist.reduce_scatter_tensor(out, t)
    return out


def _bc(dist, t: torch.Tensor) -> torch.Tensor:
    dist.broadcast(t, src=dist.get_world_size() - 1)
    return t


def _a2a(dist, rank: int, n: int) -> torch.Tensor:
    in_splits = [(rank + j) % 3 * 1000 + j for j in range(n)]
    out_splits = [(i + rank) % 3 * 1000 + rank for i in range(n)]
    out = torch.empty(sum(out_splits))
    dist.all_to_all_single(out, torch.arange(float(sum(in_splits))) + rank * 1e6, out_splits, in_splits)
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [2, 3])
def test_results_match_torch_gloo_in_real_processes(procpool: ProcPool, world_size: int) -> None:
    failures = procpool.run(_gloo_parity, world_size, timeout=150, args=(free_port(),))
    assert failures == [[]] * world_size
