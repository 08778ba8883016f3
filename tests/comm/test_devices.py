"""The layers above the transports are device-generic: they run on a non-CPU device through a transport that
declares it, and a tensor on a device the transport does not move is refused before anything is sent.

The device here is `meta` (shapes without data), moved by tests/meta_device.py's MetaTransport, with
NoCpuTensors failing any op that makes a CPU tensor while code serves meta tensors.
"""

from __future__ import annotations

import importlib
import inspect
import threading
from typing import Any

import pytest
import torch

import spmd
from spmd.comm.transports import base
from spmd.comm.transports.threads import ThreadsTransport
from spmd.testing import run_ranks
from tests.meta_device import (
    TIMEOUT,
    CpuAndMetaTransport,
    MetaTransport,
    NoCpuTensors,
    meta,
    on_meta,
    register_fake_transports,
)


@pytest.fixture(autouse=True)
def fake_transports(monkeypatch: pytest.MonkeyPatch) -> None:
    register_fake_transports(monkeypatch)


# -- the contract -------------------------------------------------------------------------------------------

def _library_transports() -> list[type[base.Transport]]:
    """Every Transport class of the library: those the registry names, and every subclass they define."""
    for entry in base._TRANSPORTS.values():
        importlib.import_module(entry.split(":")[0])
    found, todo = [], list(base.Transport.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__module__.startswith("spmd.") and not inspect.isabstract(cls):
            found.append(cls)
    return found


def test_every_transport_declares_its_devices() -> None:
    transports = _library_transports()
    assert {"ThreadsTransport", "TcpTransport"} <= {cls.__name__ for cls in transports}
    for cls in transports:
        assert "devices" in vars(cls), f"{cls.__name__} inherits devices instead of declaring them"
        assert cls.devices and all(isinstance(kind, str) for kind in cls.devices), cls


def test_a_transport_without_devices_is_refused() -> None:
    class Forgetful(ThreadsTransport):
        devices = ()

    spec = base.TransportSpec(store=spmd.HashStore(), group_name="g", group_rank=0, global_ranks=(0,),
                              hosts=("h",), timeout=5.0, token=b"t")
    with pytest.raises(TypeError, match="Forgetful must declare the device types it moves"):
        Forgetful(spec)


def test_a_tensor_on_a_device_the_transport_does_not_move_is_refused_before_anything_moves() -> None:
    def body(rank: int, size: int) -> None:
        transport = spmd.comm.world.default_group().transport
        with pytest.raises(ValueError) as caught:
            spmd.all_reduce(torch.ones(3))
        message = str(caught.value)
        for part in (f"all_reduce on rank {rank}", "group 'default' (ranks [0, 1])", "is on cpu",
                     "meta-threads backend moves only meta tensors"):
            assert part in message, message
        with pytest.raises(ValueError, match=f"isend on rank {rank}"):
            spmd.send(torch.ones(3), dst=1 - rank)
        with pytest.raises(ValueError, match="is on cpu"):
            spmd.all_to_all([meta(1), torch.ones(1)], [meta(1), meta(1)])
        assert transport.handed == []
        spmd.barrier()

    run_ranks(body, 2, timeout=TIMEOUT, backend=MetaTransport.name)


def test_one_op_may_not_mix_devices() -> None:
    def body(rank: int, size: int) -> None:
        for call in (lambda: spmd.all_gather_into_tensor(torch.empty(2), meta(1)),
                     lambda: spmd.all_gather([meta(1), torch.empty(1)], meta(1)),
                     lambda: spmd.all_to_all_single(torch.empty(2), meta(2))):
            with pytest.raises(ValueError, match="put every tensor of one op on one device"):
                call()
        spmd.barrier()

    run_ranks(body, 2, timeout=TIMEOUT, backend=CpuAndMetaTransport.name)


# -- collectives and point-to-point on meta -----------------------------------------------------------------

def _collectives(rank: int, size: int, async_op: bool) -> None:
    """Every public collective on meta tensors; outputs keep their shapes and device."""
    def done(work: spmd.Work | None) -> None:
        assert (work is not None) == async_op
        if work is not None:
            work.wait()

    x = meta(2, 3)
    done(spmd.all_reduce(x, async_op=async_op))
    done(spmd.all_reduce(meta(4, dtype=torch.complex64), op=spmd.ReduceOp.AVG, async_op=async_op))
    done(spmd.broadcast(x, src=0, async_op=async_op))
    done(spmd.reduce(x, dst=size - 1, async_op=async_op))
    gathered = [meta(2, 3) for _ in range(size)]
    done(spmd.all_gather(gathered, x, async_op=async_op))
    done(spmd.all_gather_into_tensor(meta(2 * size, 3), x, async_op=async_op))
    done(spmd.reduce_scatter(meta(2, 3), [meta(2, 3) for _ in range(size)], async_op=async_op))
    done(spmd.reduce_scatter_tensor(meta(2, 3), meta(2 * size, 3), async_op=async_op))
    done(spmd.gather(x, [meta(2, 3) for _ in range(size)] if rank == 0 else None, dst=0, async_op=async_op))
    done(spmd.scatter(x, [meta(2, 3) for _ in range(size)] if rank == 0 else None, src=0, async_op=async_op))
    out_splits = [rank + 1] * size                              # rank r receives r+1 rows from everyone
    in_splits = [r + 1 for r in range(size)]                    # and sends r+1 rows to rank r
    done(spmd.all_to_all_single(meta(sum(out_splits), 3), meta(sum(in_splits), 3), out_splits, in_splits,
                                async_op=async_op))
    done(spmd.all_to_all([meta(rank + 1, 2) for _ in range(size)], [meta(r + 1, 2) for r in range(size)],
                         async_op=async_op))
    done(spmd.barrier(async_op=async_op))
    columns = meta(3, 2 * size).t()                 # non-contiguous tensors are staged through contiguous copies
    done(spmd.all_reduce(columns, async_op=async_op))
    done(spmd.all_gather_into_tensor(columns, meta(3, 2).t(), async_op=async_op))
    assert all(t.device.type == "meta" and t.shape == (2, 3) for t in [x, *gathered])
    assert columns.device.type == "meta" and columns.shape == (2 * size, 3)


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("world_size", [1, 3])
def test_every_collective_runs_on_meta(world_size: int, async_op: bool) -> None:
    def body(rank: int, size: int) -> list[str]:
        _collectives(rank, size, async_op)
        subgroup = spmd.new_group(sorted({0, size - 1}))
        if rank in (0, size - 1):
            spmd.all_reduce(meta(5), group=subgroup)
        return sorted({op for op, _ in spmd.comm.world.default_group().transport.handed})

    handed = on_meta(body, world_size)
    assert handed[0] == sorted({"all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "gather",
                                "scatter", "all_to_all"})


def test_point_to_point_runs_on_meta() -> None:
    def body(rank: int, size: int) -> None:
        peer = 1 - rank
        if rank == 0:
            spmd.send(meta(4), dst=peer, tag=1)
        else:
            spmd.recv(meta(4), src=peer, tag=1)
        works = spmd.batch_isend_irecv([spmd.P2POp(spmd.isend, meta(2, 2), peer),
                                        spmd.P2POp(spmd.irecv, meta(2, 2), peer)])
        for work in works:
            work.wait()
        sent = spmd.isend(meta(3), dst=peer)
        received = meta(3)
        spmd.irecv(received, src=peer).wait()
        sent.wait()
        assert received.device.type == "meta"

    on_meta(body, 2)


# -- object collectives -------------------------------------------------------------------------------------

def test_object_collectives_stage_their_bytes_on_the_transports_device() -> None:
    """Object collectives read the bytes back, which meta tensors don't hold: the check is that the tensors
    they hand the transport live on its device, up to the first read of the gathered lengths."""
    def body(rank: int, size: int) -> list[tuple[str, torch.device]]:
        transport = spmd.comm.world.default_group().transport
        with pytest.raises(NotImplementedError):
            spmd.all_gather_object([None] * size, {"rank": rank})
        with pytest.raises(NotImplementedError):
            spmd.broadcast_object_list([rank], src=0)
        return transport.handed

    for handed in run_ranks(body, 2, timeout=TIMEOUT, backend=MetaTransport.name):
        assert [op for op, _ in handed] == ["all_gather", "all_gather", "broadcast"]


def test_object_collectives_on_cpu_first_transport_and_explicit_device() -> None:
    def body(rank: int, size: int) -> list[Any]:
        objects: list[Any] = [None] * size
        spmd.all_gather_object(objects, ("rank", rank))
        with pytest.raises(NotImplementedError):       # device= puts the bytes on meta: the lengths go there
            spmd.broadcast_object_list([rank], src=0, device=torch.device("meta"))
        return objects

    assert run_ranks(body, 2, timeout=TIMEOUT, backend=CpuAndMetaTransport.name) == [[("rank", 0), ("rank", 1)]] * 2


# -- DTensor on meta ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("seeded", [False, True])
def test_dtensor_redistribute_and_random_ops_run_on_meta(seeded: bool) -> None:
    from spmd.tensor import DeviceMesh, Partial, Replicate, Shard, distribute_tensor
    from spmd.tensor.random import manual_seed

    def body(rank: int, size: int) -> None:
        if seeded:
            manual_seed(7)
        mesh = DeviceMesh("meta", list(range(size)))   # its rank table is CPU metadata, made before the mode
        with NoCpuTensors():
            run_ops(mesh)

    def run_ops(mesh: DeviceMesh) -> None:
        x = distribute_tensor(meta(6, 5), mesh, [Shard(0)])
        assert x.to_local().device.type == "meta"
        for target in [(Shard(1),), (Replicate(),), (Shard(0),), (Partial(),), (Shard(1),)]:
            x = x.redistribute(mesh, target)
            assert x.to_local().device.type == "meta"
        partial = x.redistribute(mesh, [Replicate()]).redistribute(mesh, [Partial()])
        assert partial.redistribute(mesh, [Shard(0)]).to_local().device.type == "meta"
        assert partial.full_tensor().shape == (6, 5)
        y = distribute_tensor(meta(6, 5), mesh, [Shard(1)])
        y.uniform_()
        y.normal_()
        y.bernoulli_(0.5)
        for made in (torch.rand_like(y), torch.randn_like(y), torch.randint_like(y, 10), torch.bernoulli(y),
                     torch.nn.functional.dropout(y, 0.5, training=True),
                     torch.nn.functional.dropout(y, 0.5, training=False)):
            assert made.to_local().device.type == "meta"
            assert made.shape == (6, 5)
        out, mask = torch.ops.aten.native_dropout.default(y, 0.5, False)
        assert out.to_local().device.type == mask.to_local().device.type == "meta"

    run_ranks(body, 2, timeout=TIMEOUT, backend=MetaTransport.name)


def test_common_dtensor_ops_run_on_meta() -> None:
    """Beyond redistribute and random ops: the op families a model uses, each sharded so it communicates."""
    from spmd.tensor import DeviceMesh, Replicate, Shard, distribute_tensor

    def body(rank: int, size: int) -> None:
        mesh = DeviceMesh("meta", list(range(size)))
        with NoCpuTensors():
            a = distribute_tensor(meta(6, 4), mesh, [Shard(0)])
            b = distribute_tensor(meta(4, 5), mesh, [Shard(1)])
            weight = distribute_tensor(meta(10, 4), mesh, [Shard(0)])
            ids = distribute_tensor(meta(3, dtype=torch.long), mesh, [Replicate()])
            target = distribute_tensor(meta(6, dtype=torch.long), mesh, [Shard(0)])
            for made in (a @ b, a.sum(), a.mean(1), a.softmax(-1), torch.nn.functional.layer_norm(a, (4,)),
                         torch.nn.functional.cross_entropy(a @ b, target), torch.nn.functional.embedding(ids, weight),
                         a.full_tensor(), a.max(), a.view(24), *torch._foreach_norm([a, a]),
                         torch.triu(a)):             # no sharding rule: gathered, run, resharded
                assert made.device.type == "meta"
            a[1] = 0                                 # writes through views that gather a sharded dim
            a[:, 1:3].mul_(2)
            b[2, 3] = 5
            assert a.to_local().device.type == b.to_local().device.type == "meta"

    run_ranks(body, 2, timeout=TIMEOUT, backend=MetaTransport.name)


# -- random generators --------------------------------------------------------------------------------------

def test_generators_are_per_device_and_cpu_draws_are_unchanged() -> None:
    from spmd.tensor.random import get_generator, manual_seed

    results: list[Any] = []

    def body() -> None:
        assert get_generator() is None                  # unseeded: torch's default generators
        manual_seed(11)
        cpu = get_generator()
        assert cpu is get_generator("cpu") is get_generator(torch.device("cpu"))
        assert cpu.device == torch.device("cpu") and cpu.initial_seed() == 11
        assert get_generator("meta") is None            # meta draws nothing
        results.append(torch.rand(5, generator=cpu))

    thread = threading.Thread(target=body)             # a fresh context, as a rank has
    thread.start()
    thread.join(TIMEOUT)
    torch.testing.assert_close(results[0], torch.rand(5, generator=torch.Generator().manual_seed(11)),
                               rtol=0, atol=0)


# -- streams ------------------------------------------------------------------------------------------------

def test_cpu_and_meta_ops_have_no_stream_to_order() -> None:
    from spmd.comm.work import caller_stream

    assert caller_stream(None) is None
    assert caller_stream(torch.device("cpu")) is None
    assert caller_stream(torch.device("meta")) is None


class _FakeEvent:
    def __init__(self, stream: _FakeStream) -> None:
        self.stream = stream
        self.device = torch.device("meta")


class _FakeStream:
    """Stands in for an accelerator stream: logs where it is made current, recorded on and waited from."""

    def __init__(self, name: str, log: list[tuple[str, str, str]]) -> None:
        self.name = name
        self.log = log

    def _note(self, what: str) -> None:
        self.log.append((what, self.name, threading.current_thread().name))

    def __enter__(self) -> _FakeStream:
        self._note("enter")
        return self

    def __exit__(self, *exc: object) -> None:
        self._note("exit")

    def record_event(self) -> _FakeEvent:
        self._note("record")
        return _FakeEvent(self)

    def wait_event(self, event: _FakeEvent) -> None:
        self._note(f"wait for {event.stream.name}")

    def synchronize(self) -> None:
        raise AssertionError("no host synchronize may be added")


def test_a_queued_op_runs_after_the_callers_stream_and_wait_orders_the_waiters_stream(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The wiring of ProcessGroup's Note on streams, with fake streams standing in for an accelerator's."""
    from spmd.comm import group as group_module
    from spmd.comm import work as work_module

    log: list[tuple[str, str, str]] = []

    def caller_stream(device: torch.device | None) -> _FakeStream | None:
        if device is None or device.type != "meta":
            return None
        log.append(("capture", "S", threading.current_thread().name))
        return _FakeStream("S", log)

    monkeypatch.setattr(group_module, "caller_stream", caller_stream)
    monkeypatch.setattr(work_module, "current_stream", lambda device: _FakeStream("W", log))
    all_reduce = MetaTransport.all_reduce

    def logged_all_reduce(self: MetaTransport, *args: Any) -> None:
        log.append(("all_reduce", "", threading.current_thread().name))
        all_reduce(self, *args)

    monkeypatch.setattr(MetaTransport, "all_reduce", logged_all_reduce)

    def body(rank: int, size: int) -> None:
        spmd.all_reduce(meta(3))                                 # inline: the caller's stream is current
        spmd.all_reduce(meta(3), async_op=True).wait()
        spmd.barrier(async_op=True).wait()                       # no tensor: no stream

    run_ranks(body, 1, timeout=TIMEOUT, backend=MetaTransport.name)
    caller, executor = "spmd-rank0", "spmd-group-default-rank0"
    assert log == [("all_reduce", "", caller),
                   ("capture", "S", caller), ("enter", "S", executor), ("all_reduce", "", executor),
                   ("record", "S", executor), ("exit", "S", executor), ("wait for S", "W", caller)]
