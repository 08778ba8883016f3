"""DDP throughput: spmd DistributedDataParallel vs torch DDP on gloo, same model, same machine, same run.

    python benchmarks/ddp.py [--steps 10] [--repeats 2] [--settings compute comm] [--compile]

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
With --compile, every model is torch.compile'd, DDP wrapped first (inductor), twice per library in the same
processes: cut at the DDP buckets (DDPOptimizer, torch's default: gradients reach the all-reduces during the
compiled backward) and whole (torch._dynamo.config.optimize_ddp = False around its steps: every all-reduce after
the backward); the torch-over-spmd run is left out.
A third run is torch's own DDP on a torch process group of the "spmd" backend (spmd.comm.torch_backend: torch's
collectives running on spmd's groups), the way a user keeps torch's DDP and gets spmd's transports.
With --replicate, two more: each library's `replicate` on FSDP2's machinery (`_composable.replicate_with_fsdp`,
applied to each block, then the root, as TorchTitan does), spmd's on its world, torch's on gloo.
The implementations live in the same two rank processes (each rank joins an spmd world and a gloo world
and holds one model per implementation), and their steps alternate one by one (A, B, B, A, ...), so machine
noise hits both alike. Every step starts after a barrier, and a step's time is the slowest rank's. Medians
over all steps of all launches (--repeats), and the ratio of each launch.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import run_saving_processes

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
    """One implementation's group, DDP module, optimizer and data in this rank process (spmd, torch, single)."""

    def __init__(self, name: str, rank: int, world_size: int, init_file: str, bucket_cap_mb: float,
                 compiled: bool) -> None:
        self.name = name
        base, _, variant = name.partition("/")     # "spmd/whole": spmd's DDP compiled uncut, in spmd's world
        self.owns_world = not variant
        self.group: Any = None
        raw = _model()
        if base == "spmd":
            import spmd

            self.lib: Any = spmd
            if self.owns_world:
                spmd.init_process_group("auto", init_method=f"file://{init_file}.spmd", rank=rank,
                                        world_size=world_size, torch_default_group=False)
            self.backend = spmd.get_backend()
            self.model = spmd.DistributedDataParallel(raw, bucket_cap_mb=bucket_cap_mb)
        elif base == "torch":
            import torch.distributed as dist

            self.lib = dist
            if self.owns_world:
                dist.init_process_group("gloo", init_method=f"file://{init_file}.gloo", rank=rank,
                                        world_size=world_size)
            self.backend = "gloo"
            self.model = torch.nn.parallel.DistributedDataParallel(raw, bucket_cap_mb=bucket_cap_mb)
        elif name == "torch-spmd":      # torch's own DDP on a torch group of the "spmd" backend (after spmd, torch)
            import torch.distributed as dist

            from spmd.comm import torch_backend

            torch_backend.register()
            self.lib, self.backend = dist, "spmd"
            self.group = dist.new_group(backend=torch_backend.BACKEND)
            self.model = torch.nn.parallel.DistributedDataParallel(raw, bucket_cap_mb=bucket_cap_mb,
                                                                   process_group=self.group)
        elif name in ("spmd-replicate", "torch-replicate"):     # after "spmd" / "torch", whose worlds they use
            if name == "spmd-replicate":
                import spmd
                from spmd._composable.replicate_with_fsdp import replicate

                self.lib, self.backend = spmd, spmd.get_backend()
            else:
                import torch.distributed as dist
                from torch.distributed._composable.replicate_with_fsdp import replicate

                self.lib, self.backend = dist, "gloo"
            for block in raw.blocks:
                replicate(block)
            self.model = replicate(raw)
        else:
            self.lib = None
            self.backend = "none"
            self.model = raw
        self.cut = variant != "whole"
        self.compiled = compiled
        if compiled:
            self.model = torch.compile(self.model)
        self.raw = raw
        self.optimizer = torch.optim.AdamW(raw.parameters(), lr=1e-4)
        self.generator = torch.Generator().manual_seed(rank)   # the same batches for every implementation

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        if self.name.endswith("-replicate"):
            return self._without_gradient_sync()
        return self.model.no_sync() if self.lib is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def _without_gradient_sync(self) -> Any:
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def step(self, micro_batch: int, sync: bool) -> tuple[float, float]:
        """One training step, started in step with the other ranks: (step seconds, backward seconds)."""
        tokens = torch.randint(0, VOCAB, (micro_batch, CONTEXT + 1), generator=self.generator)
        self.barrier()
        start = time.perf_counter()
        with self._dynamo_config(), contextlib.nullcontext() if sync else self.no_sync():
            loss = _loss(self.model, tokens)
            backward_start = time.perf_counter()
            loss.backward()
            backward = time.perf_counter() - backward_start
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start, backward

    def _dynamo_config(self) -> contextlib.AbstractContextManager[None]:
        """Whether dynamo cuts this model's graph at DDP's buckets (it decides as it compiles, at the first steps)."""
        if not self.compiled:
            return contextlib.nullcontext()
        import torch._dynamo

        return torch._dynamo.config.patch(optimize_ddp=self.cut)

    def all_reduce_seconds(self, flat: torch.Tensor) -> float:
        if self.lib is None:
            return 0.0
        self.barrier()
        start = time.perf_counter()
        self.lib.all_reduce(flat, group=self.group)
        return time.perf_counter() - start

    def barrier(self) -> None:
        if self.lib is not None:
            self.lib.barrier()

    def close(self) -> None:
        if self.lib is not None and self.group is None and self.owns_world and not self.name.endswith("-replicate"):
            # torch-spmd's group goes with torch's world, and the replicates' with their libraries' worlds
            self.lib.barrier()   # gloo aborts a rank whose peer tears down while it still talks to it
            self.lib.destroy_process_group()


def _worker(names: list[str], rank: int, world_size: int, micro_batch: int, steps: int, bucket_cap_mb: float,
            compiled: bool, init_file: str, out_file: str) -> None:
    """Every implementation in `names` in this one process, their steps interleaved (A, B, B, A, ...)."""
    torch.set_num_threads(1)
    impls = [_Impl(name, rank, world_size, init_file, bucket_cap_mb, compiled) for name in names]
    try:
        record: dict[str, dict[str, list[float]]] = {
            impl.name: {"step": [], "backward": [], "backward_local": [], "allreduce": []} for impl in impls}
        for _ in range(3):
            for impl in impls:
                impl.step(micro_batch, sync=True)   # warm up (torch DDP also rebuilds its buckets here)
        flat = torch.zeros(sum(p.numel() for p in impls[0].raw.parameters()))
        for i in range(steps):
            for impl in impls if i % 2 == 0 else impls[::-1]:
                seconds, backward = impl.step(micro_batch, sync=True)
                record[impl.name]["step"].append(seconds)
                record[impl.name]["backward"].append(backward)
        for i in range(max(3, steps // 2)):
            for impl in impls if i % 2 == 0 else impls[::-1]:
                record[impl.name]["backward_local"].append(impl.step(micro_batch, sync=False)[1])
                record[impl.name]["allreduce"].append(impl.all_reduce_seconds(flat))
        torch.save({"record": record, "backends": {impl.name: impl.backend for impl in impls},
                    "params": flat.numel()}, f"{out_file}.{rank}")
    finally:
        for impl in impls:
            impl.close()


def _run(names: list[str], world_size: int, micro_batch: int, args: argparse.Namespace) -> dict[str, Any]:
    """One launch of `world_size` rank processes; per implementation, each timing as the slowest rank's."""
    def args_of(rank: int, out_file: str) -> tuple:
        init = os.path.join(os.path.dirname(out_file), "init")
        return (names, rank, world_size, micro_batch, args.steps, args.bucket_cap_mb, args.compile, init, out_file)
    per_rank = run_saving_processes(_worker, world_size, args_of, args.timeout, str(names))
    slowest = {name: {key: [max(values) for values in zip(*(r["record"][name][key] for r in per_rank))]
                      for key in per_rank[0]["record"][name]} for name in names}
    return {"record": slowest, "backends": per_rank[0]["backends"], "params": per_rank[0]["params"]}


def _summary(runs: list[dict[str, Any]], name: str, global_batch: int) -> dict[str, float]:
    def median(key: str) -> float:
        return statistics.median(t for run in runs for t in run["record"][name][key])

    step, backward, local, total = median("step"), median("backward"), median("backward_local"), median("allreduce")
    exposed = max(0.0, backward - local)
    return {"step_ms": step * 1e3, "tokens_s": global_batch * CONTEXT / step, "exposed_ms": exposed * 1e3,
            "comm_ms": total * 1e3, "overlapped_ms": max(0.0, total - exposed) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--repeats", type=int, default=2, help="launches, each running both implementations")
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per run")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP bucket cap, the same for both")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the models, each library's graph cut at its buckets and whole")
    parser.add_argument("--replicate", action="store_true",
                        help="also both libraries' replicate on FSDP2's machinery (replicate_with_fsdp)")
    args = parser.parse_args()
    world_size = 2
    print(f"GPT 4x256, 4 heads, context {CONTEXT}, vocab {VOCAB}; {world_size} ranks x 1 thread; "
          f"bucket_cap_mb {args.bucket_cap_mb:g}; {args.steps} timed steps x {args.repeats} repeats; medians"
          f"{'; compiled (inductor)' if args.compile else ''}")
    for setting in args.settings:
        micro = SETTINGS[setting]
        global_batch = micro * world_size
        names = ["spmd", "torch"] + (["spmd/whole", "torch/whole"] if args.compile else ["torch-spmd"]) \
            + (["spmd-replicate", "torch-replicate"] if args.replicate else [])
        runs = [_run(names, world_size, micro, args) for _ in range(args.repeats)]
        singles = [_run(["single"], 1, global_batch, args) for _ in range(args.repeats if setting == "compute" else 0)]
        spmd, ref = _summary(runs, "spmd", global_batch), _summary(runs, "torch", global_batch)
        per_run = [_summary([run], "spmd", global_batch)["tokens_s"] /
                   _summary([run], "torch", global_batch)["tokens_s"] for run in runs]
        print(f"\n{setting}-heavy: micro batch {micro}/rank, global batch {global_batch} x {CONTEXT} tokens, "
              f"spmd over {runs[0]['backends']['spmd']}, {runs[0]['params'] / 1e6:.2f}M parameters "
              f"(load average {os.getloadavg()[0]:.1f})")
        print(f"  {'':11} {'step ms':>9} {'tokens/s':>10} {'allreduce ms':>13} {'exposed ms':>11} "
              f"{'overlapped ms':>14}")
        rows = ["spmd", "torch"] + (["spmd/whole", "torch/whole"] if args.compile else [])
        for name in rows:
            row = _summary(runs, name, global_batch)
            print(f"  {name:11} {row['step_ms']:9.1f} {row['tokens_s']:10.0f} {row['comm_ms']:13.1f} "
                  f"{row['exposed_ms']:11.1f} {row['overlapped_ms']:14.1f}")
        print(f"  spmd / torch tokens/s: {spmd['tokens_s'] / ref['tokens_s']:.2f}x "
              f"(per launch: {', '.join(f'{r:.2f}x' for r in per_run)})")
        if args.compile:
            for lib in ("spmd", "torch"):
                cut = [_summary([run], lib, global_batch)["step_ms"] /
                       _summary([run], f"{lib}/whole", global_batch)["step_ms"] for run in runs]
                ratio = _summary(runs, lib, global_batch)["step_ms"] / _summary(runs, f"{lib}/whole",
                                                                                 global_batch)["step_ms"]
                print(f"  {lib}: step time cut at the buckets / whole graph: {ratio:.2f}x "
                      f"(per launch: {', '.join(f'{r:.2f}x' for r in cut)})")
        else:
            over_spmd = _summary(runs, "torch-spmd", global_batch)
            print(f"  torch's DDP over the \"spmd\" backend: {over_spmd['step_ms']:.1f} ms, "
                  f"{over_spmd['tokens_s']:.0f} tokens/s, allreduce {over_spmd['comm_ms']:.1f} ms: "
                  f"{over_spmd['tokens_s'] / ref['tokens_s']:.2f}x torch's DDP over gloo")
        if args.replicate:
            ours = _summary(runs, "spmd-replicate", global_batch)
            theirs = _summary(runs, "torch-replicate", global_batch)
            per_run = [_summary([run], "spmd-replicate", global_batch)["tokens_s"] /
                       _summary([run], "torch-replicate", global_batch)["tokens_s"] for run in runs]
            print(f"  replicate (FSDP2's machinery, per block then root): spmd {ours['step_ms']:.1f} ms "
                  f"(exposed {ours['exposed_ms']:.1f}), torch {theirs['step_ms']:.1f} ms (exposed "
                  f"{theirs['exposed_ms']:.1f}): {ours['tokens_s'] / theirs['tokens_s']:.2f}x (per launch: "
                  f"{', '.join(f'{r:.2f}x' for r in per_run)})")
        if singles:
            single = _summary(singles, "single", global_batch)
            print(f"  one process, one thread, batch {global_batch}: {single['tokens_s']:.0f} tokens/s; scaling "
                  f"efficiency spmd {spmd['tokens_s'] / (world_size * single['tokens_s']):.2f}, torch "
                  f"{ref['tokens_s'] / (world_size * single['tokens_s']):.2f}")

if __name__ == "__main__":
    main()
