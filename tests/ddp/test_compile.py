"""DDP under torch.compile: the module's graph is cut at bucket boundaries (as torch's DDPOptimizer cuts torch's
DDP; spmd.comm.torch_backend, Note: spmd's DDP under torch.compile), so a compiled backward runs piece by piece
and the reducer launches a bucket's all-reduce between the pieces, before the backward's end, as in eager
training; and it trains as one process does. Compiling the wrapper (a model class of the user's, or an
nn.Sequential, whose torch-owned forward dynamo would otherwise skip) and wrapping a compiled module alike. Over
tensor parallelism (DTensor parameters, which the cut does not take) the graph stays whole and trains as one
process. torch.export of the wrapper records the module alone. Real processes from the pool: dynamo's tracing
is not thread-safe."""

from __future__ import annotations

import copy

import torch
from torch import nn

from tests.procpool import ProcPool

WIDTH, LAYERS, STEPS = 512, 4, 2      # each layer's weight is 1 MiB: DDPOptimizer's smallest cap, a bucket each


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _sequential() -> nn.Module:
    return nn.Sequential(*[module for _ in range(LAYERS) for module in (nn.Linear(WIDTH, WIDTH), nn.Tanh())])


def _train(model: nn.Module, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for x in xs:
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
    return [(param.full_tensor() if hasattr(param, "full_tensor") else param).detach().clone()
            for param in model.parameters()]


def _compiled_ddp(rank: int, world_size: int) -> dict[str, object]:
    import torch._dynamo
    from torch._dynamo.backends.common import aot_autograd

    import spmd
    from spmd.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from spmd.device_mesh import init_device_mesh
    from spmd.tensor import Replicate
    from spmd.tensor.parallel import ColwiseParallel, parallelize_module

    spmd.init_process_group("shm", timeout=60, torch_default_group=False)
    try:
        events: list[str] = []

        def backward_compiler(graph: torch.fx.GraphModule, example_inputs: list) -> object:
            def run(args: list) -> object:
                events.append("backward")
                return graph(*args)
            run._boxed_call = True     # type: ignore[attr-defined]
            return run

        def forward_compiler(graph: torch.fx.GraphModule, example_inputs: list) -> object:
            def run(args: list) -> object:
                return graph(*args)
            run._boxed_call = True     # type: ignore[attr-defined]
            return run

        backend = aot_autograd(fw_compiler=forward_compiler, bw_compiler=backward_compiler)

        def recording_hook(state: object, bucket: object) -> torch.futures.Future:
            events.append("all-reduce")
            return allreduce_hook(state, bucket)

        generator = torch.Generator().manual_seed(7)
        xs = [torch.randn(4 * world_size, WIDTH, generator=generator) for _ in range(STEPS)]
        results: dict[str, object] = {}
        for name, build in (("user model", _Net), ("nn.Sequential", _sequential), ("compiled module", _Net),
                            ("over tensor parallelism", _Net)):
            torch._dynamo.reset()
            torch.manual_seed(0)
            model = build()
            one_process = _train(copy.deepcopy(model), xs)
            if name == "over tensor parallelism":    # DTensor parameters (a 1-rank TP mesh): compiled uncut
                mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("dp", "tp"))
                parallelize_module(model, mesh["tp"], {f"layers.{i}": ColwiseParallel(output_layouts=Replicate())
                                                       for i in range(LAYERS)})
                ddp = spmd.DistributedDataParallel(model, device_mesh=mesh["dp"], bucket_cap_mb=1)
                compiled = torch.compile(ddp, backend=backend)
            elif name == "compiled module":
                ddp = spmd.DistributedDataParallel(torch.compile(model, backend=backend), bucket_cap_mb=1)
                compiled = ddp
            else:
                ddp = spmd.DistributedDataParallel(model, bucket_cap_mb=1)
                compiled = torch.compile(ddp, backend=backend)
            ddp.register_comm_hook(None, recording_hook)
            events.clear()
            trained = _train(compiled, [x.chunk(world_size)[rank] for x in xs])
            results[name] = (trained, one_process, list(events), len(ddp.reducer.buckets))
        return results
    finally:
        spmd.destroy_process_group()


def test_compiled_backward_hands_gradients_to_the_reducer_bucket_by_bucket(procpool: ProcPool) -> None:
    for result in procpool.run(_compiled_ddp, 2, timeout=300):
        for name, (trained, one_process, events, buckets) in result.items():
            assert buckets == LAYERS, (name, buckets)
            torch.testing.assert_close(trained, one_process, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name: f"{name}: {m}")
            per_step = len(events) // STEPS
            assert events.count("all-reduce") == STEPS * buckets, (name, events)
            if name == "over tensor parallelism":
                continue
            for step in range(STEPS):
                this_step = events[step * per_step:(step + 1) * per_step]
                last_backward = max(i for i, event in enumerate(this_step) if event == "backward")
                launched_before = this_step[:last_backward].count("all-reduce")
                # uncut, one backward graph runs and then every bucket launches: none before its end
                assert launched_before >= buckets - 1, (name, step, this_step)


def _exported_ddp(rank: int, world_size: int) -> dict[bool, tuple[set[str], torch.Tensor, torch.Tensor]]:
    import spmd

    spmd.init_process_group("shm", timeout=60, torch_default_group=False)
    try:
        torch.manual_seed(0)
        ddp = spmd.DistributedDataParallel(_Net())
        x = torch.randn(3, WIDTH)
        exported = {}
        for strict in (False, True):
            program = torch.export.export(ddp, (x,), strict=strict)
            targets = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
            exported[strict] = (targets, program.module()(x).detach(), ddp.module(x).detach())
        return exported
    finally:
        spmd.destroy_process_group()


def test_exporting_the_wrapper_exports_the_module_without_collectives(procpool: ProcPool) -> None:
    """torch.export of a DDP-wrapped model records the module's forward (torch's DDP refuses to be exported):
    no collective, no reducer, the module's outputs."""
    for result in procpool.run(_exported_ddp, 2, timeout=300):
        for strict, (targets, out, eager) in result.items():
            assert not any("spmd" in target or "c10d" in target for target in targets), (strict, targets)
            assert any("linear" in target or "addmm" in target for target in targets), (strict, targets)
            torch.testing.assert_close(out, eager, rtol=0, atol=0)
