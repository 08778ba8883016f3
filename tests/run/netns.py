"""Two "hosts" on one machine for multi-node tests: network namespaces joined by a veth pair, each process
started in one with its own hostname (which resolves nowhere), optionally its own /etc/hosts and /dev/shm.

Needs root and `ip netns` (Linux); `unavailable()` says why not, for the test's skip reason. Names are unique
per instance, so tests running at the same time on one machine never share a namespace or a link; only
addresses inside the namespaces made here (10.200.0.1 and 10.200.0.2) are used. Names carry the maker's pid:
a run killed before its `close()` (a test timeout, kill -9) leaves its namespaces behind, and the next
`TwoHosts.start()` on the machine removes those whose maker is gone (`remove_stale()`).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess

ADDRESSES = ("10.200.0.1", "10.200.0.2")
# spmdtest-<maker's pid, 7 digits>-<4 hex digits>-<a|b> and the veth ends sp<pid><hex><a|b> (15 characters at most)
NAMESPACE = re.compile(r"^(spmdtest-(\d{7})-[0-9a-f]{4}-[ab])\b", re.M)            # in `ip netns list`
LINK = re.compile(r"^\d+: (sp(\d{7})[0-9a-f]{4}[ab])[@:]", re.M)                 # in `ip -o link show`

# Runs in the namespace: a private UTS and mount namespace, the given hostname, then the optional mounts.
PRELUDE = ('hostname "$0" && '
           '{ [ -z "$SPMD_TEST_HOSTS_FILE" ] || mount --bind "$SPMD_TEST_HOSTS_FILE" /etc/hosts; } && '
           '{ [ -z "$SPMD_TEST_PRIVATE_SHM" ] || mount -t tmpfs -o size=256m tmpfs /dev/shm; } && exec "$@"')


def unavailable() -> str | None:
    """Why this machine can't make the namespaces (None if it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); this test runs as an unprivileged user"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"the {tool!r} tool is not installed, so no network namespaces can be made"
    probe = TwoHosts()
    try:
        probe.start()
    except subprocess.CalledProcessError as error:
        return f"this machine refuses to make network namespaces or veth pairs ({error.stderr.strip()})"
    finally:
        probe.close()
    return None


class TwoHosts:
    """Namespaces A (10.200.0.1) and B (10.200.0.2) joined by one veth pair; `close()` removes both (stop the
    processes started in them first)."""

    def __init__(self) -> None:
        pid, salt = f"{os.getpid():07d}", secrets.token_hex(2)
        self.namespaces = (f"spmdtest-{pid}-{salt}-a", f"spmdtest-{pid}-{salt}-b")
        self.links = (f"sp{pid}{salt}a", f"sp{pid}{salt}b")
        self._made: list[str] = []

    def start(self) -> None:
        remove_stale()
        for namespace in self.namespaces:
            _ip("netns", "add", namespace)
            self._made.append(namespace)
        _ip("link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1])
        for namespace, link, address in zip(self.namespaces, self.links, ADDRESSES):
            _ip("link", "set", link, "netns", namespace)
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", link)
            _ip("-n", namespace, "link", "set", link, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")

    def argv(self, host: int, hostname: str, argv: list[str]) -> list[str]:
        """`argv` run on host 0 (A) or 1 (B) under `hostname`."""
        return ["ip", "netns", "exec", self.namespaces[host], *own_host_argv(hostname, argv)]

    def close(self) -> None:
        for namespace in self._made:            # deleting a namespace deletes its end of the veth pair
            subprocess.run(["ip", "netns", "delete", namespace], capture_output=True, timeout=30)
        self._made.clear()
        subprocess.run(["ip", "link", "delete", self.links[0]], capture_output=True, timeout=30)  # if never moved


def remove_stale() -> list[str]:
    """Remove the namespaces and veth ends made here by processes that have exited; returns their names."""
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=30).stdout
    stale = [("netns", name) for name, pid in NAMESPACE.findall(_netns_list()) if not _alive(int(pid))]
    stale += [("link", name) for name, pid in LINK.findall(links) if not _alive(int(pid))]
    for kind, name in stale:
        subprocess.run(["ip", kind, "delete", name], capture_output=True, timeout=30)
    return [name for _, name in stale]


def listed() -> list[str]:
    """The namespaces made here that exist now (any maker's)."""
    return [name for name, _ in NAMESPACE.findall(_netns_list())]


def _netns_list() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:                     # another user's process
        pass
    return True


def own_host_argv(hostname: str, argv: list[str]) -> list[str]:
    """`argv` run in this network namespace under `hostname` (with the mounts the environment asks for)."""
    return ["unshare", "--uts", "--mount", "--propagation", "private", "sh", "-c", PRELUDE, hostname, *argv]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)
