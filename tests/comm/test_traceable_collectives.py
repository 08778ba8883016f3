"""The functional collectives and the classic in-place ones under torch.compile: each is one `torch.ops.spmd.*`
node of the graph (fullgraph compiles, so no graph break), and the compiled function returns what eager does,
forward and backward (the `_autograd` variants' gradients), with aot_eager and with inductor; torch.export,
strict and not, records them and its program computes what eager does. Real processes
from the pool: dynamo's tracing is not thread-safe, so rank threads could not compile side by side."""

from __future__ import annotations

import torch

from tests.procpool import ProcPool


def _collectives(x: torch.Tensor, mesh, pg) -> list[torch.Tensor]:
    import spmd._functional_collectives as funcol

    gathered = funcol.all_gather_tensor(x, 1, pg)
    splits = [1, 3] if pg.rank() == 0 else [3, 1]       # rank 0 keeps 1 row and sends 3; rank 1 the mirror
    outputs = [funcol.wait_tensor(funcol.all_reduce(x * 2, "sum", mesh)), gathered,
               funcol.reduce_scatter_tensor(gathered, "avg", 1, (mesh, 0)),
               funcol.all_to_all_single(x, None, None, pg), funcol.all_to_all_single(x, splits, splits, pg),
               funcol.broadcast(x, 1, pg), funcol.permute_tensor(x, [1, 0], pg),
               *funcol.all_reduce_coalesced([x, x + 1], "max", pg),
               *funcol.all_gather_into_tensor_coalesced([x, x * 3], pg)]
    in_place = torch.zeros_like(x)
    funcol.all_reduce_inplace(in_place.copy_(x), "sum", pg)
    pieces = [torch.zeros_like(x) for _ in range(pg.size())]
    funcol.all_gather_inplace(pieces, x, pg)
    return [*outputs, in_place, *pieces]


def _classic(x: torch.Tensor, pg) -> list[torch.Tensor]:
    import spmd

    reduced, broadcast = x * 2, x.clone()
    spmd.all_reduce(reduced, spmd.ReduceOp.MAX, group=pg)
    spmd.broadcast(broadcast, src=1, group=pg)
    gathered = x.new_empty((pg.size() * x.shape[0], *x.shape[1:]))
    spmd.all_gather_into_tensor(gathered, x, group=pg)
    pieces = [torch.empty_like(x) for _ in range(pg.size())]
    spmd.all_gather(pieces, x, group=pg)
    scattered = x.new_empty((x.shape[0] // pg.size(), *x.shape[1:]))
    spmd.reduce_scatter_tensor(scattered, x, group=pg)
    exchanged = torch.empty_like(x)
    spmd.all_to_all_single(exchanged, x, group=pg)
    return [reduced, broadcast, gathered, *pieces, scattered, exchanged]


def _differentiated(w: torch.Tensor, pg) -> torch.Tensor:
    import spmd._functional_collectives as funcol

    h = funcol.all_gather_tensor_autograd(w, 0, pg)
    h = funcol.reduce_scatter_tensor_autograd(h * h.flip(0), "avg", 0, pg)
    h = funcol.all_to_all_single_autograd(h.sin(), None, None, pg)
    return (h * torch.arange(h.numel(), dtype=h.dtype).view(h.shape)).sum()


class _Exported(torch.nn.Module):
    """A module with a classic and a functional collective, for torch.export."""

    def __init__(self, pg) -> None:
        super().__init__()
        self.pg = pg

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import spmd
        import spmd._functional_collectives as funcol

        y = x * 2
        spmd.all_reduce(y, group=self.pg)
        return funcol.all_gather_tensor(y + 1, 0, self.pg)


def _compiled_and_eager(rank: int, world_size: int) -> dict[str, object]:
    import spmd
    from spmd.device_mesh import init_device_mesh

    spmd.init_process_group("shm", timeout=60, torch_default_group=False)
    try:
        torch._dynamo.reset()
        mesh = init_device_mesh("cpu", (world_size,))
        pg = mesh.get_group()
        x = torch.arange(12.0).view(4, 3) + 10 * rank
        nodes: list[str] = []

        def recording(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
            nodes.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
            return gm.forward

        eager = _collectives(x, mesh, pg) + _classic(x, pg)
        recorded = (torch.compile(_collectives, backend=recording, fullgraph=True)(x, mesh, pg) +
                    torch.compile(_classic, backend=recording, fullgraph=True)(x, pg))
        aot = (torch.compile(_collectives, backend="aot_eager", fullgraph=True)(x, mesh, pg) +
               torch.compile(_classic, backend="aot_eager", fullgraph=True)(x, pg))
        inductor = torch.compile(lambda t: _collectives(t, mesh, pg)[:4], fullgraph=True)(x)

        exported = {}
        for strict in (True, False):
            program = torch.export.export(_Exported(pg), (x,), strict=strict)
            exported[strict] = ({str(node.target) for node in program.graph.nodes if node.op == "call_function"},
                                program.module()(x))

        w = (torch.arange(8.0).view(4, 2) / 7 + rank).requires_grad_()
        _differentiated(w, pg).backward()
        grads = [w.grad.clone()]
        for backend in ("aot_eager", "inductor"):
            w.grad = None
            torch.compile(_differentiated, backend=backend, fullgraph=True)(w, pg).backward()
            grads.append(w.grad.clone())
        return {"eager": eager, "recorded": recorded, "aot": aot, "inductor": inductor, "nodes": nodes,
                "grads": grads, "exported": exported, "exported eager": _Exported(pg)(x)}
    finally:
        spmd.destroy_process_group()


def test_compiled_functional_collectives_are_graph_ops_and_match_eager(procpool: ProcPool) -> None:
    for result in procpool.run(_compiled_and_eager, 2, timeout=240):
        ops = {node for node in result["nodes"] if node.startswith("spmd.")}
        assert ops == {f"spmd.{op}.default" for op in ("all_reduce", "all_gather", "reduce_scatter",
                                                          "all_to_all_single", "broadcast")}, result["nodes"]
        for compiled in ("recorded", "aot"):
            torch.testing.assert_close(result[compiled], result["eager"], rtol=0, atol=0)
            assert all(type(t) is torch.Tensor for t in result[compiled])
        torch.testing.assert_close(result["inductor"], result["eager"][:4], rtol=0, atol=0)
        for strict, (targets, out) in result["exported"].items():
            assert {"spmd.all_reduce.default", "spmd.all_gather.default"} <= targets, (strict, targets)
            torch.testing.assert_close(out, result["exported eager"], rtol=0, atol=0)
        eager_grad, *compiled_grads = result["grads"]
        assert eager_grad.abs().sum() > 0
        for grad in compiled_grads:
            torch.testing.assert_close(grad, eager_grad)
