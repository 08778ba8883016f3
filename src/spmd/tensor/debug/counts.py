"""CommCounts: collective counts keyed by torch's functional-collective names, found by any of their names.

Layer: tensor (pure data; imports nothing from spmd).

spmd names a collective by its kind in its Fingerprint ("all_gather", "reduce_scatter", "all_to_all"); torch's
CommDebugMode keys its counts by functional-collective ops (all_gather_into_tensor, reduce_scatter_tensor,
all_to_all_single). Counts here are stored under torch's names, and every lookup translates its key first: a
string, or anything with a `__name__` (spmd's collective functions, spmd.comm.functional's out-of-place ones,
a torch op or op overload), to the canonical name. So a test ported from torch that reads
`counts[funcol.all_gather_into_tensor]` reads `counts[spmd.comm.collectives.all_gather_into_tensor]`, or
`counts["all_gather_into_tensor"]`, or `counts["all_gather"]`, and gets the same number.

The list and tensor forms of one collective (all_gather and all_gather_into_tensor, reduce_scatter and
reduce_scatter_tensor, all_to_all and all_to_all_single) are one kind on the wire, so they share one count.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

# A Fingerprint's op -> torch's functional-collective name, where they differ.
_TORCH_NAMES = {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor",
                "all_to_all": "all_to_all_single"}

# Every other name a collective goes by: spmd's public and out-of-place functions, torch's funcol functions,
# its c10d ops and DTensor's shard_dim_alltoall.
_ALIASES = {
    **dict.fromkeys(("all_reduced", "allreduce_"), "all_reduce"),
    **dict.fromkeys(("all_gather", "all_gathered", "all_gather_tensor", "allgather_", "_allgather_base_"),
                    "all_gather_into_tensor"),
    **dict.fromkeys(("reduce_scatter", "reduce_scattered", "reduce_scatter_", "_reduce_scatter_base_"),
                    "reduce_scatter_tensor"),
    **dict.fromkeys(("all_to_all", "all_to_all_dims", "alltoall_", "alltoall_base_", "shard_dim_alltoall"),
                    "all_to_all_single"),
    "broadcast_": "broadcast", "reduce_": "reduce", "gather_": "gather", "scatter_": "scatter",
}


def torch_name(op: str) -> str:
    """torch's name for the collective a Fingerprint calls `op`."""
    return _TORCH_NAMES.get(op, op)


def collective_key(key: Any) -> Any:
    """The canonical name `key` stands for: a string, or the `__name__` of a function or torch op (an op
    overload counts as its packet; a namespace prefix such as "c10d_functional." is dropped). Anything else is
    returned unchanged."""
    packet = getattr(key, "_overloadpacket", None)   # torch.ops.x.y.default -> torch.ops.x.y
    if packet is not None:
        key = packet
    name = key if isinstance(key, str) else getattr(key, "__name__", None)
    if not isinstance(name, str):
        return key
    name = name.rpartition(".")[2]
    return _ALIASES.get(name, name)


class CommCounts(dict):
    """Counts per collective (a dict of canonical name -> int). A missing collective reads as 0, and lookups,
    assignment and comparison translate keys with `collective_key` (see the module docstring)."""

    def __init__(self, counts: Mapping[Any, int] | Iterable[tuple[Any, int]] = ()) -> None:
        super().__init__()
        items = counts.items() if isinstance(counts, Mapping) else counts
        for key, value in items:
            self[key] = self[key] + value

    def __missing__(self, key: Any) -> int:
        return 0

    def __getitem__(self, key: Any) -> int:
        return super().__getitem__(collective_key(key))

    def __setitem__(self, key: Any, value: int) -> None:
        super().__setitem__(collective_key(key), value)

    def __delitem__(self, key: Any) -> None:
        super().__delitem__(collective_key(key))

    def __contains__(self, key: object) -> bool:
        return super().__contains__(collective_key(key))

    def get(self, key: Any, default: Any = None) -> Any:
        return super().get(collective_key(key), default)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return dict.__eq__(self, CommCounts(other))
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"CommCounts({dict.__repr__(self)})"
