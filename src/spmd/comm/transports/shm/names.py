"""Names of the shm transport's segments in /dev/shm, and the sweep that removes those a dead job left.

Layer: comm, without torch, so that spmdrun's agent can sweep after its workers stop without importing
torch. Its group unlinks a segment's name as soon as every rank has mapped it (see segment), so only a job
killed during group set-up (create -> all attached) leaves a name behind; every new segment first sweeps
such names, so they don't outlive the next shm set-up on the machine, launcher or not.

A name is spmd-<creator pid>-<its start time>-<its pid namespace>-<random>. The start time (clock ticks
since boot, from /proc/<pid>/stat) tells a live creator from a later process that reuses its pid; the pid
namespace keeps a sweep to the names of processes it can see: containers sharing /dev/shm but not pids
never remove each other's segments.
"""

from __future__ import annotations

import contextlib
import os
import secrets

SHM_DIR = "/dev/shm"
NAME_PREFIX = "spmd-"         # spmd-<pid>-<start time>-<pid namespace>-<random>


def process_start_time(pid: int) -> int | None:
    """The start time of `pid` (clock ticks since boot), or None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def _pid_namespace() -> int:
    """The inode of this process's pid namespace (0 where /proc doesn't say)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def new_segment_name() -> str:
    """A fresh name for a segment this process creates (see the module docstring)."""
    pid = os.getpid()
    return f"{NAME_PREFIX}{pid}-{process_start_time(pid) or 0}-{_pid_namespace()}-{secrets.token_hex(8)}"


def _orphaned(name: str, namespace: int) -> bool:
    """Whether `name` is a segment name of a process of `namespace` that no longer runs."""
    parts = name[len(NAME_PREFIX):].split("-")
    if len(parts) != 4 or not all(part.isdigit() for part in parts[:3]):
        return False
    pid, start, name_namespace = (int(part) for part in parts[:3])
    return name_namespace == namespace and process_start_time(pid) != start


def remove_orphan_segments(directory: str = SHM_DIR) -> list[str]:
    """Unlink spmd segments whose creating process is dead; returns their names.

    Segments of live processes (other jobs included), and of processes outside this pid namespace, are left
    alone. Every new segment calls this first; spmdrun's agent calls it whenever its workers have stopped.
    """
    if process_start_time(os.getpid()) is None:    # no /proc here: no way to tell live creators from dead
        return []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:     # no /dev/shm here: nothing to sweep
        return []
    namespace = _pid_namespace()
    removed = []
    for name in names:
        if name.startswith(NAME_PREFIX) and _orphaned(name, namespace):
            with contextlib.suppress(FileNotFoundError, PermissionError):   # swept by another, or not ours
                os.unlink(os.path.join(directory, name))
                removed.append(name)
    return removed
