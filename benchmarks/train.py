"""The reference trainer's layouts at speed: tokens/s of each layout of examples/parallelize.py against the same
layout built with torch.distributed, in the same rank processes, and the Trainer's own overhead per step.

    python benchmarks/train.py [--world 4] [--steps 8 --warmup 2 --repeats 3] [--layouts DDP PP]
    python benchmarks/train.py --steps 2 --warmup 1 --repeats 1                    # smoke check

The anchors' GPT of examples/gpt.py (4 layers, width 256, 4 heads, context 128, vocabulary 4096: 5.3 M
parameters), AdamW, one global batch of 8 sequences of 128 tokens (the same tokens, weights and seed for both
libraries), --world rank processes x 1 torch thread. Layouts (on 4 ranks; on 2 the same with 2, the 2-D ones left
out): DDP 4, FSDP2 4, TP 4 (Megatron's plan), PP 4 (--pp-schedule, --microbatches), FSDP 2 x TP 2, DDP 2 x TP 2.
  - spmd: the trainer's own layout code, parallelize.py's Layout, build_mesh and ParallelGPT (its train_step:
    forward, loss and backward, or the pipeline schedule's step), then the optimizer step; spmd on its default
    transport ("auto": shared memory on one host).
  - torch: the same layout with torch's pieces on gloo: DistributedDataParallel, fully_shard per block then the
    root, parallelize_module with ColwiseParallel / RowwiseParallel on the same plan, torch.distributed.pipelining
    on the same stage cut with the same schedule and microbatches, and TP on a 2-D mesh's "tp" dim with
    fully_shard, or DDP (device_mesh=mesh["dp"]), on its "dp" dim. A layout torch can't run here shows torch's
    error instead of a number.
  - timing: per layout both are built, warmed up (--warmup steps each), then --repeats rounds each time --steps
    steps of one library and then of the other (the order alternating per round), each block started and ended
    by a barrier and timed as the slowest rank's; tokens/s is the median over rounds, the ratio spmd / torch
    (with the range of the rounds' own ratios); beside it each library's CPU time per step and rank (all of the
    process's threads), which a loaded machine disturbs less than wall time.
  - same work: each library's loss of its first step, on every rank holding one; the table shows the largest
    difference (the same weights on the same batch: zero, or rounding where the reductions differ in order).
  - with --profile LAYOUT: cProfile of each library's steps under that layout on rank 0, after its rounds.
  - trainer overhead: examples/train_gpt.py's Trainer run for --warmup + --steps steps under each layout (its own
    model, vocabulary 256, on its corpus; no validation until the last step, no sample) with its model's and
    optimizer's methods timed: a step's wall time minus the time inside ParallelGPT.train_step, clipping,
    optimizer.step and zero_grad, the loss's all-reduce and validation is what the trainer itself spends (the
    learning-rate schedule, slicing the batch, logging); its share of the steps after the warmup, the worst rank's.
"""

from __future__ import annotations

import argparse
import contextlib
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
from torch import Tensor, nn
from torch.nn import functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import free_port, machine_line, run_saving_processes

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
VOCAB = 4096
LAYOUT_NAMES = ("DDP", "FSDP2", "TP", "PP", "FSDP x TP", "DDP x TP")
LIBRARIES = ("spmd", "torch")


def _examples() -> None:
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))


def degrees(name: str, world: int) -> dict[str, int] | None:
    """The mesh degrees of layout `name` on `world` ranks (None: the layout needs more ranks)."""
    if name in ("FSDP x TP", "DDP x TP"):
        if world < 4 or world % 2:
            return None
        return {"dp_shard" if name == "FSDP x TP" else "dp_replicate": world // 2, "tp": 2}
    return {"DDP": {"dp_replicate": world}, "FSDP2": {"dp_shard": world}, "TP": {"tp": world},
            "PP": {"pp": world}}[name]


def _gpt(args: argparse.Namespace, vocab: int = VOCAB) -> nn.Module:
    _examples()
    from gpt import GPT, GPTConfig

    with torch.random.fork_rng():
        torch.manual_seed(args.seed)
        return GPT(GPTConfig(vocab=vocab, context=args.context, layers=args.layers, width=args.width,
                             heads=args.heads))


def _global_batch(args: argparse.Namespace) -> tuple[Tensor, Tensor]:
    tokens = torch.randint(0, VOCAB, (args.global_batch, args.context + 1),
                           generator=torch.Generator().manual_seed(args.seed))
    return tokens[:, :-1], tokens[:, 1:]


def _slice(batch: tuple[Tensor, Tensor], dp: int, dp_rank: int) -> tuple[Tensor, Tensor]:
    """Data-parallel rank `dp_rank`'s contiguous share of the global batch."""
    return tuple(t.view(dp, -1, t.shape[-1])[dp_rank] for t in batch)   # type: ignore[return-value]


def _loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))


def _param_groups(params: list[nn.Parameter]) -> list[dict[str, Any]]:
    """Parameters grouped by type and mesh: the optimizer's foreach kernels take one layout per list."""
    groups: dict[Any, list[nn.Parameter]] = {}
    for param in params:
        groups.setdefault((type(param.data).__name__, getattr(param, "device_mesh", None)), []).append(param)
    return [{"params": group} for group in groups.values()]


class _Spmd:
    """The layout as the trainer builds it: parallelize.py's Layout, build_mesh and ParallelGPT."""

    def __init__(self, name: str, world: int, args: argparse.Namespace) -> None:
        _examples()
        import parallelize

        import spmd

        self.barrier: Callable[[], None] = spmd.barrier
        model = _gpt(args)
        layout = parallelize.Layout(**degrees(name, world), pp_schedule=args.pp_schedule,
                                    microbatches=args.microbatches)
        layout.check(world, model.config, args.global_batch // layout.dp)
        mesh = parallelize.build_mesh(layout)
        self.model = parallelize.ParallelGPT(model, mesh, layout)
        self.opt = torch.optim.AdamW(self.model.optimizer_groups(), lr=1e-4)
        self.batch = [_slice(_global_batch(args), layout.dp, parallelize.data_parallel_rank(mesh))]

        self.holds_loss = self.model.holds_loss

    def step(self) -> float:
        """One training step; this rank's loss (NaN off the last pipeline stage)."""
        loss = self.model.train_step(self.batch)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss if self.holds_loss else float("nan")


class _Torch:
    """The same layout with torch.distributed's own DDP, fully_shard, parallelize_module and pipelining."""

    def __init__(self, name: str, world: int, args: argparse.Namespace) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.barrier = dist.barrier
        rank = dist.get_rank()
        model = _gpt(args)
        batch = _global_batch(args)
        self.schedule: Any = None
        if name == "DDP":
            self.modules: list[nn.Module] = [nn.parallel.DistributedDataParallel(model)]
            self.batch = _slice(batch, world, rank)
        elif name == "FSDP2":
            mesh = init_device_mesh("cpu", (world,))
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            self.modules, self.batch = [model], _slice(batch, world, rank)
        elif name == "TP":
            _tensor_parallel(model, init_device_mesh("cpu", (world,)))
            self.modules, self.batch = [model], batch
        elif name == "FSDP x TP":
            mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
            _tensor_parallel(model, mesh["tp"])
            for block in model.blocks:
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
            self.modules, self.batch = [model], _slice(batch, world // 2, mesh["dp"].get_local_rank())
        elif name == "DDP x TP":
            mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
            _tensor_parallel(model, mesh["tp"])
            self.modules = [nn.parallel.DistributedDataParallel(model, device_mesh=mesh["dp"])]
            self.batch = _slice(batch, world // 2, mesh["dp"].get_local_rank())
        else:   # PP: the trainer's stage cut (GPTStage is model code), torch's stages and schedule
            _examples()
            import parallelize
            from torch.distributed.pipelining import PipelineStage
            from torch.distributed.pipelining.schedules import get_schedule_class

            layout = parallelize.Layout(pp=world, pp_schedule=args.pp_schedule, microbatches=args.microbatches)
            parts = parallelize.split_into_stages(model, layout, rank)
            (index, part), = parts.items()
            stage = PipelineStage(part, index, world, torch.device("cpu"))
            self.schedule = get_schedule_class(args.pp_schedule)(stage, layout.n_microbatches, loss_fn=_loss)
            self.first, self.last = index == 0, index == world - 1
            self.modules, self.batch = [part], batch
        self.opt = torch.optim.AdamW(_param_groups([p for m in self.modules for p in m.parameters()]), lr=1e-4)

    def step(self) -> float:
        """One training step; this rank's loss (NaN off the last pipeline stage), read as ParallelGPT reads it."""
        tokens, targets = self.batch
        value = float("nan")
        if self.schedule is not None:
            losses: list[Tensor] = []
            self.schedule.step(*((tokens,) if self.first else ()),
                               **({"target": targets, "losses": losses} if self.last else {}))
            if self.last:
                value = torch.stack(losses).mean().item()
        else:
            loss = _loss(self.modules[0](tokens), targets)
            loss.backward()
            value = loss.item()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return value


def _tensor_parallel(model: nn.Module, mesh: Any) -> None:
    """parallelize.py's plan without sequence or loss parallelism: q, k, v, up colwise, proj, down rowwise, the
    head colwise with replicated logits."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}
    for block in model.blocks:
        parallelize_module(block, mesh, plan)
    parallelize_module(model.head, mesh, ColwiseParallel(output_layouts=Replicate()))


def _timed_block(impl: Any, steps: int) -> tuple[float, float]:
    """`steps` steps between two barriers: (wall seconds, CPU seconds of this process, all its threads)."""
    impl.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        impl.step()
    impl.barrier()
    return time.perf_counter() - start, time.process_time() - cpu


def _throughput(name: str, world: int, args: argparse.Namespace) -> dict[str, list[float] | str]:
    """Block seconds per round of each library on layout `name` (torch's error text where it can't run it), and
    each library's loss of its first step (the same weights on the same batch: equal up to rounding)."""
    impls: dict[str, Any] = {"spmd": _Spmd(name, world, args)}
    out: dict[str, Any] = {"spmd": [], "first_loss": {"spmd": impls["spmd"].step()}}
    try:
        impls["torch"] = _Torch(name, world, args)
        out["torch"] = []
        out["first_loss"]["torch"] = impls["torch"].step()
    except Exception as error:   # a layout torch refuses: reported in the table
        impls.pop("torch", None)
        out["torch"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:120]
        impls["spmd"].barrier()
    for _ in range(args.warmup - 1):
        for impl in impls.values():
            impl.step()
    order = list(impls)
    for round_ in range(args.repeats):
        for library in order if round_ % 2 == 0 else order[::-1]:
            wall, cpu = _timed_block(impls[library], args.steps)
            out[library].append(wall)
            out.setdefault("cpu", {}).setdefault(library, []).append(cpu / args.steps)
    if args.profile == name:
        out["profile"] = {library: _profile(impl, args.steps, args.profile_top) for library, impl in impls.items()}
    return out


def _package(path: str, function: str) -> str:
    """'spmd/fsdp', 'torch/distributed', 'examples', a C function's name, or 'other Python'."""
    for marker, label in (("/src/spmd/", "spmd/"), ("site-packages/torch/", "torch/")):
        if marker in path:
            return label + path.split(marker)[-1].split("/")[0].removesuffix(".py")
    if "/examples/" in path:
        return "examples"
    return function if path == "~" else "other Python"


def _profile(impl: Any, steps: int, top: int) -> str:
    """cProfile of `steps` steps on this rank: the top functions by own time, and the own time of spmd's,
    torch's and the examples' Python by package (every rank runs the steps; rank 0's profile is printed)."""
    profiler = cProfile.Profile()
    impl.barrier()
    profiler.enable()
    for _ in range(steps):
        impl.step()
    profiler.disable()
    impl.barrier()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    by_package: dict[str, float] = {}
    for (path, _, name), (_, _, own, _, _) in stats.stats.items():   # type: ignore[attr-defined]
        package = _package(path, name)
        by_package[package] = by_package.get(package, 0.0) + own
    out.write("own time per step by package (ms; cProfile inflates Python code):\n")
    for package, own in sorted(by_package.items(), key=lambda kv: -kv[1])[:top]:
        out.write(f"{own / steps * 1e3:9.2f}  {package}\n")
    stats.sort_stats("tottime").print_stats(top)
    return out.getvalue()


class _Clock:
    """Time spent inside the wrapped calls (outermost only), and marks at each training step's start."""

    def __init__(self) -> None:
        self.inside, self.depth = 0.0, 0
        self.marks: list[tuple[float, float]] = []

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
                if self.depth == 0:
                    self.inside += time.perf_counter() - start
        return timed

    def mark(self) -> None:
        self.marks.append((time.perf_counter(), self.inside))

    def overhead(self, skip: int) -> tuple[float, float]:
        """(seconds per step outside the wrapped calls, their share of the step) over the steps after `skip`."""
        marks = self.marks[skip:]
        wall = marks[-1][0] - marks[0][0]
        inside = marks[-1][1] - marks[0][1]
        steps = len(marks) - 1
        return (wall - inside) / steps, (wall - inside) / wall


def _trainer_overhead(name: str, world: int, args: argparse.Namespace) -> tuple[float, float]:
    """The Trainer of train_gpt.py under layout `name`, its compute and communication calls timed."""
    _examples()
    import train_gpt

    flags = [f"--{dim.replace('_', '-')}={n}" for dim, n in degrees(name, world).items()]
    trainer_args = train_gpt.parse_args([
        *flags, f"--steps={args.warmup + args.steps}", f"--global-batch={args.global_batch}",
        f"--layers={args.layers}", f"--width={args.width}", f"--heads={args.heads}", f"--context={args.context}",
        f"--pp-schedule={args.pp_schedule}", f"--microbatches={args.microbatches}", f"--seed={args.seed}",
        "--eval-batches=1", "--sample-tokens=0", "--corpus-mb=1", "--threads=1"])
    with contextlib.redirect_stdout(io.StringIO()):
        trainer = train_gpt.Trainer(trainer_args)
        clock = _Clock()
        model, opt = trainer.model, trainer.optimizer
        for owner, method in ((model, "train_step"), (model, "clip_grad_norm_"), (model, "mean_over_data_parallel"),
                              (opt, "step"), (opt, "zero_grad"), (trainer, "validation_loss")):
            setattr(owner, method, clock.wrap(getattr(owner, method)))
        micro_batches = trainer.micro_batches

        def marking(split: str, *rest: Any) -> Any:
            if split == "train" and clock.depth == 0:
                clock.mark()
            return micro_batches(split, *rest)

        trainer.micro_batches = marking
        trainer.train()
        clock.mark()
    return clock.overhead(args.warmup)


def _worker(rank: int, world: int, args: argparse.Namespace, ports: tuple[int, int], out_file: str) -> None:
    import datetime

    import torch.distributed as dist

    import spmd

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=UserWarning)      # torch's pipelining's and DTensor's notices
    warnings.filterwarnings("ignore", category=FutureWarning)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0]))
    spmd.init_process_group("auto", timeout=args.timeout, torch_default_group=False)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[1]}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    try:
        result: dict[str, Any] = {"throughput": {}, "overhead": {}, "params": sum(
            p.numel() for p in _gpt(args).parameters())}
        for name in args.layouts:
            if degrees(name, world) is not None:
                result["throughput"][name] = _throughput(name, world, args)
        for name in args.layouts:
            if degrees(name, world) is not None and not args.no_overhead:
                result["overhead"][name] = _trainer_overhead(name, world, args)
        torch.save(result, f"{out_file}.{rank}")
    finally:
        spmd.barrier()
        dist.barrier()          # gloo aborts a rank whose peer tears down while it still talks to it
        dist.destroy_process_group()
        spmd.destroy_process_group()


def _blocks(per_rank: list[dict[str, Any]], name: str, library: str) -> list[float] | str:
    """The slowest rank's seconds of each round's block (or torch's error)."""
    first = per_rank[0]["throughput"][name][library]
    if isinstance(first, str):
        return first
    return [max(r["throughput"][name][library][i] for r in per_rank) for i in range(len(first))]


def _cpu_per_step(per_rank: list[dict[str, Any]], name: str) -> str:
    """Median CPU ms per step and rank of each library ("spmd / torch")."""
    cpu = [r["throughput"][name].get("cpu", {}) for r in per_rank]
    return " / ".join(f"{statistics.median(s for c in cpu for s in c[lib]) * 1e3:.0f}" if lib in cpu[0] else "-"
                      for lib in LIBRARIES)


def _ratio(spmd_blocks: list[float], torch_blocks: list[float] | str) -> str:
    """spmd / torch tokens/s of the medians, with the range of the rounds' own ratios."""
    if isinstance(torch_blocks, str):
        return "-"
    rounds = [t / s for s, t in zip(spmd_blocks, torch_blocks, strict=True)]
    spread = f" ({min(rounds):.2f}-{max(rounds):.2f})" if len(rounds) > 1 else ""
    return f"{statistics.median(torch_blocks) / statistics.median(spmd_blocks):.2f}{spread}"


def _loss_difference(per_rank: list[dict[str, Any]], name: str) -> str:
    """The largest difference over the ranks holding a loss between the two libraries' first-step losses."""
    pairs = [r["throughput"][name]["first_loss"] for r in per_rank]
    if "torch" not in pairs[0]:
        return "-"
    held = [abs(p["spmd"] - p["torch"]) for p in pairs if p["spmd"] == p["spmd"]]   # NaN: no loss on this rank
    return f"{max(held):.1e} (loss {pairs[-1]['spmd']:.4f})"


def _report(args: argparse.Namespace, per_rank: list[dict[str, Any]], load_before: str) -> None:
    tokens = args.steps * args.global_batch * args.context
    print(f"GPT {args.layers}x{args.width}, {args.heads} heads, context {args.context}, vocab {VOCAB}: "
          f"{per_rank[0]['params'] / 1e6:.1f} M parameters; AdamW; global batch {args.global_batch} x "
          f"{args.context}; {args.world} ranks x 1 thread; spmd on shm, torch on gloo; PP {args.pp_schedule}, "
          f"{args.microbatches or 2 * args.world} microbatches; medians of {args.repeats} rounds of {args.steps} "
          f"steps; {machine_line()}")
    print("\n| layout | spmd tokens/s | torch tokens/s | ratio (rounds) | CPU ms/step/rank spmd / torch | "
          "first loss, spmd - torch | trainer overhead |\n|---|---:|---:|---:|---:|---:|---:|")
    for name in args.layouts:
        shape = degrees(name, args.world)
        if shape is None:
            print(f"| {name} | needs 4 ranks | | | | | |")
            continue
        label = f"{name} " + "x".join(str(n) for n in shape.values())
        spmd_blocks, torch_blocks = (_blocks(per_rank, name, lib) for lib in LIBRARIES)
        spmd_rate = statistics.median(tokens / block for block in spmd_blocks)
        torch_cell = (f"not run: {torch_blocks}" if isinstance(torch_blocks, str) else
                      f"{statistics.median(tokens / block for block in torch_blocks):,.0f}")
        ratio = _ratio(spmd_blocks, torch_blocks)  # type: ignore[arg-type]
        overhead = ""
        if name in per_rank[0]["overhead"]:
            seconds, share = max((r["overhead"][name] for r in per_rank), key=lambda pair: pair[1])
            overhead = f"{share:.2%} ({seconds * 1e3:.2f} ms/step)"
        print(f"| {label} | {spmd_rate:,.0f} | {torch_cell} | {ratio} | {_cpu_per_step(per_rank, name)} | "
              f"{_loss_difference(per_rank, name)} | "
              f"{overhead} |")
    with open("/proc/loadavg") as f:
        print(f"\n/proc/loadavg before: {load_before}; after: {f.read().strip()}")
    for name in args.layouts:
        for library, text in per_rank[0]["throughput"].get(name, {}).get("profile", {}).items():
            print(f"\ncProfile of {library}'s {name} steps, rank 0:\n{text}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=4, choices=(2, 4), help="rank processes (1 thread each)")
    parser.add_argument("--steps", type=int, default=8, help="steps per timed block")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per library and layout first (>= 1)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of one block per library")
    parser.add_argument("--layouts", nargs="+", choices=LAYOUT_NAMES, default=list(LAYOUT_NAMES))
    parser.add_argument("--pp-schedule", choices=("1F1B", "GPipe"), default="1F1B")
    parser.add_argument("--microbatches", type=int, default=0, help="per pipeline step (0: 2 x --world)")
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per step over all ranks")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", choices=LAYOUT_NAMES, default=None,
                        help="after its rounds, cProfile --steps steps of each library under this layout (rank 0)")
    parser.add_argument("--profile-top", type=int, default=25, help="rows per profile table")
    parser.add_argument("--no-overhead", action="store_true", help="skip the Trainer overhead runs")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds allowed for the whole launch")
    args = parser.parse_args(argv)
    if args.warmup < 1:
        parser.error("--warmup must be at least 1 (the first step's losses are compared)")
    with open("/proc/loadavg") as f:
        load_before = f.read().strip()
    ports = (free_port(), free_port())
    per_rank = run_saving_processes(_worker, args.world, lambda rank, out: (rank, args.world, args, ports, out),
                                    args.timeout, "train benchmark")
    _report(args, per_rank, load_before)


if __name__ == "__main__":
    main()
