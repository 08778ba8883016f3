"""The only reader of os.environ inside the library: typed getters for the launcher's variables.

Layer: core. Environment variables are read here and passed on as arguments, never used as flags between modules.
"""

from __future__ import annotations

import math
import os


def _required(name: str) -> str:
    value = os.environ.get(name)
    if value is None or value == "":
        raise ValueError(
            f"spmd: environment variable {name} expected, but not set. Start the program with "
            f"`spmdrun`, or pass rank/world_size and an init_method to init_process_group()."
        )
    return value


def _int(name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"spmd: environment variable {name}={value!r} is not an integer") from None


def required_int(name: str) -> int:
    """An integer variable that must be set (RANK, WORLD_SIZE, MASTER_PORT)."""
    return _int(name, _required(name))


def required_str(name: str) -> str:
    """A string variable that must be set (MASTER_ADDR)."""
    return _required(name)


def optional_str(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return default if value in (None, "") else value


def store_token() -> str | None:
    """The shared secret stores and transports authenticate with (set by the launcher)."""
    return optional_str("SPMD_STORE_TOKEN")


def torchrun_agent_store_attempt() -> int | None:
    """Under torchrun, whose agent serves the job's store to its workers (TORCHELASTIC_USE_AGENT_STORE=True), the
    restart attempt (TORCHELASTIC_RESTART_COUNT) whose keys a worker uses; None otherwise."""
    if optional_str("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return _int("TORCHELASTIC_RESTART_COUNT", optional_str("TORCHELASTIC_RESTART_COUNT", "0") or "0")


def host_identity() -> str | None:
    """An override of this process's host identity, which groups ranks by host (ranks with one identity share
    memory); an opaque label, never resolved as a name (tests fake two hosts with it)."""
    return optional_str("SPMD_HOST_ID")


def socket_address() -> str | None:
    """The address other hosts reach this process's tcp transport at (SPMD_SOCKET_ADDR; spmdrun sets it), when
    the route towards the store picks the wrong interface (several networks, NAT); only groups spanning hosts
    use it."""
    return optional_str("SPMD_SOCKET_ADDR")


def socket_address_source() -> str | None:
    """Where SPMD_SOCKET_ADDR came from, when spmdrun set it (SPMD_SOCKET_ADDR_FROM: its --local-addr, or the
    route it chose), so a worker's error names what its user wrote."""
    return optional_str("SPMD_SOCKET_ADDR_FROM")


def connect_retry_seconds(default: float) -> float:
    """How long the tcp transport retries a peer's published address that refuses or drops connections before it
    calls the address wrong (SPMD_CONNECT_RETRY_S, seconds; NCCL's NCCL_SOCKET_RETRY_* play this part); `default`
    when unset."""
    value = optional_str("SPMD_CONNECT_RETRY_S")
    if value is None:
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if math.isnan(seconds) or seconds <= 0:   # inf: retry until the group's own timeout
        raise ValueError(f"spmd: environment variable SPMD_CONNECT_RETRY_S={value!r} is not a positive number of "
                         f"seconds")
    return seconds


def socket_ifname() -> str | None:
    """The interface whose IPv4 address this process's tcp transport publishes (SPMD_SOCKET_IFNAME), unless
    SPMD_SOCKET_ADDR names the address itself."""
    return optional_str("SPMD_SOCKET_IFNAME")


def file_timer_enabled() -> bool:
    """Whether spmdrun runs a file timer server for its workers' `expires` blocks (torchrun's
    TORCHELASTIC_ENABLE_FILE_TIMER=1)."""
    return optional_str("TORCHELASTIC_ENABLE_FILE_TIMER", "0") == "1"


def timer_file() -> str | None:
    """Where the file timer server's FIFO is to be (TORCHELASTIC_TIMER_FILE; by default spmdrun picks one)."""
    return optional_str("TORCHELASTIC_TIMER_FILE")
