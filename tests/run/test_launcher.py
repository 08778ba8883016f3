"""spmdrun end to end: real agents and workers over loopback, each test with a timeout and a pid check.

Worker scripts import only the standard library (torch costs seconds per process), except the one 2x2 job that
checks an all_reduce across two agents. Tests about what the agent does with its workers run the agent in this
process (`run_agent`); those about the launcher process itself (signals, several nodes) start `spmdrun`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from tests.run.helpers import SPMDRUN, Launcher, is_alive, run_agent, spmdrun, wait_until

pytestmark = pytest.mark.timeout(120)

FAST_RDZV = "last_call_timeout=0.5,heartbeat_interval=0.2,heartbeat_timeout=5,join_timeout=60"


def script(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


PID_WRITER = """
    import os, subprocess, sys, time
    pids = sys.argv[1]
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    with open(os.path.join(pids, os.environ["RANK"]), "w") as f:
        f.write(f"{os.getpid()} {helper.pid}")
    print("ready", flush=True)
    time.sleep(120)
"""


def read_pids(pid_dir: Path, nproc: int, per_worker: int = 2) -> list[int]:
    wait_until(lambda: len(list(pid_dir.iterdir())) == nproc, 60, "every worker to write its pid")
    wait_until(lambda: all(len(path.read_text().split()) == per_worker for path in pid_dir.iterdir()), 10,
               "whole pid files")
    return [int(pid) for path in pid_dir.iterdir() for pid in path.read_text().split()]


def test_workers_get_their_environment_prefixed_output_and_a_free_port(tmp_path: Path) -> None:
    worker = script(tmp_path, "env.py", """
        import json, os, socket, sys
        keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                "RESTART_COUNT", "SPMD_RUN_ID", "SPMD_STORE_TOKEN", "OMP_NUM_THREADS"]
        print(json.dumps({"argv": sys.argv[1:], **{key: os.environ.get(key) for key in keys}}))
        if os.environ["RANK"] == "0":  # the port must be free for worker rank 0's store
            socket.socket().bind(("0.0.0.0", int(os.environ["MASTER_PORT"])))
        print("to stderr", file=sys.stderr)
    """)
    result = spmdrun("--standalone", "--nproc-per-node", "2", "--rdzv-id", "envjob", worker, "--lr", "1e-3", "-m")
    assert result.returncode == 0, result.stderr
    records = sorted((json.loads(line.split(": ", 1)[1]) for line in result.stdout.splitlines()),
                     key=lambda record: record["RANK"])
    assert [(r["RANK"], r["LOCAL_RANK"], r["WORLD_SIZE"], r["LOCAL_WORLD_SIZE"]) for r in records] == [
        ("0", "0", "2", "2"), ("1", "1", "2", "2")]
    assert all(r["argv"] == ["--lr", "1e-3", "-m"] for r in records)
    assert all(r["GROUP_RANK"] == "0" and r["RESTART_COUNT"] == "0" and r["SPMD_RUN_ID"] == "envjob" for r in records)
    assert all(r["MASTER_ADDR"] == "127.0.0.1" and r["OMP_NUM_THREADS"] == "1" for r in records)
    assert len({r["MASTER_PORT"] for r in records}) == 1 and int(records[0]["MASTER_PORT"]) > 0
    assert len({r["SPMD_STORE_TOKEN"] for r in records}) == 1 and len(records[0]["SPMD_STORE_TOKEN"]) == 32
    assert all(line.startswith("[rank") for line in result.stdout.splitlines())
    assert "[rank0]: to stderr" in result.stderr and "[rank1]: to stderr" in result.stderr


def test_module_and_program_entry_points(tmp_path: Path) -> None:
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "job.py").write_text("import os, sys\nprint('module', __name__, os.environ['RANK'], sys.argv[1:])\n")
    code, out, err = run_agent("--nproc-per-node", "2", "-m", "mypkg.job", "x", cwd=str(tmp_path))
    assert code == 0, err
    assert sorted(out.splitlines()) == ["[rank0]: module __main__ 0 ['x']", "[rank1]: module __main__ 1 ['x']"]
    code, out, err = run_agent("--nproc-per-node", "2", "--no-python", "sh", "-c", 'echo "program $RANK $0"', "arg0")
    assert code == 0, err
    assert sorted(out.splitlines()) == ["[rank0]: program 0 arg0", "[rank1]: program 1 arg0"]


def test_worker_exiting_3_once_is_restarted_and_the_job_succeeds(tmp_path: Path) -> None:
    worker = script(tmp_path, "flaky.py", """
        import os, sys
        print("attempt", os.environ["RESTART_COUNT"], flush=True)
        if os.environ["RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
            sys.exit(3)
    """)
    code, out, err = run_agent("--nproc-per-node", "2", "--max-restarts", "2", worker)
    assert code == 0, err
    assert "[rank1]: attempt 0" in out and "[rank1]: attempt 1" in out and "[rank1]: attempt 2" not in out
    assert "rank 1 (local rank 1)" in err and "exit code 3" in err and "(restart 1 of 2)" in err


def test_sigkilled_worker_without_restarts_is_reported_by_rank_and_signal(tmp_path: Path) -> None:
    worker = script(tmp_path, "killed.py", """
        import os, signal, time
        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(120)
    """)
    started = time.monotonic()
    code, _, err = run_agent("--nproc-per-node", "2", "--max-restarts", "0", worker)
    assert code == 1
    assert time.monotonic() - started < 60  # rank 0 was stopped, not waited for
    summary = err[err.index("spmdrun: job failed"):]
    assert "root cause at" in summary and "rank 1 (local rank 1)" in summary and "signal SIGKILL" in summary
    assert "no Python traceback" in summary


def test_a_worker_killed_in_shm_set_up_leaves_no_segment_name(tmp_path: Path) -> None:
    """A name in /dev/shm only outlives a worker killed between creating its group's segment and every rank
    mapping it; the agent sweeps such names once its workers have stopped (the worker fakes the segment
    file, named as the shm transport names them, to spare the torch import)."""
    tag = f"{os.getpid()}{time.monotonic_ns()}"
    worker = script(tmp_path, "dies_in_set_up.py", f"""
        import os, signal
        stat = open("/proc/self/stat", "rb").read()
        start = int(stat[stat.rfind(b")") + 2:].split()[19])
        namespace = os.stat("/proc/self/ns/pid").st_ino
        path = f"/dev/shm/spmd-{{os.getpid()}}-{{start}}-{{namespace}}-{tag}"
        open(path, "wb").close()
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    code, _, err = run_agent("--nproc-per-node", "1", "--max-restarts", "0", worker)
    assert code == 1 and "signal SIGKILL" in err
    assert [name for name in os.listdir("/dev/shm") if name.endswith(f"-{tag}")] == []


def test_python_exception_traceback_is_in_the_summary(tmp_path: Path) -> None:
    worker = script(tmp_path, "boom.py", """
        import os, time

        def train():
            raise ValueError("boom")

        if os.environ["RANK"] == "1":
            train()
        time.sleep(120)
    """)
    code, _, err = run_agent("--nproc-per-node", "2", worker)
    assert code == 1
    summary = err[err.index("spmdrun: job failed"):]
    assert "rank 1 (local rank 1)" in summary and "raised ValueError: boom" in summary
    assert 'raise ValueError("boom")' in summary and "boom.py" in summary and "in train" in summary
    assert "runpy" not in summary and "bootstrap" not in summary  # the user's frames only


def test_sigint_to_the_launcher_stops_every_worker_and_helper(tmp_path: Path) -> None:
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    launcher = Launcher("--nproc-per-node", "2", "--shutdown-timeout", "2", script(tmp_path, "w.py", PID_WRITER),
                        str(pid_dir))
    try:
        pids = read_pids(pid_dir, 2)
        launcher.popen.send_signal(signal.SIGINT)
        assert launcher.finish(timeout=60) == 128 + signal.SIGINT
    finally:
        launcher.kill()
    wait_until(lambda: not any(is_alive(pid) for pid in pids), 10, f"workers and helpers {pids} to be gone")
    assert "got SIGINT" in launcher.output


def test_sigkill_to_the_agent_takes_its_workers_their_children_and_their_shm_names_down(tmp_path: Path) -> None:
    """Workers die through their parent-death signal; the processes they started, in their group or in a session
    of their own (setsid), and the /dev/shm names they made are the agent's watchdog's to remove (the worker fakes
    a segment file named as the shm transport does)."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    tag = f"{os.getpid()}{time.monotonic_ns()}"
    worker = script(tmp_path, "w.py", f"""
        import os, signal, subprocess, sys
        from spmd.comm.transports.shm.names import new_segment_name
        open("/dev/shm/" + new_segment_name().rsplit("-", 1)[0] + "-{tag}", "wb").close()
        child = subprocess.Popen(["sleep", "300"])
        escaped = subprocess.Popen(["sleep", "301"], start_new_session=True)
        with open(os.path.join(sys.argv[1], os.environ["RANK"]), "w") as f:
            f.write(f"{{os.getpid()}} {{child.pid}} {{escaped.pid}}")
        signal.pause()
    """)
    launcher = Launcher("--nproc-per-node", "2", worker, str(pid_dir))
    pids: list[int] = []
    try:
        pids = read_pids(pid_dir, 2, per_worker=3)
        launcher.popen.kill()
        launcher.finish(timeout=30)
        wait_until(lambda: not any(is_alive(pid) for pid in pids), 5, f"workers and their children {pids} to die")
        wait_until(lambda: not [name for name in os.listdir("/dev/shm") if name.endswith(f"-{tag}")], 5,
                   "the watchdog to sweep the workers' /dev/shm names")
    finally:
        for pid in pids:
            if is_alive(pid):
                os.kill(pid, signal.SIGKILL)
        for name in os.listdir("/dev/shm"):
            if name.endswith(f"-{tag}"):
                os.unlink(f"/dev/shm/{name}")


def test_helpers_that_outlive_a_successful_worker_are_stopped_with_its_group(tmp_path: Path) -> None:
    """A helper in the worker's group is stopped with it; one in a session of its own (setsid) by the watchdog,
    through the mark in its environment, when the agent is done."""
    pid_file = tmp_path / "child"
    worker = script(tmp_path, "w.py", f"""
        import subprocess
        child = subprocess.Popen(["sleep", "300"])
        escaped = subprocess.Popen(["sleep", "302"], start_new_session=True)
        open({str(pid_file)!r}, "w").write(f"{{child.pid}} {{escaped.pid}}")
    """)
    code, _, err = run_agent("--nproc-per-node", "1", worker)
    assert code == 0, err
    helpers = [int(pid) for pid in pid_file.read_text().split()]
    try:
        wait_until(lambda: not any(is_alive(pid) for pid in helpers), 5, f"the worker's helpers {helpers} to die")
    finally:
        for pid in helpers:
            if is_alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_slow_reader_gets_every_line_and_the_exit_code(tmp_path: Path) -> None:
    # The worker exits with its 100 kB still in the pipes, which the reader needs seconds more to read: twice the
    # 2 s the agent once gave its output at exit.
    worker = script(tmp_path, "w.py", """
        for i in range(1000):
            print(f"line {i} " + "x" * 90)
        print("final line")
    """)
    popen = subprocess.Popen([*SPMDRUN, "--nproc-per-node", "1", worker], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL)
    assert popen.stdout is not None
    received = bytearray()
    try:
        while chunk := popen.stdout.read1(250):
            received += chunk
            time.sleep(0.01)  # the slow reader itself (about 25 kB/s: about 4 s in all), not synchronisation
        assert popen.wait(timeout=30) == 0
    finally:
        popen.kill()
        popen.wait()
    lines = received.decode().splitlines()
    assert lines == [f"[rank0]: line {i} " + "x" * 90 for i in range(1000)] + ["[rank0]: final line"]


def test_a_console_reader_that_goes_away_does_not_hold_the_agent(tmp_path: Path) -> None:
    worker = script(tmp_path, "w.py", """
        for i in range(100000):
            print(f"line {i}")
    """)
    popen = subprocess.Popen([*SPMDRUN, "--nproc-per-node", "1", worker], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    assert popen.stdout is not None
    try:
        assert popen.stdout.readline() == b"[rank0]: line 0\n"
        popen.stdout.close()  # like `spmdrun ... | head -1`
        _, err = popen.communicate(timeout=60)
    finally:
        popen.kill()
        popen.wait()
    assert popen.returncode == 0, err
    assert b"Error" not in err, err


def test_a_long_line_without_newline_keeps_the_agent_memory_bounded(tmp_path: Path) -> None:
    fifos = [tmp_path / "measured", tmp_path / "written"]
    for fifo in fifos:
        os.mkfifo(fifo)
    size = 50 * 2**20
    worker = script(tmp_path, "w.py", f"""
        import sys
        print("ready", flush=True)
        open({str(fifos[0])!r}).read()
        sys.stdout.buffer.write(b"x" * {size})
        sys.stdout.flush()
        open({str(fifos[1])!r}).read()
    """)
    popen = subprocess.Popen([*SPMDRUN, "--nproc-per-node", "1", worker], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL)
    assert popen.stdout is not None
    try:
        assert popen.stdout.readline() == b"[rank0]: ready\n"
        baseline = peak_rss_kib(popen.pid)
        with open(fifos[0], "w"):
            pass
        received = 0
        while received < size:
            received += len(popen.stdout.read1(2**20).replace(b"[rank0]: ", b""))
        growth = peak_rss_kib(popen.pid) - baseline
        with open(fifos[1], "w"):
            pass
        assert popen.stdout.read() == b"\n"  # the line ends with the output
        assert popen.wait(timeout=30) == 0
    finally:
        popen.kill()
        popen.wait()
    assert received == size
    assert growth < 200 * 1024, f"the agent's peak memory grew {growth} KiB for a {size}-byte line"


def peak_rss_kib(pid: int) -> int:
    """VmHWM of `pid`: the most resident memory it has had, in KiB."""
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))


def test_two_agents_run_a_2x2_all_reduce_over_loopback(tmp_path: Path) -> None:
    worker = script(tmp_path, "allreduce.py", """
        import os
        import torch
        import spmd
        spmd.init_process_group(backend="tcp")
        t = torch.tensor([float(spmd.get_rank() + 1)])
        spmd.all_reduce(t)
        print("sum", spmd.get_rank(), spmd.get_world_size(), os.environ["GROUP_RANK"], t.item(), flush=True)
        spmd.destroy_process_group()
    """)
    endpoint = f"127.0.0.1:{free_port()}"
    common = ("--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", endpoint, "--rdzv-conf", FAST_RDZV)
    node0 = Launcher(*common, "--node-rank", "0", worker)
    node1 = Launcher(*common, "--node-rank", "1", worker)
    try:
        assert node1.finish(timeout=100) == 0, node1.output
        assert node0.finish(timeout=30) == 0, node0.output
    finally:
        node0.kill()
        node1.kill()
    sums = sorted(line for line in node0.lines + node1.lines if "sum" in line)
    assert sums == [f"[rank{rank}]: sum {rank} 4 {rank // 2} 10.0" for rank in range(4)]
    for node in (node0, node1):  # no token was given: every agent says so, once
        assert sum("has no token" in line for line in node.lines) == 1, node.output


def test_a_stranger_cannot_read_the_rendezvous_of_a_job_with_a_token(tmp_path: Path) -> None:
    from spmd._core.errors import StoreError
    from spmd.comm.store import tcp_wire as wire
    from spmd.comm.store.tcp import TCPStore

    for rank in range(2):
        os.mkfifo(tmp_path / f"go{rank}")
    worker = script(tmp_path, "w.py", f"""
        import os
        print("store", os.environ["MASTER_PORT"], os.environ["SPMD_STORE_TOKEN"], flush=True)
        os.close(os.open(os.path.join({str(tmp_path)!r}, "go" + os.environ["RANK"]), os.O_RDONLY))
    """)
    port = free_port()
    common = ("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "j",
              "--rdzv-conf", FAST_RDZV, "--rdzv-token", "job-secret")
    nodes = [Launcher(*common, "--node-rank", str(rank), worker) for rank in range(2)]
    try:
        for node in nodes:
            node.wait_for_line("store", timeout=60)
        _, master_port, worker_token = next(line for line in nodes[0].lines if "store" in line).split()[-3:]
        key = "spmd/rdzv/j/round/0/master"
        insider = TCPStore("127.0.0.1", port, timeout=5, token="job-secret")
        assert worker_token in insider.get(key).decode()  # the key is there to be read with the token
        insider.close()
        for token in (None, "guess"):
            with pytest.raises(StoreError, match="refused"):
                TCPStore("127.0.0.1", port, timeout=5, token=token)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:  # no handshake at all
            raw.sendall(wire.frame(wire.GET, [key.encode()]))
            reply = b""
            with contextlib.suppress(OSError):
                while chunk := raw.recv(4096):
                    reply += chunk
        assert worker_token.encode() not in reply and master_port.encode() not in reply
        for rank in range(2):
            with open(tmp_path / f"go{rank}", "w"):
                pass
        assert all(node.finish(timeout=60) == 0 for node in nodes), [node.output for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert not any("has no token" in node.output for node in nodes)


def test_agents_with_different_tokens_fail_naming_the_token(tmp_path: Path) -> None:
    worker = script(tmp_path, "w.py", "pass\n")
    endpoint = f"127.0.0.1:{free_port()}"
    common = ("--nnodes", "2", "--rdzv-endpoint", endpoint, "--rdzv-conf", FAST_RDZV)
    host = Launcher(*common, "--node-rank", "0", "--rdzv-token", "one", worker)
    try:
        wait_until(lambda: socket.socket().connect_ex(("127.0.0.1", int(endpoint.split(":")[1]))) == 0, 30,
                   "the rendezvous store to listen")
        code, _, err = run_agent(*common, "--node-rank", "1", "--rdzv-token", "two", worker)
    finally:
        host.kill()
    assert code == 1
    assert "do not share a token" in err and "--rdzv-token" in err, err


def test_elastic_job_regroups_when_a_node_joins_late_and_when_it_dies(tmp_path: Path) -> None:
    worker = script(tmp_path, "elastic.py", """
        import os, time
        print("world", os.environ["WORLD_SIZE"], "round", os.environ["SPMD_ROUND"], os.getpid(), flush=True)
        if os.environ["SPMD_ROUND"] != "2":
            time.sleep(120)  # round 0: wait for the second node; round 1: for its death
    """)
    common = ("--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
              "--rdzv-conf", "last_call_timeout=0.5,heartbeat_interval=0.2,heartbeat_timeout=3", worker)
    first = Launcher(*common)
    second: Launcher | None = None
    try:
        first.wait_for_line("[rank0]: world 1 round 0", timeout=60)
        second = Launcher(*common)
        second.wait_for_line("[rank1]: world 2 round 1", timeout=60)
        first.wait_for_line("[rank0]: world 2 round 1", timeout=30)
        late_worker = int(next(line for line in second.lines if "world 2 round 1" in line).split()[-1])
        second.popen.kill()  # the node dies: its worker goes with it, the other node regroups alone
        second.finish(timeout=30)
        wait_until(lambda: not is_alive(late_worker), 10, "the dead node's worker to die")
        assert first.finish(timeout=60) == 0, first.output
    finally:
        first.kill()
        if second is not None:
            second.kill()
    assert "round 1: 2 node(s), world size 2" in first.output
    assert "round 2: 1 node(s), world size 1" in first.output and "[rank0]: world 1 round 2" in first.output


def test_redirects_tee_and_log_dir(tmp_path: Path) -> None:
    worker = script(tmp_path, "logs.py", """
        import os, sys
        print("out", os.environ["RANK"])
        print("err", os.environ["RANK"], file=sys.stderr)
    """)
    logs = tmp_path / "logs"
    code, out, err = run_agent("--nproc-per-node", "2", "--rdzv-id", "logjob", "--log-dir", str(logs),
                               "--redirects", "0:1", "--tee", "1:3", worker)
    assert code == 0, err
    attempt = logs / "logjob" / "attempt_0"
    assert (attempt / "0" / "stdout.log").read_text() == "out 0\n"
    assert not (attempt / "0" / "stderr.log").exists()
    assert (attempt / "1" / "stdout.log").read_text() == "out 1\n"
    assert (attempt / "1" / "stderr.log").read_text() == "err 1\n"
    assert "[rank0]: out 0" not in out and "[rank1]: out 1" in out
    assert "[rank0]: err 0" in err and "[rank1]: err 1" in err


def test_local_ranks_filter_shows_only_chosen_ranks(tmp_path: Path) -> None:
    worker = script(tmp_path, "filtered.py", """
        import os, sys
        print("out", os.environ["RANK"])
        print("err", os.environ["RANK"], file=sys.stderr)
    """)
    code, out, err = run_agent("--nproc-per-node", "3", "--local-ranks-filter", "0,2", worker)
    assert code == 0, err
    assert sorted(out.splitlines()) == ["[rank0]: out 0", "[rank2]: out 2"]
    assert "[rank1]" not in err and "[rank2]: err 2" in err


STUCK_RANK = """
    import sys
    import torch
    import spmd


    def wait_for_release(fifo):
        print("rank 1 waits", flush=True)
        with open(fifo) as release:                     # blocks until the test opens it for writing
            release.read()


    spmd.init_process_group("auto", timeout=60)
    spmd.barrier()
    if spmd.get_rank() == 1:
        wait_for_release(sys.argv[1])
    spmd.all_reduce(torch.ones(4))
"""


def test_sigusr1_to_the_launcher_prints_what_every_rank_is_doing(tmp_path: Path) -> None:
    fifo = tmp_path / "release"
    os.mkfifo(fifo)
    path = script(tmp_path, "stuck.py", STUCK_RANK)
    lines = Path(path).read_text().splitlines()

    def line_of(code: str) -> int:
        return next(number for number, line in enumerate(lines, 1) if code in line)

    launcher = Launcher("--nproc-per-node", "2", path, str(fifo))
    try:
        launcher.wait_for_line("rank 1 waits", timeout=60)
        launcher.popen.send_signal(signal.SIGUSR1)
        launcher.wait_for_line(f"rank 1 on group 'default' last completed barrier #1 called at "
                               f"stuck.py:{line_of('spmd.barrier()')}", 30)
        status = launcher.output[launcher.output.index("SIGUSR1: what every rank is doing"):]
        assert "rank 0 on group 'default'" in status
        assert (f"now at stuck.py:{line_of('with open(fifo)')} in wait_for_release <- "
                f"stuck.py:{line_of('wait_for_release(sys.argv[1])')} in <module>") in status
        with open(fifo, "w") as release:
            release.write("go")
        assert launcher.finish(timeout=60) == 0
    finally:
        launcher.kill()
