"""ExposedCommunication: the time a thread spends blocked on communication, for a trainer's compute/communication
split. A rank that reaches a collective first waits for the other (rank 1 is busy elsewhere for 0.3 s, asleep,
which leaves the other rank the interpreter): the waiting rank's timer holds most of that wait (all of it once it
has reached the call), the late rank's almost nothing, and nothing is counted outside the `with` block.
Synchronous collectives, waits on async ones and P2P all count; nested timers each count."""

from __future__ import annotations

import time

import pytest
import torch

import spmd
from spmd.comm.work import ExposedCommunication
from spmd.testing import run_ranks

LATE = 0.3


@pytest.mark.parametrize("how", ["sync", "async", "p2p"])
@pytest.mark.parametrize("backend", ["threads", "tcp"])
def test_the_waiting_rank_is_charged_the_wait(how: str, backend: str) -> None:
    def body(rank: int, size: int) -> tuple[float, float]:
        tensor = torch.ones(4)
        spmd.barrier()
        with ExposedCommunication() as outer:
            with ExposedCommunication() as inner:
                if rank == 1:
                    time.sleep(LATE)
                if how == "sync":
                    spmd.all_reduce(tensor)
                elif how == "async":
                    spmd.all_reduce(tensor, async_op=True).wait()
                elif rank == 0:
                    spmd.recv(tensor, src=1)
                else:
                    spmd.send(tensor, dst=0)
        spmd.all_reduce(torch.ones(1))      # outside: never counted
        assert outer.seconds == inner.seconds
        return inner.seconds, outer.seconds

    (waited, _), (late, _) = run_ranks(body, 2, timeout=30, backend=backend)
    assert waited > LATE / 2
    assert late < waited / 2
