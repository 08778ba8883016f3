"""The agent's watchdog: when the agent dies, even by SIGKILL, kill its workers' process groups and sweep /dev/shm.

Layer: run. Started by spmd.run.process.Watchdog as `python .../spmd/run/watchdog.py FD MARK` (a file, like
bootstrap, so it starts in milliseconds); FD is the read end of a pipe whose write end only the agent holds, MARK
the `NAME=value` entry every worker has in its environment. The agent writes `+PGID` when a worker starts and
`-PGID` once that worker's group is dead. End of file means the agent is gone or done: every group still tracked
gets SIGKILL, and so does every process whose environment holds MARK (the workers' descendants that left their
group: setsid, a daemon's double fork; not those that cleared their environment); once they are gone (or after
GROUP_EXIT_S), the shared-memory names their processes left are removed, and the watchdog exits.
"""

import sys

if __name__ == "__main__":
    del sys.path[0]  # this directory, whose modules (config, process, ...) would shadow others of the same name

import os
import signal
import time

GROUP_EXIT_S = 5.0  # how long to wait for killed groups to empty before sweeping anyway


def tracked_groups(fd: int) -> set[int]:
    """Follow the agent's `+PGID` / `-PGID` lines until end of file; the groups still running then."""
    groups: set[int] = set()
    pending = b""
    with os.fdopen(fd, "rb", buffering=0) as pipe:
        while chunk := pipe.read(4096):
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                pgid = int(line[1:])
                if line.startswith(b"+"):
                    groups.add(pgid)
                else:
                    groups.discard(pgid)
    return groups


def kill_groups(groups: set[int]) -> None:
    """SIGKILL each group and wait (up to GROUP_EXIT_S) until none of their processes is left."""
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + GROUP_EXIT_S
    alive = set(groups)
    while alive and time.monotonic() < deadline:
        for pgid in list(alive):
            try:
                os.killpg(pgid, 0)
            except (ProcessLookupError, PermissionError):
                alive.discard(pgid)
        if alive:
            time.sleep(0.02)  # polling processes this process did not start: nothing to wait on


def marked_processes(mark: bytes) -> list[int]:
    """The live processes (other than this one) whose environment holds the entry `mark`."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as environ:
                entries = environ.read().split(b"\0")
        except OSError:   # gone meanwhile, or not ours to read
            continue
        if mark in entries:   # a zombie's environment reads empty: the dead are not found again
            found.append(int(name))
    return found


def kill_marked(mark: bytes) -> None:
    """SIGKILL every process holding `mark` until a scan finds none (what they fork meanwhile is found by the
    next), for at most GROUP_EXIT_S."""
    deadline = time.monotonic() + GROUP_EXIT_S
    while (found := marked_processes(mark)) and time.monotonic() < deadline:
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.02)   # let the kills land before the next scan


def sweep_shared_memory() -> None:
    """Remove the /dev/shm names whose creators are dead (spmd.comm.transports.shm.names)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from spmd.comm.transports.shm.names import remove_orphan_segments

    remove_orphan_segments()


def main() -> None:
    groups = tracked_groups(int(sys.argv[1]))
    kill_groups(groups)
    if sys.platform == "linux":
        kill_marked(os.fsencode(sys.argv[2]))
    sweep_shared_memory()


if __name__ == "__main__":
    main()
