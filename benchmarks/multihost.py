"""Collectives across two "hosts" (network namespaces joined by a veth pair), spmd against torch gloo.

    sudo python benchmarks/multihost.py [--size 16M] [--nproc 2,1] [--iters 5] [--reps 5] [--ops all_reduce]

Needs root (it makes two namespaces, as tests/run/netns.py does, and removes them). For each --nproc N it
runs `spmdrun --nnodes 2 --nproc-per-node N` on both hosts, with hostnames that resolve nowhere and no address
set by hand for spmd (gloo is given GLOO_SOCKET_IFNAME, which it needs there). Every worker joins an spmd world
(auto: shm+tcp with two ranks per host, tcp with one), a flat tcp group over the same ranks, and a torch gloo
world; repetitions alternate between them (benchmarks/_common.interleaved_medians). --size is the largest
buffer of an op (all_gather's and gather's output, reduce_scatter's and scatter's input), as nccl-tests counts
it; reduce, gather and scatter have rank 0 as their root. Times are the slowest rank's median; "vs gloo" is
gloo's time / spmd's time (above 1: spmd is faster).
"""

from __future__ import annotations

import argparse
import datetime
import os
import secrets
import subprocess
import sys
from collections.abc import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce", "gather", "scatter")


def worker(size: int, iters: int, reps: int, ops: list[str]) -> None:
    """One rank: time each op of `size` bytes on spmd's default group, a flat tcp group and gloo."""
    import torch
    import torch.distributed as tdist
    from _common import interleaved_medians

    import spmd

    torch.set_num_threads(1)
    spmd.init_process_group(timeout=120, torch_default_group=False)
    rank, world = spmd.get_rank(), spmd.get_world_size()
    flat = spmd.new_group(backend="tcp")
    port = [int(os.environ["MASTER_PORT"]) + 1 if rank == 0 else 0]
    spmd.broadcast_object_list(port, src=0)
    store = tdist.TCPStore(os.environ["MASTER_ADDR"], port[0], world, is_master=rank == 0,
                           timeout=datetime.timedelta(seconds=60))
    tdist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    for op in ops:
        candidates = _candidates(op, size // 4 // world * world, world, flat)
        medians = interleaved_medians(candidates, iters, reps, warm=True)
        gathered: list[dict[str, float] | None] = [None] * world
        spmd.all_gather_object(gathered, medians)
        if rank == 0:
            slowest = {name: max(m[name] for m in gathered if m is not None) for name in candidates}
            print(f"RESULT op={op} backend={spmd.get_backend()} "
                  + " ".join(f"{name.replace(' ', '_')}={seconds:.6f}" for name, seconds in slowest.items()),
                  flush=True)
    tdist.destroy_process_group()
    spmd.destroy_process_group()


def _candidates(op: str, numel: int, world: int, flat: object) -> dict[str, tuple[Callable[[], object],
                                                                             Callable[[], object]]]:
    """One `op` call (numel elements in its largest buffer) on spmd's default group, the flat group and gloo."""
    import torch
    import torch.distributed as tdist

    import spmd

    root = spmd.get_rank() == 0
    block, blocks = torch.ones(numel // world), [torch.ones(numel // world) for _ in range(world)]
    rooted: dict[str, tuple[object, ...]] = {"reduce": (torch.ones(numel), 0),
                                             "gather": (block, blocks if root else None, 0),
                                             "scatter": (block, blocks if root else None, 0)}
    if op in rooted:
        args: tuple[object, ...] = rooted[op]
    elif op == "all_reduce":
        args = (torch.ones(numel),)
    elif op == "all_gather_into_tensor":
        args = (torch.empty(numel), torch.ones(numel // world))
    else:
        args = (torch.empty(numel // world), torch.ones(numel))
    spmd_op, torch_op = getattr(spmd, op), getattr(tdist, op)
    return {
        "spmd": (lambda: spmd_op(*args), spmd.barrier),
        "spmd tcp": (lambda: spmd_op(*args, group=flat), spmd.barrier),
        "gloo": (lambda: torch_op(*args), tdist.barrier),
    }


def run(nproc: int, size: int, iters: int, reps: int, ops: list[str]) -> list[dict[str, str]]:
    """Both hosts' agents with `nproc` workers each; rank 0's RESULT fields, one dict per op."""
    sys.path.insert(0, REPO)
    from tests.run import netns

    hosts = netns.TwoHosts()
    hosts.start()
    processes = []
    try:
        token = secrets.token_hex(8)
        for node in range(2):
            argv = [sys.executable, "-m", "spmd.run", "--nnodes", "2", "--nproc-per-node", str(nproc),
                    "--node-rank", str(node), "--rdzv-endpoint", f"{netns.ADDRESSES[0]}:29400", "--rdzv-token",
                    token, os.path.abspath(__file__), "--worker", "--size", str(size), "--iters", str(iters),
                    "--reps", str(reps), "--ops", ",".join(ops)]
            env = {**os.environ, "GLOO_SOCKET_IFNAME": hosts.links[node],
                   "PYTHONPATH": os.pathsep.join([os.path.join(REPO, "src"), os.path.join(REPO, "benchmarks")])}
            processes.append(subprocess.Popen(hosts.argv(node, f"bench{node}-{secrets.token_hex(2)}", argv),
                                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = [process.communicate(timeout=600)[0] for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        hosts.close()
    lines = [line for out in outputs for line in out.splitlines() if "RESULT" in line]
    if len(lines) != len(ops):
        raise RuntimeError("no result:\n" + "\n".join(outputs))
    return [dict(field.split("=", 1) for field in line.split("RESULT ", 1)[1].split()) for line in lines]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="16M")
    parser.add_argument("--nproc", default="2,1")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--ops", default="all_reduce", help=f"comma-separated subset of {', '.join(OPS)}")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    ops = [op for op in args.ops.split(",") if op]
    if not ops or set(ops) - set(OPS):
        parser.error(f"--ops takes a comma-separated subset of {', '.join(OPS)}, not {args.ops!r}")
    text = args.size.upper().removesuffix("B").removesuffix("I")
    size = int(float(text[:-1]) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[text[-1]]) if text[-1] in "KMG" \
        else int(text)
    if args.worker:
        worker(size, args.iters, args.reps, ops)
        return
    print(f"{', '.join(ops)} of {size >> 20} MiB float32 across two network namespaces (veth), slowest rank's median")
    print(f"{'op':>22} {'hosts x ranks':>14} {'spmd backend':>13} {'spmd ms':>9} {'spmd tcp ms':>12} {'gloo ms':>9} "
          f"{'vs gloo':>8} {'tcp vs gloo':>12} {'spmd GB/s':>10}")
    for nproc in (int(n) for n in args.nproc.split(",")):
        for result in run(nproc, size, args.iters, args.reps, ops):
            spmd_s, tcp_s, gloo_s = (float(result[key]) for key in ("spmd", "spmd_tcp", "gloo"))
            print(f"{result['op']:>22} {f'2 x {nproc}':>14} {result['backend']:>13} {spmd_s * 1e3:9.2f} "
                  f"{tcp_s * 1e3:12.2f} {gloo_s * 1e3:9.2f} {gloo_s / spmd_s:8.2f} {gloo_s / tcp_s:12.2f} "
                  f"{size / spmd_s / 1e9:10.3f}")


if __name__ == "__main__":
    main()
