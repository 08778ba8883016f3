"""torch's functional collectives ("funcol") under `spmd._functional_collectives`: each op's values against what
the ranks' inputs give, every group form torch takes, gradients of the autograd variants against one process,
the same results as torch's own funcol (real processes), and the errors for bad arguments."""

from __future__ import annotations

import pytest
import torch

import spmd
import spmd._functional_collectives as funcol
from spmd.device_mesh import init_device_mesh
from spmd.testing import run_ranks
from tests.procpool import ProcPool

TIMEOUT = 60


def _rows(rank: int, rows: int = 4, cols: int = 3) -> torch.Tensor:
    return torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) + 100 * rank


def test_values_of_every_op_on_four_ranks() -> None:
    def body(rank: int, size: int) -> None:
        x = _rows(rank)
        kept = x.clone()
        every = [_rows(r) for r in range(size)]
        total = sum(every)
        got = funcol.all_reduce(x, "sum", list(range(size)))
        assert isinstance(got, funcol.AsyncCollectiveTensor)
        plain = funcol.wait_tensor(got)
        assert type(plain) is torch.Tensor and type(got + 1) is torch.Tensor and type(got.wait()) is torch.Tensor
        torch.testing.assert_close(plain, total)
        torch.testing.assert_close(funcol.all_reduce(x, "MAX", list(range(size))), every[-1])
        torch.testing.assert_close(funcol.all_reduce(x, spmd.ReduceOp.AVG, list(range(size))), total / size)
        torch.testing.assert_close(funcol.all_gather_tensor(x, 0, list(range(size))), torch.cat(every, 0))
        torch.testing.assert_close(funcol.all_gather_single(x, 1, list(range(size))), torch.cat(every, 1))
        torch.testing.assert_close(funcol.reduce_scatter_tensor(x, "sum", 0, list(range(size))),
                                   total.chunk(size, 0)[rank])
        wide = torch.cat([x] * size, 1)
        torch.testing.assert_close(funcol.reduce_scatter_single(wide, "sum", 1, list(range(size))), total)
        pair = funcol.all_reduce_coalesced([x, x[0]], "sum", list(range(size)))
        torch.testing.assert_close(pair[1], total[0])
        torch.testing.assert_close(funcol.all_gather_into_tensor_coalesced([x[:1]], list(range(size)))[0],
                                   torch.cat([e[:1] for e in every]))
        torch.testing.assert_close(funcol.reduce_scatter_tensor_coalesced([x, wide], "sum", [0, 1],
                                                                          list(range(size)))[1], total)
        # all_to_all_single, uneven: rank r sends r + j + 1 rows to rank j
        sends = [rank + j + 1 for j in range(size)]
        receives = [j + rank + 1 for j in range(size)]
        blocks = torch.arange(float(sum(sends))) + 1000 * rank
        out = funcol.all_to_all_single(blocks.unsqueeze(1), receives, sends, list(range(size))).squeeze(1)
        starts = [sum(j + src + 1 for j in range(rank)) for src in range(size)]
        want = torch.cat([torch.arange(float(starts[src]), starts[src] + receives[src]) + 1000 * src
                          for src in range(size)])
        torch.testing.assert_close(out, want)
        # permute_tensor: group rank i's tensor goes to rank (i + 1) % size
        torch.testing.assert_close(funcol.permute_tensor(x, [(i + 1) % size for i in range(size)],
                                                         list(range(size))), every[(rank - 1) % size])
        torch.testing.assert_close(x, kept)                  # the functional ops never touch their input

    run_ranks(body, 4, timeout=TIMEOUT)


def test_every_group_form_names_the_same_group_and_broadcast_takes_a_group_rank() -> None:
    def body(rank: int, size: int) -> None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        x = torch.full((2,), float(rank))
        row = [r for r in range(4) if r // 2 == rank // 2]
        for group in (mesh["tp"], (mesh, 1), (mesh, "tp"), row, [[0, 1], [2, 3]], mesh.get_group("tp"),
                      mesh.get_group("tp").name):
            torch.testing.assert_close(funcol.all_reduce(x, "sum", group), torch.full((2,), float(sum(row))))
        # group rank 1 of [1, 2] is global rank 2
        if rank in (1, 2):
            torch.testing.assert_close(funcol.broadcast(x, 1, [1, 2]), torch.full((2,), 2.0))
        before = spmd.get_pg_count()
        funcol.all_reduce(x, "sum", row)                       # the group of those ranks is made once
        assert spmd.get_pg_count() == before
        # the in-place forms
        gathered = [torch.empty(2) for _ in range(size)]
        funcol.all_gather_inplace(gathered, x)
        assert [t[0].item() for t in gathered] == [0.0, 1.0, 2.0, 3.0]
        out = torch.empty(8)
        funcol.all_gather_tensor_inplace(out, x)
        torch.testing.assert_close(out, torch.cat(gathered))
        scattered = torch.empty(2)
        funcol.reduce_scatter_tensor_inplace(scattered, torch.ones(8), "sum")
        torch.testing.assert_close(scattered, torch.full((2,), 4.0))
        y = x.clone()
        assert funcol.all_reduce_inplace(y, "max") is y and y[0].item() == 3.0
        moved = torch.empty(4)
        funcol.all_to_all_inplace(moved, torch.full((4,), float(rank)))
        torch.testing.assert_close(moved, torch.arange(4.0))

    run_ranks(body, 4, timeout=TIMEOUT)


def test_autograd_variants_give_one_process_gradients() -> None:
    inputs = [torch.randn(4, 3, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    weight = torch.randn(8, 3, generator=torch.Generator().manual_seed(9))

    def one_process(op: str) -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_() for t in inputs]
        if op == "gather":
            losses = [(torch.cat(leaves) * weight).sum() * (r + 1) for r in range(2)]
        elif op in ("scatter_sum", "scatter_avg"):
            reduced = (leaves[0] + leaves[1]) / (2 if op == "scatter_avg" else 1)
            losses = [(reduced.chunk(2)[r] * weight[:2]).sum() * (r + 1) for r in range(2)]
        else:   # all_to_all: rank r receives block r of every rank's input
            losses = [(torch.cat([leaves[s].chunk(2)[r] for s in range(2)]) * weight[:4]).sum() * (r + 1)
                      for r in range(2)]
        sum(losses).backward()
        return [leaf.grad for leaf in leaves]

    def body(rank: int, size: int) -> dict[str, torch.Tensor]:
        grads = {}
        for op in ("gather", "scatter_sum", "scatter_avg", "all_to_all"):
            leaf = inputs[rank].clone().requires_grad_()
            if op == "gather":
                out = funcol.all_gather_tensor_autograd(leaf, 0, [0, 1]) * weight
            elif op.startswith("scatter"):
                out = funcol.reduce_scatter_tensor_autograd(leaf, op.split("_")[1], 0, [0, 1]) * weight[:2]
            else:
                out = funcol.all_to_all_single_autograd(leaf, None, None, [0, 1]) * weight[:4]
            (out.sum() * (rank + 1)).backward()
            grads[op] = leaf.grad
        return grads

    results = run_ranks(body, 2, timeout=TIMEOUT)
    for op in ("gather", "scatter_sum", "scatter_avg", "all_to_all"):
        for rank, want in enumerate(one_process(op)):
            torch.testing.assert_close(results[rank][op], want, msg=op)


def _against_torchs(rank: int, world_size: int) -> dict:
    import torch.distributed._functional_collectives as torch_funcol

    spmd.init_process_group("tcp", timeout=60)       # torch's default group runs over the "spmd" backend
    try:
        import torch.distributed as dist
        torch_group = dist.group.WORLD
        x = _rows(rank)
        results = {}
        for side, module, group in (("ours", funcol, [0, 1]), ("torch", torch_funcol, torch_group)):
            results[side] = [module.wait_tensor(t) for t in (
                module.all_reduce(x, "avg", group), module.all_gather_single(x, 1, group),
                module.reduce_scatter_single(x, "sum", 0, group),
                *module.all_gather_into_tensor_coalesced([x, x[1:]], group),
                *module.reduce_scatter_tensor_coalesced([x, x * 2], "max", [0, 0], group),
                module.broadcast(x, 1, group),
                module.all_to_all_single(x, [1, 3] if rank == 0 else [3, 1], [1, 3] if rank == 0 else [3, 1],
                                         group),
                module.permute_tensor(x.reshape(-1), [1, 0], group))]   # torch's takes 1-d tensors only
        return results
    finally:
        spmd.destroy_process_group()


@pytest.mark.timeout(120)
def test_results_are_torchs(procpool: ProcPool) -> None:
    for result in procpool.run(_against_torchs, 2, timeout=90):
        for ours, torchs in zip(result["ours"], result["torch"], strict=True):
            torch.testing.assert_close(ours, torchs)


def test_bad_arguments_name_the_problem() -> None:
    def body(rank: int, size: int) -> None:
        x = torch.ones(3)
        with pytest.raises(ValueError, match="unknown reduce op 'median'"):
            funcol.all_reduce(x, "median", [0, 1])
        with pytest.raises(TypeError, match="group must be a ProcessGroup, a DeviceMesh"):
            funcol.all_reduce(x, "sum", 3.5)
        with pytest.raises(ValueError, match=f"rank {rank} is not in the ranks \\[5\\]"):
            funcol.all_reduce(x, "sum", [5])
        with pytest.raises(ValueError, match=r"a 2-D DeviceMesh \(1, 2\) names no single group; pass \(mesh, mesh_d"):
            funcol.all_reduce(x, "sum", init_device_mesh("cpu", (1, 2)))
        with pytest.raises(ValueError, match="dim 0 of size 3 does not split into 2 equal blocks"):
            funcol.reduce_scatter_tensor(x, "sum", 0, [0, 1])
        with pytest.raises(ValueError, match="only sum and avg differentiate"):
            funcol.reduce_scatter_tensor_autograd(torch.ones(2), "max", 0, [0, 1])
        with pytest.raises(ValueError, match="must be a permutation"):
            funcol.permute_tensor(x, [0, 0], [0, 1])
        with pytest.raises(ValueError, match="no group named 'nope'"):
            funcol.all_reduce(x, "sum", "nope")

    run_ranks(body, 2, timeout=TIMEOUT)
