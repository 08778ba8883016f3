"""spmdrun across two "hosts": network namespaces joined by a veth pair, each with a hostname that resolves
nowhere, as on clusters. Nothing sets an address by hand: the job must find the interface that reaches it.

Each test makes its own uniquely named namespaces and removes them (tests/run/netns.py), uses only the
addresses inside them, and is bounded in time. Where the machine can't make namespaces (no root, no `ip`),
the tests say so and do not run.
"""

from __future__ import annotations

import re
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.run import netns
from tests.run.helpers import Launcher, is_alive, wait_until

pytestmark = pytest.mark.timeout(150)

FAST_RDZV = "last_call_timeout=0.5,heartbeat_interval=0.2,heartbeat_timeout=3,join_timeout=60"

WORKER = """
    import os, socket, sys
    import torch
    import spmd
    from spmd.ddp.api import DistributedDataParallel

    torch.set_num_threads(1)
    spmd.init_process_group(timeout=60)
    rank, world = spmd.get_rank(), spmd.get_world_size()
    checks = {}
    t = torch.full((1000,), float(rank + 1))
    spmd.all_reduce(t)
    checks["all_reduce"] = t.eq(10.0).all().item()
    b = torch.full((4,), float(rank))
    spmd.broadcast(b, src=3)
    checks["broadcast"] = b.eq(3.0).all().item()
    r = torch.full((4,), float(rank))
    spmd.reduce(r, dst=2)
    checks["reduce"] = rank != 2 or r.eq(6.0).all().item()
    gathered = torch.empty(8)
    spmd.all_gather_into_tensor(gathered, torch.full((2,), float(rank)))
    checks["all_gather"] = gathered.tolist() == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
    scattered = torch.empty(2)
    spmd.reduce_scatter_tensor(scattered, torch.arange(8.0))
    checks["reduce_scatter"] = scattered.tolist() == [8.0 * rank, 8.0 * rank + 4]
    exchanged = torch.empty(4)
    spmd.all_to_all_single(exchanged, torch.arange(4.0) + 10 * rank)
    checks["all_to_all"] = exchanged.tolist() == [10.0 * i + rank for i in range(4)]
    gathered_at = [torch.empty(2) for _ in range(world)] if rank == 1 else None
    spmd.gather(torch.full((2,), float(rank)), gathered_at, dst=1)
    checks["gather"] = rank != 1 or [g[0].item() for g in gathered_at] == [0.0, 1.0, 2.0, 3.0]
    piece = torch.empty(2)
    spmd.scatter(piece, [torch.full((2,), 10.0 + i) for i in range(world)] if rank == 2 else None, src=2)
    checks["scatter"] = piece.eq(10.0 + rank).all().item()
    objects = [None] * world
    spmd.all_gather_object(objects, socket.gethostname())
    # point to point on a ring: 0->1 and 2->3 inside a host, 1->2 and 3->0 across
    inbox = torch.empty(3)
    sent = spmd.isend(torch.full((3,), float(rank)), dst=(rank + 1) % world)
    spmd.recv(inbox, src=(rank - 1) % world)
    sent.wait()
    checks["p2p"] = inbox.eq(float((rank - 1) % world)).all().item()
    flat = spmd.new_group(backend="tcp")
    f = torch.ones(100_000)
    spmd.all_reduce(f, group=flat)
    checks["tcp_group"] = f.eq(4.0).all().item()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    torch.manual_seed(rank)
    model(torch.randn(8, 4)).square().sum().backward()
    grad = model.module.weight.grad.clone()
    spmd.broadcast(grad, src=0)
    checks["ddp"] = torch.equal(grad, model.module.weight.grad)
    spmd.barrier()
    failed = [name for name, ok in checks.items() if not ok]
    print("result", rank, socket.gethostname(), os.environ["SPMD_SOCKET_ADDR"], spmd.get_backend(),
          spmd.get_backend(flat), "hosts", *objects,
          "failed", *failed, flush=True)
    spmd.destroy_process_group()
"""


@pytest.fixture(scope="module")
def can_make_hosts() -> None:
    reason = netns.unavailable()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture
def hosts(can_make_hosts: None) -> Iterator[netns.TwoHosts]:
    made = netns.TwoHosts()
    try:
        made.start()
        yield made
    finally:
        made.close()


def script(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def start_nodes(wraps: list[Callable[[list[str]], list[str]]], worker: str, endpoint: str,
                envs: list[dict[str, str]] | None = None, flags: list[tuple[str, ...]] | None = None) -> list[Launcher]:
    """One agent per wrap (node ranks 0, 1, ...), two workers each, meeting at `endpoint`; `flags` per node."""
    common = ("--nnodes", str(len(wraps)), "--nproc-per-node", "2", "--rdzv-endpoint", endpoint,
              "--rdzv-conf", FAST_RDZV, "--rdzv-token", secrets.token_hex(8))
    return [Launcher(*common, "--node-rank", str(node), *(flags[node] if flags else ()), worker,
                     env=envs[node] if envs else None, wrap=wrap)
            for node, wrap in enumerate(wraps)]


def on_hosts(hosts: netns.TwoHosts, names: tuple[str, str]) -> list[Callable[[list[str]], list[str]]]:
    return [lambda argv, node=node: hosts.argv(node, names[node], argv) for node in range(2)]


def finish_all(nodes: list[Launcher], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    try:
        return [node.finish(timeout=max(1.0, deadline - time.monotonic())) for node in nodes]
    finally:
        for node in nodes:
            node.kill()


def results(nodes: list[Launcher]) -> dict[int, list[str]]:
    found = {}
    for node in nodes:
        for line in node.lines:
            match = re.search(r"result (\d+) (.*)", line)
            if match:
                found[int(match.group(1))] = match.group(2).split()
    return found


@pytest.mark.parametrize("hosts_file", ["none", "debian"])
def test_two_hosts_with_unresolvable_names_run_every_collective_p2p_and_ddp(
        hosts: netns.TwoHosts, tmp_path: Path, hosts_file: str) -> None:
    names = (f"hosta-{secrets.token_hex(3)}", f"hostb-{secrets.token_hex(3)}")   # resolvable nowhere ...
    envs = None
    if hosts_file == "debian":            # ... or, Debian-style, each host's own name is 127.0.1.1
        envs = []
        for name in names:
            path = tmp_path / f"hosts-{name}"
            path.write_text(f"127.0.0.1 localhost\n127.0.1.1 {name}\n")
            envs.append({"SPMD_TEST_HOSTS_FILE": str(path)})
    worker = script(tmp_path, "all.py", WORKER)
    nodes = start_nodes(on_hosts(hosts, names), worker, f"{netns.ADDRESSES[0]}:29400", envs)
    codes = finish_all(nodes, timeout=120)
    outputs = "\n".join(node.output for node in nodes)
    assert codes == [0, 0], outputs
    got = results(nodes)
    assert sorted(got) == [0, 1, 2, 3], outputs
    for rank, fields in got.items():
        hostname, published, backend, flat_backend, _, *seen, _ = fields[:fields.index("failed") + 1]
        assert hostname == names[rank // 2]
        assert published == netns.ADDRESSES[rank // 2]   # the agent's choice: the route to the rendezvous
        assert seen == [names[0], names[0], names[1], names[1]]
        assert fields[fields.index("failed") + 1:] == [], outputs       # no check failed
        assert (backend, flat_backend) == ("shm+tcp", "tcp"), outputs   # auto: hierarchical, and what was asked


def test_two_hosts_with_one_hostname_and_private_shm_share_memory_only_inside_each(
        can_make_hosts: None, tmp_path: Path) -> None:
    """Two "containers" in one network namespace, both called `node`, each with its own /dev/shm: ranks group by
    what they can share, not by name, so the job runs hierarchically instead of failing in shm set-up."""
    worker = script(tmp_path, "all.py", WORKER)
    wrap = lambda argv: netns.own_host_argv("node", argv)   # noqa: E731
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{probe.getsockname()[1]}"
    nodes = start_nodes([wrap, wrap], worker, endpoint, [{"SPMD_TEST_PRIVATE_SHM": "1"}] * 2)
    codes = finish_all(nodes, timeout=120)
    outputs = "\n".join(node.output for node in nodes)
    assert codes == [0, 0], outputs
    got = results(nodes)
    assert sorted(got) == [0, 1, 2, 3], outputs
    for fields in got.values():
        assert fields[0] == "node" and fields[fields.index("failed") + 1:] == [], outputs


def test_sigkill_of_one_hosts_agent_ends_the_job_fast_naming_the_lost_host(
        hosts: netns.TwoHosts, tmp_path: Path) -> None:
    names = (f"hosta-{secrets.token_hex(3)}", f"hostb-{secrets.token_hex(3)}")
    worker = script(tmp_path, "loop.py", """
        import os, time
        import torch
        import spmd
        spmd.init_process_group(timeout=60)
        t = torch.ones(10)
        spmd.all_reduce(t)
        print("ready", os.getpid(), flush=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            spmd.all_reduce(t)
    """)
    nodes = start_nodes(on_hosts(hosts, names), worker, f"{netns.ADDRESSES[0]}:29400")
    try:
        for node in nodes:
            wait_until(lambda node=node: sum("ready" in line for line in node.lines) == 2, 90,
                       f"both workers of a node to start:\n{node.output}")
        pids = [int(line.split()[-1]) for node in nodes for line in node.lines if "ready" in line]
        killed_at = time.monotonic()
        nodes[1].popen.kill()                   # host B's agent dies; its workers follow it (parent-death signal)
        code = nodes[0].finish(timeout=60)
        took = time.monotonic() - killed_at
    finally:
        for node in nodes:
            node.kill()
    summary = nodes[0].output
    assert code == 1, summary
    assert took < 3 + 10, summary               # the heartbeat timeout (3s), plus the agents' own stops
    assert f"root cause: lost {names[1]} (node " in summary and ", ranks 2-3): its agent sent no heartbeat" in summary
    assert "no restarts are left" in summary
    assert f"rank 2 on {names[1]}" in summary   # the survivors' workers name whom they lost, with its host
    wait_until(lambda: not any(is_alive(pid) for pid in pids), 10, "every worker of both hosts to be gone")


def test_a_published_address_that_does_not_reach_fails_in_seconds_naming_both_hosts_and_the_fix(
        hosts: netns.TwoHosts, tmp_path: Path) -> None:
    names = (f"hosta-{secrets.token_hex(3)}", f"hostb-{secrets.token_hex(3)}")
    worker = script(tmp_path, "all.py", WORKER)
    wrong = ("--local-addr", "10.200.0.99", "--master-addr", netns.ADDRESSES[0])   # host A's workers publish .99
    retry = {"SPMD_CONNECT_RETRY_S": "3"}    # how long host B retries it (connect.REACH_S, 10 s, by default)
    started = time.monotonic()
    nodes = start_nodes(on_hosts(hosts, names), worker, f"{netns.ADDRESSES[0]}:29400", envs=[retry, retry],
                        flags=[wrong, ()])
    codes = finish_all(nodes, timeout=90)
    took = time.monotonic() - started
    outputs = "\n".join(node.output for node in nodes)
    assert codes == [1, 1], outputs
    assert took < 45, outputs                      # not the group timeout (60s here, 600s by default)
    summary = nodes[1].output[nodes[1].output.index("spmdrun: job failed"):]
    root = summary.splitlines()[1]
    assert "root cause at" in root and f"on host {names[1]}" in root and "PeerUnreachableError" in root, summary
    assert f"on {names[1]} can't reach rank 0 on {names[0]} at 10.200.0.99:" in root, summary
    assert "within 3s" in root, summary
    assert f"{names[0]} chose that address from spmdrun --local-addr 10.200.0.99. On {names[0]}, give an " \
           f"address of it that {names[1]} can reach: SPMD_SOCKET_ADDR=<address>" in root


def test_an_elastic_job_grows_when_the_second_host_joins_late(hosts: netns.TwoHosts, tmp_path: Path) -> None:
    names = (f"hosta-{secrets.token_hex(3)}", f"hostb-{secrets.token_hex(3)}")
    worker = script(tmp_path, "grow.py", """
        import os, time
        if os.environ["WORLD_SIZE"] == "2":     # host A alone: wait to be replaced by the grown round
            print("alone", flush=True)
            time.sleep(120)
            raise SystemExit(1)
        import torch
        import spmd
        spmd.init_process_group(timeout=60)
        t = torch.ones(4)
        spmd.all_reduce(t)
        print("grown", spmd.get_rank(), t[0].item(), spmd.get_backend(), flush=True)
        spmd.destroy_process_group()
    """)
    common = ("--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-endpoint", f"{netns.ADDRESSES[0]}:29400",
              "--rdzv-conf", FAST_RDZV, "--rdzv-token", secrets.token_hex(8), worker)
    first = Launcher(*common, wrap=lambda argv: hosts.argv(0, names[0], argv))
    nodes = [first]
    try:
        wait_until(lambda: sum("alone" in line for line in first.lines) == 2, 60, f"host A alone:\n{first.output}")
        nodes.append(Launcher(*common, wrap=lambda argv: hosts.argv(1, names[1], argv)))
        codes = finish_all(nodes, timeout=90)
    finally:
        for node in nodes:
            node.kill()
    outputs = "\n".join(node.output for node in nodes)
    assert codes == [0, 0], outputs
    grown = sorted(line.split("grown ", 1)[1] for line in outputs.splitlines() if "grown " in line)
    assert grown == [f"{rank} 4.0 shm+tcp" for rank in range(4)], outputs


def test_namespaces_left_by_a_killed_run_are_removed_by_the_next(can_make_hosts: None) -> None:
    maker = subprocess.run(
        [sys.executable, "-c", "import os, signal\nfrom tests.run import netns\nmade = netns.TwoHosts()\n"
         "made.start()\nprint(*made.namespaces, flush=True)\nos.kill(os.getpid(), signal.SIGKILL)"],
        capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[2])
    assert maker.returncode == -signal.SIGKILL, maker.stderr
    left = maker.stdout.split()
    assert len(left) == 2 and set(left) <= set(netns.listed())
    removed = netns.remove_stale()
    assert set(left) <= set(removed)
    assert not set(left) & set(netns.listed())
