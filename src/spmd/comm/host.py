"""Host identity: which ranks are on one host, in the sense shared memory needs.

Layer: comm. Ranks share memory only when they can open each other's files in /dev/shm (one tmpfs mount,
identified by its device and inode), reach each other's abstract unix sockets (one network namespace), see
each other's pids (one pid namespace), under one running kernel (its boot id). Containers with one hostname but
private /dev/shm or namespaces therefore get different identities, and the hierarchical or tcp path is chosen
by itself. SPMD_HOST_ID overrides the identity; it is an opaque label, never resolved as a name.
"""

from __future__ import annotations

import os
import secrets
import socket

from spmd._core import env
from spmd.comm.transports.shm.names import SHM_DIR

BOOT_ID = "/proc/sys/kernel/random/boot_id"
NAMESPACES = ("net", "pid", "ipc")


def host_identity() -> str:
    """This process's host identity: SPMD_HOST_ID, else the hostname with what shared memory depends on."""
    override = env.host_identity()
    if override is not None:
        return override
    hostname = socket.gethostname()
    if not os.access(SHM_DIR, os.W_OK | os.X_OK):     # no shared memory here: a host of its own
        return f"{hostname}/no-shm/{os.getpid()}-{secrets.token_hex(4)}"
    shm = os.stat(SHM_DIR)
    parts = [hostname, _boot_id(), f"shm={shm.st_dev}:{shm.st_ino}"]
    for namespace in NAMESPACES:
        try:
            parts.append(f"{namespace}={os.stat(f'/proc/self/ns/{namespace}').st_ino}")
        except OSError:
            parts.append(f"{namespace}=?")
    return "/".join(parts)


def _boot_id() -> str:
    try:
        with open(BOOT_ID, encoding="ascii") as file:
            return file.read().strip()
    except OSError:
        return "?"
