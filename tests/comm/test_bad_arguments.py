"""Arguments that can't be right fail at once with a message that names the rank and says what would be right:
complex reductions other than SUM/AVG (spmd moves complex as pairs of reals, so MAX, MIN and PRODUCT would
return numbers that are neither input nor product), impossible ranks and world sizes (arguments, RANK /
WORLD_SIZE, the init_method) before any rendezvous waits on them, a root or peer outside the group, naming the
caller and the valid range, and new_group ranks that can't make a group."""

from __future__ import annotations

import time

import pytest
import torch

import spmd
from spmd import ReduceOp
from spmd.testing import run_ranks


@pytest.mark.parametrize("op", [ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PRODUCT])
def test_complex_reductions_other_than_sum_and_avg_raise_before_sending(op: ReduceOp) -> None:
    def body(rank: int, world_size: int) -> list:
        t = torch.tensor([1 + 2j, 3 - 1j]) * (rank + 1)
        with pytest.raises(ValueError, match=f"on rank {rank} .*not defined for complex tensors"):
            spmd.all_reduce(t, op=op)
        with pytest.raises(ValueError, match="not defined for complex"):
            spmd.reduce_scatter_tensor(torch.empty(1, dtype=t.dtype), t, op=op)
        avg = t.clone()
        spmd.all_reduce(t)                       # SUM and AVG stay exact on pairs of reals
        spmd.all_reduce(avg, op=ReduceOp.AVG)
        return [t.tolist(), avg.tolist()]

    results = run_ranks(body, world_size=2, timeout=30)
    want = (torch.tensor([1 + 2j, 3 - 1j]) * 3).tolist()
    assert results == [[want, (torch.tensor([1 + 2j, 3 - 1j]) * 1.5).tolist()]] * 2


FAST_S = 1.0     # an argument error is raised at once: nothing waits on a peer or a store


@pytest.mark.parametrize(("rank", "world_size", "error", "message"), [
    (2, 2, ValueError, r"rank 2 is out of range for world_size 2 \(ranks are 0\.\.1\); check the rank= and "
                       r"world_size= arguments"),
    (0, 0, ValueError, r"world_size 0 is not a number of ranks \(it must be at least 1"),
    (0, -5, ValueError, r"world_size -5 is not a number of ranks"),
    (-3, 2, ValueError, r"rank -3 is negative \(ranks count from 0"),
    ("1", 2, TypeError, r"rank must be an int, got str '1'"),
    (0, 2.0, TypeError, r"world_size must be an int, got float 2.0"),
])
def test_impossible_ranks_fail_before_the_rendezvous(rank: object, world_size: object, error: type,
                                                     message: str) -> None:
    started = time.monotonic()
    with pytest.raises(error, match=message):
        spmd.init_process_group("tcp", init_method="tcp://127.0.0.1:1", rank=rank, world_size=world_size,
                                timeout=30)
    assert time.monotonic() - started < FAST_S    # nothing waited on a store that will never answer
    assert not spmd.is_initialized()


@pytest.mark.parametrize(("env", "arguments", "message"), [
    ({"RANK": "5", "WORLD_SIZE": "4"}, {}, r"rank 5 is out of range for world_size 4 \(ranks are 0\.\.3\); "
                                           r"check RANK / WORLD_SIZE"),
    ({"RANK": "5", "WORLD_SIZE": "4"}, {"rank": None, "world_size": None}, r"rank 5 is out of range for world_size 4"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, {}, r"world_size 0 is not a number of ranks .*check RANK / WORLD_SIZE"),
    ({"RANK": "-2", "WORLD_SIZE": "4"}, {}, r"rank -2 is negative .*check RANK / WORLD_SIZE"),
    ({"RANK": "3"}, {"world_size": 2}, r"rank 3 is out of range for world_size 2 .*check RANK / WORLD_SIZE"),
])
def test_impossible_ranks_from_the_environment_fail_before_the_rendezvous(
        monkeypatch: pytest.MonkeyPatch, env: dict[str, str], arguments: dict, message: str) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")          # nothing listens there: a rendezvous would wait
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    started = time.monotonic()
    with pytest.raises(ValueError, match=message):
        spmd.init_process_group("tcp", timeout=30, **arguments)
    assert time.monotonic() - started < FAST_S
    assert not spmd.is_initialized()


@pytest.mark.parametrize(("url", "message"), [
    ("tcp://127.0.0.1:1?rank=3&world_size=2", r"rank 3 is out of range for world_size 2 .*check the rank and "
                                             r"world_size in init_method"),
    ("tcp://127.0.0.1:1?rank=x&world_size=2", r"rank='x' in init_method .* is not an integer"),
    ("tcp://127.0.0.1:1", r"needs rank and world_size; pass rank= and world_size=, or add \?rank=R&world_size=N"),
])
def test_impossible_ranks_in_the_init_method_fail_before_the_rendezvous(url: str, message: str) -> None:
    started = time.monotonic()
    with pytest.raises(ValueError, match=message):
        spmd.init_process_group("tcp", init_method=url, timeout=30)
    assert time.monotonic() - started < FAST_S


def _raises_fast(error: type, message: str, call) -> str:
    started = time.monotonic()
    with pytest.raises(error, match=message) as raised:
        call()
    assert time.monotonic() - started < FAST_S
    return str(raised.value)


def test_a_root_outside_the_group_names_the_calling_rank() -> None:
    def body(rank: int, world_size: int) -> str:
        pair = spmd.new_group([0, 1])
        if rank > 1:
            return ""
        with pytest.raises(ValueError) as raised:
            spmd.broadcast(torch.zeros(2), src=2, group=pair)
        _raises_fast(ValueError, rf"reduce on rank {rank} of group .*: group_dst=2 is out of range for a group of "
                                 r"2 ranks \(group ranks are 0\.\.1\)",
                     lambda: spmd.reduce(torch.zeros(2), group_dst=2, group=pair))
        _raises_fast(ValueError, rf"scatter_object_list on rank {rank} of group .*: src: rank 2 is not in",
                     lambda: spmd.scatter_object_list([None], [1, 2], src=2, group=pair))
        return str(raised.value)

    for rank, message in enumerate(run_ranks(body, world_size=3, timeout=30)[:2]):
        assert f"broadcast on rank {rank} of group" in message and "src: rank 2 is not in group" in message, message
        assert "pass one of its global ranks [0, 1], or a group rank 0..1" in message, message


def test_a_peer_outside_the_group_names_the_calling_rank_and_the_range() -> None:
    def body(rank: int, world_size: int) -> None:
        pair = spmd.new_group([0, 2])
        if rank == 1:
            return
        _raises_fast(ValueError, rf"send on rank {rank} of group .*: dst: rank 1 is not in group .*\(ranks \[0, 2\]\)",
                     lambda: spmd.send(torch.zeros(1), dst=1, group=pair))
        _raises_fast(ValueError, rf"irecv on rank {rank} of .*: group_src=-1 is out of range for a group of 2 ranks "
                                 r"\(group ranks are 0\.\.1\)",
                     lambda: spmd.irecv(torch.zeros(1), group_src=-1, group=pair))
        peer = 2 - rank
        # A bad second item starts nothing: the first isend would otherwise be the message received below.
        stale = spmd.P2POp(spmd.isend, torch.full((1,), -1.0), peer, pair)
        _raises_fast(ValueError, rf"isend on rank {rank} .*: dst: rank 7 is not in group",
                     lambda: spmd.batch_isend_irecv([stale, spmd.P2POp(spmd.isend, torch.zeros(1), 7, pair)]))
        works = spmd.batch_isend_irecv([spmd.P2POp(spmd.isend, torch.full((1,), float(rank)), peer, pair),
                                        spmd.P2POp(spmd.irecv, received := torch.zeros(1), peer, pair)])
        for work in works:
            work.wait()
        assert received.item() == float(peer)

    run_ranks(body, world_size=3, timeout=30)


@pytest.mark.parametrize(("ranks", "error", "message"), [
    ([0, 0, 1], ValueError, r"ranks \[0, 0, 1\] list rank\(s\) \[0\] more than once; list each rank once"),
    ([0, 5], ValueError, r"rank 5 in ranks \[0, 5\] is out of range for world_size 3 \(ranks are 0\.\.2\)"),
    ([-1, 0], ValueError, r"rank -1 in ranks \[-1, 0\] is out of range for world_size 3"),
    ([], ValueError, r"ranks is empty; a group needs at least one rank"),
    ([0, 1.0], TypeError, r"ranks \[0, 1.0\] hold 1.0 \(float\); list global ranks as ints"),
    (3, TypeError, r"ranks must be a list of ints"),
])
def test_new_group_with_impossible_ranks_fails_on_every_rank_naming_it(ranks: object, error: type,
                                                                        message: str) -> None:
    def body(rank: int, world_size: int) -> list[int]:
        text = _raises_fast(error, message, lambda: spmd.new_group(ranks))
        assert text.startswith(f"spmd.new_group on rank {rank}: "), text
        group = spmd.new_group([0, 2])       # the failed call left no half-made group behind
        if rank == 1:
            return []
        t = torch.ones(1)
        spmd.all_reduce(t, group=group)
        return t.tolist()

    assert run_ranks(body, world_size=3, timeout=30) == [[2.0], [], [2.0]]


def test_a_wrapper_subclass_is_refused_by_collectives_and_travels_by_value_in_dtensor_redistribution() -> None:
    """A wrapper subclass (its data in the tensors it holds, its own pointer null) would be read or written as
    raw memory by the transports; collectives refuse it, naming it, and DTensor's redistribution moves a plain
    copy of its value instead."""
    from torch.testing._internal.two_tensor import TwoTensor

    from spmd.device_mesh import init_device_mesh
    from spmd.tensor import DTensor, Shard

    def body(rank: int, world_size: int) -> torch.Tensor:
        wrapped = TwoTensor(torch.full((2, 3), float(rank)), torch.full((2, 3), float(rank)))
        with pytest.raises(TypeError, match=f"all_reduce on rank {rank} .*: tensor is a TwoTensor, a tensor "
                                            f"subclass whose data lives in the tensors it wraps"):
            spmd.all_reduce(wrapped)
        with pytest.raises(TypeError, match="output_tensor is a TwoTensor"):
            spmd.all_gather_into_tensor(TwoTensor(torch.empty(4, 3), torch.empty(4, 3)), torch.ones(2, 3))
        mesh = init_device_mesh("cpu", (world_size,))
        return DTensor.from_local(wrapped, mesh, [Shard(0)]).full_tensor()

    for full in run_ranks(body, world_size=2, timeout=30):
        assert type(full) is torch.Tensor
        assert torch.equal(full, torch.tensor([[0.0] * 3] * 2 + [[1.0] * 3] * 2))
