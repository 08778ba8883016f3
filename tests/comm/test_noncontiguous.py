"""Collectives on non-contiguous tensors (a transposed or sliced view) read the view's own elements and write
the results back into it, on every transport, synchronously and async, as on contiguous tensors (torch's gloo
takes such views too, getting a column slice's all_reduce wrong); point-to-point ops refuse them before anything
is sent (tests/comm/test_failures.py), as gloo's do."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import spmd
from spmd.testing import run_ranks

TRANSPORTS = ["threads", "tcp", "shm", "torch:gloo"]
WORLD = 3


def _values(rank: int, rows: int = 3, cols: int = 4, dtype: torch.dtype = torch.float32) -> Tensor:
    """A (rows, cols) block distinct per rank (complex: with an imaginary part too)."""
    real = torch.arange(rows * cols, dtype=torch.float32).view(rows, cols) + 100 * rank
    return torch.complex(real, -real) if dtype.is_complex else real


def _finish(work: spmd.Work | None) -> None:
    if work is not None:
        work.wait()


def _ops(rank: int, size: int, async_op: bool) -> dict[str, object]:
    """Every collective on views that are not contiguous; what each leaves in the caller's tensors."""
    got: dict[str, object] = {}
    for dtype in (torch.float32, torch.complex64):
        base = _values(rank, dtype=dtype)
        _finish(spmd.all_reduce(base.t(), async_op=async_op))
        got[f"all_reduce {dtype}"] = base
    base = _values(rank)
    _finish(spmd.all_reduce(base[:, 1:3], async_op=async_op))
    got["all_reduce of a column slice"] = base
    base = _values(rank)
    _finish(spmd.broadcast(base.t(), src=1, async_op=async_op))
    got["broadcast"] = base
    base = _values(rank)
    _finish(spmd.reduce(base.t(), dst=0, async_op=async_op))
    got["reduce"] = base
    out = torch.zeros(3, 4 * size)
    _finish(spmd.all_gather_into_tensor(out.t(), _values(rank).t(), async_op=async_op))
    got["all_gather_into_tensor"] = out.t()
    out = torch.zeros(3, 2)
    _finish(spmd.reduce_scatter_tensor(out.t(), _values(rank, cols=2 * size).t(), async_op=async_op))
    got["reduce_scatter_tensor"] = out.t()
    out = torch.zeros(3, 2 * size)
    _finish(spmd.all_to_all_single(out.t(), _values(rank, cols=2 * size).t(), async_op=async_op))
    got["all_to_all_single"] = out.t()
    out = torch.zeros(3, 4)
    _finish(spmd.scatter(out.t(), [_values(i).t() for i in range(size)] if rank == 0 else None, src=0,
                         async_op=async_op))
    got["scatter"] = out.t()
    outs = [torch.zeros(3, 4).t() for _ in range(size)]
    _finish(spmd.all_gather(outs, _values(rank).t(), async_op=async_op))
    got["all_gather"] = outs
    outs = [torch.zeros(3, 4).t() for _ in range(size)]
    _finish(spmd.all_to_all(outs, [_values(rank + 10 * i).t() for i in range(size)], async_op=async_op))
    got["all_to_all"] = outs
    first, second = torch.zeros(4, 3), torch.arange(10.).view(5, 2) + rank
    _finish(spmd.all_reduce_coalesced([first.t().copy_(_values(rank)), second[:, 1]], async_op=async_op))
    got["all_reduce_coalesced"] = (first.t(), second)
    return got


def _expected(rank: int, size: int) -> dict[str, object]:
    """The same ops computed locally from every rank's inputs."""
    total = sum(_values(r) for r in range(size))
    want: dict[str, object] = {f"all_reduce {dtype}": sum(_values(r, dtype=dtype) for r in range(size))
                               for dtype in (torch.float32, torch.complex64)}
    sliced = _values(rank)
    sliced[:, 1:3] = total[:, 1:3]
    want["all_reduce of a column slice"] = sliced
    want["broadcast"] = _values(1)
    want["reduce"] = total if rank == 0 else _values(rank)
    want["all_gather_into_tensor"] = torch.cat([_values(r).t() for r in range(size)])
    want["reduce_scatter_tensor"] = sum(_values(r, cols=2 * size).t() for r in range(size))[2 * rank:2 * rank + 2]
    want["all_to_all_single"] = torch.cat([_values(i, cols=2 * size).t()[2 * rank:2 * rank + 2] for i in range(size)])
    want["scatter"] = _values(rank).t()
    want["all_gather"] = [_values(i).t() for i in range(size)]
    want["all_to_all"] = [_values(i + 10 * rank).t() for i in range(size)]
    second = torch.arange(10.).view(5, 2) + rank
    second[:, 1] = sum(torch.arange(10.).view(5, 2)[:, 1] + r for r in range(size))
    want["all_reduce_coalesced"] = (total, second)
    return want


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_collectives_on_views_read_and_write_their_logical_elements(transport: str, async_op: bool) -> None:
    def body(rank: int, size: int) -> tuple[dict[str, object], dict[str, object]]:
        return _ops(rank, size, async_op), _expected(rank, size)

    for rank, (got, want) in enumerate(run_ranks(body, WORLD, timeout=60, backend=transport)):
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0,
                                       msg=lambda m, name=name, rank=rank: f"{name} on rank {rank}: {m}")
