"""The spmd error tree: every error names the rank, the operation and the group it concerns.

Layer: core. Callers catch these types; messages carry what was expected, what was found and what to try.
"""

from __future__ import annotations

import traceback


class SpmdError(RuntimeError):
    """Base of every error spmd raises on purpose (a RuntimeError, as torch.distributed's are).

    `reason` is the failure itself, said once, without the operation, group and rank that saw it (which the
    message adds in front): what a group's error ends with, and what an abort passes on to the peers.
    `seen_by` names the rank that saw the failure first ("rank 2 on hostB") when that is not this rank.
    """

    def __init__(self, message: str = "", *, reason: str | None = None, seen_by: str | None = None) -> None:
        super().__init__(message)
        self.reason = message if reason is None else reason
        self.seen_by = seen_by

    def explained(self, where: str) -> str:
        """The message of this failure as seen at `where`: the place, the reason, and who saw it first."""
        seen = f" (seen first by {self.seen_by})" if self.seen_by else ""
        return f"{where}: {self.reason}{seen}"


class StoreError(SpmdError):
    """A store operation failed: the server is gone, the token was refused, or the address is unusable."""


class StoreAuthError(StoreError):
    """The store and this client do not share the job's token: the server refused it, or could not prove it."""


class StoreTimeoutError(StoreError, TimeoutError):
    """A store `get`/`wait` did not see its keys before the deadline."""


class QueueEmptyError(StoreError):
    """A non-blocking `queue_pop` found its queue empty."""


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

    def explained(self, where: str) -> str:
        return f"{where}: {self.seen_by} aborted the group: {self.reason}" if self.seen_by else super().explained(
            where)


class CheckpointError(SpmdError):
    """A checkpoint can't be written or read: incomplete, corrupted, from a newer format version, or not matching
    the state it is loaded into. torch's CheckpointException: `failures` maps each group rank whose failure made a
    collective save fail to (its error, an empty traceback: the text crossed ranks, not the frames); it is empty
    for an error this rank found by itself."""

    def __init__(self, message: str, failures: dict[int, tuple[BaseException, traceback.StackSummary]] | None = None
                 ) -> None:
        super().__init__(message)
        self.failures = failures or {}

    def __reduce__(self) -> tuple:
        """Pickled whole (the checkpoint process sends it back), failures included: the default keeps only the
        message."""
        return type(self), (str(self), self.failures)


def abort_text(error: BaseException, me: str) -> str:
    """What an abort tells the peers: who saw the failure first (`me` unless it was relayed to it), a NUL, and
    the failure's reason."""
    if isinstance(error, SpmdError):
        return f"{error.seen_by or me}\0{error.reason}"
    return f"{me}\0{type(error).__name__}: {error}"


def parse_abort_text(text: str) -> tuple[str | None, str]:
    """(who saw the failure first, its reason) of an abort_text; (None, text) for text of another form."""
    seen_by, sep, reason = text.partition("\0")
    return (seen_by, reason) if sep else (None, text)


# torch.distributed's names for the same kinds of error, so `except dist.DistBackendError` ports unchanged.
DistError = SpmdError
DistBackendError = CommError
DistStoreError = StoreError
