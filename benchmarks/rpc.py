"""RPC: spmd.rpc (over shared memory) vs torch's RPC (TensorPipe), the same two processes, the same calls,
interleaved.

    python benchmarks/rpc.py [--iters 200] [--repeats 5]
    python benchmarks/rpc.py --iters 20 --repeats 1        # smoke check

Both libraries' agents live in the same 2 processes (1 torch thread each), worker 0 calling worker 1:
  - latency: rpc_sync of a function returning None;
  - payload: rpc_sync of a function returning its tensor argument (1 KiB, 1 MiB, 16 MiB of float32): the tensor
    goes there and back, so GB/s counts twice its bytes;
  - ps step: one parameter-server training step of the RPC tutorial's shape (the model, a 2-layer MLP of
    1024 -> 1024 -> 10, on worker 1; a batch of 64 sent from worker 0 inside a distributed autograd context;
    backward through the call; DistributedOptimizer's SGD step).
Each figure is the median over --repeats of the mean time of --iters calls, the libraries alternating per repeat.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import free_port, machine_line, run_saving_processes

SIZES = {"1 KiB": 256, "1 MiB": 1 << 18, "16 MiB": 1 << 22}


def nothing() -> None:
    return None


def echo(x: torch.Tensor) -> torch.Tensor:
    return x


class Server:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


def forward(server: Any, x: torch.Tensor) -> torch.Tensor:
    return server.local_value().forward(x)


def parameter_rrefs(server: Any, rref_class: type) -> list[Any]:
    return [rref_class(p) for p in server.local_value().model.parameters()]


class _Side:
    """One library's RPC, autograd and optimizer modules."""

    def __init__(self, name: str, rank: int, init_file: str, port: int) -> None:
        self.name = name
        if name == "spmd":
            import spmd.autograd as dist_autograd
            import spmd.rpc as rpc
            from spmd.optim import DistributedOptimizer
            options = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{init_file}")
        else:
            import torch.distributed.autograd as dist_autograd
            import torch.distributed.rpc as rpc
            from torch.distributed.optim import DistributedOptimizer
            options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
        self.rpc, self.autograd, self.optimizer_class = rpc, dist_autograd, DistributedOptimizer
        rpc.init_rpc(f"{name}{rank}", rank=rank, world_size=2, rpc_backend_options=options)

    def timed(self, call: Callable[[], None], iters: int) -> float:
        call()
        start = time.perf_counter()
        for _ in range(iters):
            call()
        return (time.perf_counter() - start) / iters

    def measure(self, iters: int) -> dict[str, float]:
        rpc, to = self.rpc, f"{self.name}1"
        results = {"latency": self.timed(lambda: rpc.rpc_sync(to, nothing), iters)}
        for label, numel in SIZES.items():
            payload = torch.randn(numel)
            results[label] = self.timed(lambda payload=payload: rpc.rpc_sync(to, echo, (payload,)),
                                        max(2, iters // (1 + numel // 65536)))
        server = rpc.remote(to, Server)
        optimizer = self.optimizer_class(torch.optim.SGD, rpc.rpc_sync(to, parameter_rrefs, (server, rpc.RRef)),
                                         lr=0.01)
        batch, target = torch.randn(64, 1024), torch.randint(0, 10, (64,))

        def step() -> None:
            with self.autograd.context() as context_id:
                loss = nn.functional.cross_entropy(rpc.rpc_sync(to, forward, (server, batch)), target)
                self.autograd.backward(context_id, [loss])
                optimizer.step(context_id)

        results["ps step"] = self.timed(step, max(2, iters // 10))
        return results


def _worker(rank: int, iters: int, repeats: int, init_dir: str, port: int, out_file: str) -> None:
    torch.set_num_threads(1)
    sides = [_Side(name, rank, os.path.join(init_dir, "spmd-init"), port) for name in ("spmd", "torch")]
    results: dict[str, list[dict[str, float]]] = {side.name: [] for side in sides}
    if rank == 0:
        for repeat in range(repeats):
            for side in sides if repeat % 2 == 0 else sides[::-1]:
                results[side.name].append(side.measure(iters))
    for side in sides:
        side.rpc.shutdown()
    torch.save(results, f"{out_file}.{rank}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(machine_line())
    with tempfile.TemporaryDirectory() as init_dir:
        port = free_port()
        results = run_saving_processes(_worker, 2, lambda rank, out: (rank, args.iters, args.repeats, init_dir, port,
                                                                       out), timeout=1200, what="the RPC benchmark")[0]
    medians = {name: {key: statistics.median(run[key] for run in runs) for key in runs[0]}
               for name, runs in results.items()}
    print(f"2 workers in 2 processes x 1 torch thread; worker 0 calls worker 1; median of {args.repeats} repeats "
          f"of {args.iters} calls (fewer for the large payloads and the ps step), interleaved")
    print(f"  {'':12s} {'spmd':>12s} {'torch':>12s} {'torch/spmd':>11s}")
    for key in medians["spmd"]:
        mine, theirs = medians["spmd"][key], medians["torch"][key]
        extra = ""
        if key in SIZES:
            nbytes = 2 * SIZES[key] * 4
            extra = f"   {nbytes / mine / 1e9:.2f} vs {nbytes / theirs / 1e9:.2f} GB/s"
        print(f"  {key:12s} {mine * 1e6:10.0f}us {theirs * 1e6:10.0f}us {theirs / mine:10.2f}x{extra}")
    print(f"load average after: {machine_line().rsplit(' ', 1)[-1]}")


if __name__ == "__main__":
    main()
