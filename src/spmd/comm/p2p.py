"""Point-to-point operations: send, recv, isend, irecv, P2POp and batch_isend_irecv.

Layer: comm. Messages between one pair of ranks with one tag arrive in the order they were sent; sends are
buffered by the transport, so a pair of ranks may each isend before they irecv without deadlock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from torch import Tensor

from spmd._core.errors import CommTimeoutError
from spmd.comm.collectives import check_tensor
from spmd.comm.debug import user_call_site
from spmd.comm.group import ProcessGroup
from spmd.comm.work import Work
from spmd.comm.world import AnyGroup, resolve_group


def _peer(group: ProcessGroup, peer: int | None, group_peer: int | None, op: str, role: str) -> int:
    if (peer is None) == (group_peer is None):
        raise ValueError(f"{op} on rank {group.global_rank}: pass exactly one of {role} and group_{role}")
    if group_peer is None:
        group_peer = group.group_rank_of(peer, f"{op} {role}")
    elif not 0 <= group_peer < group.size():
        raise ValueError(f"{op} on rank {group.global_rank}: group_{role}={group_peer} is out of range for "
                         f"{group.description}")
    return group_peer


def _start(op: str, tensor: Tensor, peer: int | None, group: AnyGroup | None, tag: int,
           group_peer: int | None) -> tuple[ProcessGroup, Work]:
    pg = resolve_group(group, op)
    check_tensor(tensor, "tensor", op, pg)
    role = "dst" if op == "isend" else "src"
    target = _peer(pg, peer, group_peer, op, role)
    arrow = f"{pg.global_rank}->{pg.ranks[target]}" if op == "isend" else f"{pg.ranks[target]}->{pg.global_rank}"
    record = pg.next_p2p_record(f"{op} {arrow} tag {tag}", tuple(tensor.shape),
                                str(tensor.dtype).removeprefix("torch."), user_call_site())
    work = Work(f"{op} {arrow} (tag {tag}) on {pg.description}", [tensor], record)
    start: Callable[[Tensor, int, int, Work], None] = pg.transport.isend if op == "isend" else pg.transport.irecv
    try:
        start(tensor, target, tag, work)
    except BaseException as error:   # abort the group, then report
        raise pg.p2p_failed(record, error) from error
    return pg, work


def isend(tensor: Tensor, dst: int | None = None, group: AnyGroup | None = None, tag: int = 0,
          group_dst: int | None = None) -> Work:
    """Start sending `tensor` to rank `dst`; don't modify `tensor` until the returned Work completes."""
    return _start("isend", tensor, dst, group, tag, group_dst)[1]


def irecv(tensor: Tensor, src: int | None = None, group: AnyGroup | None = None, tag: int = 0,
          group_src: int | None = None) -> Work:
    """Start receiving the next message from rank `src` with `tag` into `tensor`."""
    return _start("irecv", tensor, src, group, tag, group_src)[1]


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
    _, work = _start("isend", tensor, None, pg, tag, target)
    _wait(pg, work)


def recv(tensor: Tensor, src: int | None = None, group: AnyGroup | None = None, tag: int = 0,
         group_src: int | None = None) -> int:
    """Receive the next message from rank `src` with `tag` into `tensor`; returns `src`."""
    pg = resolve_group(group, "recv")
    if src is None and group_src is None:
        raise ValueError(f"recv on rank {pg.global_rank}: receiving from any source is not supported; pass src")
    target = _peer(pg, src, group_src, "recv", "src")
    if target == pg.group_rank:
        raise ValueError(f"recv on rank {pg.global_rank}: a rank can't receive from itself")
    _, work = _start("irecv", tensor, None, pg, tag, target)
    _wait(pg, work)
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
    works = []
    for item in p2p_op_list:
        if not isinstance(item, P2POp):
            raise TypeError(f"batch_isend_irecv: expected P2POp items, got {type(item).__name__}")
        op = "isend" if item.op is isend else "irecv"
        works.append(_start(op, item.tensor, item.peer, item.group, item.tag, item.group_peer)[1])
    return works
