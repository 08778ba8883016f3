"""Collective bandwidth and latency: spmd's transports and torch gloo side by side, columns as nccl-tests.

    python benchmarks/collectives.py [--world-size 2] [--transports tcp,shm] [--max-size 256M] [--ops ...] [--runs 3]
                                     [--hosts 1]

Every rank is a process with one compute thread (torch.set_num_threads(1)) that joins both an spmd world
per transport and a torch.distributed gloo world, so each size is measured on every backend in the same
run, with repetitions alternating between backends; each repetition starts with one untimed call, so every
backend is timed in its own steady state (as nccl-tests times back-to-back calls) rather than in the cache
the other backend just dirtied. Times are the slowest rank's median over repetitions;
algbw = size / time and busbw = algbw x the nccl-tests factor (all_reduce 2(n-1)/n; all_gather,
reduce_scatter, all_to_all (n-1)/n; broadcast 1), where size is the largest buffer (all_gather's output,
reduce_scatter's input). "vs gloo" is gloo's time / spmd's time: above 1 means spmd is faster. send/recv
is a ping-pong between ranks 0 and 1, reported as one-way latency. With --runs N the whole measurement runs N
times in fresh processes, and a last table gives the median of every time over the runs, and of every ratio
with its range: the figures the README quotes. --hosts H splits the ranks into H fake hosts of consecutive
ranks (SPMD_HOST_ID), so "shm" runs hierarchically: shared memory inside each, tcp between their leaders.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as tdist
from _common import free_port, human_bytes, interleaved_medians, machine_line, memcpy_bandwidth, run_processes

import spmd

OPS = ["all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "all_to_all_single",
       "send_recv"]
BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather_into_tensor": lambda n: (n - 1) / n,
    "reduce_scatter_tensor": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "all_to_all_single": lambda n: (n - 1) / n,
    "send_recv": lambda n: 1.0,
}
SEND_RECV_MAX = 16 << 20


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def sizes_up_to(max_size: int) -> list[int]:
    """8 B, then x8 up to 1 MiB, then x4: 8, 64, 512, 4K, 32K, 256K, 1M, 4M, 16M, 64M, 256M (up to max_size)."""
    sizes, size = [], 8
    while size <= max_size:
        sizes.append(size)
        size *= 8 if size < (1 << 20) // 4 else 4
    return sizes


class Backend:
    """One way of running the ops: spmd over a transport, or torch.distributed (gloo)."""

    def __init__(self, name: str, module: Any, group: Any) -> None:
        self.name = name
        self.dist = module
        self.group = group

    def barrier(self) -> None:
        self.dist.barrier(group=self.group)

    def op(self, op: str, nbytes: int, rank: int, n: int) -> Callable[[], None] | None:
        """A closure running one `op` of `nbytes` (the nccl-tests size), or None when it does not apply."""
        dist, group = self.dist, self.group
        numel = max(1, nbytes // 4)
        if op == "all_reduce":
            t = torch.ones(numel)
            return lambda: dist.all_reduce(t, group=group)
        if op == "all_gather_into_tensor":
            if numel < n:
                return None
            inp, out = torch.ones(numel // n), torch.empty(numel // n * n)
            return lambda: dist.all_gather_into_tensor(out, inp, group=group)
        if op == "reduce_scatter_tensor":
            if numel < n:
                return None
            inp, out = torch.ones(numel // n * n), torch.empty(numel // n)
            return lambda: dist.reduce_scatter_tensor(out, inp, group=group)
        if op == "broadcast":
            t = torch.ones(numel)
            return lambda: dist.broadcast(t, src=0, group=group)
        if op == "all_to_all_single":
            if numel < n:
                return None
            inp, out = torch.ones(numel // n * n), torch.empty(numel // n * n)
            return lambda: dist.all_to_all_single(out, inp, group=group)
        if op == "send_recv":
            if nbytes > SEND_RECV_MAX:
                return None
            t = torch.ones(numel)
            if rank == 0:
                return lambda: (dist.send(t, 1, group=group), dist.recv(t, 1, group=group))
            if rank == 1:
                return lambda: (dist.recv(t, 0, group=group), dist.send(t, 0, group=group))
            return lambda: None
        raise ValueError(op)


def iterations(nbytes: int) -> tuple[int, int]:
    """(iterations per repetition, repetitions) for a size: ~ constant work per repetition."""
    if nbytes <= 64 << 10:
        return 20, 21
    if nbytes <= 4 << 20:
        return 4, 15
    return 1, 7


def worker(rank: int, world_size: int, queue: Any, ports: dict[str, int], transports: list[str], ops: list[str],
           sizes: list[int], hosts: int) -> None:
    try:
        torch.set_num_threads(1)
        if hosts > 1:
            os.environ["SPMD_HOST_ID"] = f"fake-host-{rank * hosts // world_size}"   # read by init_process_group
        warnings.filterwarnings("ignore", category=FutureWarning)   # gloo's *_into_tensor/_tensor renames
        timeout = datetime.timedelta(seconds=300)
        tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports['gloo']}", rank=rank,
                                 world_size=world_size, timeout=timeout)
        backends = []
        spmd.init_process_group(transports[0], init_method=f"tcp://127.0.0.1:{ports['spmd']}", rank=rank,
                                world_size=world_size, timeout=300, torch_default_group=False)
        for transport in transports:
            group = None if transport == transports[0] else spmd.new_group(list(range(world_size)), backend=transport)
            backends.append(Backend(f"spmd-{transport}", spmd, group))
        backends.append(Backend("gloo", tdist, None))
        results: list[tuple[str, int, str, float]] = []
        for op in ops:
            for nbytes in sizes:
                iters, reps = iterations(nbytes)
                candidates = {}
                for backend in backends:
                    fn = backend.op(op, nbytes, rank, world_size)
                    if fn is not None:
                        for _ in range(2):   # warm-up: connections, buffers, caches
                            fn()
                        candidates[backend.name] = (fn, backend.barrier)
                for name, seconds in interleaved_medians(candidates, iters, reps, warm=True).items():
                    if op == "send_recv":
                        seconds /= 2   # one way of the ping-pong
                    slowest = torch.tensor([seconds], dtype=torch.float64)
                    tdist.all_reduce(slowest, op=tdist.ReduceOp.MAX)
                    results.append((op, nbytes, name, slowest.item()))
        spmd.destroy_process_group()
        tdist.destroy_process_group()
        queue.put((rank, results))
    except BaseException as error:   # reported by the parent
        queue.put((rank, RuntimeError(f"rank {rank}: {type(error).__name__}: {error}")))


Result = tuple[str, int, str, float]     # (op, bytes, backend, seconds)


def print_tables(results: list[Result], world_size: int, names: list[str],
                 ratios: dict[tuple[str, int, str], list[float]] | None = None) -> None:
    """One nccl-tests style table per op. With `ratios` (per-run "vs gloo" ratios of several runs), the
    ratio cells show their median and range instead of the ratio of the times in `results`."""
    table: dict[tuple[str, int], dict[str, float]] = {}
    for op, nbytes, name, seconds in results:
        table.setdefault((op, nbytes), {})[name] = seconds
    for op in dict.fromkeys(op for op, *_ in results):
        factor = BUS_FACTOR[op](world_size)
        print(f"\n## {op}, {world_size} ranks" + (" (one-way latency of a ping-pong)" if op == "send_recv" else ""))
        head = f"| {'size':>9} |"
        rule = "|----------:|"
        for name in names:
            head += f" {name + ' time (us)':>20} | {'algbw GB/s':>10} | {'busbw GB/s':>10} |"
            rule += "---------------------:|-----------:|-----------:|"
        spmd_names = [name for name in names if name != "gloo"]
        width = 22 if ratios else 16
        for name in spmd_names:
            head += f" {name + ' vs gloo':>{width}} |"
            rule += "-" * (width + 1) + ":|"
        print(head)
        print(rule)
        for (row_op, nbytes), times in table.items():
            if row_op != op:
                continue
            line = f"| {human_bytes(nbytes):>9} |"
            for name in names:
                seconds = times.get(name)
                if seconds is None:
                    line += f" {'-':>20} | {'-':>10} | {'-':>10} |"
                    continue
                algbw = nbytes / seconds / 1e9
                line += f" {seconds * 1e6:>20.1f} | {algbw:>10.3f} | {algbw * factor:>10.3f} |"
            for name in spmd_names:
                if ratios:
                    runs = ratios.get((op, nbytes, name), [])
                    cell = f"{statistics.median(runs):.2f}x ({min(runs):.2f}-{max(runs):.2f})" if runs else "-"
                    line += f" {cell:>{width}} |"
                    continue
                ratio = times["gloo"] / times[name] if name in times and "gloo" in times else float("nan")
                line += f" {ratio:>15.2f}x |"
            print(line)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--transports", default="tcp,shm", help="comma-separated spmd transports, e.g. tcp,shm")
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {OPS}")
    parser.add_argument("--min-size", default="8")
    parser.add_argument("--max-size", default="256M")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--runs", type=int, default=1,
                        help="whole measurements, each in fresh processes; with more than one, a last table gives "
                             "the medians over the runs (what the README quotes)")
    parser.add_argument("--hosts", type=int, default=1,
                        help="fake hosts of consecutive ranks: 'shm' then runs hierarchically across them")
    args = parser.parse_args(argv)
    if not 1 <= args.hosts <= args.world_size:
        parser.error(f"--hosts must be between 1 and --world-size ({args.world_size}), not {args.hosts}")
    transports = [t for t in args.transports.split(",") if t]
    ops = [op for op in args.ops.split(",") if op]
    unknown = sorted(set(ops) - set(OPS))
    if unknown:
        parser.error(f"unknown ops {unknown}; choose from {OPS}")
    sizes = [s for s in sizes_up_to(parse_size(args.max_size)) if s >= parse_size(args.min_size)]
    on_hosts = f" on {args.hosts} fake hosts" if args.hosts > 1 else ""
    print(f"# spmd collectives benchmark: {args.world_size} ranks{on_hosts}, 1 thread per rank; {machine_line()}")
    print(f"# single-thread memcpy bandwidth (the limit for one copy): {memcpy_bandwidth() / 1e9:.2f} GB/s")
    names = [f"spmd-{t}" for t in transports] + ["gloo"]
    runs = []
    for run in range(args.runs):
        ports = {"gloo": free_port(), "spmd": free_port()}
        per_rank = run_processes(worker, args.world_size, (ports, transports, ops, sizes, args.hosts), args.timeout)
        if args.runs > 1:
            print(f"\n# run {run + 1} of {args.runs} (load average {os.getloadavg()[0]:.1f})")
        print_tables(per_rank[0], args.world_size, names)
        sys.stdout.flush()
        runs.append(per_rank[0])
    if args.runs > 1:
        print(f"\n# medians over {args.runs} runs: times (and algbw/busbw from them), and each \"vs gloo\" ratio "
              f"as the median (range) of the runs' ratios")
        medians, ratios = summarize(runs)
        print_tables(medians, args.world_size, names, ratios)


def summarize(runs: list[list[Result]]) -> tuple[list[Result], dict[tuple[str, int, str], list[float]]]:
    """The median time of every (op, size, backend) over the runs, and every spmd backend's per-run ratios."""
    times: dict[tuple[str, int, str], list[float]] = {}
    ratios: dict[tuple[str, int, str], list[float]] = {}
    for results in runs:
        by_cell = {(op, nbytes, name): seconds for op, nbytes, name, seconds in results}
        for (op, nbytes, name), seconds in by_cell.items():
            times.setdefault((op, nbytes, name), []).append(seconds)
            gloo = by_cell.get((op, nbytes, "gloo"))
            if name != "gloo" and gloo is not None:
                ratios.setdefault((op, nbytes, name), []).append(gloo / seconds)
    medians = [(op, nbytes, name, statistics.median(values)) for (op, nbytes, name), values in times.items()]
    return medians, ratios


if __name__ == "__main__":
    main()
