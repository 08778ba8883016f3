"""flex_attention's context parallelism: spmd's against torch's own, same ranks, same run, and the whole sequence
in one process as the anchor both replace.

    python benchmarks/flex_cp.py [--seq 4096] [--heads 8] [--dim 64] [--steps 5] [--ranks 2]
    python benchmarks/flex_cp.py --seq 512 --steps 1      # smoke check

TorchTitan's way on both sides: an attention module under `_ContextParallel(seq_dim=2, attention_type=FLEX)`,
q, k, v and the output gradient dealt by `_context_parallel_shard` with a document-causal BlockMask (three
documents) and the PTRR load balancer, each rank attending its queries against the keys and values its module
gathers. spmd on shared memory; torch on gloo, in the same rank processes (1 torch thread each), steps
alternating after a barrier; a step (forward + backward) is timed as the slowest rank's, medians over the
steps. CPU flex_attention refuses backward, though uncompiled it is plain differentiable math: this script
lets it differentiate for every side alike, as spmd's tests do. Each side's output and q/k/v gradients are
checked against the whole sequence's once. No memory column: eager flex_attention compiles its operator
internally, which dynamo refuses under a dispatch-mode tracker.
"""

from __future__ import annotations

import pathlib
import statistics
import sys
import tempfile
import warnings

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import attention_parser, free_port, machine_line, run_saving_processes, slowest_rank_step_times

SIDES = ("whole", "spmd", "torch")


def _rank(rank: int, world_size: int, init_file: str, gloo_port: int, seq: int, heads: int, dim: int, steps: int,
          out_file: str) -> None:
    import torch.distributed as dist
    import torch.distributed.tensor.experimental._context_parallel._attention as torch_cp
    import torch.distributed.tensor.experimental._context_parallel._load_balancer as torch_lb
    import torch.nn.attention.flex_attention as flex
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    import spmd
    import spmd.tensor.experimental._context_parallel as spmd_cp
    from spmd.device_mesh import init_device_mesh
    from spmd.tensor.parallel import parallelize_module

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")
    flex._validate_device = lambda query, key, value: None      # uncompiled CPU flex_attention differentiates
    spmd.init_process_group("auto", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            torch_default_group=False)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=rank, world_size=world_size)
    meshes = {"spmd": init_device_mesh("cpu", (world_size,)), "torch": torch_mesh("cpu", (world_size,))}
    lengths = torch.tensor([seq // 4, seq // 2, seq - seq // 4 - seq // 2])
    document_of = torch.repeat_interleave(torch.arange(3), lengths)

    def documents(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (document_of[q] == document_of[kv]) & (q >= kv)

    class Attend(torch.nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: object) -> torch.Tensor:
            return flex.flex_attention(q, k, v, block_mask=mask)

    gen = torch.Generator().manual_seed(0)
    whole = [torch.randn(1, heads, seq, dim, generator=gen) for _ in range(4)]     # q, k, v, output gradient
    mask = flex.create_block_mask(documents, 1, 1, seq, seq, device="cpu")
    sides = {"whole": (Attend(), whole, mask, None)}
    for name, cp, lb, parallelize in (("spmd", spmd_cp, spmd_cp, parallelize_module),
                                      ("torch", torch_cp, torch_lb, torch_parallelize)):
        balancer = lb._PTRRLoadBalancer(mask, world_size)
        *local, local_mask = cp._context_parallel_shard(meshes[name], [*whole, mask], [2, 2, 2, 2, 0], balancer)
        attend = parallelize(Attend(), meshes[name], cp._ContextParallel(
            seq_dim=2, attention_type=cp._ContextParallel.AttentionType.FLEX))
        sides[name] = (attend, local, local_mask, balancer)

    def step(name: str) -> list[torch.Tensor]:
        attend, tensors, block_mask, _ = sides[name]
        leaves = [t.detach().requires_grad_() for t in tensors[:3]]
        out = attend(*leaves, block_mask)
        out.backward(tensors[3])
        return [out.detach(), *(leaf.grad for leaf in leaves)]

    want = step("whole")
    errors = {}
    for name in ("spmd", "torch"):
        got = spmd_cp.context_parallel_unshard(meshes["spmd"], step(name), [2] * 4, sides[name][3])
        errors[name] = max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True))
    times = slowest_rank_step_times(SIDES, steps, step)
    torch.save({"times": times, "errors": errors}, f"{out_file}.{rank}")
    dist.destroy_process_group()
    spmd.destroy_process_group()


def main() -> None:
    args = attention_parser(__doc__.split("\n")[0]).parse_args()
    print(machine_line())
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        results = run_saving_processes(
            _rank, args.ranks, lambda rank, out: (rank, args.ranks, f"{tmp}/init", port, args.seq, args.heads,
                                                  args.dim, args.steps, out),
            timeout=1800, what="flex context-parallel benchmark")
    medians = {name: statistics.median(values) for name, values in results[0]["times"].items()}
    print(f"document-causal flex_attention (3 documents, PTRR deal), forward + backward, B=1 H={args.heads} "
          f"L={args.seq} E={args.dim} float32, {args.ranks} ranks x 1 thread, {args.steps} steps each")
    print(f"  {'':6s} {'ms/step':>9s} {'vs whole':>9s}  max |error|")
    for name in SIDES:
        error = "" if name == "whole" else f"{max(r['errors'][name] for r in results):.1e}"
        print(f"  {name:6s} {medians[name] * 1e3:9.1f} {medians['whole'] / medians[name]:8.2f}x  {error}")
    print(f"  spmd / torch time: {medians['spmd'] / medians['torch']:.2f}")
    print(f"load average after: {machine_line().rsplit(' ', 1)[-1]}")


if __name__ == "__main__":
    main()
