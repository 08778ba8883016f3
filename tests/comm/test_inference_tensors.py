"""Collectives and point-to-point on inference tensors (made under torch.inference_mode(), writable only inside
it), as gloo allows: Lightning validates under inference mode, so metric states synced there, or later, are such
tensors. Also: an op issued under inference mode leaves no inference tensor in a transport's buffers for a later
op outside it (see spmd/comm/group.py, Note: inference tensors)."""

from __future__ import annotations

import pytest
import torch

import spmd
from spmd.testing import run_ranks

TIMEOUT = 60.0


def _body(rank: int, world_size: int) -> list:
    seen: list = []
    with torch.inference_mode():
        group = spmd.new_group([0, 1])                       # its buffers, made under inference mode
        summed = torch.tensor([rank + 1.0, 2.0])
        spmd.all_reduce(summed)
        gathered = [torch.zeros(1) for _ in range(world_size)]
        spmd.all_gather(gathered, torch.tensor([rank + 1.0]), group=group)
        spmd.all_reduce(torch.ones(3), async_op=True).wait()
        late = torch.tensor([rank + 1])                       # an inference tensor, synced outside
        received = torch.zeros(2)
    seen += [summed.tolist(), [t.item() for t in gathered]]
    spmd.all_reduce(late)
    normal = [torch.zeros(1) for _ in range(world_size)]      # the same op, plain tensors, outside
    spmd.all_gather(normal, torch.tensor([rank + 1.0]), group=group)
    plain = torch.ones(2)
    spmd.all_reduce(plain)
    big = torch.ones(1 << 16)
    with torch.inference_mode():
        spmd.all_reduce(big)                                  # a plain tensor reduced inside inference mode
    if rank == 0:
        spmd.send(torch.full((2,), 7.0), 1)
    else:
        spmd.recv(received, 0)
    return [*seen, late.tolist(), [t.item() for t in normal], plain.tolist(), big[:2].tolist(), received.tolist()]


@pytest.mark.parametrize("backend", ["threads", "shm", "tcp"])
def test_collectives_and_p2p_write_into_inference_tensors(backend: str) -> None:
    results = run_ranks(_body, 2, timeout=TIMEOUT, backend=backend)
    common = [[3.0, 4.0], [1.0, 2.0], [3], [1.0, 2.0], [2.0, 2.0], [2.0, 2.0]]
    assert results == [[*common, [0.0, 0.0]], [*common, [7.0, 7.0]]]
