"""Helpers shared by the benchmark scripts: free ports, rank processes, robust timing, memcpy bandwidth, tables.

Benchmarks are scripts, not tests. Each one runs spmd and torch.distributed side by side in the same processes,
repeats every measurement and reports medians, so the noise of a shared machine hits both alike.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_processes(worker: Callable[..., Any], world_size: int, args: tuple, timeout: float) -> list[Any]:
    """Run worker(rank, world_size, queue, *args) in `world_size` spawned processes; returns what each put on
    the queue. Processes still alive after `timeout` seconds are killed, and the run raises."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(rank, world_size, queue, *args), daemon=True)
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"benchmark ranks did not finish within {timeout:.0f}s")
            try:
                rank, result = queue.get(timeout=min(remaining, 1.0))
            except Exception:   # queue.Empty: check whether a rank died
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a benchmark rank exited with code {dead[0]}") from None
                continue
            if isinstance(result, BaseException):
                raise result
            results[rank] = result
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [results[rank] for rank in range(world_size)]


def run_saving_processes(target: Callable[..., Any], world_size: int, args_of: Callable[[int, str], tuple],
                         timeout: float, what: str) -> list[Any]:
    """Run target(*args_of(rank, out_file)) in `world_size` spawned processes, each torch.save-ing its result to
    f"{out_file}.{rank}" (a temporary directory's file); returns the results in rank order. Processes still
    alive after `timeout` seconds are killed; any non-zero exit raises, naming `what`."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "result.pt")
        procs = [ctx.Process(target=target, args=args_of(rank, out_file)) for rank in range(world_size)]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        if any(proc.exitcode != 0 for proc in procs):
            raise RuntimeError(f"{what} on {world_size} rank(s) failed: exit codes {[p.exitcode for p in procs]}")
        return [torch.load(f"{out_file}.{rank}") for rank in range(world_size)]


def interleaved_medians(candidates: dict[str, tuple[Callable[[], None], Callable[[], None]]], iters: int,
                        reps: int, warm: bool = False) -> dict[str, float]:
    """Median seconds per call of each candidate (name -> (fn, sync)).

    Repetitions of the candidates alternate (A, B, A, B, ...), each `iters` calls started in step by its
    `sync`, so a load spike on a shared machine hits every candidate alike instead of one whole series.
    With `warm`, each repetition first makes one untimed call, so every candidate is timed in its own
    steady state (as nccl-tests times back-to-back calls), not in the cache the other one just dirtied.
    """
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(reps):
        for name, (fn, sync) in candidates.items():
            if warm:
                sync()
                fn()
            sync()
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            times[name].append((time.perf_counter() - start) / iters)
    return {name: statistics.median(samples) for name, samples in times.items()}


def attention_parser(description: str) -> argparse.ArgumentParser:
    """The command line of the attention benchmarks (cp.py, flex_cp.py): the problem's size, steps and ranks."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5, help="timed steps of each implementation")
    parser.add_argument("--ranks", type=int, default=2)
    return parser


def slowest_rank_step_times(names: Sequence[str], steps: int, step: Callable[[str], object]) -> dict[str, list[float]]:
    """Seconds of `steps` calls of `step(name)` per name, each timed as the slowest rank's: the names alternate,
    in reverse every other round (A, B, B, A, ...), each call started after a barrier; a first round warms up.
    Collective over spmd's default group."""
    import spmd

    times: dict[str, list[float]] = {name: [] for name in names}
    for index in range(steps + 1):
        for name in names if index % 2 else reversed(names):
            spmd.barrier()
            start = time.perf_counter()
            step(name)
            elapsed = torch.tensor([time.perf_counter() - start])
            spmd.all_reduce(elapsed, op=spmd.ReduceOp.MAX)
            if index:
                times[name].append(float(elapsed))
    return times


def memcpy_bandwidth(nbytes: int = 256 << 20, reps: int = 5) -> float:
    """Single-thread memcpy bandwidth in bytes/s (best of `reps`): the limit for moving bytes on one host."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - start)
        return nbytes / best
    finally:
        torch.set_num_threads(threads)


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def machine_line() -> str:
    return f"{os.cpu_count()} CPUs, torch {torch.__version__}, load average {os.getloadavg()[0]:.1f}"
