"""DDP throughput: spmd DistributedDataParallel vs torch DDP on gloo, same model, same machine, same run.

    python benchmarks/ddp.py [--steps 10] [--repeats 2] [--settings compute comm]

The GPT-style model of examples/gpt.py at 4 layers, width 256, 4 heads, context 128, vocabulary 4096
(5.3 M parameters, a 21 MB fp32 gradient), AdamW, random tokens. Two ranks, one torch thread each, as
spawned processes; spmd on its default transport ("auto": shared memory on one host), torch on gloo.
  - compute-heavy: micro batch 8 per rank. Also reports scaling efficiency against one process with one
    thread training the same global batch (tokens/s of 2 ranks / (2 x tokens/s of 1)).
  - communication-heavy: micro batch 1 per rank, where the gradient all-reduce is a large part of a step.
For each: median step time and tokens/s, and how long backward waits on communication:
  exposed    = median backward time with gradient sync - median backward time under no_sync()
  total      = median time of one all-reduce of the whole gradient (21 MB) on the same group
  overlapped = total - exposed (communication hidden behind backward compute)
Implementations alternate within each repeat, so machine noise hits both alike; medians over all repeats.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
VOCAB, CONTEXT = 4096, 128
SETTINGS = {"compute": 8, "comm": 1}   # micro batch per rank


def _model() -> torch.nn.Module:
    sys.path.insert(0, str(EXAMPLES))
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=VOCAB, context=CONTEXT, layers=4, width=256, heads=4))


def _loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


class _Impl:
    """How one implementation sets up its group, wraps the model and all-reduces (spmd, torch, single)."""

    def __init__(self, name: str, rank: int, world_size: int, init_file: str) -> None:
        self.name = name
        if name == "spmd":
            import spmd

            self.lib = spmd
            spmd.init_process_group("auto", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
            self.backend = spmd.get_backend()
        elif name == "torch":
            import torch.distributed as dist

            self.lib = dist
            dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
            self.backend = "gloo"
        else:
            self.lib = None
            self.backend = "none"

    def wrap(self, model: torch.nn.Module, bucket_cap_mb: float) -> torch.nn.Module:
        if self.name == "spmd":
            return self.lib.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
        if self.name == "torch":
            return torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
        return model

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
        return model.no_sync() if self.lib is not None else contextlib.nullcontext()

    def all_reduce(self, tensor: torch.Tensor) -> None:
        if self.lib is not None:
            self.lib.all_reduce(tensor)

    def barrier(self) -> None:
        if self.lib is not None:
            self.lib.barrier()

    def close(self) -> None:
        if self.lib is not None:
            self.lib.barrier()   # gloo aborts a rank whose peer tears down while it still talks to it
            self.lib.destroy_process_group()


def _worker(impl_name: str, rank: int, world_size: int, micro_batch: int, steps: int, bucket_cap_mb: float,
            init_file: str, out_file: str) -> None:
    torch.set_num_threads(1)
    impl = _Impl(impl_name, rank, world_size, init_file)
    try:
        raw = _model()
        model = impl.wrap(raw, bucket_cap_mb)
        optimizer = torch.optim.AdamW(raw.parameters(), lr=1e-4)
        generator = torch.Generator().manual_seed(rank)

        def step(sync: bool) -> tuple[float, float]:
            tokens = torch.randint(0, VOCAB, (micro_batch, CONTEXT + 1), generator=generator)
            start = time.perf_counter()
            with contextlib.nullcontext() if sync else impl.no_sync(model):
                loss = _loss(model, tokens)
                backward_start = time.perf_counter()
                loss.backward()
                backward = time.perf_counter() - backward_start
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return time.perf_counter() - start, backward

        for _ in range(3):
            step(sync=True)   # warm up (torch DDP also rebuilds its buckets here)
        impl.barrier()
        synced = [step(sync=True) for _ in range(steps)]
        local = [step(sync=False) for _ in range(max(3, steps // 2))]
        impl.barrier()
        flat = torch.zeros(sum(p.numel() for p in raw.parameters()))
        allreduce = []
        for _ in range(5):
            start = time.perf_counter()
            impl.all_reduce(flat)
            allreduce.append(time.perf_counter() - start)
        if rank == 0:
            torch.save({"step": [s for s, _ in synced], "backward": [b for _, b in synced],
                        "backward_local": [b for _, b in local], "allreduce": allreduce,
                        "backend": impl.backend, "params": flat.numel()}, out_file)
    finally:
        impl.close()


def _run(impl: str, world_size: int, micro_batch: int, args: argparse.Namespace) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "result.pt")
        procs = [ctx.Process(target=_worker, args=(impl, rank, world_size, micro_batch, args.steps, args.bucket_cap_mb,
                                                   os.path.join(tmp, "init"), out_file))
                 for rank in range(world_size)]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + args.timeout
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        if any(proc.exitcode != 0 for proc in procs):
            raise RuntimeError(f"{impl} with {world_size} rank(s) failed: exit codes {[p.exitcode for p in procs]}")
        return torch.load(out_file)


def _summary(results: list[dict[str, Any]], global_batch: int) -> dict[str, float]:
    step = statistics.median(t for r in results for t in r["step"])
    backward = statistics.median(t for r in results for t in r["backward"])
    local = statistics.median(t for r in results for t in r["backward_local"])
    total = statistics.median(t for r in results for t in r["allreduce"])
    exposed = max(0.0, backward - local)
    return {"step_ms": step * 1e3, "tokens_s": global_batch * CONTEXT / step, "exposed_ms": exposed * 1e3,
            "comm_ms": total * 1e3, "overlapped_ms": max(0.0, total - exposed) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each implementation, alternating")
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per run")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP bucket cap, the same for both")
    args = parser.parse_args()
    world_size = 2
    print(f"GPT 4x256, 4 heads, context {CONTEXT}, vocab {VOCAB}; {world_size} ranks x 1 thread; "
          f"bucket_cap_mb {args.bucket_cap_mb:g}; {args.steps} timed steps x {args.repeats} repeats; medians")
    for setting in args.settings:
        micro = SETTINGS[setting]
        global_batch = micro * world_size
        runs: dict[str, list[dict[str, Any]]] = {"spmd": [], "torch": [], "single": []}
        for _ in range(args.repeats):
            runs["spmd"].append(_run("spmd", world_size, micro, args))
            runs["torch"].append(_run("torch", world_size, micro, args))
            if setting == "compute":
                runs["single"].append(_run("single", 1, global_batch, args))
        spmd, ref = _summary(runs["spmd"], global_batch), _summary(runs["torch"], global_batch)
        print(f"\n{setting}-heavy: micro batch {micro}/rank, global batch {global_batch} x {CONTEXT} tokens, "
              f"spmd over {runs['spmd'][0]['backend']}, {runs['spmd'][0]['params'] / 1e6:.2f}M parameters")
        print(f"  {'':6} {'step ms':>9} {'tokens/s':>10} {'allreduce ms':>13} {'exposed ms':>11} "
              f"{'overlapped ms':>14}")
        for name, row in (("spmd", spmd), ("torch", ref)):
            print(f"  {name:6} {row['step_ms']:9.1f} {row['tokens_s']:10.0f} {row['comm_ms']:13.1f} "
                  f"{row['exposed_ms']:11.1f} {row['overlapped_ms']:14.1f}")
        print(f"  spmd / torch tokens/s: {spmd['tokens_s'] / ref['tokens_s']:.2f}x")
        if runs["single"]:
            single = _summary(runs["single"], global_batch)
            print(f"  one process, one thread, batch {global_batch}: {single['tokens_s']:.0f} tokens/s; scaling "
                  f"efficiency spmd {spmd['tokens_s'] / (world_size * single['tokens_s']):.2f}, torch "
                  f"{ref['tokens_s'] / (world_size * single['tokens_s']):.2f}")


if __name__ == "__main__":
    main()
