"""Backend "fake": one process is one rank of a simulated world. Its collectives give what torch's
FakeProcessGroup gives (the oracle, run side by side in this process), it needs no store or launcher, and
torch's utilities see its rank and world size."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as torch_dist
from torch.utils.data.distributed import DistributedSampler

import spmd
from spmd.device_mesh import init_device_mesh
from spmd.testing import run_ranks

WORLD = 4


@pytest.fixture
def fake_world() -> Iterator[None]:
    spmd.init_process_group("fake", rank=2, world_size=WORLD, torch_default_group=False)
    try:
        yield
    finally:
        spmd.destroy_process_group()


@pytest.fixture
def torch_fake_world() -> Iterator[None]:
    torch_dist.init_process_group("fake", rank=2, world_size=WORLD)
    try:
        yield
    finally:
        torch_dist.destroy_process_group()


def _every_op(dist: object, rank: int) -> list[torch.Tensor | None]:
    """The collectives and p2p of `dist` (spmd or torch.distributed), on inputs only this rank knows."""
    out: list[torch.Tensor | None] = []
    mine = torch.arange(6.0) + 10 * rank

    def run(op: Callable[..., object], result: torch.Tensor | list[torch.Tensor] | None, *args: object,
            **kwargs: object) -> None:
        op(*args, **kwargs)
        out.extend(result if isinstance(result, list) else [result])

    t = mine.clone()
    run(dist.all_reduce, t, t)
    t = mine.clone()
    run(dist.broadcast, t, t, src=0)
    for root in (0, rank):
        t = mine.clone()
        run(dist.reduce, t, t, dst=root)
    t = torch.zeros(6 * WORLD)
    run(dist.all_gather_single, t, t, mine)
    blocks = [torch.zeros(6) for _ in range(WORLD)]
    run(dist.all_gather, blocks, blocks, mine)
    t, full = torch.zeros(6), torch.arange(6.0 * WORLD)
    run(dist.reduce_scatter_single, t, t, full)
    t = torch.zeros(6)
    run(dist.reduce_scatter, t, t, list(full.chunk(WORLD)))
    for root in (0, rank):
        blocks = [torch.zeros(6) for _ in range(WORLD)]
        run(dist.gather, blocks, mine, blocks if root == rank else None, dst=root)
        t = torch.full((6,), -1.0)
        run(dist.scatter, t, t, list(full.chunk(WORLD)) if root == rank else None, src=root)
    t = torch.zeros(6 * WORLD)
    run(dist.all_to_all_single, t, t, full)
    t = torch.zeros(9)
    run(dist.all_to_all_single, t, t, torch.arange(5.0), output_split_sizes=[3, 0, 4, 2],
        input_split_sizes=[2, 1, 1, 1])
    blocks = [torch.zeros(6) for _ in range(WORLD)]
    run(dist.all_to_all, blocks, blocks, list(full.chunk(WORLD)))
    t = torch.full((6,), -2.0)
    dist.send(mine, dst=0)
    run(dist.recv, t, t, src=1)
    dist.barrier()
    return out


def test_every_op_gives_what_torchs_fake_group_gives(fake_world: None, torch_fake_world: None) -> None:
    ours, torchs = _every_op(spmd, 2), _every_op(torch_dist, 2)
    assert len(ours) == len(torchs) == 28
    for index, (got, want) in enumerate(zip(ours, torchs)):
        assert torch.equal(got, want), (index, got, want)
    assert ours[4].tolist() == (torch.arange(6.0) + 20).tolist() * WORLD      # all_gather: copies of mine
    assert ours[9].tolist() == [12.0, 13, 14, 15, 16, 17]                     # reduce_scatter: my block


def test_a_fake_world_needs_no_store_and_torch_sees_its_rank() -> None:
    spmd.init_process_group("FAKE", rank=5, world_size=1024)
    try:
        assert (spmd.get_rank(), spmd.get_world_size(), spmd.get_backend()) == (5, 1024, "fake")
        assert (torch_dist.get_rank(), torch_dist.get_world_size()) == (5, 1024)
        assert list(DistributedSampler(range(2048), shuffle=False)) == [5, 1029]
        t = torch.ones(3)
        torch_dist.all_reduce(t)                 # torch's collectives run on spmd's fake group
        assert t.tolist() == [1.0, 1.0, 1.0]
        spmd.monitored_barrier(timeout=1)        # the simulated ranks always arrive
        objects: list[object] = [None] * 1024
        spmd.all_gather_object(objects, {"rank": 5})
        assert objects == [{"rank": 5}] * 1024
        mesh = init_device_mesh("cpu", (128, 8), mesh_dim_names=("dp", "tp"))
        assert mesh["tp"].get_group().ranks == list(range(0, 8)) and mesh.get_coordinate() == (0, 5)
        assert spmd.get_backend(mesh["dp"].get_group()) == "fake"
        with pytest.raises(ValueError, match=r"backend 'fake'.*can't connect over 'tcp'"):
            spmd.new_group([0, 5], backend="tcp")
    finally:
        spmd.destroy_process_group()
    assert not torch_dist.is_initialized()


@pytest.mark.parametrize("arguments, given", [({"world_size": 8}, "rank=-1, world_size=8"),
                                              ({"rank": 1}, "rank=1, world_size=-1"),
                                              ({"rank": 1, "world_size": 8, "init_method": "tcp://h:1"},
                                               "init_method='tcp://h:1'")])
def test_a_fake_world_without_rank_and_world_size_is_refused(arguments: dict, given: str) -> None:
    with pytest.raises(ValueError, match=f"backend 'fake' simulates.*pass rank= and world_size=.*{given}"):
        spmd.init_process_group("fake", **arguments)
    spmd.init_process_group("fake", rank=0, world_size=2, torch_default_group=False)   # nothing was left behind
    spmd.destroy_process_group()


def test_a_real_world_can_make_fake_groups() -> None:
    def body(rank: int, size: int) -> list[float]:
        fake = spmd.new_group(backend="fake")
        t = torch.full((2,), float(rank))
        spmd.all_reduce(t, group=fake)           # nothing sent: each rank keeps its own
        spmd.all_reduce(t)                       # the real group still sums
        return t.tolist()

    assert run_ranks(body, 2, timeout=60) == [[1.0, 1.0], [1.0, 1.0]]


def test_ddp_and_tensor_parallel_run_on_one_rank_of_a_large_fake_world() -> None:
    from spmd.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    spmd.init_process_group("fake", rank=9, world_size=256, torch_default_group=False)
    try:
        torch.manual_seed(0)
        ddp = spmd.DistributedDataParallel(torch.nn.Linear(8, 4))
        before = ddp.module.weight.detach().clone()
        ddp(torch.randn(3, 8)).sum().backward()
        torch.optim.SGD(ddp.parameters(), lr=0.1).step()
        assert not torch.equal(before, ddp.module.weight)
        mesh = init_device_mesh("cpu", (32, 8), mesh_dim_names=("dp", "tp"))
        mlp = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
        parallelize_module(mlp, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        assert mlp[0].weight.to_local().shape == (8, 16) and mlp[2].weight.to_local().shape == (16, 8)
        out = mlp(torch.randn(5, 16))
        out.sum().backward()
        assert out.shape == (5, 16) and mlp[0].weight.grad.to_local().shape == (8, 16)
    finally:
        spmd.destroy_process_group()


def test_fake_tensors_go_through_a_fake_group_inline_and_no_real_one() -> None:
    """Under torch's FakeTensorMode (a model traced for its memory, as TorchTitan's estimation does) the fake
    group takes FakeTensors, its async ops complete on the caller's thread (the mode is per thread), object
    exchanges and mesh slicing run on real host tensors; a real group refuses a FakeTensor before sending."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    spmd.init_process_group("fake", rank=3, world_size=8, torch_default_group=False)
    try:
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        with FakeTensorMode():
            tp = mesh["tp"]
            out, mine = torch.empty(16), torch.ones(4)
            work = spmd.all_gather_into_tensor(out, mine, group=tp.get_group(), async_op=True)
            assert work.is_completed() and isinstance(out, FakeTensor) and out.shape == (16,)
            gathered: list[object] = [None] * 8
            spmd.all_gather_object(gathered, {"rank": 3})
            assert gathered == [{"rank": 3}] * 8
    finally:
        spmd.destroy_process_group()

    def body(rank: int, size: int) -> str:
        with FakeTensorMode(), pytest.raises(TypeError) as caught:
            spmd.all_reduce(torch.ones(2))
        return str(caught.value)

    for message in run_ranks(body, 2, timeout=60):
        assert "all_reduce on rank" in message and "is a FakeTensor" in message
