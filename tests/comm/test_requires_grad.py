"""Collectives and point-to-point write into tensors that require grad (torchtune sums its running loss with an
in-place all_reduce, spmd.broadcast of a parameter), as torch's gloo does: the write is data, not autograd's (see
spmd/comm/group.py, Note: writing outside autograd)."""

from __future__ import annotations

import pytest
import torch

import spmd
from spmd.testing import run_ranks

TIMEOUT = 60.0


def _body(rank: int, world_size: int) -> list:
    weight = torch.nn.Parameter(torch.full((3,), float(rank)))
    loss = (weight * 2).sum()                                  # a non-leaf with a graph behind it
    spmd.all_reduce(loss)
    biggest = weight * 1
    spmd.all_reduce(biggest, op=spmd.ReduceOp.MAX)
    spmd.reduce(loss, dst=0)
    work = spmd.all_reduce(weight, async_op=True)              # a leaf parameter, on the executor thread
    work.wait()
    spmd.broadcast(weight, src=0)
    received = torch.nn.Parameter(torch.zeros(2))
    if rank == 0:
        spmd.send(torch.ones(2), 1)
    else:
        spmd.recv(received, 0)
    return [loss.item(), biggest.tolist(), weight.tolist(), received.tolist(), loss.requires_grad]


@pytest.mark.parametrize("backend", ["threads", "shm", "tcp"])
def test_collectives_and_p2p_write_into_tensors_that_require_grad(backend: str) -> None:
    results = run_ranks(_body, 2, timeout=TIMEOUT, backend=backend)
    assert results[0] == [12.0, [1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [0.0, 0.0], True]
    assert results[1] == [6.0, [1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0], True]
