"""A 2-rank all-reduce demo on the threads transport, printing a bandwidth table (the main job until training lands)."""

from __future__ import annotations

import time

import torch

import spmd
from spmd.testing import run_ranks


def body(rank: int, world_size: int) -> list[tuple[int, float]]:
    rows = []
    for size in (1 << 10, 1 << 16, 1 << 20, 1 << 24):
        tensor = torch.ones(size // 4)
        spmd.all_reduce(tensor)
        start = time.perf_counter()
        for _ in range(5):
            spmd.all_reduce(tensor)
        rows.append((size, (time.perf_counter() - start) / 5))
    return rows


if __name__ == "__main__":
    rows = run_ranks(body, world_size=2)[0]
    print(f"{'bytes':>10} {'time (us)':>12} {'busbw (GB/s)':>14}")
    for size, seconds in rows:
        print(f"{size:>10} {seconds * 1e6:>12.1f} {size / seconds / 1e9:>14.2f}")
