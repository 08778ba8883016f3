"""Tensor parallelism under torch.compile, compiled whole: a module parallelized with ColwiseParallel/RowwiseParallel
(or SequenceParallel around them) and functions that convert DTensors (from_local, redistribute, to_local,
full_tensor) compile into ONE graph with `fullgraph=True` (no graph break: the styles' hooks, the conversions and
the DTensor ops are traced, spmd.tensor.api Note: DTensors under torch.compile), and train as eager does: same
outputs, same gradients, over two steps. With inputs (plain or DTensors) of changing sizes they compile once more,
with dynamic shapes, and no further. Real processes from the pool: dynamo's tracing is not thread-safe."""

from __future__ import annotations

import copy

import torch

from tests.procpool import ProcPool


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)
        self.up = torch.nn.Linear(16, 64)
        self.down = torch.nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def _train(model: torch.nn.Module, x: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Two SGD steps; the outputs of each and the final parameters and gradients, as whole tensors."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    outputs = []
    for _ in range(2):
        optimizer.zero_grad()
        out = model(x)
        out.square().mean().backward()
        optimizer.step()
        outputs.append(out.detach().clone())
    whole = [(t.full_tensor() if hasattr(t, "full_tensor") else t).detach() for p in model.parameters()
             for t in (p, p.grad)]
    return outputs, whole


def _conversions(t: torch.Tensor, w, mesh) -> torch.Tensor:
    from spmd.tensor import DTensor, Replicate, Shard

    d = DTensor.from_local(t, mesh, [Replicate()])
    y = torch.mm(d, w)                                    # Shard(1): w is column-sharded
    gathered = y.redistribute(mesh, [Replicate()]).to_local()
    return gathered.sin().sum() + y.redistribute(mesh, [Shard(0)]).full_tensor().cos().sum()


def _compiled_and_eager(rank: int, world_size: int) -> dict[str, object]:
    import torch._dynamo.testing

    import spmd
    from spmd.device_mesh import init_device_mesh
    from spmd.tensor import Shard, distribute_tensor
    from spmd.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    spmd.init_process_group("shm", timeout=60, torch_default_group=False)
    try:
        torch._dynamo.reset()
        mesh = init_device_mesh("cpu", (world_size,))
        torch.manual_seed(0)
        block = _Block()
        x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(1))
        results: dict[str, object] = {}
        for name, plan in (("tp", {"up": ColwiseParallel(), "down": RowwiseParallel()}),
                           ("sp", {"norm": SequenceParallel(),
                                   "up": ColwiseParallel(input_layouts=Shard(1)),
                                   "down": RowwiseParallel(output_layouts=Shard(1))})):
            local_x = x.chunk(world_size, dim=1)[rank] if name == "sp" else x
            torch._dynamo.reset()     # static shapes: a DTensor's shapes are constants of its graph
            eager = _train(parallelize_module(copy.deepcopy(block), mesh, plan), local_x)
            counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
            model = parallelize_module(copy.deepcopy(block), mesh, plan)
            compiled = _train(torch.compile(model, backend=counter, fullgraph=True), local_x)
            results[name] = (eager, compiled, counter.frame_count)

        w = distribute_tensor(torch.randn(4, 6, generator=torch.Generator().manual_seed(2)), mesh, [Shard(1)])
        w.requires_grad_(True)
        t = torch.randn(3, 4, generator=torch.Generator().manual_seed(3), requires_grad=True)
        grads = []
        counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
        for fn in (_conversions, torch.compile(_conversions, backend=counter, fullgraph=True)):
            t.grad = w.grad = None
            value = fn(t, w, mesh)
            value.backward()
            grads.append((value.detach(), t.grad.clone(), w.grad.full_tensor()))
        results["conversions"] = (grads[0], grads[1], counter.frame_count)
        return results
    finally:
        spmd.destroy_process_group()


def test_parallelized_modules_and_dtensor_conversions_compile_whole_and_train_as_eager(procpool: ProcPool) -> None:
    for result in procpool.run(_compiled_and_eager, 2, timeout=240):
        for name in ("tp", "sp", "conversions"):
            eager, compiled, graphs = result[name]
            assert graphs == 1, (name, graphs)
            torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
        (outputs, whole), _, _ = result["tp"]
        assert not torch.equal(outputs[0], outputs[1])      # the step changed the weights
        assert all(t.abs().sum() > 0 for t in whole)


def _sharded_output(t: torch.Tensor, w, mesh):
    from spmd.tensor import DTensor, Shard

    d = DTensor.from_local(t, mesh, [Shard(0)])
    return torch.mm(d, w).relu().redistribute(mesh, [Shard(0)]) * 2     # mm gives Partial: reduce-scattered


def _gathered(d) -> torch.Tensor:
    from spmd.tensor import Replicate

    return (d.redistribute(d.device_mesh, [Replicate()]) * 2).to_local().sin().sum()


def _dynamic_shapes(rank: int, world_size: int) -> dict[str, object]:
    import torch._dynamo.testing

    import spmd
    from spmd.device_mesh import init_device_mesh
    from spmd.tensor import Shard, distribute_tensor
    from spmd.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    spmd.init_process_group("shm", timeout=60, torch_default_group=False)
    try:
        torch._dynamo.reset()
        mesh = init_device_mesh("cpu", (world_size,))
        torch.manual_seed(0)
        plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
        block = _Block()
        eager = parallelize_module(copy.deepcopy(block), mesh, plan)
        compiled = parallelize_module(block, mesh, plan)
        counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
        model = torch.compile(compiled, backend=counter)
        steps = []
        for seq in (8, 12, 16, 20):          # a graph for 8, one with a symbolic sequence length for the rest
            x = torch.randn(2, seq, 16, generator=torch.Generator().manual_seed(seq))
            outs = [module(x) for module in (eager, model)]
            for out in outs:
                out.square().mean().backward()
            steps.append(([out.detach() for out in outs], counter.frame_count))
        grads = [[g.full_tensor() if hasattr(g, "full_tensor") else g for g in (p.grad for p in module.parameters())]
                 for module in (eager, compiled)]

        w = distribute_tensor(torch.randn(4, 6, generator=torch.Generator().manual_seed(2)), mesh, [Shard(1)])
        w.requires_grad_(True)
        counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
        fn = torch.compile(_sharded_output, backend=counter)
        calls = []
        for rows in (3, 5, 7, 9):
            t = torch.randn(rows, 4, generator=torch.Generator().manual_seed(rows), requires_grad=True)
            results = []
            for f in (_sharded_output, fn):
                t.grad = w.grad = None
                out = f(t, w, mesh)
                (out * out).sum().backward()          # the gradient arrives Shard(0), as traced
                results.append((tuple(out.shape), out.placements, out.full_tensor().detach(), t.grad.clone(),
                                w.grad.full_tensor()))
            calls.append((results, counter.frame_count))
        counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
        gather = torch.compile(_gathered, backend=counter)
        inputs = []
        for rows in (4, 6, 8, 10):          # DTensor inputs of new sizes: one more graph, not one per size
            d = distribute_tensor(torch.arange(rows * 3.0).view(rows, 3), mesh, [Shard(0)]).requires_grad_(True)
            value = gather(d)
            value.backward()
            inputs.append((_gathered(d.detach()), value.detach(), d.grad.full_tensor(), counter.frame_count))
        return {"block": (steps, grads), "function": calls, "inputs": inputs}
    finally:
        spmd.destroy_process_group()


def test_inputs_of_changing_sizes_compile_once_more_with_dynamic_shapes_and_match_eager(procpool: ProcPool) -> None:
    from spmd.tensor import Shard

    for result in procpool.run(_dynamic_shapes, 2, timeout=240):
        steps, (eager_grads, compiled_grads) = result["block"]
        assert [graphs for _, graphs in steps] == [1, 2, 2, 2]       # no recompile once the shape is symbolic
        for (eager, compiled), _ in steps:
            torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(compiled_grads, eager_grads, rtol=1e-5, atol=1e-6)
        assert [graphs for _, graphs in result["function"]] == [1, 2, 2, 2]
        for rows, ((eager, compiled), _) in zip((3, 5, 7, 9), result["function"], strict=True):
            assert compiled[0] == eager[0] == (2 * rows, 6)          # a concrete global shape, not a symbol
            assert compiled[1] == eager[1] == (Shard(0),)
            torch.testing.assert_close(compiled[2:], eager[2:], rtol=1e-5, atol=1e-6)
        assert [graphs for *_, graphs in result["inputs"]] == [1, 2, 2, 2]   # __metadata_guard__: not the shape
        for eager, compiled, grad, _ in result["inputs"]:
            torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(grad, 2 * (2 * torch.arange(grad.numel()).view(grad.shape)).cos())
