"""Actions and programs: what one rank does, step by step, in one pipeline step — pure data.

Layer: pipelining. Nothing here runs a model or communicates. A *program* maps each rank of the pipeline group to
its list of actions; an action names a stage, what to do and (for most kinds) a microbatch. The text form of an
action is torch's schedule IR, so programs written by torch's runtime load here and the other way round:

    2F0         stage 2 runs its forward on microbatch 0
    1B3         stage 1 runs its whole backward on microbatch 3
    1I3, 1W3    the same backward split in two: gradient w.r.t. the stage's inputs, then w.r.t. its weights
    0SEND_F1    stage 0 sends microbatch 1's output activations to stage 1
    1RECV_F1    stage 1 posts the receive of microbatch 1's input activations (from stage 0)
    1SEND_B1    stage 1 sends the gradient w.r.t. its inputs of microbatch 1 to stage 0
    0RECV_B1    stage 0 posts the receive of the gradient w.r.t. its outputs of microbatch 1 (from stage 1)
    (0F4;3B1)OVERLAP_F_B   two computations issued together (DualPipeV), run in the order written

A program holding only computations is *compute-only*; `programs.add_communication` lowers it by inserting the
sends and receives, which `validate.validate_program` then checks and the runtime executes. `None` entries in a
compute-only program are idle slots kept for torch's format; they mean nothing to the order.

Note: programs as CSV
One row per rank, in rank order, one action per cell: torch's `_dump_csv`/`_load_csv` format. Empty cells are
idle slots (`None`).
"""

from __future__ import annotations

import csv
import enum
import os
import re
from typing import Literal, NamedTuple


class ActionKind(enum.StrEnum):
    """What an action does; the value is its spelling in torch's schedule IR."""

    FORWARD = "F"               # the stage's forward on one microbatch
    BACKWARD_INPUT = "I"        # gradient w.r.t. the stage's inputs only; its BACKWARD_WEIGHT comes later
    BACKWARD_WEIGHT = "W"       # gradient w.r.t. the stage's parameters, after the microbatch's BACKWARD_INPUT
    FULL_BACKWARD = "B"         # both gradients at once
    SEND_F = "SEND_F"           # send the stage's output activations to the next stage
    RECV_F = "RECV_F"           # post the receive of the stage's input activations from the previous stage
    SEND_B = "SEND_B"           # send the gradient w.r.t. the stage's inputs to the previous stage
    RECV_B = "RECV_B"           # post the receive of the gradient w.r.t. the stage's outputs from the next stage
    UNSHARD = "UNSHARD"         # all-gather a sharded stage's parameters (FSDP stages; nothing for plain modules)
    RESHARD = "RESHARD"         # free a sharded stage's gathered parameters (FSDP stages; nothing otherwise)
    REDUCE_GRAD = "REDUCE_GRAD"  # the stage's gradients are complete: reduce them over data parallel ranks
    OVERLAP_F_B = "OVERLAP_F_B"  # a forward and a backward issued together (sub-actions), DualPipeV's unit


F = ActionKind.FORWARD
I = ActionKind.BACKWARD_INPUT  # noqa: E741 (torch's one-letter spelling of the IR)
W = ActionKind.BACKWARD_WEIGHT
B = ActionKind.FULL_BACKWARD
SEND_F, RECV_F = ActionKind.SEND_F, ActionKind.RECV_F
SEND_B, RECV_B = ActionKind.SEND_B, ActionKind.RECV_B
COMPUTE_KINDS = frozenset({F, I, W, B, ActionKind.OVERLAP_F_B})
COMM_KINDS = frozenset({SEND_F, RECV_F, SEND_B, RECV_B})
BACKWARD_KINDS = frozenset({I, W, B})
_NO_MICROBATCH = frozenset({ActionKind.UNSHARD, ActionKind.RESHARD, ActionKind.REDUCE_GRAD})


class ScheduleError(ValueError):
    """A program (or the request for one) is malformed, would hang, or leaves work undone."""


class Action(NamedTuple):
    """One step of a rank's program: `stage` does `kind` on `microbatch`.

    `microbatch` is None for UNSHARD, RESHARD and REDUCE_GRAD. An OVERLAP_F_B action carries its computations in
    `sub_actions` (and stage -1, microbatch None, as torch writes it).
    """

    stage: int
    kind: ActionKind
    microbatch: int | None = None
    sub_actions: tuple[Action, ...] | None = None

    def __str__(self) -> str:
        if self.sub_actions is not None:
            return f"({';'.join(map(str, self.sub_actions))}){self.kind.value}"
        return f"{self.stage}{self.kind.value}{'' if self.microbatch is None else self.microbatch}"

    def __repr__(self) -> str:
        return str(self)

    @property
    def stage_index(self) -> int:
        """torch's name for `stage` (its _Action's field)."""
        return self.stage

    @property
    def computation_type(self) -> ActionKind:
        """torch's name for `kind`."""
        return self.kind

    @property
    def microbatch_index(self) -> int | None:
        """torch's name for `microbatch`."""
        return self.microbatch

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    is_compute_op = is_compute     # torch's name

    @property
    def computations(self) -> tuple[Action, ...]:
        """The single computations this action runs: its sub-actions for OVERLAP_F_B, else itself."""
        return self.sub_actions if self.sub_actions is not None else (self,)

    @staticmethod
    def parse(text: str) -> Action | None:
        """The action `text` spells in torch's IR (`2F0`, `1SEND_B3`, `(0F4;3B1)OVERLAP_F_B`); None if blank."""
        text = text.strip()
        if not text:
            return None
        if text.startswith("("):
            inner, closing, kind = text[1:].partition(")")
            if not closing or kind != ActionKind.OVERLAP_F_B.value:
                raise ScheduleError(f"can't parse action {text!r}: only OVERLAP_F_B groups sub-actions, as "
                                    f"(0F4;3B1)OVERLAP_F_B")
            subs = tuple(a for a in map(Action.parse, inner.split(";")) if a is not None)
            if len(subs) < 2 or any(not a.is_compute or a.sub_actions for a in subs):
                raise ScheduleError(f"can't parse action {text!r}: OVERLAP_F_B groups two or more computations")
            return Action(-1, ActionKind.OVERLAP_F_B, None, subs)
        match = _ACTION_RE.fullmatch(text)
        if match is None:
            raise ScheduleError(f"can't parse action {text!r}: write [stage][kind][microbatch], e.g. 2F0, 1I3, "
                                f"0SEND_F1 or 1REDUCE_GRAD (kinds: {', '.join(k.value for k in ActionKind)})")
        stage, kind, microbatch = match.groups()
        action = Action(int(stage), ActionKind(kind), int(microbatch) if microbatch else None)
        if (action.microbatch is None) != (action.kind in _NO_MICROBATCH):
            want = "takes no microbatch" if action.kind in _NO_MICROBATCH else "needs a microbatch index"
            raise ScheduleError(f"can't parse action {text!r}: {action.kind.name} {want}")
        return action

    from_str = parse     # torch's name


_ACTION_RE = re.compile(r"(\d+)(" + "|".join(sorted((k.value for k in ActionKind if k is not ActionKind.OVERLAP_F_B),
                                                     key=len, reverse=True)) + r")(\d*)")

Program = dict[int, list[Action | None]]
"""rank -> that rank's actions in order (None: an idle slot of a compute-only program)."""


def write_csv(program: Program, path: str | os.PathLike[str]) -> None:
    """Write `program` to `path` as torch's runtime does (see Note: programs as CSV)."""
    with open(path, "w", newline="") as file:
        writer = csv.writer(file)
        for rank in sorted(program):
            writer.writerow("" if action is None else str(action) for action in program[rank])


def read_csv(path: str | os.PathLike[str]) -> Program:
    """Read a program written by `write_csv` or by torch's `_dump_csv` (see Note: programs as CSV)."""
    program: Program = {}
    with open(path, newline="") as file:
        for rank, row in enumerate(csv.reader(file)):
            try:
                program[rank] = [Action.parse(cell) for cell in row]
            except ScheduleError as error:
                raise ScheduleError(f"{os.fspath(path)}, row {rank + 1} (rank {rank}): {error}") from None
    return program


Placement = Literal["loop", "v"]


def stage_to_rank(num_ranks: int, num_stages: int, style: Placement = "loop") -> dict[int, int]:
    """Which rank holds each stage: round-robin (`loop`: stage s on rank s % num_ranks) or V-shaped (`v`: rounds
    of num_ranks stages go down the ranks and back up, so rank r holds stages r and 2 * num_ranks - 1 - r, ...).

    >>> stage_to_rank(2, 4), stage_to_rank(2, 4, "v")
    ({0: 0, 1: 1, 2: 0, 3: 1}, {0: 0, 1: 1, 2: 1, 3: 0})
    """
    if num_ranks < 1 or num_stages < num_ranks or num_stages % num_ranks:
        raise ScheduleError(f"stage placement: {num_stages} stages don't divide over {num_ranks} ranks; give each "
                            f"rank the same number of stages")
    if style == "loop":
        return {stage: stage % num_ranks for stage in range(num_stages)}
    if style == "v":   # zigzag: rounds of num_ranks stages go down the ranks, then back up
        return {stage: stage % num_ranks if (stage // num_ranks) % 2 == 0 else num_ranks - 1 - stage % num_ranks
                for stage in range(num_stages)}
    raise ScheduleError(f"stage placement style must be 'loop' or 'v', got {style!r}")


def stages_of(program: Program) -> dict[int, int]:
    """stage -> the rank whose program computes it, read from `program`'s computations."""
    placement: dict[int, int] = {}
    for rank in sorted(program):
        for action in program[rank]:
            for compute in (action.computations if action is not None else ()):
                if placement.setdefault(compute.stage, rank) != rank:
                    raise ScheduleError(f"stage {compute.stage} is computed on rank {placement[compute.stage]} "
                                        f"and on rank {rank} ({compute}); a stage lives on one rank")
    return placement
