"""The schedule classes users drive: ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleLoopedBFS,
ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble and ScheduleDualPipeV, each `step()`-ing its stages through
one training step (or `eval()`: forwards only).

Layer: pipelining. A schedule builds its program (programs.py) for every rank, lowers it with communication,
proves it with validate_program, and hands this rank's part to the runtime, which alone communicates. A program
loaded from CSV (`load_csv`) goes through the same validation before it can run.

Note: loss scaling
Each microbatch's loss is `loss_fn(output, target)`, a mean over its own examples. With `scale_grads` (the
default) the backward starts from loss / n_microbatches, so the gradients summed over the microbatches are those
of the mean loss over the whole batch: the one-process gradient (see microbatch.py, Note: equal microbatches).
torch divides the summed gradients by n_microbatches after the last backward instead; the result is the same,
except that spmd's also keeps gradients accumulated before the step as they are. `losses` receives the unscaled
per-microbatch losses.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor

from spmd.comm.work import Work
from spmd.pipelining import programs
from spmd.pipelining.actions import (
    BACKWARD_KINDS,
    RECV_B,
    SEND_B,
    Action,
    ActionKind,
    Program,
    ScheduleError,
    read_csv,
    stage_to_rank,
    stages_of,
    write_csv,
)
from spmd.pipelining.microbatch import TensorChunkSpec, merge_chunks, split_args_kwargs_into_chunks
from spmd.pipelining.runtime import Runtime, StepInputs
from spmd.pipelining.stage import PipelineStage
from spmd.pipelining.timeline import measured_report
from spmd.pipelining.validate import ScheduleReport, check_message_order, validate_program

CsvFormat = Literal["compute_only", "compute_comms"]


class _PipelineSchedule:
    """What every schedule shares: microbatching, the program and its validation, step() and eval()."""

    _name = ""           # the key of programs.PROGRAMS this schedule builds

    def __init__(self, stages: list[PipelineStage], n_microbatches: int,
                 loss_fn: Callable[..., Tensor] | None = None,
                 args_chunk_spec: tuple[Any, ...] | None = None,
                 kwargs_chunk_spec: dict[str, Any] | None = None,
                 output_merge_spec: Any = None, scale_grads: bool = True) -> None:
        if n_microbatches < 1:
            raise ValueError(f"{type(self).__name__}: n_microbatches must be at least 1, got {n_microbatches}")
        self._stages = _check_stages(type(self).__name__, stages)
        self._n_microbatches = n_microbatches
        self._loss_fn = loss_fn
        self._args_chunk_spec = args_chunk_spec
        self._kwargs_chunk_spec = kwargs_chunk_spec
        self._output_merge_spec = output_merge_spec
        self.scale_grads = scale_grads
        self.record_timeline = False     # time every action of the next steps (measured_report draws them)
        self._num_stages = stages[0].num_stages
        self.pp_group_size = stages[0].group_size
        self.rank = stages[0].group_rank
        stages_per_rank = self._num_stages // self.pp_group_size
        if self._num_stages != stages_per_rank * self.pp_group_size:
            raise ValueError(f"{type(self).__name__}: {self._num_stages} stages don't divide over the "
                             f"{self.pp_group_size} ranks of the pipeline group")
        self.pipeline_order: Program = {}
        self._runtime: Runtime | None = None
        if self._name:
            self.pipeline_order = programs.build(self._name, self.pp_group_size, n_microbatches, stages_per_rank)
            self._use(self.pipeline_order, stage_to_rank(self.pp_group_size, self._num_stages,
                                                         programs.placement_of(self._name)), lower=True)

    # -- the program --------------------------------------------------------------------------------------------

    def _use(self, program: Program, placement: dict[int, int], lower: bool) -> None:
        """Adopt `program` (compute-only when `lower`, else with its communication) after validating it, and
        its forward-only form for eval()."""
        full = (programs.add_data_parallel(programs.add_communication(program, placement), self._n_microbatches)
                if lower else program)
        self.report: ScheduleReport = validate_program(full, self._n_microbatches, self._num_stages, placement,
                                                       has_backward=True)
        if not self._stages[0].group.transport.matches_by_tag:
            check_message_order(full, placement)
        forward_only = _forward_only(full)
        validate_program(forward_only, self._n_microbatches, self._num_stages, placement, has_backward=False)
        self.placement = placement
        self.pipeline_order_with_comms: Program = full
        self._programs = {True: full, False: forward_only}
        _check_placement(type(self).__name__, self._stages, placement)
        by_index = {stage.stage_index: stage for stage in self._stages}
        self._runtime = Runtime(by_index, {mode: [a for a in program[self.rank] if a is not None]
                                           for mode, program in ((True, full), (False, forward_only))},
                                placement, self._stages[0].group)

    def _loaded_runtime(self, what: str) -> Runtime:
        if self._runtime is None:
            raise RuntimeError(f"{type(self).__name__}.{what}: this schedule has no program yet; load one with "
                               f"_load_csv(path) (a program written by dump_csv, by torch's _dump_csv, or by hand), "
                               f"or use a named schedule such as ScheduleInterleaved1F1B")
        return self._runtime

    def dump_csv(self, path: str | os.PathLike[str], format: CsvFormat = "compute_comms") -> None:
        """Write the program as torch's runtime does: with its communication, or the computations only."""
        self._loaded_runtime("dump_csv()")
        write_csv(self.pipeline_order_with_comms if format == "compute_comms" else self.pipeline_order, path)

    def load_csv(self, path: str | os.PathLike[str], format: CsvFormat = "compute_only") -> None:
        """Run the program in the CSV at `path` from now on (written by dump_csv, torch, or by hand); it is
        validated first. A compute-only program gets its communication added; its placement is read from it."""
        program = read_csv(path)
        placement = stages_of(program)
        if format == "compute_only":
            talking = [str(a) for actions in program.values() for a in actions if a is not None and not a.is_compute]
            if talking:
                raise ScheduleError(f"{os.fspath(path)}: a compute_only program has no {', '.join(talking[:3])}; "
                                    f"load it with format='compute_comms'")
            self.pipeline_order = program
        else:
            self.pipeline_order = {rank: [a for a in actions if a is not None and a.is_compute]
                                   for rank, actions in program.items()}
        self._use(program, placement, lower=format == "compute_only")

    _dump_csv = dump_csv     # torch's names for the same
    _load_csv = load_csv

    def measured_report(self) -> ScheduleReport:
        """The last step run with `record_timeline` set, as every rank timed it: a report render() draws like a
        schedule, its bubble computed as validate_program predicts one (timeline.py, Note: the measured report).
        Collective over the pipeline group; every rank gets the whole report."""
        runtime = self._loaded_runtime("measured_report()")
        mode = runtime.recorded_mode
        if mode is None:
            raise RuntimeError(f"{type(self).__name__}.measured_report(): no step was recorded since the program "
                               f"was set; set record_timeline = True before step()")
        return measured_report(self._programs[mode], runtime.gather_records(), self._n_microbatches,
                               self.placement)

    # -- running ------------------------------------------------------------------------------------------------

    def step(self, *args: Any, target: Any = None, losses: list[Tensor] | None = None, return_outputs: bool = True,
             **kwargs: Any) -> Any:
        """One training step over the whole batch: split into microbatches, run the program, and return the
        merged outputs on the rank holding the last stage (None elsewhere). `args` feed the first stage (pass
        them on its rank), `kwargs` every stage of this rank, `target` the loss on the last stage's rank; each
        microbatch's loss is appended to `losses` there. Collective over the pipeline group.
        """
        if self._loss_fn is not None and not torch.is_grad_enabled():
            raise RuntimeError(f"{type(self).__name__}.step() runs backward: call it with gradients enabled, or "
                               f"use eval() for forwards only")
        return self._run(args, kwargs, target, losses, return_outputs, has_backward=self._loss_fn is not None)

    def eval(self, *args: Any, target: Any = None, losses: list[Tensor] | None = None, **kwargs: Any) -> Any:
        """step() without backward (under no_grad): the outputs, and the losses when a loss_fn and target are
        given."""
        with torch.no_grad():
            return self._run(args, kwargs, target, losses, True, has_backward=False)

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any, losses: list[Tensor] | None,
             return_outputs: bool, has_backward: bool) -> Any:
        runtime = self._loaded_runtime("step()" if has_backward else "eval()")
        n = self._n_microbatches
        has_first = any(stage.is_first for stage in self._stages)
        has_last = any(stage.is_last for stage in self._stages)
        if has_first and not args and not kwargs:
            raise ValueError(f"{type(self).__name__}.step() on rank {self.rank}: this rank holds stage 0; pass "
                             f"the model's inputs")
        arg_mbs, kwarg_mbs = split_args_kwargs_into_chunks(args, kwargs, n, self._args_chunk_spec,
                                                           self._kwargs_chunk_spec)
        target_mbs = None
        if target is not None:
            target_mbs = split_args_kwargs_into_chunks((target,), {}, n, (TensorChunkSpec(0),))[0]
            target_mbs = [t[0] for t in target_mbs]
        elif has_last and self._loss_fn is not None and has_backward:
            raise ValueError(f"{type(self).__name__}.step() on rank {self.rank}: this rank holds the last stage, "
                             f"which computes the loss; pass target=")
        loss_fn = self._loss_fn if target is not None else None
        inputs = StepInputs(arg_mbs, kwarg_mbs, target_mbs, loss_fn, 1.0 / n if self.scale_grads else 1.0,
                            has_backward)
        runtime.record = self.record_timeline
        runtime.run(inputs)
        if has_last and losses is not None and inputs.losses:
            losses.clear()
            losses.extend(inputs.losses[mb].detach() for mb in range(n))
        last = next((stage for stage in self._stages if stage.is_last), None)
        if last is None or not return_outputs:
            return None
        return merge_chunks([last.output_chunks[mb] for mb in range(n)], self._output_merge_spec)


class PipelineScheduleSingle(_PipelineSchedule):
    """A schedule with one stage per rank."""

    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn: Callable[..., Tensor] | None = None,
                 args_chunk_spec: tuple[Any, ...] | None = None, kwargs_chunk_spec: dict[str, Any] | None = None,
                 output_merge_spec: Any = None, scale_grads: bool = True) -> None:
        if not isinstance(stage, PipelineStage):
            raise TypeError(f"{type(self).__name__} takes one PipelineStage; for several stages per rank use a "
                            f"multi-stage schedule such as ScheduleInterleaved1F1B")
        if stage.num_stages != stage.group_size:
            raise ValueError(f"{type(self).__name__} runs one stage per rank, but the model has {stage.num_stages} "
                             f"stages on {stage.group_size} ranks; use ScheduleInterleaved1F1B or another "
                             f"multi-stage schedule")
        self._stage = stage
        super().__init__([stage], n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                         scale_grads)


class PipelineScheduleMulti(_PipelineSchedule):
    """A schedule with one or more stages per rank (`stages`: this rank's, in any order)."""

    def __init__(self, stages: list[PipelineStage], n_microbatches: int,
                 loss_fn: Callable[..., Tensor] | None = None, args_chunk_spec: tuple[Any, ...] | None = None,
                 kwargs_chunk_spec: dict[str, Any] | None = None, output_merge_spec: Any = None,
                 scale_grads: bool = True) -> None:
        if isinstance(stages, PipelineStage):
            raise TypeError(f"{type(self).__name__} takes a list of this rank's stages")
        super().__init__(list(stages), n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec,
                         output_merge_spec, scale_grads)


class _PipelineScheduleRuntime(PipelineScheduleMulti):
    """A multi-stage schedule that runs the program it is given, and has none until `_load_csv` (torch's runtime
    schedule: TorchTitan builds one for a `pipeline_parallel_schedule_csv`). The named multi-stage schedules are
    its subclasses, each with its own program, as torch's are."""


class ScheduleGPipe(PipelineScheduleSingle):
    """GPipe: all forwards, then all backwards (programs.gpipe)."""

    _name = "GPipe"


class Schedule1F1B(PipelineScheduleSingle):
    """1F1B: one forward, one backward in the steady state (programs.one_f_one_b); n_microbatches >= stages."""

    _name = "1F1B"


class ScheduleInterleaved1F1B(_PipelineScheduleRuntime):
    """Interleaved 1F1B over round-robin stages (programs.interleaved_1f1b)."""

    _name = "Interleaved1F1B"


class ScheduleLoopedBFS(_PipelineScheduleRuntime):
    """Breadth-first looping over round-robin stages (programs.looped_bfs)."""

    _name = "LoopedBFS"


class ScheduleInterleavedZeroBubble(_PipelineScheduleRuntime):
    """Interleaved zero bubble, ZB1P (programs.interleaved_zero_bubble)."""

    _name = "InterleavedZeroBubble"


class ScheduleZBVZeroBubble(_PipelineScheduleRuntime):
    """ZB-V: two stages per rank in a V (programs.zbv_zero_bubble)."""

    _name = "ZBVZeroBubble"


class ScheduleDualPipeV(_PipelineScheduleRuntime):
    """DualPipeV: two stages per rank in a V, forwards overlapped with backwards (programs.dualpipe_v)."""

    _name = "DualPipeV"


# torch's module-level spellings of the computation types, of an action and of its p2p wait, for code that imports
# them from here (TorchTitan's pipeline and DualPipeV modules do)
_ComputationType = ActionKind
_Action = Action
FORWARD = F = ActionKind.FORWARD
BACKWARD_INPUT = I = ActionKind.BACKWARD_INPUT   # noqa: E741 (torch's one-letter spelling of the IR)
BACKWARD_WEIGHT = W = ActionKind.BACKWARD_WEIGHT
FULL_BACKWARD = B = ActionKind.FULL_BACKWARD
SEND_F, RECV_F = ActionKind.SEND_F, ActionKind.RECV_F
UNSHARD, RESHARD, REDUCE_GRAD = ActionKind.UNSHARD, ActionKind.RESHARD, ActionKind.REDUCE_GRAD
OVERLAP_F_B = ActionKind.OVERLAP_F_B


@dataclasses.dataclass
class _PipelineContext:
    """torch's record of a step handed to a schedule's custom functions: the schedule and this step's microbatches,
    targets and losses. spmd's schedules take no custom functions (register_custom_function); TorchTitan imports the
    type for the one it registers with DualPipeV's expert-parallel overlap."""

    schedule_ref: _PipelineSchedule
    arg_mbs: list[tuple] | None = None
    kwarg_mbs: list[dict] | None = None
    target_mbs: list | None = None
    losses: list | None = None


def _wait_batch_p2p(works: list[Work]) -> None:
    """Wait for each of `works` (the point-to-point operations of one batch), in order."""
    for work in works:
        work.wait()


_CLASSES: dict[str, type[_PipelineSchedule]] = {
    cls._name: cls for cls in (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleLoopedBFS,
                               ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV)}


def get_schedule_class(schedule_name: str) -> type[_PipelineSchedule]:
    """The schedule class named `schedule_name` (case-insensitive; torch's names: "1F1B", "GPipe", ...)."""
    extra: dict[str, type[_PipelineSchedule]] = {"PipelineScheduleSingle": PipelineScheduleSingle,
                                                 "PipelineScheduleMulti": PipelineScheduleMulti}
    table = {name.lower(): cls for name, cls in {**_CLASSES, **extra}.items()}
    if schedule_name.lower() not in table:
        raise ValueError(f"unknown schedule {schedule_name!r}; the schedules are {', '.join(_CLASSES)}")
    return table[schedule_name.lower()]


def _check_stages(name: str, stages: list[PipelineStage]) -> list[PipelineStage]:
    if not stages or not all(isinstance(stage, PipelineStage) for stage in stages):
        raise TypeError(f"{name} needs this rank's PipelineStages, got {stages!r}")
    first = stages[0]
    for stage in stages:
        if stage.num_stages != first.num_stages or stage.group is not first.group:
            raise ValueError(f"{name}: every stage must share num_stages and the pipeline group; {stage} and "
                             f"{first} don't")
    indices = [stage.stage_index for stage in stages]
    if len(set(indices)) != len(indices):
        raise ValueError(f"{name}: stages {sorted(indices)} repeat an index")
    return stages


def _check_placement(name: str, stages: list[PipelineStage], placement: dict[int, int]) -> None:
    rank = stages[0].group_rank
    mine = sorted(stage for stage, owner in placement.items() if owner == rank)
    held = sorted(stage.stage_index for stage in stages)
    if mine != held:
        raise ValueError(f"{name} places stages {mine} on rank {rank}, but this rank built stages {held}; build "
                         f"the stages the schedule places here (actions.stage_to_rank shows the placement)")


_BACKWARD_ONLY = BACKWARD_KINDS | {RECV_B, SEND_B, ActionKind.REDUCE_GRAD}


def _forward_only(program: Program) -> Program:
    """`program` without its backward: the forwards and their activations' messages, for eval()."""
    out: Program = {}
    for rank, actions in program.items():
        kept: list[Action | None] = []
        for action in actions:
            if action is None or action.kind in _BACKWARD_ONLY:
                continue
            if action.kind is ActionKind.OVERLAP_F_B:
                kept += [sub for sub in action.computations if sub.kind is ActionKind.FORWARD]
            else:
                kept.append(action)
        out[rank] = kept
    return out
