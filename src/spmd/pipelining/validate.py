"""The validator: run every rank's program together in a simulation and prove the step completes.

Layer: pipelining. Pure: nothing here runs a model or communicates. The runtime calls `validate_program` on every
program before it executes one, and users can call it on their own.

Note: the simulated semantics
The simulation runs the rules the runtime follows:
- a send never waits (the transports buffer it), and a RECV only posts a receive: neither blocks;
- a forward waits for its input: the previous stage's forward on the same rank, or (across ranks) a receive this
  rank posted earlier and the previous stage's SEND_F of the same microbatch; a backward (B or I) waits for the
  microbatch's forward on this stage and for the gradient of its outputs the same way (loss on the last stage);
  W waits for its I; a send waits for the computation that produced what it sends;
- messages are matched by (stage, direction, microbatch), so their order on the wire doesn't matter.
A program is accepted when every rank reaches its end, every send is received, each (stage, microbatch) gets one
forward and one backward (B, or I then W), and nothing is left over. Each computation takes
`stage_costs[(stage, kind)]`, else `costs[kind]`, time units as soon as its inputs are there; messages take no
time in flight, and issuing a send or posting a receive (or a data-parallel action) takes its cost, none unless
given (a recorded step measures them: Python's own time per action), which gives the makespan, every rank's idle
time (its bubble: the makespan less its computations) and the timeline render.py draws.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping

from spmd.pipelining.actions import (
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    ActionKind,
    B,
    F,
    I,
    Program,
    ScheduleError,
    W,
    stages_of,
)

DEFAULT_COSTS: Mapping[ActionKind, float] = {F: 1.0, I: 1.0, W: 1.0, B: 2.0}
"""Time units per computation: a backward costs about two forwards, half for inputs (I) and half for weights (W);
other kinds of action cost nothing unless given."""


@dataclasses.dataclass(frozen=True)
class TimedAction:
    """One action of a timeline (simulated, or recorded by the runtime): `action` ran on `rank` from `start` to
    `end` (equal for comms), after `wait` time units of waiting for its inputs (the rank reached it at
    start - wait)."""

    rank: int
    start: float
    end: float
    action: Action
    wait: float = 0.0


@dataclasses.dataclass(frozen=True)
class ScheduleReport:
    """What validate_program proved and measured about a program."""

    num_ranks: int
    num_stages: int
    num_microbatches: int
    placement: dict[int, int]                   # stage -> rank
    makespan: float                             # time units from the first action to the last
    busy: dict[int, float]                      # rank -> time units spent computing
    peak_live_activations: dict[int, int]       # rank -> most (stage, microbatch) forwards awaiting their backward
    timeline: dict[int, list[TimedAction]]      # rank -> its actions with their times, in program order
    costs: dict[ActionKind, float]              # the time units each computation was given (measured: mean seconds)
    measured: bool = False                      # times are seconds a real step took (timeline.py), not simulated
    stage_costs: dict[tuple[int, ActionKind], float] = dataclasses.field(default_factory=dict)
    """(stage, kind) -> time units, where a stage's computations differ from `costs` (measured: mean seconds)."""

    @property
    def bubble(self) -> dict[int, float]:
        """rank -> its idle time units within the makespan."""
        return {rank: self.makespan - busy for rank, busy in self.busy.items()}

    @property
    def bubble_fraction_per_rank(self) -> dict[int, float]:
        return {rank: idle / self.makespan if self.makespan else 0.0 for rank, idle in self.bubble.items()}

    @property
    def bubble_fraction(self) -> float:
        """The pipeline's idle share: idle time over (ranks x makespan)."""
        total = self.makespan * self.num_ranks
        return sum(self.bubble.values()) / total if total else 0.0


def validate_program(program: Program, num_microbatches: int, num_stages: int | None = None,
                     placement: Mapping[int, int] | None = None, has_backward: bool = True,
                     costs: Mapping[ActionKind, float] | None = None,
                     stage_costs: Mapping[tuple[int, ActionKind], float] | None = None) -> ScheduleReport:
    """Prove that `program` (with its communication; see programs.add_communication) completes and does all the
    work of one step over `num_microbatches` microbatches; report its bubbles and activation peaks.

    `num_stages` and `placement` default to what the program computes; given, the program must agree with them.
    `has_backward=False` checks a forward-only (evaluation) program. `costs` (per kind of computation) and
    `stage_costs` (per stage and kind, which win) set how long computations take, e.g. what a recorded step
    measured (ScheduleReport.costs and .stage_costs), so that the bubble predicted is that machine's. Raises
    ScheduleError naming every problem, and for a program that would hang, the first blocked action of each rank
    and what it waits for.
    """
    if sorted(program) != list(range(len(program))) or not program:
        raise ScheduleError(f"a program needs one action list per rank 0..R-1, got ranks {sorted(program)}")
    found = stages_of(program)
    num_stages = num_stages if num_stages is not None else 1 + max(found, default=-1)
    placement = dict(placement) if placement is not None else found
    problems = _structure_problems(program, num_microbatches, num_stages, placement, found)
    if problems:
        raise ScheduleError(_listing("the program is malformed", problems, program))
    simulation = _Simulation(program, num_stages, placement, {**DEFAULT_COSTS, **(costs or {})},
                             dict(stage_costs or {}), has_backward)
    simulation.run()
    if simulation.blocked():
        raise ScheduleError(_listing("the program would hang: no rank can run its next action",
                                     simulation.blocked_reasons(), program))
    problems = simulation.leftovers(num_microbatches, has_backward)
    if problems:
        raise ScheduleError(_listing("the program completes but leaves the step wrong", problems, program))
    return simulation.report(num_microbatches)


def check_message_order(program: Program, placement: Mapping[int, int]) -> None:
    """Refuse a program whose two ranks of a pair list the messages between them in different orders: fine over a
    transport that matches messages by tag (spmd's, gloo), but NCCL pairs them by order alone and runs a rank's
    operations with a peer one after another, so such a program hangs the GPUs or pairs the wrong tensors
    (programs.py, Note: where receives go). The lowering of every named schedule passes."""
    ranks = sorted(program)
    problems = []
    for a in ranks:
        for b in ranks[ranks.index(a) + 1:]:
            mine, theirs = _messages(program[a], b, placement), _messages(program[b], a, placement)
            if mine != theirs:
                at = next((i for i, pair in enumerate(zip(mine, theirs, strict=False)) if pair[0] != pair[1]),
                          min(len(mine), len(theirs)))
                problems.append(f"ranks {a} and {b} differ at their message {at}: rank {a} has "
                                f"{_named(mine, at)}, rank {b} {_named(theirs, at)}")
    if problems:
        raise ScheduleError(_listing("the program's ranks issue their messages in different orders, which NCCL "
                                     "(matching by order, not tag) can't run", problems, program))


def _messages(actions: list[Action | None], peer: int, placement: Mapping[int, int]) -> list[tuple[int, str, int]]:
    """The messages `actions` exchange with rank `peer`, in order, each as (sending stage, direction, microbatch)."""
    found = []
    for action in actions:
        if action is None or action.kind not in (SEND_F, SEND_B, RECV_F, RECV_B):
            continue
        forward = action.kind in (SEND_F, RECV_F)
        if action.kind in (SEND_F, SEND_B):
            sender, other = action.stage, action.stage + (1 if forward else -1)
        else:
            sender = other = action.stage + (-1 if forward else 1)
        if placement.get(other) == peer:
            found.append((sender, "F" if forward else "B", action.microbatch or 0))
    return found


def _named(messages: list[tuple[int, str, int]], at: int) -> str:
    if at >= len(messages):
        return "no more"
    sender, direction, microbatch = messages[at]
    return f"stage {sender}'s {'forward' if direction == 'F' else 'backward'} of microbatch {microbatch}"


def live_change(single: Action) -> int:
    """How a computation changes its rank's count of live activations: a forward keeps one, the microbatch's
    last backward (B, or W after I) frees it."""
    return 1 if single.kind is F else -1 if single.kind in (B, W) else 0


def _structure_problems(program: Program, num_microbatches: int, num_stages: int, placement: Mapping[int, int],
                        found: Mapping[int, int]) -> list[str]:
    problems = []
    if sorted(placement) != list(range(num_stages)):
        problems.append(f"the placement must map stages 0..{num_stages - 1} to ranks, got stages {sorted(placement)}")
    for stage, rank in found.items():
        if placement.get(stage, rank) != rank:
            problems.append(f"stage {stage} is computed on rank {rank}, but its placement is rank {placement[stage]}")
    seen: dict[Action, tuple[int, int]] = {}
    for rank, actions in program.items():
        for position, action in enumerate(actions):
            if action is None:
                continue
            where = f"rank {rank}, action {position} ({action})"
            for single in action.computations:
                problem = _action_problem(single, rank, num_microbatches, num_stages, placement)
                if problem:
                    problems.append(f"{where}: {problem}")
                elif single.kind not in (ActionKind.UNSHARD, ActionKind.RESHARD):
                    if single in seen:
                        problems.append(f"{where}: {single} also at rank {seen[single][0]}, action {seen[single][1]}")
                    seen.setdefault(single, (rank, position))
    return problems


def _action_problem(action: Action, rank: int, num_microbatches: int, num_stages: int,
                    placement: Mapping[int, int]) -> str | None:
    if not 0 <= action.stage < num_stages:
        return f"stage {action.stage} is out of range for {num_stages} stages"
    if action.sub_actions is not None:
        return "OVERLAP_F_B groups can't nest"
    if action.microbatch is not None and not 0 <= action.microbatch < num_microbatches:
        return f"microbatch {action.microbatch} is out of range for {num_microbatches} microbatches"
    if placement.get(action.stage) != rank:
        return f"stage {action.stage} lives on rank {placement.get(action.stage)}, not this one"
    peer = {SEND_F: action.stage + 1, RECV_F: action.stage - 1, SEND_B: action.stage - 1,
            RECV_B: action.stage + 1}.get(action.kind)
    if peer is not None and (not 0 <= peer < num_stages or placement[peer] == rank):
        return (f"stage {action.stage} has no stage {peer} on another rank to "
                f"{'send to' if action.kind in (SEND_F, SEND_B) else 'receive from'}")
    return None


class _Simulation:
    """Every rank's program advanced together; see Note: the simulated semantics."""

    def __init__(self, program: Program, num_stages: int, placement: Mapping[int, int],
                 costs: Mapping[ActionKind, float], stage_costs: dict[tuple[int, ActionKind], float],
                 has_backward: bool) -> None:
        self.programs = {rank: [a for a in actions if a is not None] for rank, actions in program.items()}
        self.num_stages, self.placement, self.costs, self.stage_costs = num_stages, placement, costs, stage_costs
        self.has_backward = has_backward
        self.pc = dict.fromkeys(self.programs, 0)
        self.clock = dict.fromkeys(self.programs, 0.0)
        self.done: dict[Action, float] = {}          # computation or send -> when its result is available
        self.posted: set[Action] = set()             # RECV_F / RECV_B actions posted so far
        self.consumed: set[Action] = set()           # receives a computation has used
        self.live = collections.Counter[int]()
        self.peak = collections.Counter[int]()
        self.timeline: dict[int, list[TimedAction]] = {rank: [] for rank in self.programs}

    # -- what an action waits for -------------------------------------------------------------------------------

    def _needs(self, action: Action) -> list[tuple[Action, Action | None]]:
        """The results `action` waits for: (producer, receive this rank must have posted, or None if local)."""
        s, mb, kind = action.stage, action.microbatch, action.kind
        here = self.placement[s]
        if kind is F and s > 0:
            if self.placement[s - 1] == here:
                return [(Action(s - 1, F, mb), None)]
            return [(Action(s - 1, SEND_F, mb), Action(s, RECV_F, mb))]
        if kind in (B, I):
            needs: list[tuple[Action, Action | None]] = [(Action(s, F, mb), None)]
            if s < self.num_stages - 1:
                if self.placement[s + 1] == here:
                    needs.append((self._backward_of(s + 1, mb), None))
                else:
                    needs.append((Action(s + 1, SEND_B, mb), Action(s, RECV_B, mb)))
            return needs
        if kind is W:
            return [(Action(s, I, mb), None)]
        if kind is SEND_F:
            return [(Action(s, F, mb), None)]
        if kind is SEND_B:
            return [(self._backward_of(s, mb), None)]
        return []

    def _backward_of(self, stage: int, mb: int | None) -> Action:
        """The action that produced the gradient w.r.t. a stage's inputs: its I if one ran, else its B."""
        split = Action(stage, I, mb)
        return split if split in self.done else Action(stage, B, mb)

    def _ready(self, action: Action) -> bool:
        return all(producer in self.done and (recv is None or recv in self.posted)
                   for producer, recv in self._needs(action))

    # -- running ------------------------------------------------------------------------------------------------

    def run(self) -> None:
        progress = True
        while progress:
            progress = False
            for rank, actions in self.programs.items():
                while self.pc[rank] < len(actions) and self._try(rank, actions[self.pc[rank]]):
                    self.pc[rank] += 1
                    progress = True

    def _try(self, rank: int, action: Action) -> bool:
        """Run `action` on `rank` if what it waits for is there (an OVERLAP_F_B group: all of its computations,
        one after the other); False if it must wait."""
        singles = action.computations
        if not all(self._ready(single) for single in singles):
            return False
        reached = self.clock[rank]
        times = [self._execute(rank, single) for single in singles]
        busy = sum(end - start for start, end in times)
        self.timeline[rank].append(TimedAction(rank, times[-1][1] - busy, times[-1][1], action,
                                               times[-1][1] - busy - reached))
        return True

    def _execute(self, rank: int, single: Action) -> tuple[float, float]:
        """Advance `rank`'s clock over `single`; returns when it started and ended."""
        if single.kind in (RECV_F, RECV_B):
            self.posted.add(single)
            start = self.clock[rank]
            self.clock[rank] = start + self._cost(single)      # posting one: no cost unless measured
            return start, self.clock[rank]
        inputs = self._needs(single)
        start = max([self.clock[rank]] + [self.done[producer] for producer, _ in inputs])
        self.consumed.update(recv for _, recv in inputs if recv is not None)
        if single.is_compute:
            self.clock[rank] = start + self._cost(single)
            if self.has_backward:         # a forward-only step keeps no activations
                self._track_activations(rank, single)
        else:                             # a send leaves as soon as the rank has issued it
            start = self.clock[rank]
            self.clock[rank] = start + self._cost(single)
        self.done[single] = self.clock[rank]
        return start, self.clock[rank]

    def _track_activations(self, rank: int, single: Action) -> None:
        self.live[rank] += live_change(single)
        self.peak[rank] = max(self.peak[rank], self.live[rank])

    # -- verdicts -----------------------------------------------------------------------------------------------

    def blocked(self) -> bool:
        return any(self.pc[rank] < len(actions) for rank, actions in self.programs.items())

    def blocked_reasons(self) -> list[str]:
        reasons = []
        for rank, actions in self.programs.items():
            if self.pc[rank] >= len(actions):
                continue
            action = actions[self.pc[rank]]
            single = next(s for s in action.computations if not self._ready(s))
            reasons.append(f"rank {rank} is blocked at action {self.pc[rank]} ({action}): {self._why(rank, single)}")
        return reasons

    def _why(self, rank: int, single: Action) -> str:
        for producer, recv in self._needs(single):
            if recv is not None and recv not in self.posted:
                later = recv in self.programs[rank][self.pc[rank]:]
                return (f"{single} needs the receive {recv}, which this rank posts only later in its program"
                        if later else f"{single} needs the receive {recv}, which this rank never posts")
            if producer not in self.done:
                owner = self.placement[producer.stage]
                if producer.kind in (SEND_F, SEND_B) or owner != rank:
                    where = self._position(owner, producer)
                    state = "never does it" if where is None else f"is blocked before it (it is action {where})"
                    return f"{single} waits for {producer} from rank {owner}, which {state}"
                where = self._position(rank, producer)
                return (f"{single} waits for {producer} on this rank, which "
                        f"{'never runs' if where is None else f'comes later (action {where})'}")
        return f"{single} is not ready"

    def _position(self, rank: int, wanted: Action) -> int | None:
        for position, action in enumerate(self.programs[rank]):
            if wanted in action.computations or action == wanted:
                return position
        if wanted.kind is B:              # a B producer is also satisfied by the microbatch's I
            return self._position(rank, Action(wanted.stage, I, wanted.microbatch))
        return None

    def leftovers(self, num_microbatches: int, has_backward: bool) -> list[str]:
        problems = []
        wanted = ({F, B}, {F, I, W}) if has_backward else ({F},)
        step = "training" if has_backward else "forward-only"
        for stage in range(self.num_stages):
            for mb in range(num_microbatches):
                done = {kind for kind in (F, B, I, W) if Action(stage, kind, mb) in self.done}
                if done in wanted:
                    continue
                ran = "+".join(sorted(k.value for k in done)) or "nothing"
                extra = done - set().union(*wanted)
                if extra:
                    problems.append(f"stage {stage} microbatch {mb} ran {ran}, but a {step} step has no "
                                    f"{'+'.join(sorted(k.value for k in extra))}")
                    continue
                owed = " or ".join("+".join(sorted(k.value for k in want - done)) for want in wanted if want >= done)
                problems.append(f"stage {stage} microbatch {mb} ran {ran}; a {step} step also needs {owed}")
        for action in sorted(self.done, key=str):
            if action.kind in (SEND_F, SEND_B):
                recv = Action(action.stage + (1 if action.kind is SEND_F else -1),
                              RECV_F if action.kind is SEND_F else RECV_B, action.microbatch)
                if recv not in self.consumed:
                    problems.append(f"{action} on rank {self.placement[action.stage]} is never received "
                                    f"(no {recv} used on rank {self.placement[recv.stage]})")
        problems += [f"{recv} on rank {self.placement[recv.stage]} is posted but no computation uses it"
                     for recv in sorted(self.posted - self.consumed, key=str)]
        return problems

    def _cost(self, single: Action) -> float:
        cost = self.stage_costs.get((single.stage, single.kind))
        return cost if cost is not None else self.costs.get(single.kind, 0.0)

    def report(self, num_microbatches: int) -> ScheduleReport:
        makespan = max(self.clock.values(), default=0.0)
        busy = {rank: sum(self._cost(s) for a in actions for s in a.computations if s.is_compute)
                for rank, actions in self.programs.items()}
        return ScheduleReport(len(self.programs), self.num_stages, num_microbatches, dict(self.placement), makespan,
                              busy, {rank: self.peak[rank] for rank in self.programs}, self.timeline,
                              dict(self.costs), stage_costs=dict(self.stage_costs))


def _listing(headline: str, problems: list[str], program: Program) -> str:
    shown = problems[:20]
    more = f"\n  ... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
    rows = "\n".join(f"  rank {rank}: {' '.join('.' if a is None else str(a) for a in actions)}"
                     for rank, actions in sorted(program.items()))
    return f"{headline}:\n" + "\n".join(f"  {p}" for p in shown) + more + f"\nthe program:\n{rows}"


