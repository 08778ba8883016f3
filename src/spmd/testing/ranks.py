"""run_ranks: run `fn(rank, world_size)` on N ranks that are threads of this process.

Layer: testing. Each thread gets its own world (init_process_group with the threads backend over one shared
HashStore), so spmd's public API works inside `fn` as it does under `spmdrun`.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch

from spmd.comm.group import ProcessGroup
from spmd.comm.store.base import HashStore
from spmd.comm.world import current_world, destroy_process_group, init_process_group

_RNG_LOCK = threading.RLock()


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """torch's global RNG seeded with `seed` for the block and restored after it, one thread at a time: thread
    ranks share that RNG, so two ranks seeding and drawing at once interleave their draws and build different
    models. Keep collectives out of the block (a rank holding it would wait for a rank waiting for it)."""
    with _RNG_LOCK, torch.random.fork_rng():
        torch.manual_seed(seed)
        yield


class _Run:
    def __init__(self, world_size: int) -> None:
        self.results: list[Any] = [None] * world_size
        self.failures: list[tuple[float, int, BaseException]] = []
        self.groups: list[list[ProcessGroup]] = [[] for _ in range(world_size)]
        self.lock = threading.Lock()

    def abort_all(self, error: BaseException) -> None:
        with self.lock:
            groups = [group for per_rank in self.groups for group in per_rank]
        for group in groups:
            if isinstance(group, ProcessGroup):   # a NonMemberGroup has nothing to abort
                group.abort(error)


def run_ranks(fn: Callable[[int, int], Any], world_size: int, timeout: float = 60.0,
              comm_timeout: float | None = None, backend: str = "threads") -> list[Any]:
    """Run `fn(rank, world_size)` on `world_size` thread ranks and return the per-rank results.

    `backend` is the transport the ranks talk over: "threads" (by reference), or a real one ("tcp", "shm")
    to test it without spawning processes.

    The first exception any rank raises is re-raised here (its type kept, a note naming its rank added);
    the other ranks' groups are aborted so they stop instead of waiting for the failed rank. If the ranks
    are not done within `timeout` seconds, TimeoutError names the ranks still running and where they are.
    `comm_timeout` bounds each collective (default: `timeout`). While the ranks run, torch's intra-op pool
    is limited to one thread (the ranks are the parallelism; sharing the pool oversubscribes the cores).

    >>> run_ranks(lambda rank, world_size: rank * 10, world_size=3)
    [0, 10, 20]
    """
    if world_size < 1:
        raise ValueError(f"run_ranks: world_size must be at least 1, got {world_size}")
    store = HashStore(timeout=timeout)
    run = _Run(world_size)

    def body(rank: int) -> None:
        initialized = False
        try:
            init_process_group(backend, store=store, rank=rank, world_size=world_size,
                               timeout=comm_timeout if comm_timeout is not None else timeout)
            initialized = True
            with run.lock:
                run.groups[rank] = current_world().groups   # the live list: groups made later are aborted too
            run.results[rank] = fn(rank, world_size)
        except BaseException as error:   # reported to the caller below
            with run.lock:
                run.failures.append((time.monotonic(), rank, error))
            run.abort_all(error)         # this rank's groups too, so peers waiting on it stop now
        finally:
            if initialized:
                destroy_process_group()

    threads = [threading.Thread(target=body, args=(rank,), name=f"spmd-rank{rank}", daemon=True)
               for rank in range(world_size)]
    intra_op_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
    finally:
        torch.set_num_threads(intra_op_threads)
    stuck = [rank for rank, thread in enumerate(threads) if thread.is_alive()]
    if run.failures:
        _, rank, error = min(run.failures, key=lambda failure: failure[0])
        error.add_note(f"(raised on rank {rank} of {world_size} in spmd.testing.run_ranks)")
        raise error
    if stuck:
        run.abort_all(TimeoutError("run_ranks timed out"))
        frames = sys._current_frames()
        where = "\n".join(f"rank {rank}:\n" + "".join(traceback.format_stack(frames[threads[rank].ident]))
                          for rank in stuck if threads[rank].ident in frames)
        raise TimeoutError(f"run_ranks: ranks {stuck} still running after {timeout:.1f}s\n{where}")
    return run.results
