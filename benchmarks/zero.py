"""ZeroRedundancyOptimizer step: spmd's (on shared memory) vs torch's (on gloo), same parameters, same run.

    python benchmarks/zero.py [--ranks 2] [--steps 20] [--layers 8] [--width 1024] [--bucket-view]
    python benchmarks/zero.py --overlap [--steps 10]

A stack of `layers` Linear(width, width) layers (8 x 1024 x 1024 by default: 8.4 M parameters, 34 MB fp32),
Adam. Every rank sets the same gradients (no DDP: this times the optimizer, not the gradient reduction), then
steps: each rank updates the parameters it owns and the owners broadcast them. Per rank process, one copy of
the model per implementation (spmd ZeRO, torch ZeRO, and plain Adam for reference); their steps alternate one by
one after a barrier, and a step's time is the slowest rank's. Also: the optimizer state bytes each rank keeps.

--overlap times whole training steps instead (each rank's batch of 32 rows: forward, backward, optimizer) of DDP
(4 MB buckets) with ZeRO stepped after backward, and with overlap_with_ddp=True under spmd's hook_with_zero_step
and hook_with_zero_step_interleaved, beside torch's DDP with its ZeRO stepped after backward on gloo (torch's
overlap hooks refuse gloo), alternating in the same processes; and whether the three spmd variants end with the
same parameters.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import human_bytes, machine_line, run_saving_processes


def _model(layers: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for state in optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


def _rank(rank: int, world_size: int, init_file: str, layers: int, width: int, steps: int, bucket_view: bool,
          out_file: str) -> None:
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    import spmd
    from spmd.optim import ZeroRedundancyOptimizer

    torch.set_num_threads(1)
    spmd.init_process_group("auto", init_method=f"file://{init_file}.spmd", rank=rank, world_size=world_size,
                            torch_default_group=False)
    dist.init_process_group("gloo", init_method=f"file://{init_file}.gloo", rank=rank, world_size=world_size)
    models = {name: _model(layers, width) for name in ("spmd", "torch", "plain")}
    optimizers = {"spmd": ZeroRedundancyOptimizer(models["spmd"].parameters(), torch.optim.Adam, lr=1e-4,
                                                  parameters_as_bucket_view=bucket_view),
                  "torch": TorchZero(models["torch"].parameters(), torch.optim.Adam, lr=1e-4,
                                     parameters_as_bucket_view=bucket_view),
                  "plain": torch.optim.Adam(models["plain"].parameters(), lr=1e-4)}
    times: dict[str, list[float]] = {name: [] for name in models}
    for step in range(steps + 2):
        for name in (("spmd", "torch", "plain") if step % 2 else ("plain", "torch", "spmd")):
            generator = torch.Generator().manual_seed(step)
            for param in models[name].parameters():
                param.grad = torch.randn(param.shape, generator=generator)
            spmd.barrier()
            start = time.perf_counter()
            optimizers[name].step()
            elapsed = torch.tensor([time.perf_counter() - start])
            spmd.all_reduce(elapsed, op=spmd.ReduceOp.MAX)
            if step >= 2:                     # two warm-up steps: the optimizer state is allocated in the first
                times[name].append(float(elapsed))
    same = all(torch.equal(a, b) for a, b in zip(models["spmd"].parameters(), models["torch"].parameters(),
                                                  strict=True))
    result = {"times": times, "state": {name: _state_bytes(o.optim if name != "plain" else o)
                                        for name, o in optimizers.items()}, "same": same}
    torch.save(result, f"{out_file}.{rank}")
    dist.destroy_process_group()
    spmd.destroy_process_group()


OVERLAP_NAMES = ("spmd after backward", "spmd hook_with_zero_step", "spmd interleaved", "torch after backward")


def _overlap_rank(rank: int, world_size: int, init_file: str, layers: int, width: int, steps: int,
                  out_file: str) -> None:
    """DDP and ZeRO training steps, ZeRO stepped after backward or inside it (--overlap)."""
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import spmd
    from spmd.algorithms.ddp_comm_hooks.ddp_zero_hook import hook_with_zero_step, hook_with_zero_step_interleaved
    from spmd.ddp import allreduce_hook
    from spmd.optim import ZeroRedundancyOptimizer

    torch.set_num_threads(1)
    spmd.init_process_group("auto", init_method=f"file://{init_file}.spmd", rank=rank, world_size=world_size,
                            torch_default_group=False)
    dist.init_process_group("gloo", init_method=f"file://{init_file}.gloo", rank=rank, world_size=world_size)
    models, optimizers = {}, {}
    for name in OVERLAP_NAMES:
        inner = torch.nn.Sequential(*[module for _ in range(layers)
                                      for module in (torch.nn.Linear(width, width), torch.nn.ReLU())])
        torch.manual_seed(0)
        for param in inner.parameters():
            torch.nn.init.normal_(param, std=width ** -0.5)
        if name.startswith("torch"):
            models[name] = TorchDDP(inner, bucket_cap_mb=4)
            optimizers[name] = TorchZero(models[name].parameters(), torch.optim.Adam, lr=1e-4)
            continue
        models[name] = spmd.DistributedDataParallel(inner, bucket_cap_mb=4)
        overlapped = name != "spmd after backward"
        optimizers[name] = ZeroRedundancyOptimizer(models[name].parameters(), torch.optim.Adam,
                                                   overlap_with_ddp=overlapped, lr=1e-4)
        if overlapped:
            hook = hook_with_zero_step if name == "spmd hook_with_zero_step" else hook_with_zero_step_interleaved
            models[name].register_comm_hook(None, hook(allreduce_hook, models[name], optimizers[name]))
    times: dict[str, list[float]] = {name: [] for name in OVERLAP_NAMES}
    for step in range(steps + 2):
        batch = torch.randn(32, width, generator=torch.Generator().manual_seed(step * world_size + rank))
        for name in (OVERLAP_NAMES if step % 2 else OVERLAP_NAMES[::-1]):
            spmd.barrier()
            start = time.perf_counter()
            models[name](batch).square().mean().backward()
            if name.endswith("after backward"):
                optimizers[name].step()
            optimizers[name].zero_grad()
            elapsed = torch.tensor([time.perf_counter() - start])
            spmd.all_reduce(elapsed, op=spmd.ReduceOp.MAX)
            if step >= 2:
                times[name].append(float(elapsed))
    reference = list(models["spmd after backward"].parameters())
    same = {name: all(torch.equal(a, b) for a, b in zip(reference, models[name].parameters(), strict=True))
            for name in OVERLAP_NAMES[1:3]}
    torch.save({"times": times, "same": same}, f"{out_file}.{rank}")
    dist.destroy_process_group()
    spmd.destroy_process_group()


def _launch(args: argparse.Namespace, worker: Any, extra: tuple, what: str) -> tuple[list[dict], dict[str, float], int]:
    """Run `worker(rank, world, init, layers, width, steps, *extra, out)` on every rank; the per-rank results, the
    median time of each implementation, and the parameter count."""
    with tempfile.TemporaryDirectory() as tmp:
        results = run_saving_processes(
            worker, args.ranks, lambda rank, out: (rank, args.ranks, f"{tmp}/init", args.layers, args.width,
                                                   args.steps, *extra, out),
            timeout=600, what=what)
    medians = {name: statistics.median(values) for name, values in results[0]["times"].items()}
    return results, medians, args.layers * (args.width * args.width + args.width)


def _overlap_main(args: argparse.Namespace) -> None:
    results, medians, params = _launch(args, _overlap_rank, (), "zero overlap benchmark")
    print(f"{args.ranks} ranks, {params / 1e6:.1f} M parameters, DDP (4 MB buckets) + ZeRO Adam, 32 rows per rank, "
          f"{args.steps} training steps each (median ms per step, slowest rank)")
    for name in OVERLAP_NAMES:
        print(f"  {name:26s} {medians[name] * 1e3:8.1f} ms   "
              f"(torch's time / this: {medians['torch after backward'] / medians[name]:.2f}x)")
    print(f"overlapped variants end with the parameters of the step after backward: "
          f"{all(all(r['same'].values()) for r in results)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each implementation")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--bucket-view", action="store_true", help="parameters_as_bucket_view=True for both")
    parser.add_argument("--overlap", action="store_true", help="whole DDP training steps, ZeRO stepped in backward")
    args = parser.parse_args()
    print(machine_line())
    if args.overlap:
        _overlap_main(args)
        return
    results, medians, params = _launch(args, _rank, (args.bucket_view,), "zero benchmark")
    times = results[0]["times"]
    print(f"{args.ranks} ranks, {params / 1e6:.1f} M parameters, Adam, bucket view {args.bucket_view}, {args.steps} "
          f"steps each (median ms per step)")
    for name in ("spmd", "torch", "plain"):
        states = [r["state"][name] for r in results]
        print(f"  {name:6s} {medians[name] * 1e3:8.1f} ms   optimizer state per rank: "
              f"{', '.join(human_bytes(s) for s in states)}")
    per_step = [t / s for t, s in zip(times["torch"], times["spmd"], strict=True)]
    print(f"torch ZeRO / spmd ZeRO step time: {medians['torch'] / medians['spmd']:.2f}x "
          f"(per interleaved step: {min(per_step):.2f}-{max(per_step):.2f}); "
          f"same parameters after every step: {all(r['same'] for r in results)}")


if __name__ == "__main__":
    main()
