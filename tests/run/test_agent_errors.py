"""Launch errors an agent reports before any worker starts, run in this process (no interpreter start-up):
busy ports, a rendezvous that never fills, a missing script. Each names what to change."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from spmd.run.cli import main
from tests.run.helpers import run_agent

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.fixture
def worker(tmp_path: Path) -> str:
    path = tmp_path / "ok.py"
    path.write_text("print('ran')\n")
    return str(path)


def test_busy_rendezvous_port_is_named(busy_port: int, worker: str) -> None:
    code, out, err = run_agent("--nnodes", "1", "--node-rank", "0", "--rdzv-endpoint", f"127.0.0.1:{busy_port}",
                               worker)
    assert code == 1 and f"port {busy_port} is already in use" in err and "--rdzv-endpoint" in err
    assert "ran" not in out


def test_busy_master_port_is_named(busy_port: int, worker: str) -> None:
    code, out, err = run_agent("--standalone", "--master-port", str(busy_port), worker)
    assert code == 1 and f"--master-port {busy_port} is already in use" in err
    assert "ran" not in out


def test_a_node_that_never_comes_times_out_naming_the_missing_count(worker: str) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code, _, err = run_agent("--nnodes", "3", "--node-rank", "0", "--rdzv-endpoint", f"127.0.0.1:{port}",
                             "--rdzv-conf", "join_timeout=1", worker)
    assert code == 1
    assert "rendezvous timed out after 1s: 1 of the 3 nodes needed are here, 2 node(s) missing" in err


def test_an_unreachable_rendezvous_is_reported(worker: str) -> None:
    with socket.socket() as held:     # bound, never listening: connections are refused and no one else takes it
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        code, _, err = run_agent("--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
                                 "--rdzv-conf", "join_timeout=1", worker)
    assert code == 1 and f"could not join the rendezvous at 127.0.0.1:{port}" in err


def test_a_missing_script_fails_before_anything_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--nproc-per-node", "2", str(tmp_path / "nope.py")])
    assert exited.value.code == 2 and "nope.py' does not exist" in capsys.readouterr().err


def test_bad_flags_exit_2_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--nnodes", "2", "train.py"])
    assert exited.value.code == 2 and "needs --rdzv-endpoint" in capsys.readouterr().err


def test_the_node_address_is_local_addr_resolved_else_the_route_to_the_endpoint(monkeypatch) -> None:
    from spmd.comm.transports.tcp.address import AddressChoice
    from spmd.run.agent import LaunchError, node_address
    from spmd.run.config import LaunchConfig

    monkeypatch.delenv("SPMD_SOCKET_ADDR", raising=False)
    monkeypatch.delenv("SPMD_SOCKET_IFNAME", raising=False)
    multi = {"entrypoint": "x.py", "min_nodes": 2, "max_nodes": 2, "rdzv_host": "127.0.0.1"}
    given = node_address(LaunchConfig(**multi, local_addr="localhost"))
    assert given == AddressChoice("127.0.0.1", "spmdrun --local-addr localhost")   # what workers publish, and why
    assert node_address(LaunchConfig(**multi)) == AddressChoice(   # the route to a loopback endpoint
        "127.0.0.1", "spmdrun's choice (the route to the store at 127.0.0.1)")
    monkeypatch.setenv("SPMD_SOCKET_IFNAME", "lo")
    assert node_address(LaunchConfig(**{**multi, "rdzv_host": "192.0.2.1"})) == AddressChoice(
        "127.0.0.1", "spmdrun's choice (SPMD_SOCKET_IFNAME=lo)")
    assert node_address(LaunchConfig(entrypoint="x.py")).address == "127.0.0.1"
    with pytest.raises(LaunchError, match=r"--local-addr 'no-such-node.invalid' is not an address"):
        node_address(LaunchConfig(**multi, local_addr="no-such-node.invalid"))
    monkeypatch.setenv("SPMD_SOCKET_IFNAME", "no-such-if0")
    with pytest.raises(LaunchError, match="SPMD_SOCKET_IFNAME='no-such-if0' names no interface"):
        node_address(LaunchConfig(**multi))
