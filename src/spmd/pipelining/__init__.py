"""Pipeline parallelism: torch's pipelining API on spmd's point-to-point operations.

Layer 4. Stages stream microbatches along a pipeline group. Each schedule is a pure function to a program per
rank (programs.py, actions.py), proven by validate.py before the runtime (runtime.py, the only module here that
communicates) executes it; schedules.py holds the classes users step, render.py draws their timelines;
tracing.py cuts one model into stages.
"""

from spmd.pipelining.actions import Action, ActionKind, ScheduleError, read_csv, stage_to_rank, write_csv
from spmd.pipelining.microbatch import TensorChunkSpec, merge_chunks, split_args_kwargs_into_chunks
from spmd.pipelining.programs import add_communication
from spmd.pipelining.render import render, render_png, render_svg, render_text
from spmd.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
    get_schedule_class,
)
from spmd.pipelining.stage import PipelineStage, PipeliningMetadataError, build_stage
from spmd.pipelining.tracing import Pipe, PipeInfo, SplitPoint, pipe_split, pipeline
from spmd.pipelining.validate import ScheduleReport, validate_program

__all__ = [
    "Action", "ActionKind", "Pipe", "PipeInfo", "PipelineScheduleMulti", "PipelineScheduleSingle", "PipelineStage",
    "PipeliningMetadataError", "Schedule1F1B", "ScheduleDualPipeV", "ScheduleError", "ScheduleGPipe",
    "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleLoopedBFS", "ScheduleReport",
    "ScheduleZBVZeroBubble", "SplitPoint", "TensorChunkSpec", "add_communication", "build_stage",
    "get_schedule_class", "merge_chunks", "pipe_split", "pipeline", "read_csv", "render", "render_png",
    "render_svg", "render_text", "split_args_kwargs_into_chunks", "stage_to_rank", "validate_program", "write_csv",
]
