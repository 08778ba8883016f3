"""torch sees spmd's world: spmd.init_process_group initialises torch's default group over the "spmd" backend, so
torch's DistributedSampler, collectives and its own DistributedDataParallel (compiled too) run on spmd (real
processes, shm);
`torch_default_group=False` leaves torch alone; destroy_process_group takes torch's group down too."""

from __future__ import annotations

import copy
import datetime
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist

import spmd
from spmd._core.errors import QueueEmptyError, StoreError, StoreTimeoutError
from spmd.comm import torch_backend
from spmd.comm.torch_backend import TorchStore
from spmd.comm.world import current_world
from spmd.testing import run_ranks
from tests.nccl_p2p import register_nccl_p2p_transport
from tests.procpool import ProcPool


def _torch_on_spmd(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.utils.data import DistributedSampler

    spmd.init_process_group("shm", timeout=60)
    try:
        out: dict[str, Any] = {"rank": dist.get_rank(), "size": dist.get_world_size(), "backend": dist.get_backend(),
                               "sampler": list(DistributedSampler(list(range(10)), shuffle=False))}
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        gathered = torch.empty(2 * world_size)
        dist.all_gather_into_tensor(gathered, torch.full((2,), float(rank)))
        scattered = torch.empty(1)
        dist.reduce_scatter_tensor(scattered, torch.arange(float(world_size)) * (rank + 1))
        swapped = torch.empty(world_size)
        dist.all_to_all_single(swapped, torch.full((world_size,), float(rank)))
        root = torch.tensor([7.0 if rank == 0 else 0.0])
        dist.broadcast(root, src=0)
        if rank == 0:
            dist.send(torch.tensor([42.0]), dst=1)
            got = None
        else:
            got = torch.zeros(1)
            dist.recv(got, src=0)
        dist.barrier()
        out.update(avg=t.item(), gathered=gathered.tolist(), scattered=scattered.item(), swapped=swapped.tolist(),
                   root=root.item(), got=None if got is None else got.item())
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        reference = copy.deepcopy(model)
        with_buffer = copy.deepcopy(model)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        inputs = torch.randn(2 * world_size, 4, generator=torch.Generator().manual_seed(1))
        ddp(inputs.chunk(world_size)[rank]).square().mean().backward()
        reference(inputs).square().mean().backward()       # one process, the whole batch: the mean over ranks
        out["ddp"] = all(torch.allclose(p.grad, q.grad, atol=1e-6) for p, q in
                         zip(model.parameters(), reference.parameters(), strict=True))
        # compiled whole, torch's DDP broadcasts its buffers through the group from code dynamo traces
        with_buffer.register_buffer("count", torch.zeros(1))
        compiled = torch.compile(torch.nn.parallel.DistributedDataParallel(with_buffer), backend="aot_eager")
        compiled(inputs.chunk(world_size)[rank]).square().mean().backward()
        out["compiled ddp"] = all(torch.allclose(p.grad, q.grad, atol=1e-6) for p, q in
                                  zip(with_buffer.parameters(), reference.parameters(), strict=True))
    finally:
        spmd.destroy_process_group()
    out["torch_left"] = dist.is_initialized()
    return out


@pytest.mark.timeout(120)
def test_torch_sees_spmds_world_and_runs_its_collectives_and_ddp_on_it(procpool: ProcPool) -> None:
    results = procpool.run(_torch_on_spmd, 2, timeout=90)
    for rank, out in enumerate(results):
        assert (out["rank"], out["size"], out["backend"]) == (rank, 2, "spmd")
        assert out["sampler"] == list(range(rank, 10, 2))
        assert out["avg"] == 1.5 and out["gathered"] == [0.0, 0.0, 1.0, 1.0] and out["root"] == 7.0
        assert out["scattered"] == rank * 3.0 and out["swapped"] == [0.0, 1.0]
        assert out["ddp"] and out["compiled ddp"] and not out["torch_left"]
    assert results[1]["got"] == 42.0


def _opted_out(rank: int, world_size: int) -> bool:
    import torch.distributed as dist

    spmd.init_process_group("shm", timeout=60, torch_default_group=False)
    try:
        return dist.is_initialized()
    finally:
        spmd.destroy_process_group()


@pytest.mark.timeout(60)
def test_torch_default_group_false_leaves_torch_alone(procpool: ProcPool) -> None:
    assert procpool.run(_opted_out, 2, timeout=45) == [False, False]


def _subgroup(rank: int, world_size: int) -> list[float]:
    import torch.distributed as dist

    spmd.init_process_group("shm", timeout=60)
    try:
        spmd.new_group([0, 1])                           # spmd's group of those ranks, which torch's maps to
        pair = dist.new_group([0, 1])
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=pair)
        late = dist.new_group([1, 2])                    # spmd has no such group: its members make one
        u = torch.tensor([float(rank)])
        if rank != 0:                                    # not a member: torch built nothing on rank 0
            dist.all_reduce(u, group=late)
        return t.tolist() + u.tolist()
    finally:
        spmd.destroy_process_group()


@pytest.mark.timeout(90)
def test_a_torch_subgroup_runs_on_spmds_group_of_the_same_ranks(procpool: ProcPool) -> None:
    assert procpool.run(_subgroup, 3, timeout=60) == [[1.0, 0.0], [1.0, 3.0], [2.0, 3.0]]


def _torch_first(rank: int, world_size: int) -> dict[str, Any]:
    """torch's own script, its backend named "spmd": no spmd call at all."""
    import torch.distributed as dist

    dist.init_process_group("spmd", timeout=datetime.timedelta(seconds=60))
    out: dict[str, Any] = {"spmd": (spmd.is_initialized(), spmd.get_rank(), spmd.get_world_size())}
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    reference = copy.deepcopy(model)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    inputs = torch.randn(2 * world_size, 4, generator=torch.Generator().manual_seed(1))
    ddp(inputs.chunk(world_size)[rank]).square().mean().backward()
    reference(inputs).square().mean().backward()
    out["ddp"] = all(torch.allclose(p.grad, q.grad, atol=1e-6) for p, q in
                     zip(model.parameters(), reference.parameters(), strict=True))
    out["sum"] = t.item()
    dist.destroy_process_group()                          # spmd's world goes with torch's group
    out["after torch's destroy"] = (dist.is_initialized(), spmd.is_initialized())
    dist.init_process_group("spmd", timeout=datetime.timedelta(seconds=60))    # again, in the same job
    u = torch.tensor([float(rank)])
    dist.all_reduce(u)
    out["again"] = u.item()
    spmd.destroy_process_group()                          # and torch's group goes with spmd's world
    out["after spmd's destroy"] = (dist.is_initialized(), spmd.is_initialized())
    return out


@pytest.mark.timeout(90)
def test_torchs_init_process_group_with_the_spmd_backend_builds_spmds_world(procpool: ProcPool) -> None:
    for rank, out in enumerate(procpool.run(_torch_first, 2, timeout=60)):
        assert out["spmd"] == (True, rank, 2) and out["sum"] == 3.0 and out["ddp"] and out["again"] == 1.0
        assert out["after torch's destroy"] == (False, False) and out["after spmd's destroy"] == (False, False)


def _torchs_device_queries(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """torch's code that picks a device from the group: its state-dict broadcast, its async checkpoint, FSDP2
    asking the group for buffers."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.distributed_c10d import _get_pg_default_device
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("spmd", timeout=datetime.timedelta(seconds=60))
    try:
        out: dict[str, Any] = {"devices": dist.group.WORLD._device_types, "default": _get_pg_default_device()}
        torch.manual_seed(rank)                           # the ranks' models differ until rank 0's is broadcast
        model = torch.nn.Linear(4, 4)
        full = {k: v.clone() for k, v in model.state_dict().items()} if rank == 0 else {}
        fully_shard(model)
        model.set_allocate_memory_from_process_group_for_comm(True)
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        out["weight"] = model.weight.full_tensor().detach()
        model(torch.ones(2, 4)).sum().backward()
        out["grad"] = model.weight.grad.full_tensor()
        dcp.async_save({"model": model.state_dict()}, checkpoint_id=folder).result()
        out["saved"] = sorted(os.listdir(folder))
        out["backend"] = dist.get_backend()
        out["shard_devices"] = _sharded_tensor_devices()
        return out
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(90)
def test_torchs_device_queries_on_the_spmd_backend(procpool: ProcPool, tmp_path: pathlib.Path) -> None:
    torch.manual_seed(0)
    want = torch.nn.Linear(4, 4).weight.detach()
    results = procpool.run(_torchs_device_queries, 2, timeout=60, args=(str(tmp_path),))
    for out in results:
        assert out["devices"] == [torch.device("cpu")] and out["default"] == torch.device("cpu")
        assert out["backend"] == "spmd" and out["shard_devices"] == [torch.device("cpu")] * 2
        torch.testing.assert_close(out["weight"], want, rtol=0, atol=0)
        torch.testing.assert_close(out["grad"], torch.full((4, 4), 2.0), rtol=0, atol=0)
        assert ".metadata" in out["saved"]


def _sharded_tensor_devices() -> list[torch.device]:
    """A ShardedTensor all on rank 0 (TorchRec's table-wise tables, which its checkpoint loads build): its device
    on a rank without a shard, and after a cast (torch picks CPU there only for a gloo group, else CUDA's)."""
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    table = sharded_tensor.zeros(ChunkShardingSpec(dim=0, placements=["rank:0/cpu"]), 4, 2)
    return [table.device, table.to(torch.float64).device]


def _coalesced(rank: int, world_size: int) -> dict[str, Any]:
    """torch's _coalescing_manager with a device (DeepSpeed's all_gather_coalesced), async and not."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _coalescing_manager

    dist.init_process_group("spmd", timeout=datetime.timedelta(seconds=60))
    try:
        gathered = [torch.empty(4 * world_size), torch.empty(2 * world_size)]
        with _coalescing_manager(device=torch.device("cpu"), async_ops=True) as manager:
            for out, value in zip(gathered, (torch.full((4,), float(rank)), torch.full((2,), 10.0 + rank))):
                dist.all_gather_into_tensor(out, value, async_op=True)
        manager.wait()
        summed = [torch.full((3,), float(rank + 1)), torch.full((2,), 2.0)]
        with _coalescing_manager(device=torch.device("cpu")):
            for tensor in summed:
                dist.all_reduce(tensor)
        blocked = torch.ones(2)
        dist.all_reduce(blocked, async_op=True).block_current_stream()   # torch's base Work fails on it
        mine, theirs = torch.full((1,), float(rank)), torch.empty(1)
        peer = 1 - rank
        works = [dist.isend(mine, peer), dist.irecv(theirs, peer)] if rank == 0 else \
            [dist.irecv(theirs, peer), dist.isend(mine, peer)]
        for work in works:
            work.wait()
        received_from = next(work for work in works if work is not works[rank]).source_rank()
        return {"gathered": [t.tolist() for t in gathered], "summed": [t.tolist() for t in summed],
                "blocked": blocked.tolist(), "received": (theirs.item(), received_from)}
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(90)
def test_torchs_coalescing_manager_runs_on_the_spmd_backend(procpool: ProcPool) -> None:
    for rank, out in enumerate(procpool.run(_coalesced, 2, timeout=60)):
        assert out["gathered"] == [[0.0] * 4 + [1.0] * 4, [10.0, 10.0, 11.0, 11.0]]
        assert out["summed"] == [[3.0, 3.0, 3.0], [4.0, 4.0]]
        assert out["blocked"] == [2.0, 2.0]
        assert out["received"] == (float(1 - rank), 1 - rank)      # the value and the group rank it came from


@pytest.mark.parametrize("first", ["spmd", "torch", "spmd.comm.world", "spmd.ReduceOp", "spmd.ProcessGroup",
                                   "spmd.comm.torch_backend"])
def test_importing_spmd_makes_its_backend_known_to_torch_in_either_order(first: str) -> None:
    # the last four import torch first from inside an spmd module's import, which is not whole yet then (the last
    # one is the backend's own module)
    imports = {"spmd": "import spmd; import torch", "torch": "import torch; import spmd",
               "spmd.comm.world": "import spmd; import spmd.comm.world", "spmd.ReduceOp": "import spmd; spmd.ReduceOp",
               "spmd.ProcessGroup": "import spmd; spmd.ProcessGroup",
               "spmd.comm.torch_backend": "import spmd; from spmd.comm.torch_backend import TorchStore"}[first]
    code = (f"import sys; {imports}; import torch.distributed as dist; "
            f"print('SPMD' in dist.Backend._plugins, 'torch._dynamo' in sys.modules)")
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert found.stdout.split() == ["True", "False"]       # known, and importing spmd compiled nothing
    assert "could not register" not in found.stderr


def test_a_job_that_never_compiles_never_imports_dynamo_and_compiling_later_still_sees_spmds_opaque_code(
        tmp_path: pathlib.Path) -> None:
    # dynamo costs a process 1.5 s to import: a group (spmd's and torch's default over it) and a DDP step must
    # not import it, and importing it afterwards must still make the groups' methods and DDP's forward opaque
    code = textwrap.dedent("""
        import sys, torch, spmd
        from spmd.ddp.api import DistributedDataParallel
        from spmd.comm.torch_backend import SpmdProcessGroup
        spmd.init_process_group("tcp", init_method=sys.argv[1], rank=0, world_size=1)
        assert torch.distributed.get_backend() == "spmd"
        model = DistributedDataParallel(torch.nn.Linear(2, 2))
        model(torch.ones(1, 2)).sum().backward()
        print("imported", "torch._dynamo" in sys.modules)
        import torch._dynamo
        print("opaque", DistributedDataParallel._run_module._torchdynamo_disable,
              SpmdProcessGroup.allreduce._torchdynamo_disable)
        spmd.destroy_process_group()
    """)
    found = subprocess.run([sys.executable, "-c", code, f"file://{tmp_path / 'store'}"], capture_output=True,
                           text=True, timeout=120)
    assert found.returncode == 0, found.stderr
    assert found.stdout.split() == ["imported", "False", "opaque", "True", "True"], found.stdout


def test_torch_store_adapter_gives_spmds_store_semantics() -> None:
    import torch.distributed as dist

    store = TorchStore(dist.HashStore(), timeout=5.0)
    store.set("a", "1")
    assert store.get("a") == b"1" and store.add("n", 2) == 2 and store.add("n", 3) == 5
    assert store.compare_set("a", "1", "2") == b"2" and store.multi_get(["a", "n"]) == [b"2", b"5"]
    assert store.check(["a"]) and not store.check(["a", "b"]) and store.delete_key("a")
    with pytest.raises(StoreTimeoutError, match=r"waiting for key\(s\) \['b'\]"):
        store.wait(["n", "b"], timeout=0.05)
    store.append("log", "x")
    store.append("log", "y")
    assert store.get("log") == b"xy" and sorted(store.list_keys()) == ["log", "n"] and store.has_extended_api()
    store.queue_push("q", "1")
    store.queue_push("q", "2")
    assert store.queue_len("q") == 2 and store.queue_pop("q") == b"1" and store.queue_pop("q", block=False) == b"2"
    with pytest.raises(QueueEmptyError):
        store.queue_pop("q", block=False)
    popped: list[bytes] = []
    popper = threading.Thread(target=lambda: popped.append(store.queue_pop("q")))   # polls torch's store
    popper.start()
    store.queue_push("q", "3")
    popper.join(timeout=10)
    assert popped == [b"3"]
    store.set_timeout(0.05)
    with pytest.raises(StoreTimeoutError, match="nothing was pushed to queue 'q'"):
        store.queue_pop("q")
    store.set_timeout(5.0)
    failures: list[BaseException] = []

    def wait_for_ever() -> None:
        try:
            store.wait(["never"], timeout=60)
        except StoreError as error:
            failures.append(error)

    waiting = threading.Thread(target=wait_for_ever)
    waiting.start()
    store.close()                                           # a wait in another thread fails at once
    waiting.join(timeout=10)
    # "interrupted by close()" if the wait had begun, "used after close()" if close() came first: either at once
    assert not waiting.is_alive() and re.search(r"interrupted by close\(\)|used after close\(\)", str(failures[0]))
    with pytest.raises(StoreError, match="used after close"):
        store.get("n")


def _failures_reach_torch(rank: int, world_size: int) -> list[str]:
    import torch.distributed as dist

    seen = []
    for case in ("sync", "async", "ddp"):
        spmd.init_process_group("shm", timeout=60)
        try:
            mismatched = torch.ones(2 + rank)                 # rank 1 sends one element more: spmd refuses
            if case == "sync":
                dist.all_reduce(mismatched)
            elif case == "async":
                work = dist.all_reduce(mismatched, async_op=True)
                work.wait()
            else:
                model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
                model.register_comm_hook(None, lambda state, bucket: dist.all_reduce(
                    torch.cat([bucket.buffer(), torch.zeros(rank)]), async_op=True).get_future().then(
                        lambda future: (future.wait(), bucket.buffer())[1]))
                model(torch.ones(2, 4)).sum().backward()     # the reducer's future failed: backward raises
            seen.append(f"{case}: returned")
        except Exception as error:
            seen.append(f"{case}: {type(error).__name__ if case != 'ddp' else error}")
        finally:
            spmd.destroy_process_group()
    return seen


@pytest.mark.timeout(90)
def test_a_failed_operation_raises_in_torchs_calls_and_torchs_ddp(procpool: ProcPool) -> None:
    for seen in procpool.run(_failures_reach_torch, 2, timeout=60):
        assert seen[:2] == ["sync: CollectiveMismatchError", "async: CollectiveMismatchError"]
        assert "CollectiveMismatchError" in seen[2]


def test_a_script_that_never_destroys_its_world_exits_with_no_status_thread_in_a_store_call() -> None:
    """Most torch scripts end without destroy_process_group: spmd's status thread, inside torch's store client at
    interpreter exit, aborted the process ('terminate called without an active exception') in about 1 run of 3."""
    code = """if True:
        import atexit, threading
        atexit.register(lambda: print([t.name for t in threading.enumerate() if t.name.startswith("spmd-status")]))
        import torch, torch.distributed as dist
        import spmd
        dist.init_process_group("spmd", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        print(spmd.get_world_size(), flush=True)
    """
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "[]"]        # the atexit handler registered first runs last


@pytest.mark.parametrize("world_size", [2, 4])
def test_torchs_batch_isend_irecv_starts_its_messages_together_over_an_order_pairing_transport(
        world_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch coalesces a batch only on its own group type and issues it message by message on spmd's: over NCCL's
    point-to-point semantics (tests/nccl_p2p.py: sends wait for their receives), ranks that each send, then
    receive, in one batch would hang; the spmd group starts the batch's messages together (see Note: torch's
    batch_isend_irecv over a transport that pairs messages by order). A ring, then a send, a receive and a send to
    one peer; a plain isend outside a batch still starts at once."""
    register_nccl_p2p_transport(monkeypatch)

    def body(rank: int, size: int) -> dict[str, Any]:
        group = torch_backend._group_class_ready()(current_world().default_group)
        ranks = dist.distributed_c10d._world.pg_group_ranks      # torch's P2POp maps group ranks through it
        ranks[group] = {peer: peer for peer in range(size)}
        try:
            return exchange(group, rank, size)
        finally:
            del ranks[group]

    def exchange(group: dist.ProcessGroup, rank: int, size: int) -> dict[str, Any]:
        right, left = (rank + 1) % size, (rank - 1) % size
        sent = torch.full((4096,), float(rank))
        got = torch.empty(4096)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, sent, group=group, group_peer=right),
                                        dist.P2POp(dist.irecv, got, group=group, group_peer=left)])
        for work in works:
            work.wait()
        first, second = torch.empty(3), torch.empty(3)
        peer = rank ^ 1
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((3,), rank + 0.5), group=group,
                                                   group_peer=peer),
                                        dist.P2POp(dist.irecv, first, group=group, group_peer=peer),
                                        dist.P2POp(dist.irecv, second, group=group, group_peer=peer),
                                        dist.P2POp(dist.isend, torch.full((3,), rank + 0.25), group=group,
                                                   group_peer=peer)])
        assert all(work.get_future().wait() is not None for work in works) and all(w.is_success() for w in works)
        if rank % 2 == 0:        # outside a batch: the send starts now, as before
            dist.isend(torch.ones(2), group=group, group_dst=peer).wait()
        else:
            dist.irecv(received := torch.empty(2), group=group, group_src=peer).wait()
            assert received.tolist() == [1.0, 1.0]
        return {"ring": got[0].item(), "pair": (first[0].item(), second[0].item())}

    for rank, out in enumerate(run_ranks(body, world_size=world_size, timeout=30, backend="nccl-p2p-threads")):
        peer = rank ^ 1
        assert out == {"ring": float((rank - 1) % world_size), "pair": (peer + 0.5, peer + 0.25)}


def _torch_pipelining(rank: int, world_size: int) -> dict[str, Any]:
    """torch's own pipelining (its stages exchange shapes, then activations and gradients through torch's
    batch_isend_irecv) over the "spmd" backend: 1F1B, 4 microbatches, two stages of two layers."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    dist.init_process_group("spmd", timeout=datetime.timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        layers = [torch.nn.Linear(8, 8) for _ in range(4)]
        whole = torch.nn.Sequential(*copy.deepcopy(layers))
        mine = torch.nn.Sequential(*copy.deepcopy(layers[2 * rank: 2 * rank + 2]))
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
        y = torch.randn(8, 8, generator=torch.Generator().manual_seed(2))
        schedule = Schedule1F1B(PipelineStage(mine, rank, world_size, torch.device("cpu")), 4,
                                loss_fn=torch.nn.functional.mse_loss)
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=losses)
        want = [torch.nn.functional.mse_loss(whole(xs), ys) for xs, ys in zip(x.chunk(4), y.chunk(4), strict=True)]
        (sum(want) / 4).backward()          # torch's schedule scales the gradients by the microbatch count
        expected = list(whole.parameters())[4 * rank: 4 * rank + 4]
        return {"grads": [(p.grad, q.grad) for p, q in zip(mine.parameters(), expected, strict=True)],
                "losses": [loss.item() for loss in losses], "want": [loss.item() for loss in want]}
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(90)
def test_torchs_own_pipelining_trains_over_the_spmd_backend_as_one_process(procpool: ProcPool) -> None:
    for rank, out in enumerate(procpool.run(_torch_pipelining, 2, timeout=60)):
        for got, want in out["grads"]:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        if rank == 1:
            torch.testing.assert_close(out["losses"], out["want"], rtol=1e-6, atol=1e-7)
        else:
            assert out["losses"] == []


def _compressed_full_tensor(rank: int, world_size: int) -> dict[str, Any]:
    """A DTensor whose local shards are a compressed subclass that handles torch's functional all-gather (as
    torchao's NF4 weights do) gathers as that subclass, through torch's view of spmd's group."""
    from spmd.device_mesh import init_device_mesh
    from spmd.tensor import DTensor, Shard
    from tests.checkpoint.quantized_rows import QuantizedRows

    spmd.init_process_group(timeout=60)
    try:
        full = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
        mesh = init_device_mesh("cpu", (world_size,))
        sharded = DTensor.from_local(QuantizedRows.quantize(full.chunk(world_size)[rank]), mesh, [Shard(0)])
        with torch.no_grad():
            whole = sharded.full_tensor()
        want = QuantizedRows.quantize(full)       # per row: the gathered rows' codes are the whole's
        return {"kind": type(whole).__name__, "codes": torch.equal(whole.codes, want.codes),
                "scales": torch.equal(whole.scales, want.scales)}
    finally:
        spmd.destroy_process_group()


@pytest.mark.timeout(90)
def test_a_compressed_subclass_gathers_as_itself_through_its_own_all_gather(procpool: ProcPool) -> None:
    for out in procpool.run(_compressed_full_tensor, 2, timeout=60):
        assert out == {"kind": "QuantizedRows", "codes": True, "scales": True}
