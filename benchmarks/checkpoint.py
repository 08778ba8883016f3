"""Distributed checkpoints: spmd.checkpoint vs torch's DCP (torch.distributed.checkpoint) on gloo, same state, same
disk, same run; beside them the disk's own sequential bandwidth and the time of copying the state to host memory.

    python benchmarks/checkpoint.py [--repeats 3] [--layers 8 --width 768 --heads 12 --vocab 4096] [--dir DIR]
    python benchmarks/checkpoint.py --impls torch          # while spmd.checkpoint is not there
    python benchmarks/checkpoint.py --layers 2 --width 128 --heads 4 --vocab 512 --repeats 1   # smoke check
    python benchmarks/checkpoint.py --layout ddp [--dedup-save-to-lowest-rank]    # a replicated state

The state: the GPT of examples/gpt.py in the anchors' configuration (that of benchmarks/fsdp.py: 8 layers, width
768, 12 heads, context 128, vocabulary 4096: 63 M parameters) under FSDP2 on 2 ranks x 1 torch thread as spawned
processes (fully_shard on every block and then the root; spmd's on its default transport, "auto": shared memory
on one host; torch's on gloo), after --train-steps AdamW steps, so that the optimizer's exp_avg and exp_avg_sq
exist: parameters + 2 moments, about 760 MB in fp32, half of it per rank. Each library takes its own
get_state_dict(model, optim) (spmd.checkpoint.state_dict / torch.distributed.checkpoint.state_dict): the live
sharded DTensors, no copies. Both libraries' models live in the same two rank processes, and every measurement
alternates between them (A, B in one repetition, B, A in the next), so a load spike hits both alike. Every
operation starts after a barrier and is timed as the slowest rank's; GB/s = the state's bytes (every rank's
shards, 1e9 bytes a GB) / that time; medians over --repeats repetitions, the spmd/torch ratio of the medians.
  - save: dcp.save({"model": msd, "optim": osd}, checkpoint_id=fresh directory), the library's defaults, then the
    benchmark fsyncs every file of the checkpoint and its directories, inside the timed region, so that both
    libraries end with the checkpoint on the disk whatever they do themselves (fsyncing files that the library
    already synced costs microseconds; that extra time is printed). Both fsync by default: torch's
    FileSystemWriter has sync_files=True (an fsync of each rank's data file and of .metadata, not of the
    directory); spmd's FileSystemWriter has sync_files=True too (each file, then the directory at commit).
  - load: every tensor of the state zeroed (untimed), then dcp.load(same structure, checkpoint_id=that
    directory) in place; afterwards every tensor's sum must equal the saved one (checked, untimed). Twice: cold
    (the checkpoint's files evicted from the page cache first: posix_fadvise(DONTNEED) on each file, which drops
    its clean pages without root, or with --drop-caches the whole machine's clean page cache through
    /proc/sys/vm/drop_caches, root only) and warm (the same load again: its files now all in the page cache).
  - async_save: blocked = how long dcp.async_save(...) takes to return (the time training would be held), total
    = until its future's .result() returns plus the same fsync pass as save (nothing else runs meanwhile); with
    --checkpointer process both libraries write in their checkpoint processes (AsyncCheckpointerType.PROCESS),
    spawned by the first repetition's save, which so takes seconds longer (the medians leave it out).
  - disk: each rank writes a file as large as its shard of the state with 16 MiB os.write calls from a random
    buffer, then fsyncs it, both ranks at once (as the ranks save), and rank 0 alone; each rank then reads its
    file back with 16 MiB readinto calls, cold (evicted as above) and warm.
  - host copy: each rank copies its shard of the state (every local tensor), both ranks at once, into freshly
    allocated memory (what a stager does on its first save: the pages are faulted in) and into buffers allocated
    beforehand (what a stager that keeps its buffers pays): the bar for async_save's blocked time.
With --layout ddp the model is DDP's instead (spmd.DistributedDataParallel / torch's on gloo): every rank holds
the whole state, which both libraries' default planners save once, the writes balanced across the ranks (each
writes half); --dedup-save-to-lowest-rank passes that argument to both libraries' DefaultSavePlanner (rank 0
writes everything). GB/s then counts the state once, and each rank's disk-write file is what it writes.
Every save goes to a fresh directory under one temporary directory made in --dir (default: the system's temporary
directory; the script prints its filesystem and whether it is the repository's); each repetition's checkpoints are
deleted at its end and the whole temporary directory at exit.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import free_port, machine_line, run_saving_processes

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
REPO = pathlib.Path(__file__).resolve().parents[1]
CONTEXT, GLOBAL_BATCH = 128, 8
CHUNK = 16 << 20
GB = 1e9
DROP_CACHES = "/proc/sys/vm/drop_caches"
LABELS = {"spmd": "spmd.checkpoint (shm)", "torch": "torch DCP (gloo)"}


def _gpt(args: argparse.Namespace) -> torch.nn.Module:
    sys.path.insert(0, str(EXAMPLES))
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=args.vocab, context=CONTEXT, layers=args.layers, width=args.width, heads=args.heads))


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    """The local tensors of a nested state dict (a DTensor's local shard), in a fixed order."""
    if isinstance(tree, dict):
        for key in sorted(tree, key=str):
            yield from _tensors(tree[key])
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _tensors(item)
    elif isinstance(tree, torch.Tensor):
        yield tree.to_local() if hasattr(tree, "to_local") else tree


def _fsync_tree(root: str) -> None:
    """fsync every file under `root` and every directory, `root` included."""
    for directory, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _files(root: str) -> list[str]:
    return [os.path.join(directory, name) for directory, _, files in os.walk(root) for name in files]


def _evict(paths: list[str], drop_caches: bool, rank: int) -> None:
    """Drop `paths` from the page cache (their pages are clean: everything was fsynced); with `drop_caches`,
    rank 0 drops the whole machine's clean page cache instead."""
    if drop_caches:
        if rank == 0:
            with open(DROP_CACHES, "w") as control:
                control.write("1\n")
        return
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def init_library(name: str, rank: int, world_size: int, gloo_port: int) -> types.SimpleNamespace:
    """One library's modules for the checkpoint benchmarks, its process group initialised (spmd's default
    transport, or torch's gloo): dcp, state_dict, init_device_mesh, fully_shard, DistributedDataParallel, barrier."""
    if name == "spmd":
        import spmd
        from spmd import DistributedDataParallel
        from spmd.device_mesh import init_device_mesh
        from spmd.fsdp import fully_shard
        try:
            import spmd.checkpoint as dcp
            import spmd.checkpoint.state_dict as state_dict
        except ImportError as error:
            raise RuntimeError("spmd.checkpoint is not there yet: run with --impls torch") from error

        spmd.init_process_group("auto", timeout=600, torch_default_group=False)
        barrier = spmd.barrier
    else:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        import torch.distributed.checkpoint.state_dict as state_dict
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=rank, world_size=world_size)
        barrier = dist.barrier
    return types.SimpleNamespace(dcp=dcp, state_dict=state_dict, init_device_mesh=init_device_mesh,
                                 fully_shard=fully_shard, DistributedDataParallel=DistributedDataParallel,
                                 barrier=barrier)


class _Side:
    """One library's FSDP2 model, AdamW state after a few steps, state dict and checkpoint module in this rank."""

    def __init__(self, name: str, rank: int, world_size: int, args: argparse.Namespace, gloo_port: int) -> None:
        self.name = name
        library = init_library(name, rank, world_size, gloo_port)
        self.barrier, self.dcp = library.barrier, library.dcp
        init_device_mesh, fully_shard = library.init_device_mesh, library.fully_shard
        DistributedDataParallel, get_state_dict = library.DistributedDataParallel, library.state_dict.get_state_dict
        mesh = init_device_mesh("cpu", (world_size,))
        model = _gpt(args)
        self.params = sum(p.numel() for p in model.parameters())
        if args.layout == "ddp":
            model = DistributedDataParallel(model)
        else:
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        tokens = torch.randint(0, args.vocab, (GLOBAL_BATCH // world_size, CONTEXT + 1),
                               generator=torch.Generator().manual_seed(rank))
        for _ in range(args.train_steps):
            logits = model(tokens[:, :-1])
            torch.nn.functional.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1)).backward()
            opt.step()
            opt.zero_grad()
        self.model, self.opt = model, opt
        msd, osd = get_state_dict(model, opt)
        self.state = {"model": msd, "optim": osd}
        self.local = list(_tensors(self.state))
        self.bytes = sum(t.numel() * t.element_size() for t in self.local)
        self.written = self.bytes // world_size if args.layout == "ddp" else self.bytes   # its share of the state
        self.planner = self.dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=args.dedup_save_to_lowest_rank)
        saver = importlib.import_module(f"{self.dcp.__name__}.state_dict_saver")
        self.checkpointer = saver.AsyncCheckpointerType[args.checkpointer.upper()]
        with torch.no_grad():
            self.sums = torch.stack([t.double().sum() for t in self.local])

    def save(self, directory: str) -> tuple[float, float]:
        """Seconds of save + the fsync pass, and of the fsync pass alone."""
        self.barrier()
        start = time.perf_counter()
        self.dcp.save(self.state, checkpoint_id=directory, planner=self.planner)
        saved = time.perf_counter()
        _fsync_tree(directory)
        end = time.perf_counter()
        return end - start, end - saved

    def load(self, directory: str, evict: Callable[[list[str]], None] | None) -> float:
        with torch.no_grad():
            for tensor in self.local:
                tensor.zero_()
        if evict is not None:
            self.barrier()
            evict(_files(directory))
        self.barrier()
        start = time.perf_counter()
        self.dcp.load(self.state, checkpoint_id=directory)
        seconds = time.perf_counter() - start
        with torch.no_grad():
            sums = torch.stack([t.double().sum() for t in self.local])
        if not torch.equal(sums, self.sums):
            raise AssertionError(f"{self.name}: the loaded state differs from the saved one")
        return seconds

    def async_save(self, directory: str) -> tuple[float, float]:
        """Seconds async_save blocked, and until its future completed and the checkpoint was fsynced."""
        self.barrier()
        start = time.perf_counter()
        future = self.dcp.async_save(self.state, checkpoint_id=directory, planner=self.planner,
                                     async_checkpointer_type=self.checkpointer)
        blocked = time.perf_counter() - start
        future.result()
        _fsync_tree(directory)
        return blocked, time.perf_counter() - start

    def host_copy(self) -> tuple[float, float]:
        """Seconds to copy this rank's state into fresh memory, and into buffers allocated beforehand."""
        self.barrier()
        start = time.perf_counter()
        copies = [t.clone() for t in self.local]
        fresh = time.perf_counter() - start
        del copies
        buffers = [torch.empty_like(t) for t in self.local]
        for buffer in buffers:
            buffer.zero_()                      # fault the pages in outside the timed copy
        self.barrier()
        start = time.perf_counter()
        for buffer, tensor in zip(buffers, self.local, strict=True):
            buffer.copy_(tensor)
        return fresh, time.perf_counter() - start

    def close(self) -> None:
        if self.name == "spmd":
            import spmd
            spmd.destroy_process_group()
        else:
            import torch.distributed as dist
            dist.destroy_process_group()


def _disk(rank: int, barrier: Callable[[], None], directory: str, nbytes: int, source: memoryview,
          evict: Callable[[list[str]], None]) -> dict[str, float]:
    """This rank's seconds to write `nbytes` (16 MiB writes + fsync; both ranks at once, then rank 0 alone) and
    to read them back cold and warm."""
    path = os.path.join(directory, f"disk.{rank}")
    times: dict[str, float] = {}

    def write() -> float:
        start = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            done = 0
            while done < nbytes:
                done += os.write(fd, source[done:min(done + CHUNK, nbytes)])
            os.fsync(fd)
        finally:
            os.close(fd)
        return time.perf_counter() - start

    def read() -> float:
        buffer = memoryview(bytearray(CHUNK))
        start = time.perf_counter()
        with open(path, "rb", buffering=0) as file:
            while file.readinto(buffer):
                pass
        return time.perf_counter() - start

    barrier()
    times["write"] = write()
    barrier()
    evict([path])
    barrier()
    times["read_cold"] = read()
    barrier()
    times["read_warm"] = read()
    os.unlink(path)
    barrier()
    if rank == 0:
        times["write_alone"] = write()
        os.unlink(path)
    barrier()
    return times


def _env(rank: int, world_size: int, store_port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store_port))


def _worker(names: list[str], rank: int, world_size: int, args: argparse.Namespace, ports: tuple[int, int],
            base: str, out_file: str) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    _env(rank, world_size, ports[0])
    sides = [_Side(name, rank, world_size, args, ports[1]) for name in names]
    try:
        barrier = sides[0].barrier

        def evict(paths: list[str]) -> None:
            _evict(paths, args.drop_caches, rank)

        source = memoryview(os.urandom(sides[0].written))
        results: dict[str, Any] = {"disk": [], "bytes": sides[0].written, "params": sides[0].params,
                                   **{side.name: {"bytes": side.written, "save": [], "fsync": [], "load_cold": [],
                                                  "load_warm": [], "blocked": [], "async": [], "copy_fresh": [],
                                                  "copy_kept": [], "files": None} for side in sides}}
        for rep in range(args.repeats):
            rep_dir = os.path.join(base, f"rep{rep}")
            os.makedirs(rep_dir, exist_ok=True)
            results["disk"].append(_disk(rank, barrier, rep_dir, sides[0].written, source, evict))
            order = sides if rep % 2 == 0 else sides[::-1]
            for side in order:
                fresh, kept = side.host_copy()
                results[side.name]["copy_fresh"].append(fresh)
                results[side.name]["copy_kept"].append(kept)
            for side in order:
                seconds, fsync = side.save(os.path.join(rep_dir, f"{side.name}.save"))
                results[side.name]["save"].append(seconds)
                results[side.name]["fsync"].append(fsync)
            for side in order:
                results[side.name]["load_cold"].append(side.load(os.path.join(rep_dir, f"{side.name}.save"), evict))
            for side in order:
                results[side.name]["load_warm"].append(side.load(os.path.join(rep_dir, f"{side.name}.save"), None))
            for side in order:
                blocked, total = side.async_save(os.path.join(rep_dir, f"{side.name}.async"))
                results[side.name]["blocked"].append(blocked)
                results[side.name]["async"].append(total)
            barrier()
            if rank == 0:
                for side in sides:
                    files = _files(os.path.join(rep_dir, f"{side.name}.save"))
                    results[side.name]["files"] = (len(files), sum(os.path.getsize(f) for f in files))
                shutil.rmtree(rep_dir)
            barrier()
        torch.save(results, f"{out_file}.{rank}")
    finally:
        for side in sides:
            side.close()


def _filesystem(path: str) -> str:
    """The device and type of the filesystem holding `path` (the longest mount point above it)."""
    best = ("?", "?", "")
    real = os.path.realpath(path)
    with open("/proc/mounts") as mounts:
        for line in mounts:
            device, mount, kind = line.split()[:3]
            if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best[2]):
                best = (device, kind, mount)
    return f"{best[0]} ({best[1]} on {best[2]})"


def _slowest(per_rank: list[dict[str, Any]], pick: Callable[[dict[str, Any]], list[float]]) -> list[float]:
    """Per repetition, the slowest rank's seconds."""
    return [max(values) for values in zip(*(pick(r) for r in per_rank), strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="repetitions of every measurement (medians)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--layout", choices=["fsdp", "ddp"], default="fsdp",
                        help="FSDP2 (each rank holds half the state) or DDP (each holds all of it)")
    parser.add_argument("--dedup-save-to-lowest-rank", action="store_true",
                        help="both libraries' DefaultSavePlanner(dedup_save_to_lowest_rank=True): with --layout ddp, "
                             "rank 0 writes the whole state")
    parser.add_argument("--train-steps", type=int, default=2, help="AdamW steps before the state is saved")
    parser.add_argument("--checkpointer", choices=["thread", "process"], default="thread",
                        help="where both libraries' async_save writes (AsyncCheckpointerType): the first save "
                             "with 'process' includes spawning the checkpoint processes")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the temporary checkpoint directory goes")
    parser.add_argument("--impls", type=lambda s: s.split(","), default=["spmd", "torch"],
                        help="comma-separated, from spmd,torch")
    parser.add_argument("--drop-caches", action="store_true",
                        help=f"cold reads after writing 1 to {DROP_CACHES} (root) instead of posix_fadvise")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed for the launch")
    args = parser.parse_args()
    if not args.impls or any(name not in LABELS for name in args.impls):
        parser.error(f"--impls takes a comma-separated list from {','.join(LABELS)}")
    if args.drop_caches and not os.access(DROP_CACHES, os.W_OK):
        parser.error(f"--drop-caches needs {DROP_CACHES} writable (root)")

    base = tempfile.mkdtemp(prefix="spmd-checkpoint-bench-", dir=args.dir)
    try:
        ports = (free_port(), free_port())
        per_rank = run_saving_processes(_worker, 2, lambda rank, out_file: (args.impls, rank, 2, args, ports, base,
                                                                            out_file),
                                        args.timeout, "the checkpoint benchmark")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    _report(args, base, per_rank)


def _report(args: argparse.Namespace, base: str, per_rank: list[dict[str, Any]]) -> None:
    first = per_rank[0]
    shard_bytes = [r["bytes"] for r in per_rank]
    same_fs = os.stat(os.path.dirname(base)).st_dev == os.stat(REPO).st_dev
    cold = f"{DROP_CACHES} (the whole machine)" if args.drop_caches else "posix_fadvise(DONTNEED) on each file"
    print(f"GPT {args.layers}x{args.width}, {args.heads} heads, context {CONTEXT}, vocab {args.vocab}: "
          f"{first['params'] / 1e6:.1f} M parameters; AdamW state after {args.train_steps} steps; "
          f"{'FSDP2' if args.layout == 'fsdp' else 'DDP'} on 2 ranks x 1 thread"
          f"{', writes to the lowest rank' if args.dedup_save_to_lowest_rank else ''}; state "
          f"{sum(shard_bytes) / 1e6:.0f} MB ({', '.join(f'{b / 1e6:.0f}' for b in shard_bytes)} MB per rank"
          f"{'; each holds all of it, and the disk reference writes this share' if args.layout == 'ddp' else ''}); "
          f"{args.repeats} repetitions; "
          f"medians; {machine_line()}")
    print(f"target {base} on {_filesystem(base)}; the repository's filesystem: {'yes' if same_fs else 'no'}; "
          f"cold reads after evicting with {cold}")

    def median(pick: Callable[[dict[str, Any]], list[float]]) -> float:
        return statistics.median(_slowest(per_rank, pick))

    disk_write = sum(shard_bytes) / median(lambda r: [d["write"] for d in r["disk"]])
    disk_alone = shard_bytes[0] / statistics.median(d["write_alone"] for d in first["disk"])
    disk_cold = sum(shard_bytes) / median(lambda r: [d["read_cold"] for d in r["disk"]])
    disk_warm = sum(shard_bytes) / median(lambda r: [d["read_warm"] for d in r["disk"]])
    print(f"disk, 16 MiB writes + fsync, a file of one rank's shard per rank: write {disk_write / GB:.2f} GB/s "
          f"(2 processes at once; 1 alone {disk_alone / GB:.2f}), read cold {disk_cold / GB:.2f} GB/s, "
          f"warm {disk_warm / GB:.2f} GB/s")

    figures: dict[str, dict[str, float]] = {}
    for name in args.impls:
        state = sum(r[name]["bytes"] for r in per_rank)
        figures[name] = {key: median(lambda r, key=key, name=name: r[name][key]) for key in
                         ("save", "fsync", "load_cold", "load_warm", "blocked", "async", "copy_fresh", "copy_kept")}
        figures[name]["bytes"] = state
    print(f"\n{'':24}{'save s':>8}{'GB/s':>7}{'load cold s':>13}{'GB/s':>7}{'load warm s':>13}{'GB/s':>7}"
          f"{'async blocked s':>17}{'total s':>9}{'host copy s':>13}")
    for name, f in figures.items():
        print(f"{LABELS[name]:24}{f['save']:>8.2f}{f['bytes'] / f['save'] / GB:>7.2f}"
              f"{f['load_cold']:>13.2f}{f['bytes'] / f['load_cold'] / GB:>7.2f}"
              f"{f['load_warm']:>13.2f}{f['bytes'] / f['load_warm'] / GB:>7.2f}"
              f"{f['blocked']:>17.3f}{f['async']:>9.2f}{f['copy_fresh']:>13.3f}")
    if len(figures) == 2:
        spmd, torch_ = figures["spmd"], figures["torch"]
        print("spmd / torch throughput: " + ", ".join(f"{label} {torch_[key] / spmd[key]:.2f}x" for label, key in (
            ("save", "save"), ("load cold", "load_cold"), ("load warm", "load_warm"), ("async total", "async"))) +
            f"; async blocked {spmd['blocked'] / torch_['blocked']:.2f} of torch's")
    for key, label in (("save", "save"), ("load_cold", "load cold"), ("async", "async total")):
        print(f"{label} s per repetition: " + "; ".join(
            f"{name} " + ", ".join(f"{s:.2f}" for s in _slowest(per_rank, lambda r, key=key, name=name: r[name][key]))
            for name in figures))
    print("save GB/s / disk write GB/s (2 at once): " + ", ".join(
        f"{name} {f['bytes'] / f['save'] / disk_write:.2f}" for name, f in figures.items()))
    print("async blocked / host copy of the state into fresh memory (into kept buffers): " + ", ".join(
        f"{name} {f['blocked'] / f['copy_fresh']:.2f} ({f['blocked'] / f['copy_kept']:.2f}; copies "
        f"{f['copy_fresh']:.3f} s, {f['copy_kept']:.3f} s)" for name, f in figures.items()))
    print("the benchmark's fsync pass after each save (already durable if ~0): " + ", ".join(
        f"{name} {f['fsync'] * 1e3:.1f} ms" for name, f in figures.items()))
    print("on disk: " + ", ".join(f"{name} {first[name]['files'][1] / 1e6:.0f} MB in {first[name]['files'][0]} files"
                                  for name in figures))


if __name__ == "__main__":
    main()
