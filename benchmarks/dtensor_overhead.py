"""DTensor dispatch overhead: microseconds per op on small tensors, spmd beside torch.distributed.tensor.

What is measured: the CPU cost of running one op on a DTensor (look up the cached sharding decision, unwrap,
run the local op, wrap the result) minus nothing: the plain-tensor time of the same local op is printed
beside it, and "overhead" is DTensor time minus plain time. The ops need no communication (add of two
Shard(0) tensors, mm of Shard(0) by Replicate, a view keeping the sharded dim, sum and mean over a sharded dim
giving Partial; mean runs spmd's custom-kernel path, a local sum scaled by the global count), so only dispatch
is timed, on a 1-d (4,) mesh and a 2-d (2, 2) mesh. "AdamW step" is one optimizer step (foreach) over 20
Shard(0) parameters with Shard(0) gradients: what DTensor dispatch costs a training step.

How: one process. spmd runs 4 rank threads (threads transport); rank 0 times while the others wait in a
barrier. torch's DTensor needs a process group: a 4-rank "fake" group (torch's own test backend, no
communication) in the same process, timed from the same thread, rounds interleaved with spmd's so the noise
of a shared machine hits both alike. Medians over repetitions.

    python benchmarks/dtensor_overhead.py [--iters 500] [--reps 15]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.tensor as torch_dtensor
from _common import machine_line
from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import spmd
from spmd.device_mesh import init_device_mesh
from spmd.tensor import Replicate, Shard, distribute_tensor
from spmd.testing import run_ranks

WORLD = 4
MESHES = ((4,), (2, 2))


def _ops(distribute: Callable, mesh: object, ndim: int) -> dict[str, Callable[[], object]]:
    """The timed calls on DTensors made by `distribute(tensor, mesh, placements)` (spmd's or torch's)."""
    rows = [torch_dtensor.Shard(0) if distribute is torch_dtensor.distribute_tensor else Shard(0)] * ndim
    rep_cls = torch_dtensor.Replicate if distribute is torch_dtensor.distribute_tensor else Replicate
    torch.manual_seed(0)
    a = distribute(torch.randn(64, 32), mesh, rows)
    b = distribute(torch.randn(64, 32), mesh, rows)
    w = distribute(torch.randn(32, 16), mesh, [rep_cls()] * ndim)
    return {"add": lambda: a + b, "mm": lambda: torch.mm(a, w), "view": lambda: a.view(64, 4, 8),
            "sum(dim 0)": lambda: a.sum(0), "mean(dim 0)": lambda: a.mean(0)}


def _adamw_step(distribute: Callable, mesh: object, ndim: int, fused: bool = False) -> Callable[[], object]:
    """One AdamW step (foreach implementation) over 20 small Shard(0) parameters: ~9 foreach ops per step."""
    rows = [torch_dtensor.Shard(0) if distribute is torch_dtensor.distribute_tensor else Shard(0)] * ndim
    params = [torch.nn.Parameter(distribute(torch.randn(64, 32), mesh, rows)) for _ in range(20)]
    for param in params:
        param.grad = distribute(torch.randn(64, 32), mesh, rows)
    optimizer = torch.optim.AdamW(params, lr=1e-3, foreach=True)
    return optimizer.step


def _plain_adamw_step() -> Callable[[], object]:
    params = [torch.nn.Parameter(torch.randn(16, 32)) for _ in range(20)]
    for param in params:
        param.grad = torch.randn(16, 32)
    return torch.optim.AdamW(params, lr=1e-3, foreach=True).step


def _plain_ops() -> dict[str, Callable[[], object]]:
    """The same local ops on plain tensors of one shard's size (64 rows over 4 ranks: 16)."""
    a, b, w = torch.randn(16, 32), torch.randn(16, 32), torch.randn(32, 16)
    return {"add": lambda: a + b, "mm": lambda: torch.mm(a, w), "view": lambda: a.view(16, 4, 8),
            "sum(dim 0)": lambda: a.sum(0), "mean(dim 0)": lambda: a.mean(0)}


def _per_call_us(fn: Callable[[], object], iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e6


def _measure(iters: int, reps: int) -> list[dict[str, object]]:
    """Rank 0 of a 4-rank spmd world times spmd, torch and plain ops, interleaved; returns table rows."""
    torch_meshes = {shape: torch_init_device_mesh("cpu", shape) for shape in MESHES}
    rows: list[dict[str, object]] = []

    def body(rank: int, world_size: int) -> None:
        spmd_meshes = {shape: init_device_mesh("cpu", shape) for shape in MESHES}
        spmd_ops = {shape: {**_ops(distribute_tensor, spmd_meshes[shape], len(shape)),          # collective
                            "AdamW step": _adamw_step(distribute_tensor, spmd_meshes[shape], len(shape))}
                    for shape in MESHES}
        if rank == 0:
            plain = {**_plain_ops(), "AdamW step": _plain_adamw_step()}
            for shape in MESHES:
                ours = spmd_ops[shape]
                theirs = {**_ops(torch_dtensor.distribute_tensor, torch_meshes[shape], len(shape)),
                          "AdamW step": _adamw_step(torch_dtensor.distribute_tensor, torch_meshes[shape], len(shape))}
                for name in ours:
                    calls = iters // 20 if name == "AdamW step" else iters     # a step is ~20x an op
                    for fn in (ours[name], theirs[name], plain[name]):     # warm the decision caches
                        _per_call_us(fn, 20)
                    samples: dict[str, list[float]] = {"spmd": [], "torch": [], "plain": []}
                    for _ in range(reps):
                        samples["spmd"].append(_per_call_us(ours[name], calls))
                        samples["torch"].append(_per_call_us(theirs[name], calls))
                        samples["plain"].append(_per_call_us(plain[name], calls))
                    rows.append({"op": name, "mesh": shape, **{k: statistics.median(v) for k, v in samples.items()}})
        spmd.barrier()          # the other ranks wait here (no CPU) while rank 0 times

    run_ranks(body, world_size=WORLD, timeout=1800)
    return rows


def _print(rows: list[dict[str, object]], iters: int, reps: int) -> None:
    print(f"DTensor dispatch overhead ({machine_line()}); median of {reps} x {iters} calls, µs per op")
    header = (f"{'op':<13}{'mesh':<8}{'plain':>9}{'torch':>10}{'spmd':>10}{'torch ovh':>11}{'spmd ovh':>11}"
              f"{'spmd/torch':>12}")
    print(header)
    print("-" * len(header))
    for row in rows:
        ours, theirs, plain = row["spmd"], row["torch"], row["plain"]
        ratio = (ours - plain) / max(theirs - plain, 1e-9)
        print(f"{row['op']:<13}{row['mesh']!s:<8}{plain:>9.1f}{theirs:>10.1f}{ours:>10.1f}{theirs - plain:>11.1f}"
              f"{ours - plain:>11.1f}{ratio:>11.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=500)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        _print(_measure(args.iters, args.reps), args.iters, args.reps)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
