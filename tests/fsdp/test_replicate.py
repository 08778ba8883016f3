"""replicate on FSDP2's machinery (torch 2.13's `_composable.replicate_with_fsdp`): data parallelism with every
parameter a whole Replicate() DTensor, gradients all-reduced once per replicate call. Trains like one process, alone,
with mixed precision, accumulation and tensor parallelism; refuses what it cannot do."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import spmd
from spmd._composable import _get_registry
from spmd._composable.replicate_with_fsdp import ReplicateModule, is_composable_with_replicate, replicate
from spmd.checkpoint.state_dict import get_model_state_dict
from spmd.device_mesh import DeviceMesh, init_device_mesh
from spmd.fsdp import DataParallelMeshDims, FSDPModule, MixedPrecisionPolicy, fully_shard
from spmd.tensor import DTensor, Replicate
from spmd.testing import run_ranks, seeded
from tests.fsdp import test_tp
from tests.fsdp.harness import TIMEOUT, assert_parity, blocks_of, fsdp_train, reference
from tests.parity.models import build


def replicate_blocks_then_root(model: nn.Module, mesh: Any, **options: Any) -> None:
    for block in blocks_of(model):
        replicate(block, mesh=mesh, **options)
    replicate(model, mesh=mesh, **options)


def groups(model: nn.Module) -> int:
    """The replicate calls that own parameters: one all-reduce each per synced backward."""
    return sum(1 for m in model.modules() if isinstance(m, ReplicateModule) and m._fsdp_state().groups)


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_trains_like_one_process_with_one_all_reduce_per_call(kind: str) -> None:
    results = run_ranks(lambda rank, size: fsdp_train(kind, rank, size, shard=replicate_blocks_then_root), 2,
                        timeout=TIMEOUT)
    assert_parity(results, reference(kind, 2))
    for result in results:
        model = result["model"]
        assert result["counts"] == [{0: {"all_reduce": groups(model)}}] * 2     # nothing gathered nor scattered
        assert isinstance(model, ReplicateModule) and isinstance(model, FSDPModule)
        assert type(model).__name__ == f"Replicate{type(build(kind)).__name__}"
        for param in model.parameters():
            assert isinstance(param, DTensor) and param.placements == (Replicate(),)


def test_replicas_start_from_rank_0s_values_and_state_dicts_hold_whole_tensors() -> None:
    def body(rank: int, size: int) -> dict[str, torch.Tensor]:
        with seeded(rank):                      # each rank initialises differently, as DDP users may
            model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
        model[1].running_mean.fill_(float(rank))
        replicate(model)
        return get_model_state_dict(model)

    with seeded(0):
        expected = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).state_dict()
    for state in run_ranks(body, 2, timeout=TIMEOUT):
        torch.testing.assert_close(state["0.weight"].full_tensor(), expected["0.weight"], rtol=0, atol=0)
        torch.testing.assert_close(state["1.running_mean"], torch.zeros(4), rtol=0, atol=0)


def test_accumulation_without_sync_then_with_matches_the_big_batch() -> None:
    results = run_ranks(lambda rank, size: fsdp_train("mlp", rank, size, micro_steps=2,
                                                      shard=replicate_blocks_then_root), 2, timeout=TIMEOUT)
    assert_parity(results, reference("mlp", 2, micro_steps=2))
    for result in results:       # the first micro-step communicates nothing; the last, once per call
        assert result["counts"] == [{0: {"all_reduce": groups(result["model"])}}] * 2


def test_mixed_precision_runs_forward_in_bf16_and_keeps_fp32_parameters_and_gradients() -> None:
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def body(rank: int, size: int) -> dict[str, Any]:
        result = fsdp_train("mlp", rank, size, shard=lambda m, mesh: replicate_blocks_then_root(m, mesh,
                                                                                               mp_policy=policy))
        seen: list[torch.dtype] = []
        layer = blocks_of(result["model"])[0]
        handle = layer.register_forward_hook(lambda module, args, out: seen.append(module.weight.dtype))
        result["model"](torch.randn(2, 7)).sum().backward()
        handle.remove()
        result["forward dtypes"] = seen
        result["grad dtype"] = layer.weight.grad.dtype
        return result

    results = run_ranks(body, 2, timeout=TIMEOUT)
    assert_parity(results, reference("mlp", 2), rtol=2e-2, atol=2e-2)
    for result in results:
        assert result["forward dtypes"] == [torch.bfloat16]
        assert result["grad dtype"] == torch.float32
        assert all(p.dtype == torch.float32 for p in result["model"].parameters())


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16])
def test_forward_uses_the_parameters_own_storage_unless_it_needs_another_dtype(param_dtype: torch.dtype | None
                                                                               ) -> None:
    """Without mixed precision, replicate holds each parameter once: the module's parameter in forward is the
    replica's own storage (torch's copies it); in bf16 it is a copy."""

    def body(rank: int, size: int) -> tuple[bool, bool, int]:
        with seeded(0):
            model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
        replicate(model[0], mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype))
        replicate(model, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype))
        shard = model[0]._fsdp_state().params[0].local_shard
        seen = []
        model[0].register_forward_hook(lambda m, args, out: seen.append(m.weight.data_ptr() == shard.data_ptr()))
        for _ in range(2):
            model(torch.randn(2, 3)).sum().backward()
        unsharded = sum(t.numel() for t in model[0]._fsdp_state().groups[0].held_tensors()["unsharded parameters"])
        return seen[0], seen[1], unsharded

    for first, second, unsharded in run_ranks(body, 2, timeout=TIMEOUT):
        assert first == second == (param_dtype is None)
        assert (unsharded == 0) == (param_dtype is None)


def test_a_model_built_on_meta_then_materialised_trains_like_one_process() -> None:
    """TorchTitan's order: replicate on the meta device, then to_empty and initialise; forward then uses the new
    shards' storage (and backward reaches their hooks)."""

    def materialise(model: nn.Module) -> None:
        model.to_empty(device="cpu")
        with torch.no_grad():
            for param, initial in zip(model.parameters(), build("mlp", seed=0).parameters(), strict=True):
                param.to_local().copy_(initial)

    def body(rank: int, size: int) -> dict[str, Any]:
        with torch.device("meta"):
            model = build("mlp", seed=0)
        return fsdp_train("mlp", rank, size, model=model, shard=replicate_blocks_then_root, setup=materialise)

    assert_parity(run_ranks(body, 2, timeout=TIMEOUT), reference("mlp", 2))


@pytest.mark.parametrize(("mixed", "mode"), [(False, "last"), (False, "each"), (False, "scatter_each"),
                                             (True, "last"), (True, "each")])
def test_accumulate_drives_replicate_alone_and_under_a_root_over_fully_shard_blocks(mixed: bool, mode: str) -> None:
    """spmd.accumulate sets every replicate module (and fully_shard one, when a replicate root sits over
    fully_shard blocks, as a small model's head over sharded blocks); the gradient is the big batch's."""

    def build_model() -> nn.Module:
        with seeded(0):
            return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    def inputs() -> list[torch.Tensor]:
        return [torch.randn(4, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)]

    def body(rank: int, size: int) -> list[torch.Tensor]:
        model = build_model()
        if mixed:
            fully_shard(model[0])
        else:
            replicate(model[0])
            replicate(model[2])
        replicate(model)
        for x in spmd.accumulate(model, [x.chunk(size)[rank] for x in inputs()], reduce=mode):
            (model(x).square().mean() / 3).backward()
        return [p.grad.full_tensor() for p in model.parameters()]

    model = build_model()
    (sum(model(x).square().mean() for x in inputs()) / 3).backward()
    for grads in run_ranks(body, 2, timeout=TIMEOUT):
        for got, param in zip(grads, model.parameters(), strict=True):
            torch.testing.assert_close(got, param.grad)


def test_gradient_divide_factor_one_leaves_the_sum() -> None:
    def body(rank: int, size: int) -> torch.Tensor:
        with seeded(0):
            model = nn.Linear(3, 2)
        replicate(model)
        model.set_gradient_divide_factor(1.0)
        model(torch.full((1, 3), float(rank + 1))).sum().backward()
        return model.weight.grad.to_local()

    for grad in run_ranks(body, 2, timeout=TIMEOUT):
        torch.testing.assert_close(grad, torch.full((2, 3), 3.0))     # 1 + 2, not their mean


@pytest.mark.parametrize("whole_mesh", [False, True])
def test_over_tensor_parallelism_trains_like_one_process(whole_mesh: bool) -> None:
    """replicate over mesh["dp"] of tensor-parallel DTensors, or over the whole (dp, tp) mesh with dp_mesh_dims;
    the parameters live on (dp, tp), Replicate on dp."""

    def shard(model: nn.Module, dp_mesh: DeviceMesh) -> None:
        if not whole_mesh:
            replicate_blocks_then_root(model, dp_mesh)
            return
        whole = dp_mesh._root
        test_tp._on_the_whole_mesh(model, whole)
        replicate_blocks_then_root(model, whole, dp_mesh_dims=DataParallelMeshDims(replicate="dp"))

    initial = test_tp.build("lm", layers=1)
    results = run_ranks(lambda rank, size: test_tp.train("lm", copy.deepcopy(initial), "adamw", shard=shard), 4,
                        timeout=TIMEOUT)
    test_tp.assert_parity(results, test_tp.reference("lm", "adamw", layers=1))
    for result in results:
        up = result["model"].blocks[0].up.weight
        assert up.device_mesh.mesh_dim_names == ("dp", "tp")
        assert up.placements[0] == Replicate()


def test_registry_and_composability_with_fully_shard() -> None:
    def body(rank: int, size: int) -> None:
        mesh = init_device_mesh("cpu", (size,))
        sharded, replicated = fully_shard(nn.Linear(2, 2), mesh=mesh), replicate(nn.Linear(2, 2), mesh=mesh)
        assert fully_shard.state(sharded) is not None and replicate.state(replicated) is not None
        assert fully_shard.state(nn.Linear(2, 2)) is None
        assert set(_get_registry(sharded)) == {"fully_shard"}
        assert set(_get_registry(replicated)) == {"replicate"}
        assert _get_registry(nn.Linear(2, 2)) is None
        assert not is_composable_with_replicate(sharded) and is_composable_with_replicate(replicated)
        with pytest.raises(RuntimeError, match="already managed by fully_shard or replicate"):
            replicate(sharded, mesh=mesh)
        with pytest.raises(ValueError, match="already sharded"):
            fully_shard(replicated, mesh=mesh)

    run_ranks(body, 2, timeout=TIMEOUT)


def test_refuses_meshes_it_cannot_replicate_over() -> None:
    def body(rank: int, size: int) -> None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        with pytest.raises(ValueError, match="1-d DeviceMesh of the replicas, got a 2-d mesh"):
            replicate(nn.Linear(2, 2), mesh=mesh)
        with pytest.raises(ValueError, match="names shard dims"):
            replicate(nn.Linear(2, 2), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
        with pytest.raises(ValueError, match="replicating only is"):
            fully_shard(nn.Linear(2, 2), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(replicate="dp"))

    run_ranks(body, 4, timeout=TIMEOUT)
