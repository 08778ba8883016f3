"""Recorded timelines: what a real pipeline step did, per rank and action, as a ScheduleReport that render.py draws
like a schedule and whose bubble is computed as the validator predicts one.

Layer: pipelining. Pure: the runtime records (runtime.py, Note: recording a step's timeline) and gathers the
records; this module turns them into a report.

Note: the measured report
Each rank records, per action of its program, the monotonic time it reached the action, how long the action
waited for its receives, and when it ended. In the report an action starts once its waits are over (`start`,
with `wait` the waiting before it: for an OVERLAP_F_B group, all of its waits) and ends when it ended; times are
seconds from the moment the first rank reached its first action, on a clock all ranks of one host share (ranks
on different hosts read different clocks: their rows are aligned only as well as those clocks). As in
validate_program, a rank's busy time is the sum of its computations' durations, the makespan runs from the
first action to the last, and the bubble is the makespan minus the busy time; what the runtime spends between
actions (Python, posting receives, issuing sends) is idle. `costs` are the mean measured seconds per kind of
action and `stage_costs` per stage and kind, communication included, which validate_program can take to predict
the bubble of the same program on the same machine.
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Mapping, Sequence

from spmd.pipelining.actions import Action, ActionKind, Program, ScheduleError
from spmd.pipelining.validate import DEFAULT_COSTS, ScheduleReport, TimedAction, live_change

Record = tuple[int, float, float, float]
"""(position of the action in the rank's program, time the rank reached it, time it ended, seconds it waited)."""


def measured_report(program: Program, records: Mapping[int, Sequence[Record]], num_microbatches: int,
                    placement: Mapping[int, int]) -> ScheduleReport:
    """The report of a recorded step: `records[rank]` are that rank's records of `program[rank]` (idle slots
    dropped, as the runtime runs it), in the order it ran them. See Note: the measured report."""
    if sorted(records) != sorted(program):
        raise ScheduleError(f"measured_report: records for ranks {sorted(records)}, but the program has ranks "
                            f"{sorted(program)}")
    origin = min((reached for rows in records.values() for _, reached, _, _ in rows), default=0.0)
    timeline: dict[int, list[TimedAction]] = {}
    for rank in sorted(program):
        actions = [a for a in program[rank] if a is not None]
        timeline[rank] = [TimedAction(rank, reached + wait - origin, end - origin, _action(actions, position, rank),
                                      wait) for position, reached, end, wait in records[rank]]
    makespan = max((t.end for rows in timeline.values() for t in rows), default=0.0)
    busy = {rank: sum(t.end - t.start for t in rows if t.action.is_compute) for rank, rows in timeline.items()}
    return ScheduleReport(len(program), len(placement), num_microbatches, dict(placement), makespan, busy,
                          {rank: _peak_live(rows) for rank, rows in timeline.items()}, timeline, _costs(timeline),
                          measured=True, stage_costs=_stage_costs(timeline))


def _action(actions: list[Action], position: int, rank: int) -> Action:
    if not 0 <= position < len(actions):
        raise ScheduleError(f"measured_report: rank {rank} recorded action {position}, but its program has "
                            f"{len(actions)} actions")
    return actions[position]


def _peak_live(rows: list[TimedAction]) -> int:
    live = peak = 0
    for timed in rows:
        for single in timed.action.computations:
            live += live_change(single)
            peak = max(peak, live)
    return peak


def _stage_costs(timeline: dict[int, list[TimedAction]]) -> dict[tuple[int, ActionKind], float]:
    """The mean measured seconds of each (stage, kind) of single action (OVERLAP_F_B groups left out)."""
    durations: dict[tuple[int, ActionKind], list[float]] = collections.defaultdict(list)
    for rows in timeline.values():
        for timed in rows:
            if timed.action.sub_actions is None:
                durations[(timed.action.stage, timed.action.kind)].append(timed.end - timed.start)
    return {key: statistics.fmean(values) for key, values in durations.items()}


def _costs(timeline: dict[int, list[TimedAction]]) -> dict[ActionKind, float]:
    """The mean measured seconds of each kind of single action; computations that only ran inside OVERLAP_F_B
    groups get the default costs' proportion to the forward's mean."""
    durations: dict[ActionKind, list[float]] = collections.defaultdict(list)
    for rows in timeline.values():
        for timed in rows:
            if timed.action.sub_actions is None:
                durations[timed.action.kind].append(timed.end - timed.start)
    costs = {kind: statistics.fmean(values) for kind, values in durations.items()}
    computed = [cost for kind, cost in costs.items() if kind in DEFAULT_COSTS]
    unit = costs.get(ActionKind.FORWARD, min(computed, default=1.0))
    return {**costs, **{kind: costs.get(kind, unit * default) for kind, default in DEFAULT_COSTS.items()}}
