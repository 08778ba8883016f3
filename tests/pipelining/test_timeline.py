"""Recorded timelines: a step run with record_timeline set gives, on every rank, one timed entry per action each
rank executed, in program order; the report's busy time, bubble and peak live activations follow the validator's
rules, and render draws it like a schedule. measured_report itself is checked on hand-made records."""

from __future__ import annotations

import collections
import threading
import xml.etree.ElementTree as ET

import pytest

from spmd.pipelining import (
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
    programs,
    render_svg,
    render_text,
    stage_to_rank,
    validate_program,
)
from spmd.pipelining.actions import RECV_B, RECV_F, SEND_B, SEND_F, ActionKind
from spmd.pipelining.schedules import PipelineScheduleSingle
from spmd.pipelining.timeline import measured_report
from spmd.pipelining.validate import ScheduleReport
from spmd.testing import run_ranks
from tests.pipelining.test_runtime import batch, build_stages, gpt, loss_fn

F, B = ActionKind.FORWARD, ActionKind.FULL_BACKWARD
_build_lock = threading.Lock()
CASES = [(ScheduleGPipe, 1, "loop"), (ScheduleInterleaved1F1B, 2, "loop"), (ScheduleZBVZeroBubble, 2, "v"),
         (ScheduleDualPipeV, 2, "v")]


def _computations(actions: list) -> list[str]:
    return [str(c) for a in actions if a is not None and a.is_compute for c in a.computations]


@pytest.mark.parametrize("cls, per_rank, style", CASES, ids=[c[0].__name__ for c in CASES])
def test_a_recorded_step_times_every_action_of_every_rank(cls: type, per_rank: int, style: str) -> None:
    model = gpt(layers=2 * per_rank)
    tokens, targets = batch(0)

    def body(rank: int, world_size: int) -> tuple[ScheduleReport, dict, ScheduleReport]:
        with _build_lock:
            stages, _ = build_stages(model, rank, world_size, per_rank, style)
        schedule = cls(stages[0] if issubclass(cls, PipelineScheduleSingle) else stages, 4, loss_fn=loss_fn)
        with pytest.raises(RuntimeError, match=r"no step was recorded.*set record_timeline = True"):
            schedule.measured_report()     # refused on every rank alike: nothing collective ran
        schedule.record_timeline = True
        last = any(stage.is_last for stage in stages)
        schedule.step(*((tokens,) if rank == 0 else ()), target=targets if last else None)
        return schedule.measured_report(), schedule.pipeline_order_with_comms, schedule.report

    results = run_ranks(body, world_size=2, timeout=60.0)
    (report, program, predicted), (other, _, _) = results
    assert report == other                                   # every rank gets the whole report
    assert report.measured and report.makespan > 0
    for rank, actions in program.items():
        rows = report.timeline[rank]
        assert [t.action for t in rows] == [a for a in actions if a is not None]   # one entry per action, in order
        reached = [t.start - t.wait for t in rows]
        assert all(t.wait >= 0 and t.end >= t.start >= 0 for t in rows)
        assert all(rows[k].end <= reached[k + 1] + 1e-9 for k in range(len(rows) - 1))
        busy = sum(t.end - t.start for t in rows if t.action.is_compute)
        assert report.busy[rank] == pytest.approx(busy)
        assert 0 <= report.bubble[rank] == pytest.approx(report.makespan - busy)
        assert max(t.end for t in rows) <= report.makespan
    assert min(t.start - t.wait for rows in report.timeline.values() for t in rows) == 0.0
    assert report.peak_live_activations == predicted.peak_live_activations
    assert 0 <= report.bubble_fraction < 1
    assert report.costs[F] > 0 and all(cost > 0 for cost in report.costs.values())

    root = ET.fromstring(render_svg(report))
    rects = [e.get("data-action") for e in root.iter("{http://www.w3.org/2000/svg}rect")
             if "action" in e.get("class", "").split()]
    assert collections.Counter(rects) == collections.Counter(c for actions in program.values()
                                                              for c in _computations(actions))
    text = render_text(report).splitlines()
    assert "ms" in text[1] and "measured" in root.findtext("{http://www.w3.org/2000/svg}text", "")
    for rank, actions in program.items():
        cells = text[1 + rank].split("  idle")[0].split()[2:]
        assert [c for c in cells if c[0].isdigit()] == _computations(actions)


def test_eval_records_the_forward_only_program() -> None:
    model = gpt(layers=2)
    tokens, _ = batch(0)

    def body(rank: int, world_size: int) -> dict[int, list[str]]:
        with _build_lock:
            stages, _ = build_stages(model, rank, world_size, 1, "loop")
        schedule = ScheduleGPipe(stages[0], 2, loss_fn=loss_fn)
        schedule.record_timeline = True
        schedule.eval(*((tokens,) if rank == 0 else ()))
        return {rank: [str(t.action) for t in rows] for rank, rows in schedule.measured_report().timeline.items()}

    for timeline in run_ranks(body, world_size=2, timeout=60.0):
        assert timeline == {0: ["0UNSHARD", "0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RESHARD"],
                            1: ["1RECV_F0", "1UNSHARD", "1F0", "1RECV_F1", "1F1", "1RESHARD"]}


def test_measured_report_from_hand_made_records() -> None:
    program = programs.add_communication(programs.gpipe(2, 1), stage_to_rank(2, 2))
    assert [list(map(str, program[r])) for r in (0, 1)] == [["0F0", "0SEND_F0", "0RECV_B0", "0B0"],
                                                           ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]]
    # (position, reached, ended, waited) in seconds from 100; issuing rank 0's send takes 0.25 s, then its backward
    # waits 2.75 s for rank 1's
    records = {0: [(0, 100.0, 101.0, 0.0), (1, 101.0, 101.25, 0.0), (2, 101.25, 101.25, 0.0), (3, 101.25, 106.0, 2.75)],
               1: [(0, 100.5, 100.5, 0.0), (1, 100.5, 102.0, 0.5), (2, 102.0, 104.0, 0.0), (3, 104.0, 104.0, 0.0)]}
    report = measured_report(program, records, 1, stage_to_rank(2, 2))
    assert report.makespan == 6.0
    assert report.busy == {0: 3.0, 1: 3.0} and report.bubble == {0: 3.0, 1: 3.0}
    assert report.bubble_fraction == 0.5
    first_backward = report.timeline[0][3]
    assert (first_backward.start, first_backward.end, first_backward.wait) == (4.0, 6.0, 2.75)
    assert report.costs[F] == 1.0 and report.costs[B] == 2.0     # the mean of each kind
    assert report.costs[ActionKind.BACKWARD_INPUT] == 1.0         # never ran: the default share of a forward
    assert report.costs[SEND_F] == 0.25 and report.costs[RECV_F] == 0.0
    assert report.stage_costs == {(0, RECV_B): 0.0, (0, F): 1.0, (0, SEND_F): 0.25, (0, B): 2.0, (1, RECV_F): 0.0,
                                  (1, F): 1.0, (1, B): 2.0, (1, SEND_B): 0.0}
    replayed = validate_program(program, 1, 2, stage_to_rank(2, 2), costs=report.costs, stage_costs=report.stage_costs)
    assert replayed.makespan == 6.25     # the send issued, then rank 1's forward and backward, then rank 0's
    assert replayed.busy == {0: 3.0, 1: 3.0}     # issuing the send is idle time, as in the measured report
    assert report.peak_live_activations == {0: 1, 1: 1}
    assert "idle 3e+03/6e+03 ms (50%)" in render_text(report)
    assert render_text(report).splitlines()[0].split() == ["time", "0", "1", "2", "3", "4", "5"]   # 1 s cells
    with pytest.raises(ValueError, match="rank 1 recorded action 4, but its program has 4 actions"):
        measured_report(program, {0: records[0], 1: [(4, 0.0, 0.0, 0.0)]}, 1, stage_to_rank(2, 2))
