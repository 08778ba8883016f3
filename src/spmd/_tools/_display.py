"""The text the memory trackers print: snapshots per device and category, as lines (the layout torch's trackers
print) or as one aligned table.

Layer: _tools. A snapshot is {device: {category: bytes, ..., "Total": bytes}} (see Note: snapshots in
mem_tracker.py); devices whose total rounds to zero in the chosen units are left out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Any

import torch

Snapshot = dict[torch.device, dict[Any, int]]
_TOTAL_KEY = "Total"
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def _rounded(nbytes: int, units: str) -> float | int:
    divisor = _UNITS[units]
    return nbytes if divisor == 1 else round(nbytes / divisor, 2)


def _check_units(units: str) -> None:
    if units not in _UNITS:
        raise ValueError(f"MemTracker: units must be one of {', '.join(_UNITS)}, got {units!r}")


def _shown(snapshot: Snapshot, units: str) -> list[tuple[torch.device, dict[Any, int]]]:
    return [(device, snap) for device, snap in snapshot.items() if _rounded(snap[_TOTAL_KEY], units) > 0]


def _name(key: Any) -> str:
    return key.value if isinstance(key, Enum) else str(key)


def _lines(snapshot: Snapshot, units: str) -> list[str]:
    if not snapshot:
        return ["No memory tracked."]
    lines = []
    for device, snap in _shown(snapshot, units):
        lines.append(f"Device: {device}")
        lines.extend(f"\t{_name(key)}: {_rounded(nbytes, units)} {units}" for key, nbytes in snap.items())
    return lines


def _table(labelled: Sequence[tuple[str, Snapshot]], units: str, label_header: str) -> str:
    """One row per shown device of each snapshot (the label on the first row of its snapshot), a column per
    category; an aligned text table in reStructuredText's simple layout."""
    rows: list[list[str]] = []
    categories: list[str] = []
    for label, snapshot in labelled:
        for index, (device, snap) in enumerate(_shown(snapshot, units)):
            categories = categories or [_name(key) for key in snap]
            rows.append([label if index == 0 else "", str(device),
                         *(f"{_rounded(nbytes, units)} {units}" for nbytes in snap.values())])
    if not rows:
        return "No memory tracked."
    headers = [label_header, "Device", *categories] if label_header else ["Device", *categories]
    rows = rows if label_header else [row[1:] for row in rows]
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows)]
    rule = "  ".join("=" * width for width in widths)
    body = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    return "\n".join([rule, "  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip(), rule, *body, rule])


def format_snapshot(snapshot: Snapshot, units: str, tabulate: bool) -> str:
    """One snapshot: per device, each category's bytes in `units` (B, KiB, MiB, GiB)."""
    _check_units(units)
    return _table([("", snapshot)], units, "") if tabulate else "\n".join(_lines(snapshot, units))


def format_state_snapshots(snapshots: Mapping[Any, Sequence[Snapshot]], units: str, tabulate: bool) -> str:
    """A module's snapshots: each state's, numbered by call (`# 1`, `# 2`, ...)."""
    _check_units(units)
    if tabulate:
        labelled = [(f"{_name(state)} # {index + 1}", snapshot) for state, calls in snapshots.items()
                    for index, snapshot in enumerate(calls)]
        return _table(labelled, units, "State & Call")
    lines = []
    for state, calls in snapshots.items():
        lines.append(_name(state))
        for index, snapshot in enumerate(calls):
            lines.append(f"# {index + 1}:")
            lines.extend(_lines(snapshot, units))
    return "\n".join([*lines, ""])
