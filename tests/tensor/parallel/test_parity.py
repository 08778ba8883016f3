"""Tensor-parallel training matches one process: the example GPT and the Llama-style model, on 2 and 4 thread
ranks, for plain TP, TP + sequence parallel and TP + loss parallel (same seed, same batch on every rank).

Losses at every step and every parameter's full value after the last step agree to 1e-5: the ranks sum the
same products in other orders (partial sums reduced across ranks), a few ulps per op.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spmd.device_mesh import init_device_mesh
from spmd.fsdp import fully_shard
from spmd.tensor import DTensor, Replicate, Shard, record_fallbacks
from spmd.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module
from spmd.testing import run_ranks, seeded
from tests.tensor.parallel.plans import CONTEXT, VOCAB, Layout, build, parallelize

STEPS = 3
RTOL, ATOL = 1e-5, 1e-6
TIMEOUT = 120.0


def batch(step: int, size: int = 4) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (size, CONTEXT + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def fresh(kind: str) -> nn.Module:
    with seeded(0):
        return build(kind)


def fsdp_over_tp(kind: str = "gpt", layout: Layout = Layout.TP) -> nn.Module:
    """TorchTitan's 2-D layout on a 2 x 2 (dp, tp) mesh: the plan over mesh["tp"], fully_shard per block and the
    root over mesh["dp"]. Collective over 4 ranks."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize(kind, fresh(kind), mesh["tp"], layout)
    for block in model.blocks if kind == "gpt" else model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def full(value: Tensor) -> Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def step_loss(model: nn.Module, tokens: Tensor, targets: Tensor, use_loss_parallel: bool) -> Tensor:
    logits = model(tokens)
    if use_loss_parallel:
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
            loss.backward()
        return loss.full_tensor()
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
    loss.backward()
    return loss


def train(model: nn.Module, use_loss_parallel: bool = False) -> tuple[list[float], dict[str, Tensor]]:
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        losses.append(step_loss(model, *batch(step), use_loss_parallel).item())
        opt.step()
    return losses, {name: full(p.detach()) for name, p in model.named_parameters()}


_REFERENCE: dict[str, tuple[list[float], dict[str, Tensor]]] = {}


def reference(kind: str) -> tuple[list[float], dict[str, Tensor]]:
    if kind not in _REFERENCE:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)      # as each rank: reductions split the same way
        try:
            _REFERENCE[kind] = train(fresh(kind))
        finally:
            torch.set_num_threads(threads)
    return _REFERENCE[kind]


def run_tp(kind: str, layout: Layout, world_size: int) -> list[tuple[list[float], dict[str, Tensor]]]:
    def body(rank: int, size: int) -> tuple[list[float], dict[str, Tensor]]:
        mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("tp",))
        model = parallelize(kind, fresh(kind), mesh["tp"], layout)
        with record_fallbacks() as fallbacks:
            result = train(model, layout.loss_parallel)
        assert fallbacks == [], f"ops without a sharding rule ran replicated: {fallbacks}"
        return result
    return run_ranks(body, world_size, timeout=TIMEOUT)


@pytest.mark.parametrize("kind", ["gpt", "llama"])
@pytest.mark.parametrize("layout", list(Layout), ids=lambda layout: layout.value)
@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_matches_one_process(kind: str, layout: Layout, world_size: int) -> None:
    ref_losses, ref_params = reference(kind)
    for losses, params in run_tp(kind, layout, world_size):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
        assert params.keys() == ref_params.keys()
        for name, value in params.items():
            torch.testing.assert_close(value, ref_params[name], rtol=RTOL, atol=ATOL, msg=name)


def test_compiled_tensor_parallel_blocks_train_as_one_process() -> None:
    """torch.compile of each block's forward (as the trainer's --compile), TP with sequence parallelism (so both
    the styles' hooks and PrepareModuleInput's run): the DTensor code runs eagerly between the compiled pieces,
    so every weight still gets its gradient (spmd.tensor.api, Note: DTensors under torch.compile). Without that,
    the blocks' weights got none and the losses drifted from eager."""
    def body(rank: int, size: int) -> tuple[list[float], dict[str, Tensor]]:
        mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("tp",))
        model = parallelize("gpt", fresh("gpt"), mesh["tp"], Layout.TP_SP)
        for block in model.blocks:
            block.forward = torch.compile(block.forward, backend="aot_eager")
        return train(model)

    ref_losses, ref_params = reference("gpt")
    for losses, params in run_ranks(body, 2, timeout=TIMEOUT):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
        for name, value in params.items():
            torch.testing.assert_close(value, ref_params[name], rtol=RTOL, atol=ATOL, msg=name)


def test_parameters_are_laid_out_as_megatron() -> None:
    def body(rank: int, size: int) -> dict[str, tuple]:
        mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("tp",))
        model = parallelize("llama", fresh("llama"), mesh["tp"], Layout.TP_SP_LOSS)
        return {name: (tuple(p.placements), tuple(p._local_tensor.shape))
                for name, p in model.named_parameters() if isinstance(p, DTensor)}
    layouts = run_ranks(body, 2, timeout=TIMEOUT)[0]
    reference_model = copy.deepcopy(fresh("llama"))
    assert len(layouts) == sum(1 for _ in reference_model.parameters())     # every parameter is a DTensor
    assert layouts["layers.0.attention.wq.weight"] == ((Shard(0),), (16, 32))
    assert layouts["layers.0.attention.wk.weight"] == ((Shard(0),), (8, 32))
    assert layouts["layers.0.attention.wo.weight"] == ((Shard(1),), (32, 16))
    assert layouts["layers.0.feed_forward.w2.weight"] == ((Shard(1),), (32, 48))
    assert layouts["layers.0.attention_norm.weight"] == ((Replicate(),), (32,))
    assert layouts["tok_embeddings.weight"] == ((Shard(0),), (32, 32))
    assert layouts["output.weight"] == ((Shard(0),), (32, 32))


@pytest.mark.parametrize("kind", ["gpt", "llama"])
@pytest.mark.parametrize("layout", [Layout.TP, Layout.TP_SP_LOSS], ids=lambda layout: layout.value)
def test_fsdp_over_tensor_parallel_on_a_2x2_mesh_matches_one_process(kind: str, layout: Layout) -> None:
    """TorchTitan's composition: parallelize_module on mesh["tp"], then fully_shard every block and the root on
    mesh["dp"]; each dp rank trains on its half of the batch and the optimizer steps the (dp, tp) DTensors."""
    def body(rank: int, size: int) -> tuple[list[float], dict[str, Tensor]]:
        model = fsdp_over_tp(kind, layout)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))   # the same mesh again: no new group
        assert all(p.device_mesh.ndim == 2 or p.device_mesh == mesh["dp"] for p in model.parameters())
        opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        dp_rank, losses = mesh.get_coordinate()[0], []
        for step in range(STEPS):
            opt.zero_grad()
            tokens, targets = (t.chunk(2)[dp_rank] for t in batch(step))
            loss = step_loss(model, tokens, targets, layout.loss_parallel)
            losses.append(loss.item())
            opt.step()
        return losses, {name: full(p.detach()) for name, p in model.named_parameters()}
    ref_losses, ref_params = reference(kind)
    results = run_ranks(body, 4, timeout=TIMEOUT)
    mean_losses = [(a + b) / 2 for a, b in zip(results[0][0], results[2][0])]    # dp ranks 0 and 1, tp rank 0
    torch.testing.assert_close(torch.tensor(mean_losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
    for _, params in results:
        for name, value in params.items():
            torch.testing.assert_close(value, ref_params[name], rtol=RTOL, atol=ATOL, msg=name)


def test_modules_reading_one_tensor_reduce_its_gradient_once() -> None:
    """q, k and v (and Llama's w1 and w3) read the same plain tensor: its three Partial gradients are added before
    one all-reduce (see Note: one DTensor per shared input). The GPT's TP step: per block one all-reduce after
    attention and one after the MLP in forward, one for the attention input's and one for the MLP input's gradient
    in backward (not three and one); the loss as one process."""
    ref_losses, _ = reference("gpt")

    def body(rank: int, size: int) -> tuple[list[str], float]:
        mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("tp",))
        model = parallelize("gpt", fresh("gpt"), mesh["tp"], Layout.TP)
        group = mesh["tp"].get_group(0)
        ops: list[str] = []
        run = group.run

        def counting_run(fingerprint, *rest, **options):
            ops.append(fingerprint.op)
            return run(fingerprint, *rest, **options)

        group.run = counting_run
        loss = step_loss(model, *batch(0), use_loss_parallel=False)
        del group.run
        return ops, loss.item()

    layers = len(fresh("gpt").blocks)
    for ops, loss in run_ranks(body, 2, timeout=TIMEOUT):
        forward = ["all_reduce"] * (1 + 2 * layers) + ["all_gather"]   # the embedding, the blocks, the head
        backward = ["all_reduce"] * (1 + 2 * layers)                       # the head's input, the blocks
        assert ops == forward + backward
        assert loss == pytest.approx(ref_losses[0], rel=RTOL)


def test_a_shared_input_is_converted_again_when_it_changed() -> None:
    """The shared conversion is only reused for the same tensor in the same state: after an in-place write, or
    with requires_grad switched on, the next module converts it again (its gradient still arrives)."""
    def body(rank: int, size: int) -> None:
        mesh = init_device_mesh("cpu", (size,))
        with seeded(0):
            a, b = nn.Linear(4, 6), nn.Linear(4, 6)
            x = torch.randn(3, 4)
        ref_b = copy.deepcopy(b)
        for module in (a, b):
            parallelize_module(module, mesh, ColwiseParallel(output_layouts=Replicate()))
        a(x)
        x.requires_grad_()
        b(x).sum().backward()
        ref_x = x.detach().clone().requires_grad_()
        ref_b(ref_x).sum().backward()
        torch.testing.assert_close(x.grad, ref_x.grad, rtol=RTOL, atol=ATOL)
        with torch.no_grad():
            x.mul_(2)
        torch.testing.assert_close(b(x), ref_b(ref_x * 2), rtol=RTOL, atol=ATOL)

    run_ranks(body, 2, timeout=TIMEOUT)


@pytest.mark.parametrize("world_size", [3, 4])
def test_a_hidden_width_the_ranks_do_not_divide_trains_as_one_process(world_size: int) -> None:
    """ColwiseParallel into RowwiseParallel with 10 hidden features on 3 or 4 ranks (shards of 4, 4, 2 and 3, 3,
    3, 1): the column layer's local output is laid out with the row layer's in_features as its width, not the
    local width times the ranks, so losses and the full weights after SGD steps agree with one process."""
    def make() -> nn.Module:
        with seeded(0):
            return nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 5))

    def run(model: nn.Module) -> tuple[list[float], dict[str, Tensor]]:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(STEPS):
            x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step))
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, {name: full(p).detach() for name, p in model.named_parameters()}

    want_losses, want_params = run(make())

    def body(rank: int, size: int) -> tuple[list[float], dict[str, Tensor]]:
        mesh = init_device_mesh("cpu", (size,))
        model = parallelize_module(make(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        assert model[0].weight.to_local().shape[0] == torch.arange(10).chunk(size)[rank].numel()
        return run(model)

    for losses, params in run_ranks(body, world_size, timeout=TIMEOUT):
        torch.testing.assert_close(losses, want_losses, rtol=RTOL, atol=ATOL)
        for name, value in params.items():
            torch.testing.assert_close(value, want_params[name], rtol=RTOL, atol=ATOL, msg=name)
