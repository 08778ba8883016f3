"""Schedules as data: actions and their text form, CSV files both ways with torch's runtime, stage placement,
and every generator's program equal to torch's schedule of the same name (torch builds its programs without
communicating, so stand-in stages suffice)."""

from __future__ import annotations

import pathlib
import types

import pytest
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

from spmd.pipelining import programs
from spmd.pipelining.actions import Action, ActionKind, ScheduleError, read_csv, stage_to_rank, write_csv
from spmd.pipelining.validate import check_message_order, validate_program

F, B = ActionKind.FORWARD, ActionKind.FULL_BACKWARD
DATA_PARALLEL = (ActionKind.UNSHARD, ActionKind.RESHARD, ActionKind.REDUCE_GRAD)


def _torch_schedule(name: str, num_ranks: int, n_microbatches: int, stages_per_rank: int) -> object:
    def stage(index: int, num_stages: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(num_stages=num_stages, group_size=num_ranks, group_rank=0, stage_index=index,
                                     submod=None, stage_index_to_group_rank=None)

    cls = torch_schedules.get_schedule_class(name)
    if name == "GPipe":
        return cls(stage(0, num_ranks), n_microbatches)
    return cls([stage(i, num_ranks * stages_per_rank) for i in range(stages_per_rank)], n_microbatches)


def _spelled(program: dict) -> dict[int, list[str]]:
    return {rank: [str(a) for a in actions if a is not None and str(a).find("REDUCE_GRAD") < 0]
            for rank, actions in program.items()}


def test_actions_print_and_parse_as_torch_spells_them() -> None:
    for text in ("2F0", "1B3", "1I3", "0W12", "0SEND_F1", "1RECV_F1", "1SEND_B1", "0RECV_B1", "3UNSHARD", "3RESHARD",
                 "0REDUCE_GRAD", "(0F4;3B1)OVERLAP_F_B"):
        action = Action.parse(text)
        assert action is not None and str(action) == text
    assert Action.parse("  ") is None
    assert Action.parse("1SEND_B1") == Action(1, ActionKind.SEND_B, 1)
    assert Action.parse("(0F4;3B1)OVERLAP_F_B").computations == (Action(0, F, 4), Action(3, B, 1))


@pytest.mark.parametrize("text, says", [("F0", "[stage][kind][microbatch]"), ("1X2", "[stage][kind][microbatch]"),
                                        ("1F", "needs a microbatch"), ("1REDUCE_GRAD0", "takes no microbatch"),
                                        ("(0F1)OVERLAP_F_B", "two or more"), ("(0F1;1B0)F", "only OVERLAP_F_B")])
def test_a_misspelled_action_is_refused_with_the_form_to_use(text: str, says: str) -> None:
    with pytest.raises(ScheduleError, match=r"can't parse action") as error:
        Action.parse(text)
    assert says in str(error.value)


def test_csv_round_trips_and_reads_what_torchs_runtime_writes(tmp_path: pathlib.Path) -> None:
    program = programs.add_communication(programs.dualpipe_v(2, 4), stage_to_rank(2, 4, "v"))
    write_csv(program, tmp_path / "mine.csv")
    assert read_csv(tmp_path / "mine.csv") == program

    for name in ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):
        schedule = _torch_schedule(name, 2, 4, 2)
        schedule._dump_csv(tmp_path / "torch.csv", format="compute_comms")
        theirs = read_csv(tmp_path / "torch.csv")   # with torch's UNSHARD, RESHARD and REDUCE_GRAD
        assert {rank: list(map(str, actions)) for rank, actions in theirs.items()} == {
            rank: list(map(str, actions)) for rank, actions in schedule.pipeline_order_with_comms.items()}
        report = validate_program(theirs, 4, placement=schedule.stage_index_to_group_rank)
        assert report.num_stages == 4

    write_csv(programs.gpipe(2, 2), tmp_path / "gpipe.csv")
    torch_gpipe = _torch_schedule("Interleaved1F1B", 2, 2, 1)
    torch_gpipe._load_csv(str(tmp_path / "gpipe.csv"))   # torch's runtime loads what we write
    assert _spelled(torch_gpipe.pipeline_order) == _spelled(programs.gpipe(2, 2))


def test_a_bad_csv_cell_names_its_row(tmp_path: pathlib.Path) -> None:
    (tmp_path / "bad.csv").write_text("0F0,0B0\n1F0,1Q0\n")
    with pytest.raises(ScheduleError, match=r"row 2 \(rank 1\): can't parse action '1Q0'"):
        read_csv(tmp_path / "bad.csv")


@pytest.mark.parametrize("num_ranks, num_stages", [(1, 1), (2, 4), (3, 6), (4, 8), (2, 6), (4, 4)])
def test_stage_placement_matches_torch(num_ranks: int, num_stages: int) -> None:
    for style in ("loop", "v"):
        assert stage_to_rank(num_ranks, num_stages, style) == generate_stage_to_rank_mapping(
            num_ranks, num_stages, style)
    with pytest.raises(ScheduleError, match="don't divide"):
        stage_to_rank(num_ranks + 1, num_ranks * 2 + 1)


# 1F1B is checked against torch's runtime order below: torch's printed pipeline_order for it is off by one
# microbatch on the last rank, while its _step_microbatches runs the order programs.one_f_one_b returns.
ORACLE = [(name, ranks, n, v) for name in ("GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
          for ranks in (1, 2, 3, 4) for n in (1, 2, 3, 4, 5, 6, 8, 12) for v in ((1,) if name == "GPipe" else (1, 2, 3))
          ] + [(name, ranks, n, 2) for name in ("ZBVZeroBubble", "DualPipeV") for ranks in (1, 2, 3, 4)
               for n in (1, 2, 3, 4, 5, 6, 8, 12)]


@pytest.mark.parametrize("name, ranks, n, v", ORACLE)
def test_every_program_is_torchs(name: str, ranks: int, n: int, v: int) -> None:
    try:
        theirs = _spelled(_torch_schedule(name, ranks, n, v).pipeline_order)
    except ValueError as error:   # torch refuses this size: so do we
        with pytest.raises(ScheduleError):
            programs.build(name, ranks, n, v)
        assert str(error)
        return
    assert _spelled(programs.build(name, ranks, n, v)) == theirs


def test_one_f_one_b_is_the_order_torchs_runtime_runs() -> None:
    # torch's Schedule1F1B._step_microbatches: min(n, R - r) forwards, then B and F alternate, then the Bs left
    for ranks, n in ((1, 3), (2, 2), (3, 5), (4, 8)):
        for rank, actions in programs.one_f_one_b(ranks, n).items():
            warmup = min(n, ranks - rank)
            want = [f"{rank}F{mb}" for mb in range(warmup)]
            for mb in range(n):
                want.append(f"{rank}B{mb}")
                if warmup + mb < n:
                    want.append(f"{rank}F{warmup + mb}")
            assert list(map(str, actions)) == want
    with pytest.raises(ScheduleError, match="at least as many microbatches as stages: got 3 microbatches for 4"):
        programs.one_f_one_b(4, 3)


@pytest.mark.parametrize("call, says", [
    (lambda: programs.build("Nope", 2, 4), "unknown schedule 'Nope'; the schedules are GPipe, 1F1B"),
    (lambda: programs.build("gpipe", 2, 4, 2), "GPipe holds 1 stage per rank, not 2"),
    (lambda: programs.build("ZBVZeroBubble", 2, 4, 3), "ZBVZeroBubble holds 2 stages per rank, not 3"),
    (lambda: programs.interleaved_1f1b(4, 9, 2), "9 microbatches don't split into 2 equal rounds"),
    (lambda: programs.dualpipe_v(2, 3), "DualPipeV needs at least as many microbatches as stages: got 3 micro"),
    (lambda: programs.gpipe(0, 4), "the number of ranks must be at least 1, got 0"),
])
def test_impossible_sizes_are_refused_naming_the_schedule(call: object, says: str) -> None:
    with pytest.raises(ScheduleError) as error:
        call()   # type: ignore[operator]
    assert says in str(error.value)


def test_lowering_sends_after_and_places_receives_at_their_senders_turn() -> None:
    lowered = programs.add_communication(programs.gpipe(2, 2), {0: 0, 1: 1})
    # rank 1's backward gradients are received by rank 0 only once it has sent every forward: a receive posted
    # before rank 0's last SEND_F would hang NCCL (one stream per pair of ranks, large sends wait)
    assert list(map(str, lowered[0])) == ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1",
                                          "0B1"]
    assert list(map(str, lowered[1])) == ["1RECV_F0", "1F0", "1RECV_F1", "1F1", "1B0", "1SEND_B0", "1B1",
                                          "1SEND_B1"]
    local = programs.add_communication(programs.interleaved_1f1b(1, 2, 2), {0: 0, 1: 0})
    assert all(a is not None and a.is_compute for a in local[0])   # stages on one rank hand over locally


LOWERED = [("GPipe", 2, 4, 1), ("GPipe", 4, 8, 1), ("1F1B", 4, 8, 1), ("Interleaved1F1B", 2, 4, 4),
           ("Interleaved1F1B", 4, 8, 2), ("InterleavedZeroBubble", 2, 4, 2), ("ZBVZeroBubble", 2, 4, 2),
           ("ZBVZeroBubble", 4, 8, 2), ("DualPipeV", 2, 4, 2), ("DualPipeV", 4, 8, 2), ("LoopedBFS", 3, 6, 4)]


@pytest.mark.parametrize("name, ranks, n, v", LOWERED)
def test_lowering_is_torchs_and_every_pair_of_ranks_lists_its_messages_in_one_order(name: str, ranks: int, n: int,
                                                                                     v: int) -> None:
    compute = programs.build(name, ranks, n, v)
    num_stages = ranks * (2 if name in ("ZBVZeroBubble", "DualPipeV") else v)
    placement = stage_to_rank(ranks, num_stages, programs.placement_of(name))
    ours = programs.add_communication(compute, placement)
    theirs = torch_schedules._add_send_recv(
        {rank: [None if a is None else torch_schedules._Action.from_str(str(a)) for a in actions]
         for rank, actions in compute.items()}, lambda stage: placement[stage], num_stages)
    assert {rank: list(map(str, actions)) for rank, actions in ours.items()} == \
        {rank: list(map(str, actions)) for rank, actions in theirs.items()}
    check_message_order(ours, placement)
    validate_program(ours, n, placement=placement)


@pytest.mark.parametrize("name, ranks, n, v", [("GPipe", 2, 4, 1), ("1F1B", 4, 8, 1), ("Interleaved1F1B", 2, 4, 4),
                                               ("InterleavedZeroBubble", 2, 4, 2), ("ZBVZeroBubble", 2, 4, 2),
                                               ("DualPipeV", 2, 4, 2), ("LoopedBFS", 3, 6, 4)])
def test_data_parallel_actions_sit_where_torchs_lowering_puts_them(name: str, ranks: int, n: int, v: int) -> None:
    compute = programs.build(name, ranks, n, v)
    placement = stage_to_rank(ranks, ranks * (2 if name in ("ZBVZeroBubble", "DualPipeV") else v),
                              programs.placement_of(name))
    ours = programs.add_data_parallel(programs.add_communication(compute, placement), n)
    validate_program(ours, n, placement=placement)

    def shape(actions: list) -> list[str]:
        """Computations and the data-parallel actions between them, as text (each run of RESHARDs, or of
        UNSHARDs, sorted: torch evicts from a set)."""
        out: list[list[str]] = []
        for action in (Action.parse(str(a)) for a in actions if a is not None):
            if action is None or not (action.is_compute or action.kind in DATA_PARALLEL):
                continue
            if action.kind in (ActionKind.UNSHARD, ActionKind.RESHARD) and out and out[-1][0].endswith(
                    action.kind.value):
                out[-1].append(str(action))
            else:
                out.append([str(action)])
        return [" ".join(sorted(run)) for run in out]

    for rank, actions in compute.items():
        theirs = torch_schedules._add_reduce_grad(torch_schedules._add_unshard_reshard(
            [torch_schedules._Action.from_str(str(a)) for a in actions if a is not None]), n)
        assert shape(ours[rank]) == shape(theirs)
        assert sum(a is not None and a.kind is ActionKind.REDUCE_GRAD for a in ours[rank]) == \
            sum(1 for r in placement.values() if r == rank)
