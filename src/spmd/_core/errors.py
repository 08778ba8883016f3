"""The spmd error tree: every error names the rank, the operation and the group it concerns.

Layer: core. Callers catch these types; messages carry what was expected, what was found and what to try.
"""

from __future__ import annotations


class SpmdError(RuntimeError):
    """Base of every error spmd raises on purpose (a RuntimeError, as torch.distributed's are)."""


class StoreError(SpmdError):
    """A store operation failed: the server is gone, the token was refused, or the address is unusable."""


class StoreAuthError(StoreError):
    """The store and this client do not share the job's token: the server refused it, or could not prove it."""


class StoreTimeoutError(StoreError, TimeoutError):
    """A store `get`/`wait` did not see its keys before the deadline."""


class CommError(SpmdError):
    """A collective or point-to-point operation failed."""


class CommTimeoutError(CommError, TimeoutError):
    """A collective's peers did not arrive before the group's timeout."""


class PeerLostError(CommError):
    """A peer rank's process died or its connection broke during an operation."""


class PeerUnreachableError(CommError):
    """A peer's published address can't be reached from this host (a wrong interface, a firewall, NAT); group
    set-up fails within seconds, naming both hosts, the address and the override to set."""


class CollectiveMismatchError(CommError):
    """Ranks of one group called different collectives (op, shape, dtype, reduce op or root) at one step."""


class GroupAbortedError(CommError):
    """The group was aborted (by this rank or a peer) after an earlier failure; it can't run more operations."""


class CheckpointError(SpmdError):
    """A checkpoint can't be written or read: incomplete, corrupted, from a newer format version, or not matching
    the state it is loaded into."""
