"""Tensor-parallel throughput: spmd.tensor.parallel vs torch's own tensor parallel on gloo, same model, same run.

    python benchmarks/tp.py [--steps 10] [--repeats 2] [--layers 4 --width 256 --heads 4] [--profile]
    python benchmarks/tp.py --overhead [--steps 30]
    python benchmarks/tp.py --layers 2 --width 128 --steps 2 --repeats 1   # smoke check

The GPT of examples/gpt.py (default: 4 layers, width 256, 4 heads, context 128, vocabulary 4096: 5.3 M
parameters), AdamW, 2 ranks x 1 torch thread as spawned processes. The plan, the same on both sides (spmd's
classes, torch's classes): every block's attn.q, attn.k, attn.v ColwiseParallel, attn.proj RowwiseParallel, up
ColwiseParallel, down RowwiseParallel; the embeddings, norms and head stay plain replicated parameters. Both
ranks train the same global batch (8 x 128 tokens): tensor parallelism splits the work of one batch, not the
batch. spmd on its default transport ("auto": shared memory on one host), torch on gloo.
  - throughput: both implementations in the same two rank processes, steps alternating (A, B, B, A, ...), each
    step started after a barrier and timed as the slowest rank's; medians over all steps of all launches, and
    the ratio per launch. One process with one thread on the same batch is the reference. Beside the wall time,
    the CPU time of each rank process per step (all its threads: a descheduled rank doesn't count, spinning
    does), less sensitive than wall time to a machine shared with other work.
  - collectives per step: spmd's counted on its tensor-parallel group (ProcessGroup.run), torch's with its
    CommDebugMode, over one step.
  - DTensor overhead: a third model in the same rank processes, "local", is the plain GPT with each block's
    Linears cut to one rank's shard (q, k, v, up: half the output features; proj, down: half the input
    features): the local compute of a tensor-parallel step, with no DTensor and no communication, timed with
    the others. "comm" is the step's all-reduces (one per collective counted, of the size TP moves) back to
    back on each library's group. overhead = step - local - comm: what neither compute nor bytes explain
    (Python dispatch, hooks, autograd functions, and the ranks' waits for each other).
  - with --profile: cProfile of spmd's steps on rank 0 (after the timed steps): own time per module, then the
    top functions.
  - with --overhead, instead: DTensor's own cost, free of communication and of the other rank: one process, the
    plan on a 1-rank mesh, shapes so small that compute is next to nothing (width 32, vocabulary 64, context 16,
    batch 2), spmd, torch and the plain model interleaved; thread CPU time of forward, backward and optimizer
    step, and each DTensor step minus the plain one.
`--impls` picks the implementations.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pathlib
import pstats
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import free_port, machine_line, run_saving_processes

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
VOCAB, CONTEXT, BATCH = 4096, 128, 8
TINY = {"vocab": 64, "context": 16, "batch": 2, "width": 32}     # --overhead: compute next to nothing
LABELS = {"spmd": "spmd TP (shm)", "torch": "torch TP (gloo)", "local": "local compute only",
          "single": "one process, 1 thread"}


def _gpt(args: argparse.Namespace) -> nn.Module:
    sys.path.insert(0, str(EXAMPLES))
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=args.vocab, context=args.context, layers=args.layers, width=args.width,
                         heads=args.heads))


def _plan(colwise: type, rowwise: type) -> dict[str, Any]:
    """One block's plan, with spmd's or torch's style classes."""
    return {"attn.q": colwise(), "attn.k": colwise(), "attn.v": colwise(), "attn.proj": rowwise(),
            "up": colwise(), "down": rowwise()}


def _cut_to_one_shard(model: nn.Module, world_size: int) -> None:
    """Each block's Linears replaced by plain ones of one tensor-parallel rank's shard shape."""
    for block in model.blocks:
        for parent, name, cut_out in ((block.attn, "q", True), (block.attn, "k", True), (block.attn, "v", True),
                                      (block.attn, "proj", False), (block, "up", True), (block, "down", False)):
            full = getattr(parent, name)
            out_features = full.out_features // world_size if cut_out else full.out_features
            in_features = full.in_features if cut_out else full.in_features // world_size
            setattr(parent, name, nn.Linear(in_features, out_features))


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


class _Impl:
    """One implementation's model, optimizer and data in this rank process: spmd, torch, local or single."""

    def __init__(self, name: str, rank: int, world_size: int, args: argparse.Namespace, gloo_port: int) -> None:
        self.name, self.rank, self.world_size = name, rank, world_size
        self.model = _gpt(args)
        self.group: Any = None
        if name == "spmd":
            import spmd
            from spmd.device_mesh import init_device_mesh
            from spmd.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            if not spmd.is_initialized():
                spmd.init_process_group("auto", timeout=300, torch_default_group=False)
            self.comm: Any = spmd
            mesh = init_device_mesh("cpu", (world_size,))
            self.group = mesh.get_group(0)
        elif name == "torch":
            import torch.distributed as dist
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            if not dist.is_initialized():
                dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=rank,
                                        world_size=world_size)
            self.comm = dist
            mesh = init_device_mesh("cpu", (world_size,))
            self.group = mesh.get_group(0)
        elif name == "local":
            _cut_to_one_shard(self.model, world_size)
        if name in ("spmd", "torch"):
            for block in self.model.blocks:
                parallelize_module(block, mesh, _plan(ColwiseParallel, RowwiseParallel))
        self.barrier: Callable[[], None] = self.comm.barrier if self.group is not None else lambda: None
        self.opt = torch.optim.AdamW(_param_groups(self.model), lr=1e-4)
        generator = torch.Generator().manual_seed(0)      # the same global batch on every rank
        self.tokens = torch.randint(0, args.vocab, (args.batch, args.context + 1), generator=generator)
        self.phases: list[tuple[float, float, float]] = []     # per step: forward, backward, optimizer CPU seconds

    def step(self) -> tuple[float, float]:
        """One training step started in step with the other rank: (wall seconds, CPU seconds of this process)."""
        self.barrier()
        start, cpu, phase = time.perf_counter(), time.process_time(), time.thread_time()
        loss = _loss(self.model, self.tokens)
        forward = time.thread_time()
        loss.backward()
        backward = time.thread_time()
        self.opt.step()
        self.opt.zero_grad()
        end = time.thread_time()
        self.phases.append((forward - phase, backward - forward, end - backward))
        return time.perf_counter() - start, time.process_time() - cpu

    def collectives(self) -> dict[str, int]:
        """The collectives one step issues, by kind."""
        if self.name == "spmd":
            counts: dict[str, int] = {}
            run = self.group.run

            def counting_run(fingerprint: Any, *rest: Any, **options: Any) -> Any:
                counts[fingerprint.op] = counts.get(fingerprint.op, 0) + 1
                return run(fingerprint, *rest, **options)

            self.group.run = counting_run       # an instance attribute shadows the method for this step
            try:
                self.step()
            finally:
                del self.group.run
            counts.pop("barrier", None)
            return counts
        from torch.distributed.tensor.debug import CommDebugMode

        with CommDebugMode() as mode:
            self.step()
        return {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}

    def communication_seconds(self, all_reduces: int, reps: int = 5) -> float:
        """`all_reduces` all-reduces of one activation (batch x context x width) back to back on this group:
        what the step's collectives move (TP's all-reduces are all of that size)."""
        buffer = torch.zeros(self.tokens.shape[0], self.tokens.shape[1] - 1, self.model.config.width)
        best = float("inf")
        for _ in range(reps):
            self.barrier()
            start = time.perf_counter()
            for _ in range(all_reduces):
                self.comm.all_reduce(buffer, group=self.group)
            best = min(best, time.perf_counter() - start)
        return best

    def close(self) -> None:
        if self.name in ("spmd", "torch"):
            self.barrier()          # gloo aborts a rank whose peer tears down while it still talks to it
            self.comm.destroy_process_group()


def _param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """The DTensor parameters and the plain ones in separate groups: a foreach op over a list mixing both is an
    error in torch's DTensor (the optimizer runs one foreach call per group, device and dtype)."""
    distributed, plain = [], []
    for param in model.parameters():
        (plain if type(param.data) is torch.Tensor else distributed).append(param)
    return [group for group in ({"params": distributed}, {"params": plain}) if group["params"]]


def _env(rank: int, world_size: int, store_port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store_port))


def _profile(impl: _Impl, steps: int, top: int) -> str:
    """cProfile of `steps` steps: own time per module (spmd's by path, torch's Python, C functions by name) in ms
    per step, then the top functions by own and by cumulative time."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        impl.step()
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    by_module: dict[str, float] = {}
    for (path, _, name), (_, _, own, _, _) in stats.stats.items():   # type: ignore[attr-defined]
        if "/src/spmd/" in path:
            module = "spmd/" + path.split("/src/spmd/")[-1]
        elif "site-packages/" in path:
            module = path.split("site-packages/")[-1]
        else:
            module = name if path == "~" else pathlib.Path(path).name
        by_module[module] = by_module.get(module, 0.0) + own
    spmd_total = sum(own for module, own in by_module.items() if module.startswith("spmd/"))
    out.write(f"own time per step by module (ms; cProfile inflates Python code): spmd total "
              f"{spmd_total / steps * 1e3:.1f}\n")
    for module, own in sorted(by_module.items(), key=lambda kv: -kv[1])[:top]:
        out.write(f"{own / steps * 1e3:9.2f}  {module}\n")
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumtime").print_stats(top)
    return out.getvalue()


def _worker(names: list[str], rank: int, world_size: int, args: argparse.Namespace, ports: tuple[int, int],
            out_file: str) -> None:
    """Every implementation in `names` in this process; steps interleaved (A, B, C, C, B, A, ...)."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message="Full backward hook")      # CommDebugMode's module hooks
    _env(rank, world_size, ports[0])
    impls = [_Impl(name, rank, world_size, args, ports[1]) for name in names]
    try:
        steps: dict[str, list[float]] = {impl.name: [] for impl in impls}
        cpu: dict[str, list[float]] = {impl.name: [] for impl in impls}
        for impl in impls:
            impl.step()                        # warm up: the decision caches, the optimizer state
            impl.step()
            impl.phases.clear()
        for i in range(args.steps):
            for impl in impls if i % 2 == 0 else impls[::-1]:
                wall, seconds = impl.step()
                steps[impl.name].append(wall)
                cpu[impl.name].append(seconds)
        counts = {impl.name: impl.collectives() for impl in impls if impl.group is not None}
        comm = {impl.name: impl.communication_seconds(sum(counts[impl.name].values())) for impl in impls
                if impl.group is not None}
        profile = ""
        if args.profile and rank == 0:
            profile = "\n".join(_profile(impl, args.steps, args.profile_top) for impl in impls if impl.name == "spmd")
        elif args.profile:
            for impl in impls:
                if impl.name == "spmd":
                    for _ in range(args.steps):
                        impl.step()
        params = sum(p.numel() for p in _gpt(args).parameters())
        phases = {impl.name: impl.phases[:args.steps] for impl in impls}
        torch.save({"steps": steps, "cpu": cpu, "phases": phases, "counts": counts, "comm": comm, "params": params,
                    "profile": profile}, f"{out_file}.{rank}")
    finally:
        for impl in impls:
            impl.close()


def _launch(names: list[str], world_size: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    ports = (free_port(), free_port())
    return run_saving_processes(_worker, world_size, lambda rank, out_file: (names, rank, world_size, args, ports,
                                                                            out_file), args.timeout, str(names))


def _slowest(per_rank: list[dict[str, Any]], name: str) -> list[float]:
    return [max(values) for values in zip(*(r["steps"][name] for r in per_rank), strict=True)]


def _report(args: argparse.Namespace, distributed: list[str], launches: list[list[dict[str, Any]]],
            single: dict[str, Any] | None) -> None:
    params = (launches[0][0] if launches else single)["params"]
    tokens = args.batch * args.context
    print(f"GPT {args.layers}x{args.width}, {args.heads} heads, context {args.context}, vocab {args.vocab}: "
          f"{params / 1e6:.1f} M parameters; AdamW; the same batch {args.batch} x {args.context} on both ranks; "
          f"2 ranks x 1 thread; {args.steps} timed steps x {args.repeats} launches; medians; {machine_line()}")
    step_s = {name: statistics.median(t for run in launches for t in _slowest(run, name)) for name in distributed}
    cpu_s = {name: statistics.median(t for run in launches for r in run for t in r["cpu"][name])
             for name in distributed}
    if single is not None:
        step_s["single"] = statistics.median(single["steps"]["single"])
        cpu_s["single"] = statistics.median(single["cpu"]["single"])
    print(f"\n{'':24}{'step ms':>10}{'tokens/s':>10}{'x 1 proc':>10}{'CPU ms/rank':>13}")
    for name, step in step_s.items():
        scaling = f"{step_s['single'] / step:>10.2f}" if single is not None else f"{'':>10}"
        print(f"{LABELS[name]:24}{step * 1e3:>10.1f}{tokens / step:>10.0f}{scaling}{cpu_s[name] * 1e3:>13.1f}")
    if "spmd" in distributed and "torch" in distributed:
        ratios = [statistics.median(_slowest(run, "torch")) / statistics.median(_slowest(run, "spmd"))
                  for run in launches]
        print(f"spmd / torch tokens/s: {step_s['torch'] / step_s['spmd']:.2f}x (launches: "
              f"{', '.join(f'{r:.2f}' for r in ratios)}); CPU per step spmd / torch "
              f"{cpu_s['spmd'] / cpu_s['torch']:.2f}")
    for name in ("spmd", "torch"):
        if name not in distributed:
            continue
        counts = launches[0][0]["counts"][name]
        comm = statistics.median(r["comm"][name] for run in launches for r in run)
        kinds = ", ".join(f"{n} {kind}" for kind, n in counts.items())
        line = f"{name}: {sum(counts.values())} collectives per step ({kinds}), {comm * 1e3:.1f} ms back to back"
        if "local" in step_s:
            beyond = step_s[name] - step_s["local"]
            line += (f"; beyond the local compute: {beyond * 1e3:.1f} ms = comm {comm * 1e3:.1f} + overhead "
                     f"{(beyond - comm) * 1e3:.1f} ({(beyond - comm) / step_s[name]:.0%} of the step); CPU "
                     f"{(cpu_s[name] - cpu_s['local']) * 1e3:.1f} ms")
        print(line)


def _overhead(args: argparse.Namespace) -> None:
    """--overhead: one rank process, a 1-rank mesh (no communication), tiny shapes: each implementation's CPU time
    per phase beside the plain model's; the difference is DTensor's own cost (dispatch, hooks, conversions)."""
    for name, value in TINY.items():
        setattr(args, name, value)
    result = _launch(["spmd", "torch", "single"], 1, args)[0]
    print(f"DTensor overhead of a TP step: GPT {args.layers}x{args.width}, {args.heads} heads, context {args.context}, "
          f"vocab {args.vocab}, batch {args.batch} (compute next to nothing), the plan on a 1-rank mesh, one process, "
          f"1 thread; thread CPU ms per step, medians of {args.steps}; {machine_line()}")
    phases = {name: [statistics.median(step[k] for step in steps) for k in range(3)]
              for name, steps in result["phases"].items()}
    plain = phases["single"]
    print(f"\n{'':18}{'forward':>10}{'backward':>10}{'optimizer':>11}{'step':>9}{'overhead':>10}")
    for name, label in (("single", "plain model"), ("spmd", "spmd DTensor"), ("torch", "torch DTensor")):
        row = phases[name]
        print(f"{label:18}{row[0] * 1e3:>10.2f}{row[1] * 1e3:>10.2f}{row[2] * 1e3:>11.2f}{sum(row) * 1e3:>9.2f}"
              f"{(sum(row) - sum(plain)) * 1e3:>10.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per implementation per launch")
    parser.add_argument("--repeats", type=int, default=2, help="launches running the implementations")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--impls", nargs="+", choices=("spmd", "torch", "local", "single"),
                        default=["spmd", "torch", "local", "single"])
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--context", type=int, default=CONTEXT)
    parser.add_argument("--batch", type=int, default=BATCH, help="sequences per step (the same on both ranks)")
    parser.add_argument("--overhead", action="store_true",
                        help="DTensor's own cost per phase on a 1-rank mesh at tiny shapes, instead")
    parser.add_argument("--profile", action="store_true", help="cProfile spmd's steps on rank 0")
    parser.add_argument("--profile-top", type=int, default=30, help="functions shown per profile table")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per launch")
    args = parser.parse_args()
    if args.overhead:
        _overhead(args)
        return
    distributed = [name for name in ("spmd", "torch", "local") if name in args.impls]
    launches = [_launch(distributed, 2, args) for _ in range(args.repeats)] if distributed else []
    single = _launch(["single"], 1, args)[0] if "single" in args.impls else None
    _report(args, distributed, launches, single)
    if args.profile and launches:
        print("\ncProfile of spmd's steps, rank 0, last launch:\n" + launches[-1][0]["profile"])


if __name__ == "__main__":
    main()
