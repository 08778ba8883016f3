"""The collective test matrix every transport runs: every op x dtypes x sizes x world sizes 1-4 x default group
and subgroups x sync/async, with expected values computed locally from the same seeded inputs.

Ranks are threads (spmd.testing.run_ranks) talking over the transport under test, so the matrix stays fast; a
new transport joins by adding its name to TRANSPORTS. Each test runs one family of ops on one world, on the
default group and on the subgroups of SUBGROUPS (non-contiguous, and a group of one), looping over
CASES inside, so the set-up of a world is paid once per family. Inputs are small integers in every dtype, so
sums and products are exact and results must match the reference bit for bit (AVG: the last bit of one division).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

import spmd
from spmd import ReduceOp
from spmd.testing import run_ranks

TRANSPORTS = ["threads", "tcp", "shm", "torch:gloo"]
WORLD_SIZES = [1, 2, 3, 4]
SUBGROUPS: dict[int, list[list[int]]] = {1: [], 2: [], 3: [[2, 0]], 4: [[0, 2, 3], [1, 3], [2]]}

FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
INTS = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool]
DTYPES = FLOATS + INTS
# (dtype, numel): 0, 1 and odd sizes in every dtype; sizes past the small-message limit (64 KiB) in a few, so
# the ring/chain algorithms run with blocks that don't divide evenly, and one past 1 MiB.
CASES: list[tuple[torch.dtype, int]] = [(dtype, numel) for dtype in DTYPES for numel in (0, 1, 7)] + [
    (torch.float32, 16411), (torch.float32, 262147), (torch.bfloat16, 40009), (torch.int64, 9001),
    (torch.bool, 70001), (torch.float16, 33333)]
LARGE = 1 << 13


Body = Callable[[int, spmd.ProcessGroup | None, list[int]], None]


def run_matrix(transport: str, world_size: int, body: Body, timeout: float = 90.0) -> None:
    """Run body(rank, group, members) on every group of the world this rank belongs to (default first)."""

    def fn(rank: int, size: int) -> None:
        groups: list[tuple[spmd.ProcessGroup | None, list[int]]] = [(None, list(range(size)))]
        for ranks in SUBGROUPS[size]:
            group = spmd.new_group(ranks)
            if rank in ranks:
                groups.append((group, sorted(ranks)))
        for group, members in groups:
            body(rank, group, members)

    run_ranks(fn, world_size, timeout=timeout, backend=transport)


def value(rank: int, numel: int, dtype: torch.dtype, salt: int) -> Tensor:
    """Rank `rank`'s input: small integers (exact sums/products in every dtype), seeded by (rank, salt)."""
    generator = torch.Generator().manual_seed(rank * 1000003 + salt * 7919 + numel)
    if dtype is torch.bool:
        return torch.randint(0, 2, (numel,), generator=generator).bool()
    low = 0 if dtype is torch.uint8 else -3
    return torch.randint(low, 4, (numel,), generator=generator).to(dtype)


def reference(inputs: list[Tensor], op: ReduceOp) -> Tensor:
    stack = torch.stack(inputs)
    dtype = stack.dtype
    if dtype is torch.bool and op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.BOR):
        return stack.any(0)
    if dtype is torch.bool and op in (ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.BAND):
        return stack.all(0)
    if op is ReduceOp.SUM:
        return stack.sum(0, dtype=dtype)
    if op is ReduceOp.AVG:
        return (stack.double().sum(0) / len(inputs)).to(dtype)
    if op is ReduceOp.PRODUCT:
        return stack.prod(0, dtype=dtype)
    if op is ReduceOp.MIN:
        return stack.amin(0)
    if op is ReduceOp.MAX:
        return stack.amax(0)
    kernel = {ReduceOp.BAND: torch.bitwise_and, ReduceOp.BOR: torch.bitwise_or, ReduceOp.BXOR: torch.bitwise_xor}[op]
    return functools.reduce(kernel, inputs)


def ops_for(dtype: torch.dtype, numel: int) -> list[ReduceOp]:
    if numel >= LARGE:
        return [ReduceOp.SUM, ReduceOp.MAX]
    if dtype.is_floating_point:
        return [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX]
    return [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR]


def check(actual: Tensor, expected: Tensor, what: str, op: ReduceOp | None = None) -> None:
    """Bit for bit, but for AVG: one division of the exact sum, rounded in the dtype (the reference rounds the
    exact quotient once from float64, so the two may differ by the last bit of a float dtype)."""
    rtol = torch.finfo(actual.dtype).eps if op is ReduceOp.AVG else 0.0
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=0, equal_nan=False,
                               msg=lambda message: f"{what}: {message}")


def finish(work: spmd.Work | None, async_op: bool) -> None:
    assert (work is not None) == async_op
    if work is not None:
        work.wait()
        assert work.is_completed()


# -- families -----------------------------------------------------------------------------------------------


def all_reduce_family(rank: int, group: spmd.ProcessGroup | None, members: list[int]) -> None:
    for index, (dtype, numel) in enumerate(CASES):
        for op in ops_for(dtype, numel):
            async_op = index % 2 == 1
            salt = index * 16 + list(ReduceOp).index(op)
            t = value(rank, numel, dtype, salt)
            finish(spmd.all_reduce(t, op=op, group=group, async_op=async_op), async_op)
            check(t, reference([value(r, numel, dtype, salt) for r in members], op),
                  f"all_reduce {op} {dtype} numel={numel} ranks={members}", op)
    for shape in [(), (3, 5)]:    # a 0-d tensor and a 2-d one keep their shapes
        t = value(rank, max(1, len(shape) and 15), torch.float32, 99).reshape(shape)
        spmd.all_reduce(t, group=group)
        expected = reference([value(r, max(1, len(shape) and 15), torch.float32, 99) for r in members],
                             ReduceOp.SUM).reshape(shape)
        check(t, expected, f"all_reduce of shape {shape}")


def rooted_family(rank: int, group: spmd.ProcessGroup | None, members: list[int]) -> None:
    n = len(members)
    me = members.index(rank)
    for index, (dtype, numel) in enumerate(CASES):
        async_op = index % 2 == 0
        root = members[index % n]
        inputs = [value(r, numel, dtype, index) for r in members]

        t = inputs[me].clone()
        finish(spmd.broadcast(t, src=root, group=group, async_op=async_op), async_op)
        check(t, inputs[members.index(root)], f"broadcast {dtype} numel={numel} root={root}")

        op = ReduceOp.MAX if index % 3 else ReduceOp.SUM
        t = inputs[me].clone()
        finish(spmd.reduce(t, dst=root, op=op, group=group, async_op=async_op), async_op)
        check(t, reference(inputs, op) if rank == root else inputs[me], f"reduce {op} {dtype} numel={numel}")

        gather_list = [torch.empty(numel, dtype=dtype) for _ in members] if rank == root else None
        finish(spmd.gather(inputs[me], gather_list, dst=root, group=group, async_op=async_op), async_op)
        if gather_list is not None:
            for r, got in zip(members, gather_list):
                check(got, inputs[members.index(r)], f"gather {dtype} numel={numel} from {r}")

        blocks = [value(root * 31 + j, numel, dtype, index) for j in range(n)]
        out = torch.empty(numel, dtype=dtype)
        scatter_list = blocks if rank == root else None
        finish(spmd.scatter(out, scatter_list, src=root, group=group, async_op=async_op), async_op)
        check(out, blocks[me], f"scatter {dtype} numel={numel} root={root}")


def gather_family(rank: int, group: spmd.ProcessGroup | None, members: list[int]) -> None:
    n = len(members)
    for index, (dtype, numel) in enumerate(CASES):
        async_op = index % 2 == 1
        inputs = [value(r, numel, dtype, index) for r in members]
        mine = inputs[members.index(rank)]
        out = torch.empty(n * numel, dtype=dtype)
        finish(spmd.all_gather_into_tensor(out, mine, group=group, async_op=async_op), async_op)
        check(out, torch.cat(inputs), f"all_gather_into_tensor {dtype} numel={numel}")
        outs = [torch.empty(numel, dtype=dtype) for _ in members]
        finish(spmd.all_gather(outs, mine, group=group, async_op=async_op), async_op)
        for got, want in zip(outs, inputs):
            check(got, want, f"all_gather {dtype} numel={numel}")
    two_d = value(rank, 6, torch.float64, 5).reshape(2, 3)     # gathers along dim 0 keep the row shape
    out = torch.empty(2 * n, 3, dtype=torch.float64)
    spmd.all_gather_into_tensor(out, two_d, group=group)
    check(out, torch.cat([value(r, 6, torch.float64, 5).reshape(2, 3) for r in members]), "all_gather 2-d")
    sizes = uneven_sizes(n)                 # a list of uneven sizes (torch's NCCL takes it; its gloo refuses)
    for dtype, async_op in ((torch.float32, False), (torch.int64, True)):
        outs = [torch.empty(size, dtype=dtype) for size in sizes]
        mine = value(rank, sizes[members.index(rank)], dtype, 11)
        finish(spmd.all_gather(outs, mine, group=group, async_op=async_op), async_op)
        for got, member, size in zip(outs, members, sizes):
            check(got, value(member, size, dtype, 11), f"all_gather uneven {dtype} sizes={sizes}")


def uneven_sizes(n: int) -> list[int]:
    """Sizes of a list collective's pieces, one per group rank: uneven, one of them 0 in a group of four."""
    return [(3 * i + 1) % 5 for i in range(n)]


def reduce_scatter_family(rank: int, group: spmd.ProcessGroup | None, members: list[int]) -> None:
    n = len(members)
    me = members.index(rank)
    for index, (dtype, numel) in enumerate(CASES):
        async_op = index % 2 == 0
        op = ReduceOp.SUM if index % 2 else (ReduceOp.MIN if dtype is not torch.bool else ReduceOp.BAND)
        inputs = [value(r, n * numel, dtype, index) for r in members]
        expected = reference(inputs, op)[me * numel:(me + 1) * numel]
        out = torch.empty(numel, dtype=dtype)
        finish(spmd.reduce_scatter_tensor(out, inputs[me], op=op, group=group, async_op=async_op), async_op)
        check(out, expected, f"reduce_scatter_tensor {op} {dtype} numel={numel}")
        out = torch.empty(numel, dtype=dtype)
        finish(spmd.reduce_scatter(out, list(inputs[me].chunk(n)) if numel else [torch.empty(0, dtype=dtype)] * n,
                                   op=op, group=group, async_op=async_op), async_op)
        check(out, expected, f"reduce_scatter {op} {dtype} numel={numel}")
    inputs = [value(r, n * 5, torch.float32, 77) for r in members]
    out = torch.empty(5)
    spmd.reduce_scatter_tensor(out, inputs[me], op=ReduceOp.AVG, group=group)
    check(out, reference(inputs, ReduceOp.AVG)[me * 5:(me + 1) * 5], "reduce_scatter_tensor AVG", ReduceOp.AVG)
    sizes = uneven_sizes(n)                 # pieces of uneven sizes, each the size of its rank's output (TorchRec)
    for op, dtype, async_op in ((ReduceOp.SUM, torch.float32, False), (ReduceOp.MAX, torch.int32, True)):
        pieces = [value(rank, size, dtype, 12 + i) for i, size in enumerate(sizes)]
        out = torch.empty(sizes[me], dtype=dtype)
        finish(spmd.reduce_scatter(out, pieces, op=op, group=group, async_op=async_op), async_op)
        expected = reference([value(member, sizes[me], dtype, 12 + me) for member in members], op)
        check(out, expected, f"reduce_scatter uneven {op} {dtype} sizes={sizes}")


def all_to_all_family(rank: int, group: spmd.ProcessGroup | None, members: list[int]) -> None:
    n = len(members)
    me = members.index(rank)

    def splits(r: int, scale: int) -> list[int]:     # uneven, with zeros: rank r sends (r + j) % 3 * scale to j
        return [(r + j) % 3 * scale for j in range(n)]

    for index, (dtype, numel) in enumerate(CASES):
        async_op = index % 2 == 1
        scale = max(1, numel // 4)
        inputs = [value(r, sum(splits(i, scale)), dtype, index) for i, r in enumerate(members)]
        out_splits = [splits(i, scale)[me] for i in range(n)]
        out = torch.empty(sum(out_splits), dtype=dtype)
        finish(spmd.all_to_all_single(out, inputs[me], out_splits, splits(me, scale), group=group,
                                      async_op=async_op), async_op)
        expected = torch.cat([inputs[i].split(splits(i, scale))[me] for i in range(n)])
        check(out, expected, f"all_to_all_single uneven {dtype} scale={scale}")

        even = [value(r, n * numel, dtype, index + 500) for r in members]
        out = torch.empty(n * numel, dtype=dtype)
        finish(spmd.all_to_all_single(out, even[me], group=group, async_op=async_op), async_op)
        check(out, torch.cat([even[i].chunk(n)[me] if numel else even[i] for i in range(n)]),
              f"all_to_all_single even {dtype} numel={numel}")

        ins = [value(members[me] * 97 + j, (me + j) % 3 + numel % 5, dtype, index) for j in range(n)]
        outs = [torch.empty((i + me) % 3 + numel % 5, dtype=dtype) for i in range(n)]
        finish(spmd.all_to_all(outs, ins, group=group, async_op=async_op), async_op)
        for i, got in enumerate(outs):
            check(got, value(members[i] * 97 + me, (i + me) % 3 + numel % 5, dtype, index), f"all_to_all {dtype}")


def barrier_and_order_family(rank: int, group: spmd.ProcessGroup | None, members: list[int]) -> None:
    spmd.barrier(group=group)
    finish(spmd.barrier(group=group, async_op=True), True)
    # Many async ops in flight, waited in reverse: each still gets its own result (program order per group).
    tensors = [torch.full((1000 * (k % 3),), float(rank + k)) for k in range(8)]
    works = [spmd.all_reduce(t, group=group, async_op=True) for t in tensors]
    for work in reversed(works):
        work.wait()
    for k, t in enumerate(tensors):
        check(t, torch.full_like(t, float(sum(members) + k * len(members))), f"async all_reduce #{k}")
    future_work = spmd.all_reduce(torch.ones(3), group=group, async_op=True)
    result = future_work.get_future().wait()
    check(result[0], torch.full((3,), float(len(members))), "get_future value")


def p2p_family(rank: int, group: spmd.ProcessGroup | None, members: list[int]) -> None:
    n = len(members)
    me = members.index(rank)
    nxt, prev = members[(me + 1) % n], members[(me - 1) % n]
    for index, (dtype, numel) in enumerate(CASES):
        # Both sides isend first (buffered), several messages per tag, two tags interleaved: order per tag kept.
        sends = [spmd.isend(value(rank, numel, dtype, index * 10 + k), dst=nxt, group=group, tag=k % 2)
                 for k in range(4)]
        got = [torch.empty(numel, dtype=dtype) for _ in range(4)]
        recvs = [spmd.irecv(got[k], src=prev, group=group, tag=k % 2) for k in (1, 0, 3, 2)]
        for work in sends + recvs:
            work.wait()
        for k in range(4):
            check(got[k], value(prev, numel, dtype, index * 10 + k), f"isend/irecv {dtype} numel={numel} #{k}")
    if n > 1:
        if me == 0:
            spmd.send(torch.arange(5.0), dst=nxt, group=group, tag=7)
            back = torch.empty(5)
            spmd.recv(back, src=prev, group=group, tag=7)
            check(back, torch.arange(5.0) + n - 1, "send/recv around the ring")
        else:
            t = torch.empty(5)
            assert spmd.recv(t, src=prev, group=group, tag=7) == prev
            spmd.send(t + 1, dst=nxt, group=group, tag=7)
    ops = [spmd.P2POp(spmd.isend, torch.full((3,), float(rank)), nxt, group),
           spmd.P2POp(spmd.irecv, torch.empty(3), prev, group)]
    for work in spmd.batch_isend_irecv(ops):
        work.wait()
    check(ops[1].tensor, torch.full((3,), float(prev)), "batch_isend_irecv")


def objects_family(rank: int, group: spmd.ProcessGroup | None, members: list[int]) -> None:
    n = len(members)
    mine = {"rank": rank, "payload": list(range(rank * 3)), "text": "é" * rank}
    gathered: list[object] = [None] * n
    spmd.all_gather_object(gathered, mine, group=group)
    assert gathered == [{"rank": r, "payload": list(range(r * 3)), "text": "é" * r} for r in members]
    root = members[-1]
    objects = [("from", rank), None, 3.5] if rank == root else [None, None, None]
    spmd.broadcast_object_list(objects, src=root, group=group)
    assert objects == [("from", root), None, 3.5]
    out = [None] * n if rank == root else None
    spmd.gather_object(rank * 2, out, dst=root, group=group)
    if rank == root:
        assert out == [r * 2 for r in members]
    received: list[object] = [None]
    spmd.scatter_object_list(received, [f"for {r}" for r in members] if rank == root else None, src=root,
                             group=group)
    assert received == [f"for {rank}"]


FAMILIES: dict[str, Body] = {
    "all_reduce": all_reduce_family,
    "rooted": rooted_family,
    "all_gather": gather_family,
    "reduce_scatter": reduce_scatter_family,
    "all_to_all": all_to_all_family,
    "barrier_and_order": barrier_and_order_family,
    "p2p": p2p_family,
    "objects": objects_family,
}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_matrix(transport: str, world_size: int, family: str) -> None:
    run_matrix(transport, world_size, FAMILIES[family])
