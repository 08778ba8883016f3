"""spmd.collective_utils (torch's `distributed.collective_utils`): a function run on one rank or every rank, its
result or its failure shared, so every rank returns the same or raises together."""

from __future__ import annotations

from typing import Any

import pytest

import spmd
from spmd.collective_utils import SyncPayload, all_gather, all_gather_object_enforce_type, broadcast
from spmd.testing import run_ranks


class Unpicklable(Exception):
    def __init__(self) -> None:
        super().__init__("held a lock")
        self.lock = __import__("threading").Lock()


def test_broadcast_runs_the_function_on_one_rank_and_returns_its_result_everywhere() -> None:
    def body(rank: int, world_size: int) -> Any:
        calls = []
        sub = spmd.new_group([1, 2])
        value = broadcast(lambda: calls.append(rank) or f"id-{rank}", rank=2, pg=spmd.group.WORLD)
        data = broadcast({"from": rank}, pg=spmd.group.WORLD)
        in_sub = broadcast(lambda: rank * 10, rank=1, pg=sub) if rank in (1, 2) else None   # group rank 1: rank 2
        return value, calls, data, in_sub

    results = run_ranks(body, world_size=3, timeout=30)
    assert [value for value, *_ in results] == ["id-2"] * 3
    assert [calls for _, calls, *_ in results] == [[], [], [2]]
    assert [data for *_, data, _ in results] == [{"from": 0}] * 3
    assert [in_sub for *_, in_sub in results] == [None, 20, 20]


def test_a_failure_on_the_broadcasting_rank_raises_on_every_rank_from_its_exception() -> None:
    def body(rank: int, world_size: int) -> Any:
        raised = []
        for fn, success in [(lambda: 1 / 0, True), (None, False), (lambda: (_ for _ in ()).throw(Unpicklable()), True)]:
            try:
                broadcast(fn, success=success, stage_name="allocate", rank=1, pg=spmd.group.WORLD)
            except RuntimeError as error:
                raised.append((str(error), type(error.__cause__).__name__))
        return raised

    for raised in run_ranks(body, world_size=3, timeout=30):
        assert raised == [
            ("collective_utils.broadcast: group rank 1 (global rank 1) failed: stage allocate: exception division "
             "by zero", "ZeroDivisionError"),
            ("collective_utils.broadcast: group rank 1 (global rank 1) failed: stage allocate", "NoneType"),
            ("collective_utils.broadcast: group rank 1 (global rank 1) failed: stage allocate: exception "
             "Unpicklable: held a lock", "RuntimeError"),   # carried as its type and message
        ]
    with pytest.raises(ValueError, match="carries no payload"):
        broadcast(lambda: 1, success=False)


def test_without_a_group_nothing_travels() -> None:
    assert broadcast(lambda: "here") == "here"
    assert broadcast(lambda: "elsewhere", rank=1) is None
    assert all_gather(lambda: 5) == [5]
    with pytest.raises(RuntimeError, match=r"all_gather failed with exception .boom.") as caught:
        all_gather(lambda: (_ for _ in ()).throw(KeyError("boom")))
    assert isinstance(caught.value.__cause__, KeyError)


def test_all_gather_returns_every_result_or_raises_everywhere_naming_the_ranks() -> None:
    def body(rank: int, world_size: int) -> Any:
        outcome: dict[str, Any] = {"values": all_gather(lambda: rank * rank, stage_name="s", pg=spmd.group.WORLD)}
        try:
            all_gather(lambda: 1 // (rank % 2), stage_name="t", pg=spmd.group.WORLD)
        except RuntimeError as error:
            outcome["failed"] = (error.args[0], [(index, type(exc).__name__) for index, exc in error.args[1]],
                                 type(error.__cause__).__name__)
        try:
            all_gather(rank, stage_name="late" if rank == 2 else "on time", pg=spmd.group.WORLD)
        except RuntimeError as error:
            outcome["strays"] = error.args[0]
        return outcome

    for outcome in run_ranks(body, world_size=4, timeout=30):
        assert outcome["values"] == [0, 1, 4, 9]
        assert outcome["failed"] == ("collective_utils.all_gather: group ranks [0, 2] failed",
                                     [(0, "ZeroDivisionError"), (2, "ZeroDivisionError")], "ZeroDivisionError")
        assert outcome["strays"] == ("collective_utils.all_gather: group ranks [2] are at stages ['late'], group "
                                     "rank 0 at stage on time")


def test_all_gather_object_enforce_type_raises_on_every_rank_when_a_rank_sent_another_type() -> None:
    def body(rank: int, world_size: int) -> Any:
        same: list[Any] = [None] * world_size
        all_gather_object_enforce_type(spmd.group.WORLD, same, SyncPayload("s", True, rank))
        mixed: list[Any] = [None] * world_size
        with pytest.raises(TypeError, match="group rank 1 is a <class 'str'>"):
            all_gather_object_enforce_type(spmd.group.WORLD, mixed, "x" if rank == 1 else rank)
        lenient: list[Any] = [None] * world_size
        all_gather_object_enforce_type(spmd.group.WORLD, lenient, "x" if rank == 1 else rank,
                                       type_checker=lambda first, other: True)
        return [payload.payload for payload in same], lenient

    for same, lenient in run_ranks(body, world_size=3, timeout=30):
        assert same == [0, 1, 2] and lenient == [0, "x", 2]
