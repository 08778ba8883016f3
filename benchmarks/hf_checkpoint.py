"""Hugging Face checkpoints: spmd.checkpoint's HuggingFaceStorageWriter / Reader vs torch's, on an FSDP2 model's
sharded state dict, same state, same disk, same run.

    python benchmarks/hf_checkpoint.py [--repeats 3] [--layers 8 --width 768 --heads 12 --vocab 4096]
    python benchmarks/hf_checkpoint.py --layers 2 --width 128 --heads 4 --vocab 512 --repeats 1   # smoke check

The state: the model state dict (parameters only, fp32, what a Hugging Face release holds) of the GPT of
examples/gpt.py in benchmarks/checkpoint.py's configuration (63 M parameters, 253 MB) under FSDP2 on 2 ranks x 1
torch thread (fully_shard on every block and the root; spmd on shared memory, torch on gloo), each library's
get_model_state_dict: live sharded DTensors. The keys go to two files (the blocks' first half and embeddings in
model-00001-of-00002, the rest in the other), as a model's index would say.
  - save: whole tensors in model-0000i-of-00002.safetensors files and model.safetensors.index.json, what
    transformers loads. spmd: HuggingFaceStorageWriter(path, mapping), every rank writing its shards in place.
    torch: HuggingFaceStorageWriter(path, mapping, save_distributed=True, enable_consolidation=True), each rank
    writing its shards to path/sharded and rank 0 then consolidating them into the whole files (TorchTitan's
    way to save a sharded model for Hugging Face). Both followed, in the timed region, by an fsync of every file
    and directory under the path (both write with fsync already; the pass costs little then).
  - load: every shard zeroed (untimed), then load(state, storage_reader=HuggingFaceStorageReader(path)) of the
    directory the library saved, cold (its files evicted from the page cache with posix_fadvise(DONTNEED)) and
    warm; the shards' sums are checked against the saved ones. Each library also loads the other's files once
    (checked, untimed).
The libraries alternate (A, B in one repetition, B, A in the next); each operation starts after a barrier and is
timed as the slowest rank's; medians over --repeats.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import free_port, machine_line, run_saving_processes

from checkpoint import _evict, _files, _fsync_tree, _gpt, _tensors, init_library

LABELS = {"spmd": "spmd HuggingFaceStorage* (shm)", "torch": "torch HuggingFaceStorage* (gloo)"}
GB = 1e9


class _Side:
    """One library's FSDP2 model, its sharded model state dict and its HF storage classes, in this rank."""

    def __init__(self, name: str, rank: int, world_size: int, args: argparse.Namespace, gloo_port: int) -> None:
        self.name = name
        library = init_library(name, rank, world_size, gloo_port)
        self.barrier, self.dcp = library.barrier, library.dcp
        init_device_mesh, fully_shard = library.init_device_mesh, library.fully_shard
        get_model_state_dict = library.state_dict.get_model_state_dict
        mesh = init_device_mesh("cpu", (world_size,))
        model = _gpt(args)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        self.state = get_model_state_dict(model)
        half = args.layers // 2
        self.mapping = {key: 1 if not key.startswith("blocks.") or int(key.split(".")[1]) < half else 2
                        for key in self.state}
        self.local = list(_tensors(self.state))
        self.bytes = sum(t.numel() * t.element_size() for t in self.local)
        with torch.no_grad():
            self.sums = torch.stack([t.double().sum() for t in self.local])

    def save(self, directory: str) -> float:
        extra = {} if self.name == "spmd" else {"save_distributed": True, "enable_consolidation": True}
        self.barrier()
        start = time.perf_counter()
        self.dcp.save(self.state, storage_writer=self.dcp.HuggingFaceStorageWriter(directory, self.mapping, **extra))
        _fsync_tree(directory)
        self.barrier()
        return time.perf_counter() - start

    def load(self, directory: str, evict: bool, rank: int) -> float:
        with torch.no_grad():
            for tensor in self.local:
                tensor.zero_()
        if evict:
            self.barrier()
            _evict(_files(directory), False, rank)
        self.barrier()
        start = time.perf_counter()
        self.dcp.load(self.state, storage_reader=self.dcp.HuggingFaceStorageReader(directory))
        seconds = time.perf_counter() - start
        with torch.no_grad():
            sums = torch.stack([t.double().sum() for t in self.local])
        if not torch.equal(sums, self.sums):
            raise AssertionError(f"{self.name}: the state loaded from {directory} differs from the saved one")
        return seconds

    def close(self) -> None:
        if self.name == "spmd":
            import spmd
            spmd.destroy_process_group()
        else:
            import torch.distributed as dist
            dist.destroy_process_group()


def _worker(rank: int, world_size: int, args: argparse.Namespace, ports: tuple[int, int], base: str,
            out_file: str) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(ports[0]))
    sides = [_Side(name, rank, world_size, args, ports[1]) for name in ("spmd", "torch")]
    barrier = sides[0].barrier
    results: dict[str, Any] = {"bytes": sides[0].bytes, "params": sum(p.numel() for p in sides[0].model.parameters()),
                               **{s.name: {"save": [], "load_cold": [], "load_warm": [], "files": None}
                                  for s in sides}}
    try:
        for rep in range(args.repeats):
            rep_dir = os.path.join(base, f"rep{rep}")
            order = sides if rep % 2 == 0 else sides[::-1]
            for side in order:
                results[side.name]["save"].append(side.save(os.path.join(rep_dir, side.name)))
            for side in order:
                results[side.name]["load_cold"].append(side.load(os.path.join(rep_dir, side.name), True, rank))
            for side in order:
                results[side.name]["load_warm"].append(side.load(os.path.join(rep_dir, side.name), False, rank))
            if rep == 0:        # each library reads the other's files
                for side, other in zip(sides, sides[::-1], strict=True):
                    side.load(os.path.join(rep_dir, other.name), False, rank)
            barrier()
            if rank == 0:
                for side in sides:
                    files = _files(os.path.join(rep_dir, side.name))
                    results[side.name]["files"] = (len(files), sum(os.path.getsize(f) for f in files))
                shutil.rmtree(rep_dir)
            barrier()
        torch.save(results, f"{out_file}.{rank}")
    finally:
        for side in sides:
            side.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the temporary checkpoints go")
    args = parser.parse_args()
    base = tempfile.mkdtemp(prefix="spmd-hf-bench-", dir=args.dir)
    try:
        ports = (free_port(), free_port())
        per_rank = run_saving_processes(_worker, 2, lambda rank, out: (rank, 2, args, ports, base, out), 1800.0,
                                        "the HF checkpoint benchmark")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    state = sum(r["bytes"] for r in per_rank)
    print(f"GPT {args.layers}x{args.width}, vocab {args.vocab}: {per_rank[0]['params'] / 1e6:.1f} M parameters, "
          f"model state {state / 1e6:.0f} MB fp32, FSDP2 on 2 ranks x 1 thread, 2 output files; {args.repeats} "
          f"repetitions, medians of the slowest rank; {machine_line()}")
    figures = {}
    print(f"\n{'':34}{'save s':>8}{'GB/s':>7}{'load cold s':>13}{'GB/s':>7}{'load warm s':>13}{'GB/s':>7}"
          f"{'on disk':>22}")
    for name in LABELS:
        figures[name] = {key: statistics.median(max(values) for values in zip(*(r[name][key] for r in per_rank),
                                                                             strict=True))
                         for key in ("save", "load_cold", "load_warm")}
        f, (count, size) = figures[name], per_rank[0][name]["files"]
        print(f"{LABELS[name]:34}{f['save']:>8.2f}{state / f['save'] / GB:>7.2f}{f['load_cold']:>13.2f}"
              f"{state / f['load_cold'] / GB:>7.2f}{f['load_warm']:>13.2f}{state / f['load_warm'] / GB:>7.2f}"
              f"{f'{size / 1e6:.0f} MB, {count} files':>22}")
    print("spmd / torch throughput: " + ", ".join(
        f"{label} {figures['torch'][key] / figures['spmd'][key]:.2f}x"
        for label, key in (("save", "save"), ("load cold", "load_cold"), ("load warm", "load_warm"))))
    print("save s per repetition: " + "; ".join(
        f"{name} " + ", ".join(f"{max(v):.2f}" for v in zip(*(r[name]["save"] for r in per_rank), strict=True))
        for name in LABELS))
    print(f"load average after: {machine_line().rsplit(' ', 1)[-1]}")


if __name__ == "__main__":
    main()
