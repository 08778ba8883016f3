"""FSDP2's API around the training step: the module class, state dicts, explicit unshard/reshard, the setters,
offloading, placements other than Shard(0), ignored parameters, and the errors bad use gets."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from spmd.device_mesh import DeviceMesh, init_device_mesh
from spmd.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard, register_fsdp_forward_method, share_comm_ctx
from spmd.tensor import DTensor, Replicate, Shard, distribute_tensor
from spmd.testing import run_ranks
from tests.fsdp.harness import TIMEOUT, assert_parity, fsdp_train, reference, shard_blocks_then_root
from tests.parity.models import MLP, TinyGPT, batch, build, loss_fn


def _sharded_gpt(mesh: DeviceMesh, **options) -> nn.Module:
    model = build("gpt")
    shard_blocks_then_root(model, mesh, **options)
    return model


def _gradients_of_two_backwards() -> list[torch.Tensor]:
    """One process: the GPT's gradients after two backwards of the same 2-rank global batch (accumulated)."""
    ref = build("gpt")
    x, y = batch("gpt", 4)
    for _ in range(2):
        for xs, ys in zip(x.chunk(2), y.chunk(2), strict=True):
            (loss_fn("gpt", ref(xs), ys) / 2).backward()
    return [p.grad for p in ref.parameters()]


def test_module_class_becomes_an_fsdp_subclass() -> None:
    def body(rank: int, size: int) -> None:
        model = _sharded_gpt(init_device_mesh("cpu", (size,)))
        assert type(model).__name__ == "FSDPTinyGPT" and isinstance(model, FSDPModule | TinyGPT)
        assert type(model.blocks[0]).__name__ == "FSDPBlock" and isinstance(model.blocks[0], FSDPModule)
        assert type(model.blocks[0]) is type(model.blocks[1])   # one class per original class
        assert not isinstance(model.ln, FSDPModule)
    run_ranks(body, 2, timeout=TIMEOUT)


def test_state_dict_is_sharded_and_loads_back() -> None:
    def body(rank: int, size: int) -> None:
        mesh = init_device_mesh("cpu", (size,))
        model = _sharded_gpt(mesh, reshard_after_forward=False)
        x, _ = batch("gpt", 2)
        model(x)                                            # leaves the blocks unsharded
        state = model.state_dict()
        assert all(isinstance(v, DTensor) and v.placements == (Shard(0),) for v in state.values())
        want = build("gpt").state_dict()
        for key, value in state.items():
            torch.testing.assert_close(value.full_tensor(), want[key])
        other = _sharded_gpt(mesh)
        with torch.no_grad():
            for p in other.parameters():
                p.zero_()
        other.load_state_dict(state)
        for key, p in zip(state, other.parameters(), strict=True):
            torch.testing.assert_close(p.full_tensor(), want[key])
        other.load_state_dict(state, assign=True)           # new parameter objects are adopted
        torch.testing.assert_close(other(x), model(x))
    run_ranks(body, 2, timeout=TIMEOUT)


def test_explicit_unshard_and_reshard() -> None:
    def body(rank: int, size: int) -> None:
        model = _sharded_gpt(init_device_mesh("cpu", (size,)))
        block = model.blocks[0]
        handle = block.unshard(async_op=True)
        handle.wait()
        assert not isinstance(block.qkv.weight, DTensor) and block.qkv.weight.shape == (72, 24)
        torch.testing.assert_close(block.qkv.weight, build("gpt").blocks[0].qkv.weight)
        block.reshard()
        assert isinstance(block.qkv.weight, DTensor)
        assert block.unshard() is None
        block.reshard()
    run_ranks(body, 2, timeout=TIMEOUT)


def test_the_root_unsharded_before_each_forward_the_first_too_trains_as_one_process() -> None:
    # pytorch/examples' FSDP2 example with --explicit-prefetching calls model.unshard() before every forward
    def body(rank: int, size: int) -> list[torch.Tensor]:
        model = _sharded_gpt(init_device_mesh("cpu", (size,)))
        x, y = batch("gpt", 2 * size)
        for _ in range(2):
            model.unshard()
            loss_fn("gpt", model(x.chunk(size)[rank]), y.chunk(size)[rank]).backward()
        with torch.device("meta"):
            on_meta = TinyGPT()
        shard_blocks_then_root(on_meta, init_device_mesh("cpu", (size,)))
        with pytest.raises(RuntimeError, match=r"position is still on the meta device, and FSDP was asked to "
                                               r"gather it.*to_empty"):
            on_meta.unshard()
        return [p.grad.full_tensor() for p in model.parameters()]

    ref = _gradients_of_two_backwards()
    for grads in run_ranks(body, 2, timeout=TIMEOUT):
        for got, want in zip(grads, ref, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_reshard_after_backward_off_keeps_parameters_for_the_next_micro_batch() -> None:
    def body(rank: int, size: int) -> dict:
        model = _sharded_gpt(init_device_mesh("cpu", (size,)), reshard_after_forward=False)
        model.set_reshard_after_backward(False)
        x, y = batch("gpt", 2 * size)
        loss_fn("gpt", model(x.chunk(size)[rank]), y.chunk(size)[rank]).backward()
        held = not isinstance(model.blocks[0].qkv.weight, DTensor)
        model.set_reshard_after_backward(True)
        loss_fn("gpt", model(x.chunk(size)[rank]), y.chunk(size)[rank]).backward()
        return {"held": held, "grads": [p.grad.full_tensor() for p in model.parameters()]}

    results = run_ranks(body, 2, timeout=TIMEOUT)
    ref = _gradients_of_two_backwards()
    for result in results:
        assert result["held"]
        for got, want in zip(result["grads"], ref, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_is_last_backward_false_leaves_reductions_pending() -> None:
    def body(rank: int, size: int) -> tuple[list, list]:
        model = _sharded_gpt(init_device_mesh("cpu", (size,)))
        x, y = batch("gpt", 2 * size)
        xs, ys = x.chunk(size)[rank], y.chunk(size)[rank]
        model.set_is_last_backward(False)
        loss_fn("gpt", model(xs), ys).backward()
        pending = [p.grad is None for p in model.parameters()]
        model.set_is_last_backward(True)
        loss_fn("gpt", model(xs), ys).backward()
        return pending, [p.grad.full_tensor() for p in model.parameters()]

    results = run_ranks(body, 2, timeout=TIMEOUT)
    ref = _gradients_of_two_backwards()
    for pending, grads in results:
        assert any(pending)                                   # the last group's reduction was still in flight
        for got, want in zip(grads, ref, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_gradient_divide_factor() -> None:
    def setup(model):
        model.set_gradient_divide_factor(1.0)              # sum instead of average: twice the step on 2 ranks
    results = run_ranks(lambda rank, size: fsdp_train("mlp", rank, size, setup=setup, steps=1), 2, timeout=TIMEOUT)
    plain = run_ranks(lambda rank, size: fsdp_train("mlp", rank, size, steps=1), 2, timeout=TIMEOUT)
    start = [p.detach() for p in build("mlp").parameters()]
    for got, base, first in zip(results[0]["params"], plain[0]["params"], start, strict=True):
        torch.testing.assert_close(got - first, 2 * (base - first), rtol=1e-5, atol=1e-6)


def test_cpu_offload_policy_trains_the_same() -> None:
    def shard(model, mesh):
        shard_blocks_then_root(model, mesh, offload_policy=CPUOffloadPolicy())
    results = run_ranks(lambda rank, size: fsdp_train("gpt", rank, size, shard=shard), 2, timeout=TIMEOUT)
    assert_parity(results, reference("gpt", 2))
    for result in results:
        assert all(p._local_tensor.device.type == "cpu" for p in result["model"].parameters())


def test_shard_placement_fn_shards_another_dim() -> None:
    def shard(model, mesh):
        def placement(param):
            return Shard(1) if param.ndim == 2 else None
        for block in model.blocks:
            fully_shard(block, mesh=mesh, shard_placement_fn=placement)
        fully_shard(model, mesh=mesh, shard_placement_fn=placement)
    results = run_ranks(lambda rank, size: fsdp_train("gpt", rank, size, shard=shard), 2, timeout=TIMEOUT)
    assert_parity(results, reference("gpt", 2))
    qkv = results[0]["model"].blocks[0].qkv.weight
    assert qkv.placements == (Shard(1),) and qkv._local_tensor.shape == (72, 12)


def test_ignored_params_stay_plain_and_local() -> None:
    def body(rank: int, size: int) -> None:
        model = MLP()
        fully_shard(model, mesh=init_device_mesh("cpu", (size,)), ignored_params={model.layers[0].weight})
        assert not isinstance(model.layers[0].weight, DTensor)
        assert isinstance(model.layers[0].bias, DTensor)
        model(torch.randn(2, 7)).sum().backward()
        assert model.layers[0].weight.grad is not None and not isinstance(model.layers[0].weight.grad, DTensor)
    run_ranks(body, 2, timeout=TIMEOUT)


# -- bad input -----------------------------------------------------------------------------------------------

def test_dtensor_parameters_on_the_fsdp_mesh_are_refused() -> None:
    """A DTensor parameter must be tensor-parallel, on another slice of FSDP's mesh's root (tests/fsdp/test_tp.py)."""
    def body(rank: int, size: int) -> None:
        mesh = init_device_mesh("cpu", (size,))
        model = nn.Linear(4, 4)
        model.weight = nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Replicate()]))
        with pytest.raises(ValueError, match=r"parameter weight is a DTensor.*must be another slice of the same mesh"):
            fully_shard(model, mesh=mesh)
    run_ranks(body, 2, timeout=TIMEOUT)


def test_rank_outside_the_mesh_is_refused() -> None:
    def body(rank: int, size: int) -> None:
        mesh = DeviceMesh("cpu", [0])
        if rank == 1:
            with pytest.raises(ValueError, match="on rank 1: this rank is not in the mesh"):
                fully_shard(nn.Linear(4, 4), mesh=mesh)
    run_ranks(body, 2, timeout=TIMEOUT)


def test_bad_options_are_refused() -> None:
    def body(rank: int, size: int) -> None:
        mesh = init_device_mesh("cpu", (size,))
        with pytest.raises(ValueError, match="reshard_after_forward must be True, False or a divisor"):
            fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=3)
        with pytest.raises(ValueError, match="mesh must be 1-d"):
            fully_shard(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (size, 1, 1)))
        with pytest.raises(ValueError, match="returned Replicate"):
            fully_shard(nn.Linear(4, 4), mesh=mesh, shard_placement_fn=lambda p: Replicate())
        scalar = nn.Module()
        scalar.temperature = nn.Parameter(torch.tensor(1.0))
        with pytest.raises(ValueError, match="temperature is a scalar"):
            fully_shard(scalar, mesh=mesh)
        layer = nn.Linear(4, 4)
        fully_shard(layer, mesh=mesh)
        with pytest.raises(ValueError, match="Linear is already sharded"):
            fully_shard(layer, mesh=mesh)
    run_ranks(body, 4, timeout=TIMEOUT)


def test_child_forward_before_the_root_is_named() -> None:
    def body(rank: int, size: int) -> None:
        mesh = init_device_mesh("cpu", (size,))
        model = build("gpt")
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        model.blocks[0](torch.randn(1, 4, 24))       # the block initialises as its own root
        with pytest.raises(RuntimeError, match=r"Block.* already ran forward before this module was sharded"):
            fully_shard(model, mesh=mesh)
        other = build("gpt")
        for block in other.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(other, mesh=mesh)
        other.blocks[1](torch.randn(1, 4, 24))
        with pytest.raises(RuntimeError, match=r"blocks.1|Block.*already ran forward as its own root"):
            other(batch("gpt", 1)[0])
    run_ranks(body, 2, timeout=TIMEOUT)


def test_replaced_parameter_is_named() -> None:
    def body(rank: int, size: int) -> None:
        model = _sharded_gpt(init_device_mesh("cpu", (size,)))
        model.blocks[1].up.weight = nn.Parameter(torch.randn(96, 24))
        with pytest.raises(RuntimeError, match=r"parameter blocks\.1\.up\.weight was replaced"):
            model(batch("gpt", 1)[0])
    run_ranks(body, 2, timeout=TIMEOUT)


def test_meta_parameters_at_forward_are_named() -> None:
    def body(rank: int, size: int) -> None:
        with torch.device("meta"):
            model = TinyGPT()
        shard_blocks_then_root(model, init_device_mesh("cpu", (size,)))
        with pytest.raises(RuntimeError, match=r"position is still on the meta device.*to_empty"):
            model(batch("gpt", 1)[0])
    run_ranks(body, 2, timeout=TIMEOUT)


def test_different_models_across_ranks_are_named_not_hung() -> None:
    def body(rank: int, size: int) -> None:
        model = build("gpt", width=24 if rank == 0 else 32, heads=4)
        shard_blocks_then_root(model, init_device_mesh("cpu", (size,)))
        with pytest.raises(ValueError, match=r"the model differs from group rank \d.*parameter position"):
            model(batch("gpt", 1)[0])
    run_ranks(body, 2, timeout=TIMEOUT)


def test_mixed_precision_casts_inputs_and_root_outputs() -> None:
    from spmd.fsdp import MixedPrecisionPolicy

    def body(rank: int, size: int) -> tuple:
        seen = []
        model = MLP()
        model.layers[1].register_forward_pre_hook(lambda mod, args: seen.append(args[0].dtype))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float16)
        mesh = init_device_mesh("cpu", (size,))
        fully_shard(model.layers[1], mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        out = model(torch.randn(2, 7))
        no_cast = MLP()
        fully_shard(no_cast, mesh=mesh, mp_policy=MixedPrecisionPolicy(cast_forward_inputs=False))
        return seen[0], out.dtype, no_cast(torch.randn(2, 7)).dtype

    assert run_ranks(body, 2, timeout=TIMEOUT) == [(torch.bfloat16, torch.float16, torch.float32)] * 2


class _Scorer(nn.Module):
    """A model with a method run instead of forward that reads its own (root-held) parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(4, 4)
        self.head = nn.Parameter(torch.randn(6, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x) @ self.head.T

    def score(self, x: torch.Tensor) -> torch.Tensor:
        return (self.block(x) @ self.head.T).logsumexp(-1)


def test_a_registered_forward_method_gathers_the_parameters_and_trains_like_one_process() -> None:
    torch.manual_seed(0)
    ref = _Scorer()
    x = torch.randn(4, 4)
    ref.score(x).sum().backward()

    def body(rank: int, size: int) -> list[torch.Tensor]:
        model = _Scorer()
        model.load_state_dict(ref.state_dict())                # rank threads share torch's generator
        register_fsdp_forward_method(model, "score")          # not fully_shard'ed yet: a no-op
        assert "score" not in vars(model)
        mesh = init_device_mesh("cpu", (size,))
        fully_shard(model.block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        with pytest.raises(ValueError, match="has no method 'sample'"):
            register_fsdp_forward_method(model, "sample")
        register_fsdp_forward_method(model, "score")
        model.score(x.chunk(size)[rank]).sum().backward()
        assert isinstance(model.head, DTensor) and model.head.to_local().shape == (6 // size, 4)  # resharded
        return [p.grad.full_tensor() for p in model.parameters()]

    for grads in run_ranks(body, 2, timeout=TIMEOUT):
        for got, want in zip(grads, ref.parameters(), strict=True):
            torch.testing.assert_close(got, want.grad / 2)


def test_share_comm_ctx_takes_fsdp_modules_only() -> None:
    def body(rank: int, size: int) -> None:
        mesh = init_device_mesh("cpu", (size,))
        stages = [fully_shard(nn.Linear(4, 4), mesh=mesh) for _ in range(2)]
        share_comm_ctx(stages)                       # spmd's FSDP communicates on the caller's stream: shared
        with pytest.raises(ValueError, match=r"modules\[1\] is a Linear, not a module fully_shard wrapped"):
            share_comm_ctx([stages[0], nn.Linear(2, 2)])

    run_ranks(body, 2, timeout=TIMEOUT)
