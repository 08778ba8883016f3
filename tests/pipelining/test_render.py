"""Rendering: the text grid, the SVG and the PNG each show every computation of the program once (an
OVERLAP_F_B group as its two), in the colour of its kind, with idle time between; the SVG parses as XML and the
PNG decodes (its CRCs checked) to the size it declares."""

from __future__ import annotations

import collections
import pathlib
import struct
import xml.etree.ElementTree as ET
import zlib

import pytest

from spmd.pipelining import programs, render, render_png, render_svg, render_text
from spmd.pipelining.actions import ActionKind, ScheduleError, stage_to_rank
from spmd.pipelining.render import COLOURS, IDLE, report_of

CASES = [("1F1B", 4, 8, 1), ("InterleavedZeroBubble", 2, 4, 2), ("DualPipeV", 2, 4, 2), ("ZBVZeroBubble", 3, 6, 2)]


def _computations(name: str, ranks: int, n: int, v: int) -> dict[int, list[str]]:
    program = programs.build(name, ranks, n, v)
    return {rank: [str(c) for a in actions if a is not None for c in a.computations]
            for rank, actions in program.items()}


@pytest.mark.parametrize("name, ranks, n, v", CASES)
def test_text_shows_each_computation_once_in_program_order(name: str, ranks: int, n: int, v: int) -> None:
    text = render_text(programs.build(name, ranks, n, v))
    rows = text.splitlines()
    assert rows[0].startswith("time    0")
    for rank, want in _computations(name, ranks, n, v).items():
        cells = rows[1 + rank].split("  idle")[0].split()[2:]
        assert [c for c in cells if c[0].isdigit()] == want


@pytest.mark.parametrize("name, ranks, n, v", CASES)
def test_svg_has_one_rectangle_per_computation(name: str, ranks: int, n: int, v: int) -> None:
    root = ET.fromstring(render_svg(programs.build(name, ranks, n, v)))
    rects = [e for e in root.iter("{http://www.w3.org/2000/svg}rect") if "action" in e.get("class", "").split()]
    want = _computations(name, ranks, n, v)
    assert collections.Counter(r.get("data-action") for r in rects) == collections.Counter(
        a for actions in want.values() for a in actions)
    for rect in rects:
        kind = ActionKind(rect.get("data-action", "").lstrip("0123456789")[0])
        assert rect.get("fill") == COLOURS[kind]


def _decode_png(data: bytes) -> tuple[int, int, bytes]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    at, chunks = 8, {}
    while at < len(data):
        (length,) = struct.unpack(">I", data[at:at + 4])
        kind, body = data[at + 4:at + 8], data[at + 8:at + 8 + length]
        assert struct.unpack(">I", data[at + 8 + length:at + 12 + length])[0] == zlib.crc32(kind + body)
        chunks[kind] = body
        at += 12 + length
    width, height, depth, colour_type = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, colour_type) == (8, 2) and b"IEND" in chunks
    raw = zlib.decompress(chunks[b"IDAT"])
    assert len(raw) == height * (1 + 3 * width)
    return width, height, raw


@pytest.mark.parametrize("name, ranks, n, v", CASES)
def test_png_shows_each_rank_s_computations_as_coloured_blocks(name: str, ranks: int, n: int, v: int) -> None:
    width, _, raw = _decode_png(render_png(programs.build(name, ranks, n, v)))
    colours = {bytes.fromhex(c[1:]) for c in COLOURS.values()}
    idle = 0
    for rank, want in _computations(name, ranks, n, v).items():
        y = 28 + rank * 24 + 10                                  # the middle of the rank's row
        row = raw[y * (1 + 3 * width) + 1:(y + 1) * (1 + 3 * width)]
        pixels = [row[x:x + 3] for x in range(0, len(row), 3)]
        blocks = sum(1 for a, b in zip([b"", *pixels], pixels, strict=False) if b in colours and a not in colours)
        assert blocks == len(want)
        idle += pixels.count(bytes.fromhex(IDLE[1:]))
    assert idle > 0                                              # the bubbles show


def test_render_writes_by_suffix_from_a_program_or_its_report(tmp_path: pathlib.Path) -> None:
    program = programs.add_communication(programs.gpipe(2, 3), stage_to_rank(2, 2))
    report = report_of(program)
    render(program, tmp_path / "gpipe.svg")
    render(report, tmp_path / "gpipe.png")
    render(report, tmp_path / "gpipe.txt")
    assert ET.parse(tmp_path / "gpipe.svg").getroot().tag.endswith("svg")
    assert _decode_png((tmp_path / "gpipe.png").read_bytes())[0] > 0
    assert (tmp_path / "gpipe.txt").read_text() == render_text(program) + "\n"
    assert "idle 3/12 (25%)" in render_text(program)
    assert "idle 2/8 (25%)" in render_text(program, costs={ActionKind.FULL_BACKWARD: 1.0})
    with pytest.raises(ScheduleError, match=r"use a .svg, .png or .txt path"):
        render(program, tmp_path / "gpipe.jpg")
