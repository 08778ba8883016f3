"""The validator proves every built-in schedule over a grid of sizes, measures what the literature predicts
(1F1B's bubble (R-1)/(n+R-1), its R-r live microbatches, zero bubble below 1F1B), and refuses broken programs
naming what is wrong: a missing receive, a swapped order that deadlocks, work left undone."""

from __future__ import annotations

import itertools

import pytest

from spmd.pipelining import programs
from spmd.pipelining.actions import Action, ActionKind, Program, ScheduleError
from spmd.pipelining.validate import check_message_order, validate_program

GRID = [(name, ranks, n, v) for name, (_, placement, multi) in programs.PROGRAMS.items()
        for ranks in (1, 2, 3, 4) for n in (1, 2, 3, 4, 6, 8)
        for v in (((1, 2, 3) if multi else (1,)) if placement == "loop" else (2,))]


def _lowered(name: str, ranks: int, n: int, v: int = 1) -> tuple[Program, dict[int, int]]:
    program = programs.build(name, ranks, n, v)
    placement = programs.placement_for(program, programs.placement_of(name))
    return programs.add_communication(program, placement), placement


def test_every_built_in_schedule_validates_over_the_grid() -> None:
    accepted = 0
    for name, ranks, n, v in GRID:
        try:
            program, placement = _lowered(name, ranks, n, v)
        except ScheduleError:   # a size the schedule refuses up front (tested in test_programs)
            continue
        report = validate_program(program, n, placement=placement)
        assert report.num_stages == ranks * v and 0 <= report.bubble_fraction < 1
        assert sum(report.busy.values()) == 3 * n * ranks * v   # F=1 and B=2 (or I=1 and W=1) per stage and mb
        accepted += 1
    assert accepted >= 150


@pytest.mark.parametrize("ranks, n", [(2, 2), (2, 8), (4, 4), (4, 8), (3, 7)])
def test_one_f_one_b_bubble_and_memory_are_the_textbook_ones(ranks: int, n: int) -> None:
    report = validate_program(*_lowered("1F1B", ranks, n)[:1], n)
    assert report.makespan == 3 * (n + ranks - 1)
    assert report.bubble_fraction == pytest.approx((ranks - 1) / (n + ranks - 1))
    assert report.peak_live_activations == {rank: ranks - rank for rank in range(ranks)}
    gpipe = validate_program(_lowered("GPipe", ranks, n)[0], n)
    assert gpipe.bubble_fraction == pytest.approx(report.bubble_fraction)
    assert gpipe.peak_live_activations == dict.fromkeys(range(ranks), n)


def test_the_zero_bubble_schedules_idle_less_than_1f1b() -> None:
    one_f_one_b = validate_program(_lowered("1F1B", 4, 8)[0], 8).bubble_fraction
    interleaved = validate_program(*_lowered("Interleaved1F1B", 4, 8, 2)[:1], 8).bubble_fraction
    for name, v in (("InterleavedZeroBubble", 2), ("ZBVZeroBubble", 2), ("DualPipeV", 2)):
        program, placement = _lowered(name, 4, 8, v)
        assert validate_program(program, 8, placement=placement).bubble_fraction < interleaved < one_f_one_b


def test_costs_per_stage_set_the_simulated_times() -> None:
    program, placement = _lowered("GPipe", 2, 1)
    even = validate_program(program, 1, placement=placement)
    uneven = validate_program(program, 1, placement=placement, costs={ActionKind.FORWARD: 0.5},
                              stage_costs={(1, ActionKind.FORWARD): 3.0, (1, ActionKind.FULL_BACKWARD): 4.0})
    assert even.makespan == 1 + 1 + 2 + 2
    assert uneven.makespan == 0.5 + 3 + 4 + 2 and uneven.busy == {0: 2.5, 1: 7.0}
    assert uneven.stage_costs == {(1, ActionKind.FORWARD): 3.0, (1, ActionKind.FULL_BACKWARD): 4.0}
    issuing = validate_program(program, 1, placement=placement, costs={ActionKind.SEND_F: 0.5, ActionKind.RECV_B: 0.25})
    assert issuing.makespan == 1 + 0.5 + 1 + 2 + 2    # rank 0 computes, sends (rank 1 then goes on), posts
    assert issuing.busy == {0: 3.0, 1: 3.0}                   # issuing and posting are idle time, not work


def test_the_timeline_holds_every_action_in_program_order() -> None:
    program, placement = _lowered("DualPipeV", 2, 4, 2)
    report = validate_program(program, 4, placement=placement)
    for rank, actions in program.items():
        timed = report.timeline[rank]
        assert [t.action for t in timed] == actions
        assert all(t.start <= t.end for t in timed)
        compute = [t for t in timed if t.action.is_compute]
        assert all(a.end <= b.start for a, b in itertools.pairwise(compute))


def test_a_forward_only_program_validates_without_backwards() -> None:
    program = programs.add_communication({r: [Action(r, ActionKind.FORWARD, mb) for mb in range(3)]
                                          for r in range(2)}, {0: 0, 1: 1})
    report = validate_program(program, 3, has_backward=False)
    assert report.peak_live_activations == {0: 0, 1: 0}
    with pytest.raises(ScheduleError, match=r"stage 1 microbatch 2 ran F; a training step also needs B or I\+W"):
        validate_program(program, 3)


def _parse(rows: dict[int, str]) -> Program:
    return {rank: [Action.parse(text) for text in row.split()] for rank, row in rows.items()}


def test_a_missing_receive_is_named() -> None:
    program = _parse({0: "0F0 0SEND_F0 0RECV_B0 0B0", 1: "1F0 1B0 1SEND_B0"})
    with pytest.raises(ScheduleError, match=r"would hang") as error:
        validate_program(program, 1)
    message = str(error.value)
    assert "rank 1 is blocked at action 0 (1F0): 1F0 needs the receive 1RECV_F0, which this rank never posts" in message
    assert "rank 0 is blocked at action 3 (0B0): 0B0 waits for 1SEND_B0 from rank 1, which is blocked before it" \
        in message


def test_a_swapped_order_that_deadlocks_names_each_ranks_blocked_action() -> None:
    # rank 0 runs B0 before F1, but rank 1 wants F1 before it can run B0: each waits for the other
    program = _parse({0: "0F0 0SEND_F0 0RECV_B0 0B0 0F1 0SEND_F1 0RECV_B1 0B1",
                      1: "1RECV_F0 1RECV_F1 1F0 1F1 1B0 1SEND_B0 1B1 1SEND_B1"})
    with pytest.raises(ScheduleError) as error:
        validate_program(program, 2)
    message = str(error.value)
    assert "rank 0 is blocked at action 3 (0B0): 0B0 waits for 1SEND_B0 from rank 1, which is blocked before it " \
           "(it is action 5)" in message
    assert "rank 1 is blocked at action 3 (1F1): 1F1 waits for 0SEND_F1 from rank 0, which is blocked before it " \
           "(it is action 5)" in message
    assert "rank 0: 0F0 0SEND_F0" in message   # the program is shown


@pytest.mark.parametrize("rows, n, says", [
    ({0: "0B0 0F0"}, 1, "0B0 waits for 0F0 on this rank, which comes later (action 1)"),
    ({0: "0F0 0I0 0W1 0F1 0I1"}, 2, "0W1 waits for 0I1 on this rank, which comes later (action 4)"),
    ({0: "0F0 0B0 0F1"}, 2, "stage 0 microbatch 1 ran F; a training step also needs B or I+W"),
    ({0: "0F0 0B0 0F0 0B0"}, 1, "rank 0, action 2 (0F0): 0F0 also at rank 0, action 0"),
    ({0: "0F0 0B0 0F3 0B3"}, 2, "microbatch 3 is out of range for 2 microbatches"),
    ({0: "0F0 0B0", 1: "0F1 0B1"}, 2, "stage 0 is computed on rank 0 and on rank 1 (0F1)"),
    ({0: "0F0 0SEND_F0 0B0 1F0 1B0"}, 1, "stage 0 has no stage 1 on another rank to send to"),
    ({0: "0F0 0I0 0B0 0W0"}, 1, "stage 0 microbatch 0 ran B+F+I+W; a training step also needs"),
])
def test_broken_programs_are_refused_naming_the_problem(rows: dict[int, str], n: int, says: str) -> None:
    with pytest.raises(ScheduleError) as error:
        validate_program(_parse(rows), n)
    assert says in str(error.value)


def test_unmatched_messages_are_refused() -> None:
    program = _parse({0: "0F0 0SEND_F0 0F1 0SEND_F1", 1: "1RECV_F0 1RECV_F1 1F0"})
    with pytest.raises(ScheduleError, match="completes but leaves the step wrong") as error:
        validate_program(program, 2, has_backward=False)
    message = str(error.value)
    assert "stage 1 microbatch 1 ran nothing; a forward-only step also needs F" in message
    assert "0SEND_F1 on rank 0 is never received (no 1RECV_F1 used on rank 1)" in message
    assert "1RECV_F1 on rank 1 is posted but no computation uses it" in message


def test_a_program_must_agree_with_the_placement_it_is_given() -> None:
    program, _ = _lowered("GPipe", 2, 2)
    with pytest.raises(ScheduleError, match="stage 1 is computed on rank 1, but its placement is rank 0"):
        validate_program(program, 2, placement={0: 0, 1: 0})
    with pytest.raises(ScheduleError, match="one action list per rank"):
        validate_program({1: []}, 2)


def test_a_pair_of_ranks_listing_its_messages_in_two_orders_is_refused_for_nccl() -> None:
    """Valid where messages match by tag (spmd's transports, gloo), so validate_program takes it; NCCL matches by
    order: rank 0 would wait for its first backward's gradient while rank 1 waits for the second activation."""
    program = {r: [Action.parse(a) for a in row.split()] for r, row in enumerate((
        "0F0 0SEND_F0 0RECV_B0 0F1 0SEND_F1 0RECV_B1 0B0 0B1",
        "1RECV_F0 1RECV_F1 1F0 1F1 1B0 1SEND_B0 1B1 1SEND_B1"))}
    validate_program(program, 2, placement={0: 0, 1: 1})
    with pytest.raises(ScheduleError, match="ranks 0 and 1 differ at their message 1: rank 0 has stage 1's backward of "
                                            "microbatch 0, rank 1 stage 0's forward of microbatch 1"):
        check_message_order(program, {0: 0, 1: 1})
