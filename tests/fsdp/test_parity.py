"""FSDP2 parity: fully_shard on N thread ranks trains exactly like one process on the global batch.

Start here when FSDP gives wrong numbers. Each test names the option it exercises; the harness (harness.py)
says how the reference is built and why the tolerances are what they are. Sizes are odd on purpose: the MLP's
layers (7 -> 15 -> 13 -> 3) and the GPT's vocabulary (37) do not divide by 2 or 4, so every run shards unevenly,
and on 4 ranks the last MLP layer's 3 output rows leave one rank an empty shard.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from spmd.device_mesh import init_device_mesh
from spmd.fsdp import MixedPrecisionPolicy, fully_shard
from spmd.tensor import DTensor, Replicate, Shard
from spmd.tensor.random import manual_seed
from spmd.testing import run_ranks
from tests.fsdp.harness import (
    BATCH_PER_RANK,
    STEPS,
    TIMEOUT,
    assert_parity,
    blocks_of,
    fsdp_train,
    optimizer,
    reference,
    shard_blocks_then_root,
)
from tests.parity.models import TinyGPT, batch, build, loss_fn


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_matches_one_process(kind: str, world_size: int) -> None:
    results = run_ranks(lambda rank, size: fsdp_train(kind, rank, size), world_size, timeout=TIMEOUT)
    assert_parity(results, reference(kind, world_size))
    for result in results:
        for param in result["model"].parameters():
            assert isinstance(param, DTensor) and param.placements == (Shard(0),)


@pytest.mark.parametrize("reshard_after_forward", [False, 2, None])
def test_reshard_after_forward_options(reshard_after_forward: bool | int | None) -> None:
    def shard(model, mesh):
        shard_blocks_then_root(model, mesh, reshard_after_forward=reshard_after_forward)
    results = run_ranks(lambda rank, size: fsdp_train("gpt", rank, size, shard=shard), 4, timeout=TIMEOUT)
    assert_parity(results, reference("gpt", 4))
    blocks = len(blocks_of(build("gpt")))
    for result in results:
        step = result["counts"][0][0]
        # forward: one all-gather per group; backward: one per block resharded to the smaller group (those run
        # on the post-forward groups, not the mesh's); never for the root or with reshard_after_forward=False;
        # None (torch 2.13's default) reshards every block, so each is gathered again on the mesh in backward
        assert step["all_gather"] == blocks + 1 + (blocks if reshard_after_forward is None else 0)
        assert step["reduce_scatter"] == blocks + 1


def test_explicit_prefetch() -> None:
    def setup(model):
        blocks = blocks_of(model)
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1: i + 2])
            block.set_modules_to_backward_prefetch(blocks[i - 1: i] if i else [])
    results = run_ranks(lambda rank, size: fsdp_train("gpt", rank, size, setup=setup, build_kwargs={"layers": 3}),
                        2, timeout=TIMEOUT)
    assert_parity(results, reference("gpt", 2, build_kwargs={"layers": 3}))


def test_collectives_per_step() -> None:
    results = run_ranks(lambda rank, size: fsdp_train("gpt", rank, size, build_kwargs={"layers": 3}), 2,
                        timeout=TIMEOUT)
    for result in results:
        for step in result["counts"]:
            # forward: the root and 3 blocks; backward: the 3 resharded blocks again; one reduce-scatter per group
            assert step[0] == {"all_gather": 4 + 3, "reduce_scatter": 4}


def test_gradient_accumulation_reduces_once() -> None:
    results = run_ranks(lambda rank, size: fsdp_train("gpt", rank, size, micro_steps=3), 2, timeout=TIMEOUT)
    assert_parity(results, reference("gpt", 2, micro_steps=3))
    blocks = len(blocks_of(build("gpt")))
    for result in results:
        # three forwards and backwards, one reduce-scatter per group (the last micro-batch's)
        assert result["counts"][0][0] == {"all_gather": 3 * (2 * blocks + 1), "reduce_scatter": blocks + 1}


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=["fsdp", "hsdp"])
def test_gradients_accumulated_with_sync_off_are_reduced_by_reduce_accumulated_gradients(
        mesh_shape: tuple[int, ...]) -> None:
    """What a pipeline's weight half needs: backwards that reduce nothing, then one explicit reduction per group."""
    world_size = math.prod(mesh_shape)
    results = run_ranks(lambda rank, size: fsdp_train(
        "gpt", rank, size, mesh_shape=mesh_shape, setup=lambda model: model.set_requires_gradient_sync(False),
        before_step=lambda model: model.reduce_accumulated_gradients()), world_size, timeout=TIMEOUT)
    assert_parity(results, reference("gpt", world_size))
    blocks = len(blocks_of(build("gpt")))
    for result in results:
        assert result["counts"][0][len(mesh_shape) - 1]["reduce_scatter"] == blocks + 1


def test_hsdp_on_a_2x2_mesh() -> None:
    results = run_ranks(lambda rank, size: fsdp_train("gpt", rank, size, mesh_shape=(2, 2)), 4, timeout=TIMEOUT)
    assert_parity(results, reference("gpt", 4))
    blocks = len(blocks_of(build("gpt")))
    for result in results:
        step = result["counts"][0]
        assert step[1] == {"all_gather": 2 * blocks + 1, "reduce_scatter": blocks + 1}   # the shard dim
        assert step[0] == {"all_reduce": blocks + 1}                                      # the replicate dim
        for param in result["model"].parameters():
            assert param.placements[0].is_replicate() and param.placements[1] == Shard(0)


def test_hsdp_on_torchtitans_slice_of_a_flattened_dim() -> None:
    """TorchTitan's HSDP mesh: the root's replicate dim beside its flattened shard dim,
    world_mesh["dp_replicate", "dp_shard_cp"] (the groups are the 2x2 mesh's, so the harness counts them)."""
    def shard_on_titans_mesh(model: nn.Module, _: object) -> None:
        root = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        root[("dp_shard",)]._flatten("dp_shard_cp")
        shard_blocks_then_root(model, root["dp_replicate", "dp_shard_cp"])

    results = run_ranks(lambda rank, size: fsdp_train("gpt", rank, size, mesh_shape=(2, 2),
                                                      shard=shard_on_titans_mesh), 4, timeout=TIMEOUT)
    assert_parity(results, reference("gpt", 4))
    blocks = len(blocks_of(build("gpt")))
    for result in results:
        assert result["counts"][0] == {0: {"all_reduce": blocks + 1},
                                       1: {"all_gather": 2 * blocks + 1, "reduce_scatter": blocks + 1}}
        for param in result["model"].parameters():
            assert param.device_mesh.mesh_dim_names == ("dp_replicate", "dp_shard_cp")
            assert param.placements[0].is_replicate() and param.placements[1] == Shard(0)


def _freeze_first_layer(model: nn.Module) -> None:
    for param in model.layers[0].parameters():
        param.requires_grad_(False)


def test_frozen_parameters_take_no_reduction() -> None:
    results = run_ranks(lambda rank, size: fsdp_train("mlp", rank, size, frozen=_freeze_first_layer), 2,
                        timeout=TIMEOUT)
    assert_parity(results, reference("mlp", 2, frozen=_freeze_first_layer))
    for result in results:
        layer = result["model"].layers[0]
        assert all(p.grad is None for p in layer.parameters())
        # 3 layers gathered in forward and backward (root has no parameters); layers 1 and 2 reduce
        assert result["counts"][0][0] == {"all_gather": 3 + 3, "reduce_scatter": 2}


@pytest.mark.parametrize("how", ["non-reentrant", "reentrant"])
def test_activation_checkpointing(how: str) -> None:
    kwargs = {"checkpoint_blocks": how}
    results = run_ranks(lambda rank, size: fsdp_train("gpt", rank, size, build_kwargs=kwargs), 2, timeout=TIMEOUT)
    assert_parity(results, reference("gpt", 2, build_kwargs=kwargs))


def test_tied_weights_stay_tied() -> None:
    results = run_ranks(lambda rank, size: fsdp_train("gpt", rank, size), 2, timeout=TIMEOUT)
    for result in results:
        model = result["model"]
        assert isinstance(model.embed.weight, DTensor)
        names = [name for name, _ in model.named_parameters()]
        assert names == [name for name, _ in build("gpt").named_parameters()]


def _init_like_one_process(model: nn.Module, generator: torch.Generator | None) -> None:
    """GPT-2 style init drawn parameter by parameter (the DTensor ops draw the global tensor's numbers)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim >= 2:
                nn.init.normal_(param, std=0.02, generator=generator)
            elif name.endswith("weight"):
                nn.init.ones_(param)
            else:
                nn.init.normal_(param, std=0.01, generator=generator)


def test_meta_device_init_materialises_only_shards() -> None:
    ref_model = build("gpt")
    _init_like_one_process(ref_model, torch.Generator().manual_seed(5))

    def body(rank: int, size: int):
        with torch.device("meta"):
            model = TinyGPT()

        def shard(model, mesh):
            shard_blocks_then_root(model, mesh)
            for param in model.parameters():
                assert param.device.type == "meta"
            model.to_empty(device="cpu")
            manual_seed(5)
            _init_like_one_process(model, None)
            for param in model.parameters():
                assert param._local_tensor.numel() < param.numel()
            assert model.embed.weight is model._parameters.get("embed.weight", model.embed.weight)
        return fsdp_train("gpt", rank, size, model=model, shard=shard)

    results = run_ranks(body, 2, timeout=TIMEOUT)
    assert_parity(results, reference("gpt", 2, model=ref_model))


def _bf16(model_kind: str, reduce_dtype: torch.dtype):
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)

    def shard(model, mesh):
        shard_blocks_then_root(model, mesh, mp_policy=policy)
    return shard


def _bf16_reference(kind: str, world_size: int, reduce_dtype: torch.dtype) -> dict:
    """One process under the same casts: bf16 copies of the fp32 parameters compute each rank's shard; the shard
    gradients are cast to `reduce_dtype`, summed there and averaged, then applied to the fp32 parameters."""
    master = build(kind)
    opt = optimizer(master.parameters())
    losses = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)    # as each rank: bf16 LayerNorm grads depend on how many threads split the sum
    try:
        _bf16_steps(kind, world_size, reduce_dtype, master, opt, losses)
    finally:
        torch.set_num_threads(threads)
    return {"losses": losses, "params": [p.detach().clone() for p in master.parameters()]}


def _bf16_steps(kind, world_size, reduce_dtype, master, opt, losses) -> None:
    for step in range(STEPS):
        x, y = batch(kind, BATCH_PER_RANK * world_size, seed=step)
        grads = [torch.zeros_like(p, dtype=reduce_dtype) for p in master.parameters()]
        total = 0.0
        for xs, ys in zip(x.chunk(world_size), y.chunk(world_size), strict=True):
            low = build(kind)
            low.load_state_dict(master.state_dict())
            low.to(torch.bfloat16)
            loss = loss_fn(kind, low(xs.to(torch.bfloat16) if xs.is_floating_point() else xs), ys)
            loss.backward()
            total += loss.item() / world_size
            for acc, p in zip(grads, low.parameters(), strict=True):
                acc += p.grad.to(reduce_dtype)
        for p, acc in zip(master.parameters(), grads, strict=True):
            p.grad = (acc / world_size).to(torch.float32)
        opt.step()
        opt.zero_grad()
        losses.append(total)


@pytest.mark.parametrize("reduce_dtype", [torch.float32, torch.bfloat16])
def test_bf16_mixed_precision(reduce_dtype: torch.dtype) -> None:
    results = run_ranks(lambda rank, size: fsdp_train("gpt", rank, size, shard=_bf16("gpt", reduce_dtype)), 2,
                        timeout=TIMEOUT)
    # Each rank computes the same bf16 numbers as the reference's shard (one intra-op thread on both sides), and
    # both reduce in `reduce_dtype` (a sum of two values, exact in the same order), so fp32 tolerances hold.
    assert_parity(results, _bf16_reference("gpt", 2, reduce_dtype))
    for result in results:
        assert all(p.dtype == torch.float32 for p in result["model"].parameters())


def test_clip_grad_norm_matches_one_process() -> None:
    def clip(model):
        return float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5))
    results = run_ranks(lambda rank, size: fsdp_train("gpt", rank, size, before_step=clip), 2, timeout=TIMEOUT)
    ref = reference("gpt", 2, before_step=clip)
    assert_parity(results, ref)
    for result in results:
        torch.testing.assert_close(result["extras"], ref["extras"], rtol=1e-5, atol=1e-6)
    assert ref["extras"][0] > 0.5    # the clipping really clipped


def test_a_list_of_modules_is_one_group() -> None:
    def shard(model, mesh):
        fully_shard(list(model.layers[:2]), mesh=mesh)
        fully_shard(model, mesh=mesh)
    results = run_ranks(lambda rank, size: fsdp_train("mlp", rank, size, shard=shard), 2, timeout=TIMEOUT)
    assert_parity(results, reference("mlp", 2))
    for result in results:
        # forward: the pair (gathered once for both) and the root (layer 2); backward: the pair again
        assert result["counts"][0][0] == {"all_gather": 3, "reduce_scatter": 2}


class _Autocast(nn.Module):
    """The GPT's forward under torch.autocast (bf16 matmuls, fp32 parameters)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, tokens):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.inner(tokens).float()


def test_autocast() -> None:
    def shard(model, mesh):
        shard_blocks_then_root(model.inner, mesh)
        fully_shard(model, mesh=mesh)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)     # as each rank (bf16 reductions split over threads round differently)
    try:
        ref = reference("gpt", 2, model=_Autocast(build("gpt")))
    finally:
        torch.set_num_threads(threads)
    results = run_ranks(lambda rank, size: fsdp_train("gpt", rank, size, model=_Autocast(build("gpt")), shard=shard),
                        2, timeout=TIMEOUT)
    assert_parity(results, ref)


def test_gradient_arriving_in_two_backwards_is_reduced_in_full() -> None:
    # Reentrant's `shared` layer runs twice, once inside reentrant checkpointing: its gradient is accumulated in
    # the nested backward (when the group looks complete) and again in the outer one. Both parts must be reduced.
    def shard(model, mesh):
        fully_shard(model, mesh=mesh)
    results = run_ranks(lambda rank, size: fsdp_train("reentrant", rank, size, shard=shard), 2, timeout=TIMEOUT)
    assert_parity(results, reference("reentrant", 2))
    for result in results:
        assert result["counts"][0][0]["reduce_scatter"] == 2


def test_grad_scaler_with_fp16_skips_on_every_rank_when_one_shard_overflows() -> None:
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)

    def body(rank: int, size: int) -> dict:
        from spmd.device_mesh import init_device_mesh
        model = build("mlp")
        shard_blocks_then_root(model, init_device_mesh("cpu", (size,)), mp_policy=policy)
        opt = optimizer(model.parameters())
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        scales, stepped = [], []
        for step in range(3):
            x, y = batch("mlp", BATCH_PER_RANK * size, seed=step)
            before = [p.detach().full_tensor() for p in model.parameters()]
            loss = loss_fn("mlp", model(x.chunk(size)[rank]).float(), y.chunk(size)[rank])
            scaler.scale(loss).backward()
            if step == 1 and rank == 1:
                model.layers[1].weight.grad._local_tensor[0, 0] = float("inf")   # one shard of one rank
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            after = [p.detach().full_tensor() for p in model.parameters()]
            stepped.append(any(not torch.equal(a, b) for a, b in zip(after, before, strict=True)))
            scales.append(scaler.get_scale())
        return {"scales": scales, "stepped": stepped}

    results = run_ranks(body, 2, timeout=TIMEOUT)
    for result in results:
        assert result["stepped"] == [True, False, True]           # step 1 skipped everywhere
        assert result["scales"] == [2.0 ** 10, 2.0 ** 9, 2.0 ** 9]  # and the scale backed off identically


def test_an_optimizer_stepped_in_backward_by_post_accumulate_grad_hooks_matches_one_process() -> None:
    """torchtune's optimizer-in-backward: a hook on each sharded parameter steps its own optimizer once FSDP has
    reduced its gradient, and frees the gradient; FSDP runs those hooks after the reduction, as torch's does."""
    def setup(model: nn.Module) -> None:
        for param in model.parameters():
            param_opt = optimizer([param])

            def step(p: torch.Tensor, param_opt: torch.optim.Optimizer = param_opt) -> None:
                param_opt.step()
                param_opt.zero_grad()
            param.register_post_accumulate_grad_hook(step)

    results = run_ranks(lambda rank, size: fsdp_train("gpt", rank, size, setup=setup), 2, timeout=TIMEOUT)
    assert_parity(results, reference("gpt", 2))
    for result in results:
        assert all(p.grad is None for p in result["model"].parameters())   # each hook stepped and freed its own


def test_parameters_placed_on_another_mesh_by_shard_placement_fn_train_like_one_process() -> None:
    """torch 2.13's per-parameter mesh (a mixture-of-experts block's experts on their own mesh): shard_placement_fn
    returns a ShardPlacementResult for the middle layer, which is sharded HSDP-style over a (2, 2) mesh while the
    rest is sharded over all 4 ranks; one fully_shard call, one group per mesh, the same training."""
    from spmd.device_mesh import init_device_mesh
    from spmd.fsdp._fully_shard._fsdp_common import HSDPMeshInfo, ShardPlacementResult

    def shard(model: nn.Module, mesh) -> None:
        experts = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
        middle = {id(p) for p in model.layers[1].parameters()}

        def place(param: nn.Parameter):
            if id(param) in middle:
                return ShardPlacementResult(Shard(0), HSDPMeshInfo(experts, shard_mesh_dim=1, replicate_mesh_dim=0))
            return None
        fully_shard(model, mesh=mesh, shard_placement_fn=place)

    results = run_ranks(lambda rank, size: fsdp_train("mlp", rank, size, shard=shard), 4, timeout=TIMEOUT)
    assert_parity(results, reference("mlp", 4))
    for result in results:
        model = result["model"]
        assert len(model._fsdp_state().groups) == 2
        placements = {name: param.placements for name, param in model.named_parameters()}
        assert placements["layers.1.weight"] == (Replicate(), Shard(0))
        assert placements["layers.0.weight"] == placements["layers.2.bias"] == (Shard(0),)
        step = result["counts"][0][0]
        assert step["all_gather"] == step["reduce_scatter"] == 1        # the call's own mesh: one of each


def test_what_several_meshes_in_one_call_cannot_serve_is_refused() -> None:
    from spmd.device_mesh import init_device_mesh
    from spmd.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult

    def body(rank: int, size: int) -> None:
        mesh = init_device_mesh("cpu", (size,))
        other = init_device_mesh("cpu", (2, 2))
        with pytest.raises(ValueError, match=r"shards over a 1-d mesh \(shard_mesh_dim=0\) or a 2-d \(replicate, "):
            FSDPMeshInfo(other, shard_mesh_dim=0)
        on_other = ShardPlacementResult(None, FSDPMeshInfo(other, shard_mesh_dim=1, replicate_mesh_dim=0))
        with pytest.raises(ValueError, match="reshard_after_forward=int reshards to a part of `mesh`"):
            fully_shard(build("mlp"), mesh=mesh, reshard_after_forward=2,
                        shard_placement_fn=lambda p: on_other if p.ndim == 1 else None)
        model = fully_shard(build("mlp"), mesh=mesh, shard_placement_fn=lambda p: on_other if p.ndim == 1 else None)
        model(batch("mlp", 2, seed=0)[0])               # names the module by its path
        with pytest.raises(ValueError, match=r"set_all_reduce_hook: <root> \(FSDPMLP\) has parameters on 2 meshes"):
            model.set_all_reduce_hook(lambda output: None)

    run_ranks(body, 4, timeout=TIMEOUT)
