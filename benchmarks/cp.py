"""Context-parallel attention: spmd's ring attention over 2 ranks ("allgather" and "alltoall") against the same
causal attention on the whole sequence in one process (torch's SDPA), same run.

    python benchmarks/cp.py [--seq 4096] [--heads 8] [--dim 64] [--steps 5] [--ranks 2]
    python benchmarks/cp.py --seq 512 --steps 1      # smoke check

torch's own context parallelism serves only CUDA's flash, efficient and cuDNN kernels, so on CPU the anchor is
what CP replaces: one process attending over the whole sequence. Each rank process (1 torch thread, spmd on
shared memory) runs, alternating step by step after a barrier, forward + backward of
  - "whole": torch's F.scaled_dot_product_attention(q, k, v, is_causal=True) on the whole sequence (B=1), what
    one core does alone;
  - "allgather" / "alltoall": the same attention as TorchTitan writes it (an attention module under
    _ContextParallel, _enable_context_parallel_dispatcher, the batch dealt head-tail by _context_parallel_shard),
    each rank attending its half of the queries, K/V gathered once or passed around the ring.
A step's time is the slowest rank's; medians over the steps. Memory: peak live tensor bytes of one forward +
backward per rank (spmd.testing.memory's TensorMemoryTracker, q/k/v and their gradients included). The CP
outputs and gradients are checked against the whole-sequence ones once.
"""

from __future__ import annotations

import pathlib
import statistics
import sys
import tempfile

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import attention_parser, human_bytes, machine_line, run_saving_processes, slowest_rank_step_times

METHODS = ("allgather", "alltoall")


class _Attention(torch.nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _rank(rank: int, world_size: int, init_file: str, seq: int, heads: int, dim: int, steps: int,
          out_file: str) -> None:
    import spmd
    from spmd.device_mesh import init_device_mesh
    from spmd.tensor.experimental._attention import (
        _context_parallel_shard,
        _ContextParallel,
        _enable_context_parallel_dispatcher,
        _HeadTailLoadBalancer,
        context_parallel_unshard,
        set_rotate_method,
    )
    from spmd.tensor.parallel import parallelize_module
    from spmd.testing.memory import TensorMemoryTracker

    torch.set_num_threads(1)
    spmd.init_process_group("auto", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            torch_default_group=False)
    mesh = init_device_mesh("cpu", (world_size,))
    gen = torch.Generator().manual_seed(0)
    whole = [torch.randn(1, heads, seq, dim, generator=gen) for _ in range(4)]      # q, k, v, output grad
    balancer = _HeadTailLoadBalancer(seq, world_size, "cpu")
    local = _context_parallel_shard(mesh, whole, [2] * 4, load_balancer=balancer)
    _enable_context_parallel_dispatcher()
    attention = parallelize_module(_Attention(), mesh, _ContextParallel(seq_dim=2, attention_type=_ContextParallel
                                                                        .AttentionType.SDPA))

    def step(name: str) -> list[torch.Tensor]:
        tensors = whole if name == "whole" else local
        leaves = [t.detach().requires_grad_() for t in tensors[:3]]
        if name == "whole":
            out = F.scaled_dot_product_attention(*leaves, is_causal=True)
        else:
            set_rotate_method(name)
            out = attention(*leaves)
        out.backward(tensors[3])
        return [out.detach(), *(leaf.grad for leaf in leaves)]

    want = step("whole")
    errors = {}
    for name in METHODS:
        got = context_parallel_unshard(mesh, step(name), [2] * 4, balancer)
        errors[name] = max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True))
    peaks = {}
    for name in ("whole", *METHODS):
        with TensorMemoryTracker() as tracker:
            tracker.track(whole if name == "whole" else local)
            step(name)
        peaks[name] = tracker.peak_bytes
    times = slowest_rank_step_times(("whole", *METHODS), steps, step)
    torch.save({"times": times, "peaks": peaks, "errors": errors}, f"{out_file}.{rank}")
    spmd.destroy_process_group()


def main() -> None:
    args = attention_parser(__doc__.split("\n")[0]).parse_args()
    print(machine_line())
    with tempfile.TemporaryDirectory() as tmp:
        results = run_saving_processes(
            _rank, args.ranks, lambda rank, out: (rank, args.ranks, f"{tmp}/init", args.seq, args.heads, args.dim,
                                                  args.steps, out),
            timeout=1200, what="context-parallel benchmark")
    times = results[0]["times"]
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(f"causal attention, forward + backward, B=1 H={args.heads} L={args.seq} E={args.dim} float32, "
          f"{args.ranks} ranks x 1 thread, {args.steps} steps each")
    print(f"  {'':10s} {'ms/step':>9s} {'vs whole':>9s} {'peak tensor bytes per rank':>28s}  max |error|")
    for name in ("whole", *METHODS):
        peaks = ", ".join(human_bytes(r["peaks"][name]) for r in results)
        error = "" if name == "whole" else f"{max(r['errors'][name] for r in results):.1e}"
        print(f"  {name:10s} {medians[name] * 1e3:9.1f} {medians['whole'] / medians[name]:8.2f}x "
              f"{peaks:>28s}  {error}")
    print(f"load average after: {machine_line().rsplit(' ', 1)[-1]}")


if __name__ == "__main__":
    main()
