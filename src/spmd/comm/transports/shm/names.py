"""Names of the shm transport's segments in /dev/shm, and the sweep that removes those a dead job left.

Layer: comm, without torch, so that spmdrun's agent can sweep after its workers stop without importing
torch. A segment's name is spmd-<creator pid>-<random>; its group unlinks it as soon as every rank has
mapped it (see segment), so only a job killed during group set-up leaves a name behind.
"""

from __future__ import annotations

import contextlib
import os

SHM_DIR = "/dev/shm"
NAME_PREFIX = "spmd-"         # spmd-<creator pid>-<random>: the sweep finds a dead creator's names


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


def remove_orphan_segments(directory: str = SHM_DIR) -> list[str]:
    """Unlink spmd segments whose creating process is dead; returns their names.

    Segments of live processes (other jobs included) are left alone. spmdrun's agent calls this whenever
    its workers have stopped; tests call it too.
    """
    try:
        names = os.listdir(directory)
    except FileNotFoundError:     # no /dev/shm here: nothing to sweep
        return []
    removed = []
    for name in names:
        if not name.startswith(NAME_PREFIX):
            continue
        try:
            pid = int(name.split("-")[1])
        except (IndexError, ValueError):
            continue
        if pid != os.getpid() and process_start_time(pid) is None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))
                removed.append(name)
    return removed
