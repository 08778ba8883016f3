"""Point-to-point operations: send, recv, isend, irecv, P2POp and batch_isend_irecv.

Layer: comm. Messages between one pair of ranks with one tag arrive in the order they were sent; sends are
buffered by the transport, so a pair of ranks may each isend before they irecv without deadlock.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

from torch import Tensor

from spmd._core.errors import CommTimeoutError
from spmd.comm.collectives import check_contiguous, check_tensor
from spmd.comm.debug import dtype_name, user_call_site
from spmd.comm.group import ProcessGroup
from spmd.comm.transports.base import P2PStart
from spmd.comm.work import Work
from spmd.comm.world import AnyGroup, resolve_group


def _peer(group: ProcessGroup, peer: int | None, group_peer: int | None, op: str, role: str) -> int:
    where = f"{op} on rank {group.global_rank} of {group.description}"
    if (peer is None) == (group_peer is None):
        raise ValueError(f"{where}: pass exactly one of {role} and group_{role}")
    if group_peer is None:
        return group.group_rank_of(peer, f"{where}: {role}")
    if isinstance(group_peer, bool) or not isinstance(group_peer, int) or not 0 <= group_peer < group.size():
        raise ValueError(f"{where}: group_{role}={group_peer!r} is out of range for a group of {group.size()} "
                         f"ranks (group ranks are 0..{group.size() - 1})")
    return group_peer


def _work(op: str, tensor: Tensor, pg: ProcessGroup, target: int, tag: int) -> Work:
    """The Work of one checked send or receive, with its flight-recorder entry."""
    name, description = pg.p2p_names(op, target, tag)
    record = pg.next_p2p_record(name, tuple(tensor.shape), dtype_name(tensor.dtype), user_call_site())
    work = Work(description, [tensor], record)
    if op == "irecv":
        work.source = target
    return work


def _start(op: str, tensor: Tensor, pg: ProcessGroup, target: int, tag: int) -> Work:
    check_tensor(tensor, "tensor", op, pg)
    check_contiguous(tensor, "tensor", op, pg)
    work = _work(op, tensor, pg, target, tag)
    start: Callable[[Tensor, int, int, Work], None] = pg.transport.isend if op == "isend" else pg.transport.irecv
    try:
        start(tensor, target, tag, work)
    except BaseException as error:   # abort the group, then report
        assert work.record is not None
        raise pg.p2p_failed(work.record, error) from error
    return work


def isend(tensor: Tensor, dst: int | None = None, group: AnyGroup | None = None, tag: int = 0,
          group_dst: int | None = None) -> Work:
    """Start sending `tensor` to rank `dst`; don't modify `tensor` until the returned Work completes."""
    pg = resolve_group(group, "isend")
    return _start("isend", tensor, pg, _peer(pg, dst, group_dst, "isend", "dst"), tag)


def irecv(tensor: Tensor, src: int | None = None, group: AnyGroup | None = None, tag: int = 0,
          group_src: int | None = None) -> Work:
    """Start receiving the next message from rank `src` with `tag` into `tensor`."""
    pg = resolve_group(group, "irecv")
    return _start("irecv", tensor, pg, _peer(pg, src, group_src, "irecv", "src"), tag)


def _wait(pg: ProcessGroup, work: Work) -> None:
    try:
        work.wait(timeout=pg.timeout)
    except CommTimeoutError as error:
        assert work.record is not None
        raise pg.p2p_failed(work.record, CommTimeoutError(f"no matching peer operation within {pg.timeout:.1f}s"))\
            from error


def send(tensor: Tensor, dst: int | None = None, group: AnyGroup | None = None, tag: int = 0,
         group_dst: int | None = None) -> None:
    """Send `tensor` to rank `dst` and return once it may be reused."""
    pg = resolve_group(group, "send")
    target = _peer(pg, dst, group_dst, "send", "dst")
    if target == pg.group_rank:
        raise ValueError(f"send on rank {pg.global_rank}: a rank can't send to itself; use isend/irecv pairs")
    _wait(pg, _start("isend", tensor, pg, target, tag))


def recv(tensor: Tensor, src: int | None = None, group: AnyGroup | None = None, tag: int = 0,
         group_src: int | None = None) -> int:
    """Receive the next message from rank `src` with `tag` into `tensor`; returns `src`."""
    pg = resolve_group(group, "recv")
    if src is None and group_src is None:
        raise ValueError(f"recv on rank {pg.global_rank}: receiving from any source is not supported; pass src")
    target = _peer(pg, src, group_src, "recv", "src")
    if target == pg.group_rank:
        raise ValueError(f"recv on rank {pg.global_rank}: a rank can't receive from itself")
    _wait(pg, _start("irecv", tensor, pg, target, tag))
    return pg.ranks[target]


@dataclasses.dataclass
class P2POp:
    """One operation of batch_isend_irecv: `op` is spmd.isend or spmd.irecv."""

    op: Callable[..., Work]
    tensor: Tensor
    peer: int | None = None
    group: AnyGroup | None = None
    tag: int = 0
    group_peer: int | None = None

    def __post_init__(self) -> None:
        if self.op not in (isend, irecv):
            raise ValueError(f"P2POp.op must be spmd.isend or spmd.irecv, got {self.op!r}")


def batch_isend_irecv(p2p_op_list: list[P2POp]) -> list[Work]:
    """Start every operation of the list; returns their Works in the same order."""
    if not p2p_op_list:
        raise ValueError("batch_isend_irecv: the list of P2POp is empty")
    planned = []
    for item in p2p_op_list:       # every item is checked before the first one starts
        if not isinstance(item, P2POp):
            raise TypeError(f"batch_isend_irecv: expected P2POp items, got {type(item).__name__}")
        op = "isend" if item.op is isend else "irecv"
        pg = resolve_group(item.group, op)
        target = _peer(pg, item.peer, item.group_peer, op, "dst" if op == "isend" else "src")
        check_tensor(item.tensor, "tensor", op, pg)
        check_contiguous(item.tensor, "tensor", op, pg)
        planned.append((op, item.tensor, pg, target, item.tag))
    works = [_work(*plan) for plan in planned]
    started = 0
    for pg, run in itertools.groupby(zip(planned, works, strict=True), key=lambda pair: pair[0][2]):
        ops: list[P2PStart] = [(op, tensor, target, tag, work) for (op, tensor, _, target, tag), work in run]
        try:
            pg.transport.start_p2p_batch(ops)
        except BaseException as failure:   # abort the group, fail the Works not started (none is handed back)
            assert ops[0][4].record is not None
            error = pg.p2p_failed(ops[0][4].record, failure)
            for work in works[started:]:
                work.to_failed(error)
            raise error from failure
        started += len(ops)
    return works
