"""torch's ProcessGroup methods on spmd's groups (`pg.allreduce([t]).wait()`, ...): each overload torch serves,
torch's options objects read by their fields, group ranks as roots, a timeout bounding one operation."""

from __future__ import annotations

import datetime
import time
from typing import Any

import pytest
import torch
import torch.distributed as torch_dist

import spmd
from spmd._core.errors import CommTimeoutError
from spmd.testing import run_ranks


def _collectives(rank: int, world_size: int) -> dict[str, Any]:
    pg = spmd.group.WORLD
    out: dict[str, Any] = {}
    t = torch.full((2,), float(rank + 1))
    pg.allreduce([t]).wait()                                        # opts omitted: SUM
    out["allreduce"] = t.tolist()
    t = torch.full((2,), float(rank + 1))
    pg.allreduce(t, torch_dist.ReduceOp.MAX).wait()                 # torch's ReduceOp, one tensor
    out["allreduce max"] = t.tolist()
    t = torch.full((2,), float(rank + 1))
    opts = torch_dist.AllreduceOptions()
    opts.reduceOp = torch_dist.ReduceOp.PRODUCT
    pg.allreduce([t], opts).wait()                                  # torch's options object
    out["allreduce opts"] = t.tolist()
    t = torch.full((2,), float(rank + 1))
    mine = spmd.AllreduceOptions()
    mine.reduceOp = spmd.ReduceOp.MIN                               # spmd's options object, torch's fields
    pg.allreduce([t], mine).wait()
    out["allreduce spmd opts"] = t.tolist()
    t = torch.full((1,), float(rank))
    pg.broadcast([t], spmd.BroadcastOptions(rootRank=2)).wait()
    out["broadcast spmd opts"] = t.item()
    pair = [torch.full((1,), float(rank)), torch.full((2,), 1.0)]
    pg.allreduce_coalesced(pair).wait()
    out["coalesced"] = [p.tolist() for p in pair]
    t = torch.full((1,), float(rank))
    pg.broadcast(t, 2).wait()                                       # root positional
    out["broadcast"] = t.item()
    t = torch.full((1,), float(rank))
    bopts = torch_dist.BroadcastOptions()
    bopts.rootRank = 1
    pg.broadcast([t], bopts).wait()
    out["broadcast opts"] = t.item()
    t = torch.full((1,), float(rank + 1))
    pg.reduce(t, 0, spmd.ReduceOp.SUM).wait()
    out["reduce"] = t.item() if rank == 0 else None
    gathered = [torch.empty(1) for _ in range(world_size)]
    pg.allgather([gathered], [torch.full((1,), float(rank))]).wait()
    out["allgather"] = [g.item() for g in gathered]
    flat = torch.empty(world_size)
    pg._allgather_base(flat, torch.full((1,), float(rank * 10))).wait()
    out["allgather base"] = flat.tolist()
    piece = torch.empty(1)
    pg.reduce_scatter([piece], [[torch.full((1,), float(r + rank)) for r in range(world_size)]]).wait()
    out["reduce_scatter"] = piece.item()
    piece = torch.empty(1)
    pg._reduce_scatter_base(piece, torch.arange(world_size, dtype=torch.float32)).wait()
    out["reduce_scatter base"] = piece.item()
    received = torch.empty(world_size)
    pg.alltoall_base(received, torch.full((world_size,), float(rank)), [], []).wait()
    out["alltoall"] = received.tolist()
    gather_list = [torch.empty(1) for _ in range(world_size)]
    pg.gather(gather_list, torch.full((1,), float(rank)), 1).wait()
    out["gather"] = [g.item() for g in gather_list] if rank == 1 else None
    scattered = torch.empty(1)
    pg.scatter(scattered, [torch.full((1,), 100.0 + r) for r in range(world_size)], 0).wait()
    out["scatter"] = scattered.item()
    pg.barrier().wait()
    pg.barrier(torch_dist.BarrierOptions()).wait()
    pg.barrier(timeout=datetime.timedelta(seconds=30)).wait()          # torch's keyword overload
    t = torch.full((1,), float(rank + 1))
    pg.allreduce([t], op=torch_dist.ReduceOp.MAX).wait()
    assert t.item() == 3.0
    t = torch.full((1,), float(rank))
    pg.broadcast(t, root=1).wait()
    assert t.item() == 1.0
    t = torch.full((1,), float(rank + 1))
    pg.reduce(t, root=2, op=spmd.ReduceOp.PRODUCT).wait()
    assert rank != 2 or t.item() == 6.0
    keyword = [torch.empty(1) for _ in range(world_size)]
    pg.allgather(keyword, torch.full((1,), float(rank)), timeout=datetime.timedelta(seconds=30)).wait()
    assert [k.item() for k in keyword] == [0.0, 1.0, 2.0]
    message = torch.full((1,), float(rank))
    peer = (rank + 1) % world_size
    sent = pg.send([message], peer, 7)
    got = torch.empty(1)
    received = pg.recv([got], (rank - 1) % world_size, 7)
    received.wait()
    sent.wait()
    out["recv"] = (got.item(), received.source_rank())
    with pytest.raises(ValueError, match="source_rank"):
        sent.source_rank()
    return out


def test_each_of_torchs_group_methods_gives_the_collectives_result() -> None:
    for rank, out in enumerate(run_ranks(_collectives, world_size=3, timeout=60)):
        assert out == {
            "allreduce": [6.0, 6.0], "allreduce max": [3.0, 3.0], "allreduce opts": [6.0, 6.0],
            "allreduce spmd opts": [1.0, 1.0], "broadcast spmd opts": 2.0, "coalesced": [[3.0], [3.0, 3.0]],
            "broadcast": 2.0, "broadcast opts": 1.0,
            "reduce": 6.0 if rank == 0 else None, "allgather": [0.0, 1.0, 2.0], "allgather base": [0.0, 10.0, 20.0],
            "reduce_scatter": float(3 * rank + 3), "reduce_scatter base": float(3 * rank),
            "alltoall": [0.0, 1.0, 2.0], "gather": [0.0, 1.0, 2.0] if rank == 1 else None,
            "scatter": 100.0 + rank, "recv": (float((rank - 1) % 3), (rank - 1) % 3)}


def test_roots_are_group_ranks_and_a_timeout_bounds_one_operation() -> None:
    def body(rank: int, world_size: int) -> Any:
        sub = spmd.new_group([1, 2, 3])
        value = torch.full((1,), float(rank))
        if rank != 0:
            sub.broadcast(value, 2).wait()                   # group rank 2: global rank 3
        late = None
        if rank == 1:
            started = time.monotonic()
            with pytest.raises(CommTimeoutError, match="broadcast"):
                sub.broadcast(torch.zeros(1), 0, datetime.timedelta(seconds=0.5)).wait()
            late = time.monotonic() - started
        return value.item(), late

    results = run_ranks(body, world_size=4, timeout=60, comm_timeout=60)
    assert [value for value, _ in results] == [0.0, 3.0, 3.0, 3.0]
    assert results[1][1] < 20            # the 0.5 s bound, not the group's 60 s


def test_bad_arguments_name_the_method_and_rank() -> None:
    def body(rank: int, world_size: int) -> None:
        pg = spmd.group.WORLD
        with pytest.raises(ValueError, match=r"ProcessGroup.allreduce on rank \d .*holds 2 entries"):
            pg.allreduce([torch.ones(1), torch.ones(1)])
        with pytest.raises(TypeError, match=r"ProcessGroup.broadcast .* neither torch's options object"):
            pg.broadcast(torch.ones(1), "zero")
        with pytest.raises(ValueError, match="PREMUL_SUM"):
            pg.allreduce(torch.ones(1), torch_dist._make_nccl_premul_sum(2.0))

    run_ranks(body, world_size=2, timeout=30)


def test_torchs_group_accessors_and_lifecycle_methods() -> None:
    def body(rank: int, world_size: int) -> dict[str, Any]:
        world = spmd.group.WORLD
        named = spmd.new_group([0, 1], group_desc="tp")
        split = spmd.split_group(split_ranks=[[0, 1], [2]], group_desc="halves")
        out: dict[str, Any] = {"descs": (world.group_desc, getattr(named, "group_desc", None), split.group_desc),
                               "device": world.bound_device_id}
        store = world.get_group_store()
        store.set(f"seen/{rank}", str(rank))
        store.wait([f"seen/{r}" for r in range(world_size)])
        out["store"] = sorted(store.get(f"seen/{r}").decode() for r in range(world_size))
        world.barrier().wait()
        if rank == 2:
            split.abort()                                       # torch's abort(): no error to pass
            with pytest.raises(spmd.DistBackendError, match=r"aborted by ProcessGroup.abort\(\) on rank 2"):
                split.allreduce(torch.ones(1)).wait()
            split.shutdown()
        elif rank in (0, 1):
            named.set_timeout(datetime.timedelta(seconds=0.3))
            if rank == 0:
                started = time.monotonic()
                with pytest.raises(CommTimeoutError):
                    named.barrier().wait()                      # rank 1 never comes: the new timeout bounds it
                out["waited"] = time.monotonic() - started
        return out

    results = run_ranks(body, world_size=3, timeout=60, comm_timeout=60)
    assert [out["descs"] for out in results] == [("default_pg", "tp", "halves"), ("default_pg", "tp", "halves"),
                                                 ("default_pg", None, "halves")]
    assert all(out["device"] is None and out["store"] == ["0", "1", "2"] for out in results)
    assert results[0]["waited"] < 20


def test_a_groups_bound_device_is_init_process_groups_device_id() -> None:
    spmd.init_process_group("fake", rank=0, world_size=2, device_id=torch.device("cpu"), torch_default_group=False)
    try:
        assert spmd.group.WORLD.bound_device_id == torch.device("cpu")
        assert spmd.new_group([0, 1]).bound_device_id == torch.device("cpu")
    finally:
        spmd.destroy_process_group()
