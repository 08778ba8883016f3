"""FSDP2 throughput and memory: spmd's fully_shard vs torch's FSDP2 on gloo, same model, same machine, same run.

    python benchmarks/fsdp.py [--steps 6] [--repeats 2] [--layers 8 --width 768 --heads 12] [--impls ...]
    python benchmarks/fsdp.py --scale [--scale-layers 20 --scale-width 2048]
    python benchmarks/fsdp.py --layers 2 --width 128 --heads 4 --steps 2 --repeats 1   # smoke check

The GPT of examples/gpt.py (default: 8 layers, width 768, 12 heads, context 128, vocabulary 4096: 63 M
parameters), AdamW, global batch 8 x 128 tokens, 2 ranks x 1 torch thread as spawned processes, fully_shard on
every block and then the root. spmd on its default transport ("auto": shared memory on one host), torch on gloo.
  - throughput: both implementations in the same two rank processes, steps alternating (A, B, B, A, ...), each
    step started after a barrier and timed as the slowest rank's; medians over all steps of all launches, and
    the ratio per launch. One process with one thread on the whole global batch is the reference.
  - tensor peak per rank: live tensor bytes through a dispatch-mode tracker (spmd.testing.memory), on a separate
    step, for spmd (with its breakdown at the peak), torch FSDP2 and the one-process run.
  - peak RSS per rank: each implementation alone in fresh processes (RSS is per process) running only its
    training steps, ru_maxrss; beside it the RSS before the model was built (interpreter, torch, process group).
  - communication (spmd): exposed = time the step spends waiting on FSDP's all-gathers and reduce-scatters, per
    step the rank that waits least (the other also waits for the slower rank's compute, not for bytes), with the
    other rank's wait beside it; total = the same step's collectives run back to back on their own;
    overlapped = total - exposed.
With --fsdp1 both sides wrap the model in their FSDP1 FullyShardedDataParallel instead (ModuleWrapPolicy of the
block class, device_id=cpu): throughput, tensor peaks and RSS as above, no communication breakdown.
`--impls` picks the implementations (e.g. `--impls torch single` while spmd.fsdp is not there).
With --scale: a GPT of about 1 B parameters built on the meta device, fully_shard over 4 ranks, to_empty, each
rank initialising only its shards, then one forward/backward/SGD step; each rank's peak RSS beside the whole
model's fp32 size and its tensor peak with the breakdown (torch is not run).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import resource
import statistics
import sys
import time
import warnings
from typing import Any

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import free_port, human_bytes, machine_line, run_saving_processes

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
VOCAB, CONTEXT, GLOBAL_BATCH = 4096, 128, 8
MiB = 1 << 20


def _gpt(layers: int, width: int, heads: int, device: str = "cpu") -> torch.nn.Module:
    sys.path.insert(0, str(EXAMPLES))
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    with torch.device(device):
        return GPT(GPTConfig(vocab=VOCAB, context=CONTEXT, layers=layers, width=width, heads=heads))


def _loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


class _TimedWaits:
    """Wraps the collectives spmd's FSDP issues so that every wait on them is timed (the exposed communication)."""

    def __init__(self) -> None:
        from spmd.fsdp import comm  # the default all-gather and reduce-scatter call these

        self.seconds = 0.0
        for name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
            setattr(comm, name, self._timed(getattr(comm, name)))

    def _timed(self, issue):
        waits = self

        class Timed:
            def __init__(self, work) -> None:
                self.work = work

            def wait(self) -> None:
                start = time.perf_counter()
                self.work.wait()
                waits.seconds += time.perf_counter() - start

        return lambda *args, **kwargs: Timed(issue(*args, **kwargs))


def _fsdp1(name: str) -> tuple[Any, Any]:
    """FullyShardedDataParallel and ModuleWrapPolicy of spmd or torch (--fsdp1)."""
    if name == "spmd":
        from spmd.fsdp import FullyShardedDataParallel
        from spmd.fsdp.wrap import ModuleWrapPolicy
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    return FullyShardedDataParallel, ModuleWrapPolicy


class _Impl:
    """One implementation's model, optimizer and data in this rank process: "spmd", "torch" or "single"."""

    def __init__(self, name: str, rank: int, world_size: int, args: argparse.Namespace, gloo_port: int) -> None:
        self.name, self.rank, self.world_size, self.fsdp1 = name, rank, world_size, args.fsdp1
        if name == "spmd":
            import spmd
            from spmd.device_mesh import init_device_mesh
            from spmd.fsdp import fully_shard

            if not spmd.is_initialized():
                spmd.init_process_group("auto", timeout=300, torch_default_group=False)
            self.barrier = spmd.barrier
            mesh = init_device_mesh("cpu", (world_size,))
        elif name == "torch":
            import torch.distributed as dist
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            if not dist.is_initialized():
                dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=rank,
                                        world_size=world_size)
            self.barrier = dist.barrier
            mesh = init_device_mesh("cpu", (world_size,))
        else:
            self.barrier = lambda: None
        self.baseline_rss = _max_rss()         # the process group is up, this model not built yet
        self.model = _gpt(args.layers, args.width, args.heads)
        if name != "single" and args.fsdp1:
            wrapper, policy = _fsdp1(name)
            self.model = wrapper(self.model, auto_wrap_policy=policy({type(self.model.blocks[0])}),
                                 device_id=torch.device("cpu"))
        elif name != "single":
            for block in self.model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        generator = torch.Generator().manual_seed(rank)
        self.tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH // world_size, CONTEXT + 1), generator=generator)

    def step(self) -> float:
        self.barrier()
        start = time.perf_counter()
        _loss(self.model, self.tokens).backward()
        self.opt.step()
        self.opt.zero_grad()
        return time.perf_counter() - start

    def tensor_peak(self) -> tuple[int, dict[str, int]]:
        from spmd.testing.memory import TensorMemoryTracker, fsdp_categories

        classify = fsdp_categories(self.model, self.opt) if self.name == "spmd" and not self.fsdp1 else None
        with TensorMemoryTracker(classify=classify) as tracker:
            tracker.track([*self.model.parameters(), self.opt.state])
            self.step()
        return tracker.peak_bytes, tracker.peak_breakdown

    def communication_seconds(self, reps: int = 3) -> float:
        """The step's collectives back to back on their own: an all-gather per group in forward, another per
        resharded group (every one but the root's) in backward, a reduce-scatter per group."""
        if self.name == "spmd":
            import spmd as comm
        else:
            import torch.distributed as comm
        n = self.world_size
        in_blocks = {id(p) for block in self.model.blocks for p in block.parameters()}
        root = [p for p in self.model.parameters() if id(p) not in in_blocks]
        sizes = [sum(-(-p.shape[0] // n) * (p.numel() // p.shape[0]) for p in params)
                 for params in [*(list(b.parameters()) for b in self.model.blocks), root]]
        plan = [("ag", s) for s in sizes] + [("ag", s) for s in sizes[:-1]] + [("rs", s) for s in sizes]
        buffers = {s: (torch.empty(s), torch.empty(n * s)) for s in set(sizes)}
        best = float("inf")
        for _ in range(reps):
            self.barrier()
            start = time.perf_counter()
            for op, size in plan:
                piece, whole = buffers[size]
                if op == "ag":
                    comm.all_gather_into_tensor(whole, piece)
                else:
                    comm.reduce_scatter_tensor(piece, whole)
            best = min(best, time.perf_counter() - start)
        return best

    def close(self) -> None:
        if self.name == "spmd":
            import spmd
            spmd.destroy_process_group()
        elif self.name == "torch":
            import torch.distributed as dist
            dist.destroy_process_group()


def _env(rank: int, world_size: int, store_port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store_port))


def _max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux reports KiB


def _throughput_worker(names: list[str], rss_only: bool, rank: int, world_size: int, args: argparse.Namespace,
                       ports: tuple[int, int], out_file: str) -> None:
    """Every implementation in `names` in this process; steps interleaved; then (unless `rss_only`, where only
    the steps run, so that ru_maxrss is theirs) tensor peaks and comm times."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)   # torch 2.13 renames the *_tensor collectives
    _env(rank, world_size, ports[0])
    waits = _TimedWaits() if "spmd" in names else None
    impls = [_Impl(name, rank, world_size, args, ports[1]) for name in names]
    try:
        steps: dict[str, list[float]] = {impl.name: [] for impl in impls}
        exposed: list[float] = []
        for impl in impls:
            impl.step()                        # warm up
        for i in range(args.steps):
            for impl in impls if i % 2 == 0 else impls[::-1]:
                before = waits.seconds if waits is not None else 0.0
                steps[impl.name].append(impl.step())
                if impl.name == "spmd" and waits is not None:
                    exposed.append(waits.seconds - before)
        rss = _max_rss()
        # torch's FSDP1 FlatParameter fails under the dispatch-mode tracker (aten.detach has no handler)
        peaks = {} if rss_only else {impl.name: impl.tensor_peak() for impl in impls
                                     if not (args.fsdp1 and impl.name == "torch")}
        comm = {} if rss_only or args.fsdp1 else {impl.name: impl.communication_seconds() for impl in impls
                                                  if impl.name != "single"}
        params = sum(p.numel() for p in impls[0].model.parameters())
        torch.save({"steps": steps, "exposed": exposed, "peaks": peaks, "comm": comm, "rss": rss,
                    "baseline_rss": impls[0].baseline_rss, "params": params}, f"{out_file}.{rank}")
    finally:
        for impl in impls:
            impl.close()


def _launch(target: Any, world_size: int, args: argparse.Namespace, extra: tuple) -> list[dict[str, Any]]:
    ports = (free_port(), free_port())
    return run_saving_processes(target, world_size, lambda rank, out_file: (*extra, rank, world_size, args, ports,
                                                                           out_file), args.timeout,
                                f"{target.__name__}{extra}")


def _slowest(per_rank: list[dict[str, Any]], name: str) -> list[float]:
    return [max(values) for values in zip(*(r["steps"][name] for r in per_rank), strict=True)]


def _throughput(args: argparse.Namespace) -> None:
    distributed = [name for name in ("spmd", "torch") if name in args.impls]
    launches = [_launch(_throughput_worker, 2, args, (distributed, False)) for _ in range(args.repeats)
                if distributed]
    single = _launch(_throughput_worker, 1, args, (["single"], False)) if "single" in args.impls else []
    alone = {name: _launch(_throughput_worker, 2, args, ([name], True)) for name in distributed}
    rss = {name: (max(r["rss"] for r in runs), max(r["baseline_rss"] for r in runs)) for name, runs in alone.items()}
    if single:
        rss["single"] = (single[0]["rss"], single[0]["baseline_rss"])
    params = (launches[0] if launches else single)[0]["params"]
    tokens = GLOBAL_BATCH * CONTEXT
    print(f"GPT {args.layers}x{args.width}, {args.heads} heads, context {CONTEXT}, vocab {VOCAB}: {params / 1e6:.1f} M "
          f"parameters; AdamW; global batch {GLOBAL_BATCH} x {CONTEXT}; 2 ranks x 1 thread; {args.steps} timed steps "
          f"x {args.repeats} launches; medians; {machine_line()}")
    step_ms = {name: statistics.median(t for run in launches for t in _slowest(run, name)) for name in distributed}
    if single:
        step_ms["single"] = statistics.median(single[0]["steps"]["single"])
    labels = {"spmd": "spmd fully_shard (shm)", "torch": "torch FSDP2 (gloo)", "single": "one process, 1 thread"}
    if args.fsdp1:
        labels.update(spmd="spmd FSDP1 wrapper (shm)", torch="torch FSDP1 (gloo)")
    print(f"\n{'':24}{'step ms':>10}{'tokens/s':>10}")
    for name, step in step_ms.items():
        print(f"{labels[name]:24}{step * 1e3:>10.0f}{tokens / step:>10.0f}")
    if len(distributed) == 2:
        ratios = [statistics.median(_slowest(run, "torch")) / statistics.median(_slowest(run, "spmd"))
                  for run in launches]
        print(f"spmd / torch tokens/s: {step_ms['torch'] / step_ms['spmd']:.2f}x (launches: "
              f"{', '.join(f'{r:.2f}' for r in ratios)})")

    def peak(name: str) -> str:
        runs = single if name == "single" else launches[0]
        if name not in runs[0]["peaks"]:
            return "n/a"
        return human_bytes(max(r["peaks"][name][0] for r in runs))

    print("\ntensor peak per rank: " + ", ".join(f"{name} {peak(name)}" for name in step_ms))
    print("peak RSS per rank (each alone; before the model): " + ", ".join(
        f"{name} {human_bytes(rss[name][0])} ({human_bytes(rss[name][1])})" for name in step_ms))
    if "spmd" in distributed and not args.fsdp1:
        _spmd_breakdown(launches)


def _spmd_breakdown(launches: list[list[dict[str, Any]]]) -> None:
    """spmd's tensors at its peak by category, and its exposed vs total communication."""
    worst = max(launches[0], key=lambda r: r["peaks"]["spmd"][0])
    print("spmd at its peak:", ", ".join(f"{k} {human_bytes(v)}" for k, v in
                                         sorted(worst["peaks"]["spmd"][1].items(), key=lambda kv: -kv[1])))
    per_step = [sorted(waits) for run in launches for waits in zip(*(r["exposed"] for r in run), strict=True)]
    exposed = statistics.median(waits[0] for waits in per_step)
    other = statistics.median(waits[-1] for waits in per_step)
    total = statistics.median(r["comm"]["spmd"] for run in launches for r in run)
    print(f"spmd communication per step: exposed {exposed * 1e3:.0f} ms (the other rank waits {other * 1e3:.0f} ms), "
          f"total {total * 1e3:.0f} ms, overlapped {max(0.0, total - exposed) * 1e3:.0f} ms")
    if "torch" in launches[0][0]["comm"]:
        torch_total = statistics.median(r["comm"]["torch"] for run in launches for r in run)
        print(f"the same collectives on torch's gloo: {torch_total * 1e3:.0f} ms")


def _scale_worker(rank: int, world_size: int, args: argparse.Namespace, ports: tuple[int, int],
                  out_file: str) -> None:
    torch.set_num_threads(1)
    _env(rank, world_size, ports[0])
    import spmd
    from spmd.device_mesh import init_device_mesh
    from spmd.fsdp import fully_shard
    from spmd.tensor.random import manual_seed
    from spmd.testing.memory import TensorMemoryTracker, fsdp_categories

    spmd.init_process_group("auto", timeout=600, torch_default_group=False)
    baseline_rss = _max_rss()
    try:
        model = _gpt(args.scale_layers, args.scale_width, args.scale_heads, device="meta")
        params = sum(p.numel() for p in model.parameters())
        mesh = init_device_mesh("cpu", (world_size,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        manual_seed(0)
        start = time.perf_counter()
        with torch.no_grad():
            for param in model.parameters():
                torch.nn.init.normal_(param, std=0.02) if param.ndim > 1 else torch.nn.init.zeros_(param)
        init_seconds = time.perf_counter() - start
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        tokens = torch.randint(0, VOCAB, (1, CONTEXT + 1), generator=torch.Generator().manual_seed(rank))
        start = time.perf_counter()
        with TensorMemoryTracker(classify=fsdp_categories(model, opt)) as tracker:   # a few % of the step
            tracker.track(model.parameters())
            loss = _loss(model, tokens)
            loss.backward()
            opt.step()
        torch.save({"params": params, "loss": loss.item(), "init_s": init_seconds,
                    "step_s": time.perf_counter() - start, "rss": _max_rss(), "baseline_rss": baseline_rss,
                    "tensor_peak": tracker.peak_bytes, "breakdown": tracker.peak_breakdown}, f"{out_file}.{rank}")
    finally:
        spmd.destroy_process_group()


def _scale(args: argparse.Namespace) -> None:
    results = _launch(_scale_worker, 4, args, ())
    params = results[0]["params"]
    print(f"GPT {args.scale_layers}x{args.scale_width} ({params / 1e6:,.0f} M parameters, {human_bytes(4 * params)} in "
          f"fp32) on meta, fully_shard over 4 ranks, to_empty, shards initialised in place, one SGD step; "
          f"{machine_line()}")
    for rank, result in enumerate(results):
        print(f"rank {rank}: peak RSS {human_bytes(result['rss'])} ({result['rss'] / (4 * params):.2f} x the whole "
              f"model; {human_bytes(result['baseline_rss'])} before it), "
              f"init {result['init_s']:.0f} s, step {result['step_s']:.0f} s, loss {result['loss']:.3f}")
        print(f"        tensor peak {human_bytes(result['tensor_peak'])}: " + ", ".join(
            f"{k} {human_bytes(v)}" for k, v in sorted(result["breakdown"].items(), key=lambda kv: -kv[1])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="timed steps per implementation per launch")
    parser.add_argument("--repeats", type=int, default=2, help="launches running both implementations")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--impls", nargs="+", choices=("spmd", "torch", "single"), default=["spmd", "torch", "single"])
    parser.add_argument("--fsdp1", action="store_true", help="FSDP1's FullyShardedDataParallel (a unit per block, "
                        "then the root) in place of fully_shard, spmd's and torch's")
    parser.add_argument("--scale", action="store_true", help="the ~1 B parameter meta-device run instead")
    parser.add_argument("--scale-layers", type=int, default=20)
    parser.add_argument("--scale-width", type=int, default=2048)
    parser.add_argument("--scale-heads", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds allowed per launch")
    args = parser.parse_args()
    _scale(args) if args.scale else _throughput(args)


if __name__ == "__main__":
    main()
