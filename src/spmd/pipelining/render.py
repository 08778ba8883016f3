"""Drawing a schedule: each rank's timeline as validate_program simulated it (or as a recorded step ran it:
timeline.py), with its bubbles visible.

Layer: pipelining. Pure: text for terminals, SVG (written by hand) and PNG (a small encoder over zlib), no
plotting library. Forward, full backward, input-gradient and weight-gradient computations each have a colour
(a letter in text); idle time is the grey (or `.`) left between them. Communication takes no simulated time and
is not drawn. One cell (a text column, 28 pixels) is the cheapest computation's cost: a simulated time unit, or
for a recorded step the mean duration of its fastest kind of computation.

    >>> from spmd.pipelining import programs
    >>> print(render_text(programs.add_communication(programs.one_f_one_b(2, 2), {0: 0, 1: 1})))
    time    0   1   2   3   4   5   6   7   8
    rank 0  0F0 0F1 .   .   0B0 --- .   0B1 ---  idle 3/9 (33%), peak 2 live
    rank 1  .   1F0 1B0 --- 1F1 1B1 --- .   .    idle 3/9 (33%), peak 1 live
"""

from __future__ import annotations

import math
import os
import struct
import zlib
from collections.abc import Mapping
from typing import Any

from spmd.pipelining.actions import COMPUTE_KINDS, Action, ActionKind, Program, ScheduleError, stages_of
from spmd.pipelining.programs import add_communication
from spmd.pipelining.validate import ScheduleReport, validate_program

COLOURS: Mapping[ActionKind, str] = {
    ActionKind.FORWARD: "#4e79a7",          # blue
    ActionKind.FULL_BACKWARD: "#59a14f",    # green
    ActionKind.BACKWARD_INPUT: "#f28e2b",   # orange
    ActionKind.BACKWARD_WEIGHT: "#b07aa1",  # purple
}
IDLE = "#e6e6e6"
_CELL, _ROW, _LEFT, _TOP = 28, 24, 64, 28      # SVG/PNG geometry in pixels: one time unit, one rank, margins


def report_of(source: Any, num_microbatches: int | None = None,
              costs: Mapping[ActionKind, float] | None = None) -> ScheduleReport:
    """The simulated timeline to draw: `source` is a schedule (its validated program), a ScheduleReport, or a
    program (compute-only ones get their communication added over the placement they compute)."""
    if isinstance(source, ScheduleReport):
        return source
    report = getattr(source, "report", None)
    if isinstance(report, ScheduleReport) and costs is None:
        return report
    program: Program = getattr(source, "pipeline_order_with_comms", source)
    if not isinstance(program, dict):
        raise TypeError(f"render: expected a schedule, a ScheduleReport or a program, got {type(source).__name__}")
    singles = [c for actions in program.values() for a in actions if a is not None for c in a.computations]
    placement = stages_of(program)
    if all(a is None or a.is_compute for actions in program.values() for a in actions):
        program = add_communication(program, placement)
    if num_microbatches is None:
        num_microbatches = 1 + max((c.microbatch for c in singles if c.microbatch is not None), default=-1)
    return validate_program(program, num_microbatches, placement=placement, costs=costs)


def _computations(report: ScheduleReport, rank: int) -> list[tuple[float, float, Action]]:
    """The rank's single computations with their simulated times (an OVERLAP_F_B group's split by cost)."""
    out = []
    for timed in report.timeline[rank]:
        if not timed.action.is_compute:
            continue
        singles = timed.action.computations
        weights = [max(_cost(report, s), 1e-9) for s in singles]
        start, span = timed.start, timed.end - timed.start
        for single, weight in zip(singles, weights, strict=True):
            end = start + span * weight / sum(weights)
            out.append((start, end, single))
            start = end
    return out


def _cost(report: ScheduleReport, single: Action) -> float:
    return report.costs.get(single.kind, 0.0)


def _unit(report: ScheduleReport) -> float:
    """The time one cell stands for: the cheapest computation's cost (issuing messages is drawn as idle)."""
    return min((c for kind, c in report.costs.items() if kind in COMPUTE_KINDS and c > 0), default=1.0)


def _summary(report: ScheduleReport, rank: int) -> str:
    idle, makespan = report.bubble[rank], report.makespan
    times = (f"{1e3 * idle:.3g}/{1e3 * makespan:.3g} ms" if report.measured else f"{idle:g}/{makespan:g}")
    return (f"idle {times} ({100 * idle / makespan if makespan else 0:.0f}%), "
            f"peak {report.peak_live_activations[rank]} live")


def render_text(source: Any, num_microbatches: int | None = None,
                costs: Mapping[ActionKind, float] | None = None) -> str:
    """A rank x time grid: each computation's label in its first time unit, `-` over the rest, `.` idle. (A
    computation shorter than a cell, as measured ones can be, still gets a cell of its own, after the previous.)"""
    report = report_of(source, num_microbatches, costs)
    unit = _unit(report)
    cells = math.ceil(report.makespan / unit - 1e-9)
    grid = {rank: ["."] * cells for rank in report.timeline}
    for rank in report.timeline:
        row, free = grid[rank], 0
        for start, end, single in _computations(report, rank):
            first = max(round(start / unit), free)
            last = max(round(end / unit), first + 1)
            row.extend("." * (last - len(row)))
            row[first:last] = [str(single)] + ["-"] * (last - first - 1)
            free = last
    cells = max(map(len, grid.values()), default=cells)
    for row in grid.values():
        row.extend("." * (cells - len(row)))
    width = max([len(cell) for row in grid.values() for cell in row] + [len(str(cells - 1))])
    lines = ["time    " + " ".join(f"{t:<{width}}" for t in range(cells))]
    for rank, row in grid.items():
        cols = " ".join("-" * width if cell == "-" else f"{cell:<{width}}" for cell in row)
        lines.append(f"rank {rank:<2} {cols}  {_summary(report, rank)}")
    return "\n".join(line.rstrip() for line in lines)


def render_svg(source: Any, num_microbatches: int | None = None,
               costs: Mapping[ActionKind, float] | None = None) -> str:
    """An SVG document of the timeline: one row per rank, one rectangle per computation (class "action" and
    data-action naming it), idle time grey, a legend and each rank's idle share."""
    report = report_of(source, num_microbatches, costs)
    cell = _CELL / _unit(report)                       # pixels per time unit
    span = report.makespan * cell
    width = _LEFT + span + 220
    height = _TOP + report.num_ranks * _ROW + 30
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:g}" height="{height}" '
             f'font-family="monospace" font-size="11">',
             f'<text x="4" y="16">{report.num_ranks} ranks, {report.num_stages} stages, '
             f'{report.num_microbatches} microbatches{", measured" if report.measured else ""}: '
             f'bubble {100 * report.bubble_fraction:.1f}%</text>']
    for rank in report.timeline:
        y = _TOP + rank * _ROW
        parts.append(f'<text x="4" y="{y + 16}">rank {rank}</text>')
        parts.append(f'<rect class="idle" x="{_LEFT}" y="{y}" width="{span:g}" '
                     f'height="{_ROW - 4}" fill="{IDLE}"/>')
        for start, end, single in _computations(report, rank):
            x, w = _LEFT + start * cell, (end - start) * cell
            label = str(single) if report.num_stages > report.num_ranks else f"{single.kind.value}{single.microbatch}"
            parts.append(f'<rect class="action {single.kind.name.lower()}" data-action="{single}" x="{x + 1:g}" '
                         f'y="{y}" width="{max(w - 2, 1):g}" height="{_ROW - 4}" fill="{COLOURS[single.kind]}">'
                         f'<title>{single}: {_times(report, start, end)}</title></rect>')
            if w >= 7 * len(label):
                parts.append(f'<text x="{x + w / 2:g}" y="{y + 14}" fill="white" text-anchor="middle">{label}</text>')
        parts.append(f'<text x="{_LEFT + span + 8:g}" y="{y + 14}">{_summary(report, rank)}</text>')
    legend_y = _TOP + report.num_ranks * _ROW + 14
    for k, (kind, colour) in enumerate(COLOURS.items()):
        x = _LEFT + k * 150
        parts.append(f'<rect x="{x}" y="{legend_y - 10}" width="12" height="12" fill="{colour}"/>'
                     f'<text x="{x + 16}" y="{legend_y}">{kind.name.lower().replace("_", " ")}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _times(report: ScheduleReport, start: float, end: float) -> str:
    return f"{1e3 * start:.3f}-{1e3 * end:.3f} ms" if report.measured else f"{start:g}-{end:g}"


def _hex(colour: str) -> tuple[int, int, int]:
    return int(colour[1:3], 16), int(colour[3:5], 16), int(colour[5:7], 16)


def render_png(source: Any, num_microbatches: int | None = None,
               costs: Mapping[ActionKind, float] | None = None) -> bytes:
    """A PNG image of the timeline, the SVG's rows and colours without text: a white gap separates neighbouring
    computations, idle time is grey."""
    report = report_of(source, num_microbatches, costs)
    cell = _CELL / _unit(report)
    width = _LEFT + math.ceil(report.makespan * cell) + 8
    height = _TOP + report.num_ranks * _ROW + 8
    pixels = bytearray(b"\xff" * (width * height * 3))

    def fill(x0: float, x1: float, y0: int, y1: int, colour: str) -> None:
        rgb = bytes(_hex(colour)) * max(0, round(x1) - round(x0))
        for y in range(y0, y1):
            at = (y * width + round(x0)) * 3
            pixels[at:at + len(rgb)] = rgb

    for rank in report.timeline:
        y = _TOP + rank * _ROW
        fill(_LEFT, _LEFT + report.makespan * cell, y, y + _ROW - 4, IDLE)
        for start, end, single in _computations(report, rank):
            fill(_LEFT + start * cell + 1, _LEFT + end * cell - 1, y, y + _ROW - 4, COLOURS[single.kind])
    raw = b"".join(b"\x00" + bytes(pixels[y * width * 3:(y + 1) * width * 3]) for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)     # 8-bit RGB, no interlace
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def render(source: Any, path: str | os.PathLike[str], num_microbatches: int | None = None,
           costs: Mapping[ActionKind, float] | None = None) -> None:
    """Draw `source` (a schedule, a ScheduleReport or a program) to `path`: .svg, .png, or text (.txt)."""
    suffix = os.fspath(path).rsplit(".", 1)[-1].lower()
    if suffix == "svg":
        content: str | bytes = render_svg(source, num_microbatches, costs)
    elif suffix == "png":
        content = render_png(source, num_microbatches, costs)
    elif suffix == "txt":
        content = render_text(source, num_microbatches, costs) + "\n"
    else:
        raise ScheduleError(f"render: can't draw to {os.fspath(path)!r}; use a .svg, .png or .txt path")
    with open(path, "wb") as file:
        file.write(content.encode() if isinstance(content, str) else content)
