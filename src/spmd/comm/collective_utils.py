"""torch's `collective_utils`: run a function on one rank (or on every rank) and share its result, or its
failure, with the group, so that every rank raises together instead of the others hanging in their next
collective.

Layer: comm. Payloads and exceptions travel through the object collectives (pickled: ranks of one job only).
Unlike torch's, `rank` is a group rank throughout (torch compares it with the group rank but broadcasts from
that global rank), and `all_gather` raises on every rank when the ranks name different stages (torch's drops
those ranks' payloads and raises only if some rank failed too).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from spmd.comm.objects import all_gather_object, broadcast_object_list, portable_exception
from spmd.comm.world import AnyGroup, resolve_group

__all__ = ["SyncPayload", "all_gather", "all_gather_object_enforce_type", "broadcast"]

T = TypeVar("T")


@dataclasses.dataclass
class SyncPayload(Generic[T]):
    """What one rank contributes: its stage, whether it succeeded, its payload, and the exception if it failed."""

    stage_name: str | None
    success: bool
    payload: T
    exception: Exception | None = None


def _run(data_or_fn: T | Callable[[], T], stage_name: str | None) -> SyncPayload[Any]:
    """A payload of `data_or_fn`, called when it is callable; a failure (success False) if it raised."""
    if not callable(data_or_fn):
        return SyncPayload(stage_name, True, data_or_fn)
    try:
        return SyncPayload(stage_name, True, data_or_fn())
    except Exception as error:
        return SyncPayload(stage_name, False, None, portable_exception(error))


def broadcast(data_or_fn: T | Callable[[], T], *, success: bool = True, stage_name: str | None = None,
              rank: int = 0, pg: AnyGroup | None = None) -> T:
    """The data, or the result of calling `data_or_fn`, on group rank `rank`, returned on every rank of `pg`;
    if the call raised there (or that rank passed `success=False`), every rank raises RuntimeError from it.
    Without `pg` nothing travels: the call runs here when `rank` is 0. Collective over `pg`."""
    if not success and data_or_fn is not None:
        raise ValueError("collective_utils.broadcast: a failure (success=False) carries no payload: pass "
                         "data_or_fn=None")
    group = resolve_group(pg, "collective_utils.broadcast") if pg is not None else None
    runs_here = rank == 0 if group is None else group.rank() == rank
    sync: SyncPayload[Any] = SyncPayload(stage_name, success, None)
    if runs_here and success:
        sync = _run(data_or_fn, stage_name)
    if group is not None:
        carried: list[Any] = [sync]
        broadcast_object_list(carried, group=group, group_src=rank)
        sync = carried[0]
    if not sync.success:
        where = f"rank {rank}" if group is None else f"group rank {rank} (global rank {group.ranks[rank]})"
        stage = f": stage {sync.stage_name}" if sync.stage_name is not None else ""
        failure = f": exception {sync.exception}" if sync.exception is not None else ""
        raise RuntimeError(f"collective_utils.broadcast: {where} failed{stage}{failure}") from sync.exception
    return sync.payload


def all_gather(data_or_fn: T | Callable[[], T], stage_name: str | None = None,
               pg: AnyGroup | None = None) -> list[T]:
    """Every rank's data, or result of calling `data_or_fn`, in group rank order, on every rank of `pg`. If a
    rank's call raised, or the ranks name different stages, every rank raises RuntimeError(message,
    [(group rank, exception), ...]) from the first exception. Without `pg`: [this rank's]. Collective over `pg`."""
    sync = _run(data_or_fn, stage_name)
    if pg is None:
        if not sync.success:
            raise RuntimeError(f"collective_utils.all_gather failed with exception {sync.exception}") \
                from sync.exception
        return [sync.payload]
    group = resolve_group(pg, "collective_utils.all_gather")
    gathered: list[Any] = [None] * group.size()
    all_gather_object_enforce_type(group, gathered, sync)
    stage = gathered[0].stage_name
    strays = [index for index, each in enumerate(gathered) if each.stage_name != stage]
    failures = [(index, each.exception) for index, each in enumerate(gathered) if not each.success]
    if strays or failures:
        message = "collective_utils.all_gather:"
        if strays:
            message += (f" group ranks {strays} are at stages {[gathered[index].stage_name for index in strays]}, "
                        f"group rank 0 at stage {stage}")
        if failures:
            message += f" group ranks {[index for index, _ in failures]} failed"
        raise RuntimeError(message, failures) from (failures[0][1] if failures else None)
    return [each.payload for each in gathered]


def all_gather_object_enforce_type(pg: AnyGroup, object_list: list[Any], obj: Any,
                                   type_checker: Callable[[Any, Any], bool] = lambda x, y: type(x) is type(y)
                                   ) -> None:
    """all_gather_object, then TypeError on every rank unless `type_checker(object_list[0], each)` holds for every
    gathered object (by default: the same type): a rank that took another branch is found, not unpickled into
    the wrong place. Collective."""
    all_gather_object(object_list, obj, group=pg)
    for index in range(1, len(object_list)):
        if not type_checker(object_list[0], object_list[index]):
            raise TypeError(f"all_gather_object_enforce_type: the object of group rank {index} is a "
                            f"{type(object_list[index])}, the first rank's a {type(object_list[0])}")
