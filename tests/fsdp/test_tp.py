"""FSDP over tensor parallelism: `fully_shard(model, mesh=mesh["dp"])` of a model whose parameters are already
DTensors on `mesh["tp"]` of a (dp, tp) = (2, 2) mesh of 4 thread ranks, as TorchTitan does with torch's FSDP2.

The tensor parallelism is built by hand, Megatron style: a colwise Linear has weight and bias Shard(0) on tp, a
rowwise Linear weight Shard(1) and bias Replicate; a plain activation enters a colwise layer as a Replicate
DTensor and leaves a rowwise one redistributed to Replicate. The transformer block runs its norms sequence
parallel (activations Shard(1), norm weights Replicate, whose gradients come out Partial). Every model has a
plain (not tensor-parallel) Linear beside the tensor-parallel ones, sharded in the same fully_shard call.

The reference is one process on the same global batch: dp rank d trains on chunk d, both tp ranks of it on the
same chunk, so the mean of the dp chunks' losses is the loss and its gradient FSDP's. Odd sizes on purpose: the
MLP's hidden width 11 splits 6/5 over tp and its tp pieces 3/3 and 3/2 over dp; the output width 5 splits 3/2.
Tolerances: fp32 on CPU, the order of additions differs (rtol 1e-5 / atol 1e-6, as in harness.py).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spmd.device_mesh import DeviceMesh, init_device_mesh
from spmd.fsdp import DataParallelMeshDims, MixedPrecisionPolicy, fully_shard
from spmd.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from spmd.tensor.placement import _StridedShard, chunk_range
from spmd.tensor.random import manual_seed
from spmd.testing import run_ranks, seeded

TIMEOUT = 120.0
STEPS = 3
DP, TP = 2, 2
BATCH_PER_DP = 2
RTOL, ATOL = 1e-5, 1e-6


# -- models --------------------------------------------------------------------------------------------------

class MLP(nn.Module):
    """A plain input projection (`plain=True`), then a Megatron MLP: colwise `up`, rowwise `down`."""

    def __init__(self, d_in: int = 5, width: int = 7, hidden: int = 11, d_out: int = 5, plain: bool = True) -> None:
        super().__init__()
        self.proj = nn.Linear(d_in, width) if plain else None
        self.up = nn.Linear(width if plain else d_in, hidden)
        self.down = nn.Linear(hidden, d_out)

    def forward(self, x: Tensor) -> Tensor:
        if self.proj is not None:
            x = torch.tanh(self.proj(x))
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP on (B, S, D); heads split over tp, norms sequence parallel."""

    def __init__(self, width: int = 8, heads: int = 2, hidden: int = 11) -> None:
        super().__init__()
        self.width, self.heads = width, heads
        self.norm1 = nn.LayerNorm(width)
        self.q, self.v = nn.Linear(width, width), nn.Linear(width, width)
        self.k = nn.Linear(width, width, bias=False)    # a key bias's gradient is zero in exact arithmetic
        self.o = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def _split_heads(self, x: Tensor) -> Tensor:
        batch, seq, _ = x.shape
        return x.view(batch, seq, self.heads, self.width // self.heads).transpose(1, 2)    # (B, H, S, D/H)

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm1(x)
        q, k, v = self._split_heads(self.q(h)), self._split_heads(self.k(h)), self._split_heads(self.v(h))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        batch, _, seq, _ = attn.shape
        x = x + self.o(attn.transpose(1, 2).reshape(batch, seq, self.width))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyLM(nn.Module):
    """Plain input projection -> tensor-parallel blocks -> plain head; (B, S, d_in) -> (B, S, d_out)."""

    def __init__(self, d_in: int = 5, width: int = 8, d_out: int = 3, layers: int = 2) -> None:
        super().__init__()
        self.proj = nn.Linear(d_in, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.head = nn.Linear(width, d_out)

    def forward(self, x: Tensor) -> Tensor:
        x = self.proj(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(kind: str, **kwargs: Any) -> nn.Module:
    with seeded(0):
        return MLP(**kwargs) if kind == "mlp" else TinyLM(**kwargs)


def batches(kind: str, steps: int = STEPS, dp: int = DP) -> list[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(1)
    size = BATCH_PER_DP * dp
    shape_in, shape_out = ((size, 5), (size, 5)) if kind == "mlp" else ((size, 6, 5), (size, 6, 3))
    return [(torch.randn(shape_in, generator=gen), torch.randn(shape_out, generator=gen)) for _ in range(steps)]


# -- tensor parallelism by hand ----------------------------------------------------------------------------

def _distribute(module: nn.Module, name: str, tp: DeviceMesh, placement: Placement) -> None:
    param = module._parameters[name]
    if param is None:
        return
    if param.device.type == "meta":           # distribute_tensor reads values; a meta parameter has none
        shape = distribute_tensor(torch.empty(param.shape), tp, [placement], src_data_rank=None).to_local().shape
        dt = DTensor.from_local(torch.empty(shape, device="meta"), tp, [placement], shape=param.shape)
    else:
        dt = distribute_tensor(param.detach(), tp, [placement], src_data_rank=None)
    module.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))


def colwise(linear: nn.Linear, tp: DeviceMesh) -> None:
    """Weight and bias Shard(0); the input (plain, or a DTensor laid out otherwise) enters as a Replicate
    DTensor."""
    _distribute(linear, "weight", tp, Shard(0))
    _distribute(linear, "bias", tp, Shard(0))

    def enter(module: nn.Module, args: tuple) -> tuple:
        x = args[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, tp, [Replicate()])
        return (x.redistribute(placements=[Replicate()]),)
    linear.register_forward_pre_hook(enter)


def rowwise(linear: nn.Linear, tp: DeviceMesh, output_placement: Placement | None = None) -> None:
    """Weight Shard(1), bias Replicate; the Partial output is redistributed to `output_placement`, or to
    Replicate and made a plain tensor again (None)."""
    _distribute(linear, "weight", tp, Shard(1))
    _distribute(linear, "bias", tp, Replicate())

    def leave(module: nn.Module, args: tuple, out: DTensor) -> Tensor:
        if output_placement is not None:
            return out.redistribute(placements=[output_placement])
        return out.redistribute(placements=[Replicate()]).to_local()
    linear.register_forward_hook(leave)


def sequence_parallel(norm: nn.LayerNorm, tp: DeviceMesh) -> None:
    """Weight and bias Replicate on Shard(1) activations; the output is gathered for the next colwise layer."""
    _distribute(norm, "weight", tp, Replicate())
    _distribute(norm, "bias", tp, Replicate())
    norm.register_forward_hook(lambda module, args, out: out.redistribute(placements=[Replicate()]))


def parallelize(model: nn.Module, tp: DeviceMesh) -> None:
    if isinstance(model, MLP):
        colwise(model.up, tp)
        rowwise(model.down, tp)
        return
    for block in model.blocks:
        sequence_parallel(block.norm1, tp)
        sequence_parallel(block.norm2, tp)
        for linear in (block.q, block.k, block.v, block.up):
            colwise(linear, tp)
        rowwise(block.o, tp, Shard(1))
        rowwise(block.down, tp, Shard(1))
        block.register_forward_pre_hook(
            lambda module, args: (DTensor.from_local(args[0], tp, [Replicate()]).redistribute(
                placements=[Shard(1)]),))
        block.register_forward_hook(
            lambda module, args, out: out.redistribute(placements=[Replicate()]).to_local())


def shard_root(model: nn.Module, dp: DeviceMesh, **options: Any) -> None:
    fully_shard(model, mesh=dp, **options)


def shard_blocks_then_root(model: nn.Module, dp: DeviceMesh, **options: Any) -> None:
    for block in getattr(model, "blocks", []):
        fully_shard(block, mesh=dp, **options)
    fully_shard(model, mesh=dp, **{k: v for k, v in options.items() if k != "reshard_after_forward"})


# -- the training runs -------------------------------------------------------------------------------------

def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=name == "adamw-foreach")


def mesh_2d() -> DeviceMesh:
    return init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))


def hybrid_mesh() -> DeviceMesh:
    """HSDP over tensor parallelism: (replicate, shard, tp) = (2, 2, 2), 8 ranks."""
    return init_device_mesh("cpu", (2, 2, TP), mesh_dim_names=("rep", "shard", "tp"))


def reference(kind: str, optimizer: str = "sgd", model: nn.Module | None = None,
              before_step: Callable[[nn.Module], Any] | None = None, dp: int = DP,
              **build_kwargs: Any) -> dict[str, Any]:
    """One process: each dp chunk of the global batch in turn, the chunk losses averaged."""
    model = model if model is not None else build(kind, **build_kwargs)
    opt = make_optimizer(optimizer, model.parameters())
    losses, extras = [], []
    for x, y in batches(kind, dp=dp):
        opt.zero_grad()
        total = 0.0
        for xs, ys in zip(x.chunk(dp), y.chunk(dp), strict=True):
            loss = F.mse_loss(model(xs), ys)
            (loss / dp).backward()
            total += loss.item() / dp
        if before_step is not None:
            extras.append(before_step(model))
        opt.step()
        losses.append(total)
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "extras": extras}


def train(kind: str, model: nn.Module, optimizer: str = "sgd",
          shard: Callable[..., None] = shard_blocks_then_root, setup: Callable[[nn.Module], None] | None = None,
          before_step: Callable[[nn.Module], Any] | None = None, hybrid: bool = False,
          flattened: bool = False, unflattened: bool = False) -> dict[str, Any]:
    """This rank: tensor parallelism on tp, fully_shard over dp (rep and shard with `hybrid`: HSDP; with
    `flattened`, TorchTitan's dp mesh: dims ("dp_shard", "cp") of a (dp_shard, cp, tp) mesh flattened), then the
    reference's steps on its dp chunk."""
    if flattened:
        mesh = init_device_mesh("cpu", (DP, 1, TP), mesh_dim_names=("dp_shard", "cp", "tp"))
        dp_mesh = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    elif unflattened:     # TorchTitan 0.2: tp from one unflattening of the world mesh, fsdp from another
        world = init_device_mesh("cpu", (DP * TP,), mesh_dim_names=("world",))
        mesh = world._unflatten(0, (DP, 1, TP), ("batch", "cp", "tp"), backend_override={"cp": "fake"})
        dp_mesh = world._unflatten(0, (1, DP, TP), ("dp_replicate", "fsdp", "tp"),
                                   backend_override={"dp_replicate": "fake"})["fsdp"]
    else:
        mesh = hybrid_mesh() if hybrid else mesh_2d()
        dp_mesh = mesh["rep", "shard"] if hybrid else mesh["dp"]
    parallelize(model, mesh["tp"])
    shard(model, dp_mesh)
    if setup is not None:
        setup(model)
    opt = make_optimizer(optimizer, model.parameters())
    dp = dp_mesh.size()
    d = mesh.get_coordinate()[0] * 2 + mesh.get_coordinate()[1] if hybrid else dp_mesh.get_local_rank()
    losses, extras = [], []
    for x, y in batches(kind, dp=dp):
        opt.zero_grad()
        loss = F.mse_loss(model(x.chunk(dp)[d]), y.chunk(dp)[d])
        loss.backward()
        if before_step is not None:
            extras.append(before_step(model))
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        params = {n: p.full_tensor() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params, "extras": extras, "model": model, "dp_rank": d, "mesh": mesh}


def assert_parity(results: list[dict[str, Any]], ref: dict[str, Any], rtol: float = RTOL, atol: float = ATOL) -> None:
    """Each dp rank's loss is its chunk's (the same on its tp ranks): their mean is the reference loss; every
    rank's full parameters are the reference's."""
    by_dp: dict[int, list[float]] = {}
    for result in results:
        seen = by_dp.setdefault(result["dp_rank"], result["losses"])
        torch.testing.assert_close(result["losses"], seen, rtol=rtol, atol=atol)
    mean = torch.tensor([by_dp[d] for d in range(len(by_dp))], dtype=torch.float64).mean(0)
    torch.testing.assert_close(mean, torch.tensor(ref["losses"], dtype=torch.float64), rtol=rtol, atol=atol)
    for result in results:
        assert result["params"].keys() == ref["params"].keys()
        for name, want in ref["params"].items():
            torch.testing.assert_close(result["params"][name], want, rtol=rtol, atol=atol, msg=name)


def run(body: Callable[[int, int], Any]) -> list[Any]:
    return run_ranks(body, DP * TP, timeout=TIMEOUT)


# -- parity ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("optimizer", ["sgd", "adamw", "adamw-foreach"])
def test_megatron_mlp_matches_one_process(optimizer: str) -> None:
    initial = build("mlp")
    results = run(lambda rank, size: train("mlp", copy.deepcopy(initial), optimizer, shard=shard_root))
    assert_parity(results, reference("mlp", optimizer))


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_transformer_blocks_match_one_process(optimizer: str) -> None:
    initial = build("lm")
    results = run(lambda rank, size: train("lm", copy.deepcopy(initial), optimizer))
    assert_parity(results, reference("lm", optimizer))


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_transformer_with_prefetch_and_reshard_options(reshard_after_forward: bool) -> None:
    def shard(model, dp):
        shard_blocks_then_root(model, dp, reshard_after_forward=reshard_after_forward)

    def setup(model):
        blocks = list(model.blocks)
        blocks[0].set_modules_to_forward_prefetch([blocks[1]])
        blocks[1].set_modules_to_backward_prefetch([blocks[0]])
    initial = build("lm")
    results = run(lambda rank, size: train("lm", copy.deepcopy(initial), "sgd", shard=shard, setup=setup))
    assert_parity(results, reference("lm"))


def test_over_a_flattened_data_parallel_mesh() -> None:
    """TorchTitan passes fully_shard its flattened ("dp_shard", "cp") mesh: the sharded parameters live on that
    dim and tp (DeviceMesh._concatenate of a flattened mesh)."""
    initial = build("lm", layers=1)
    results = run(lambda rank, size: train("lm", copy.deepcopy(initial), "adamw", flattened=True))
    assert_parity(results, reference("lm", "adamw", layers=1))
    for result in results:
        up = result["model"].blocks[0].up.weight
        assert up.device_mesh.mesh_dim_names == ("dp_shard_cp", "tp") and up.device_mesh.mesh.tolist() == [[0, 1],
                                                                                                           [2, 3]]


def test_over_meshes_from_two_unflattenings_of_the_world_mesh() -> None:
    """TorchTitan 0.2 unflattens its 1-d world mesh several times and takes fsdp from one and tp from another:
    DeviceMesh._concatenate lays the two out over the world's ranks."""
    initial = build("lm", layers=1)
    results = run(lambda rank, size: train("lm", copy.deepcopy(initial), "adamw", unflattened=True))
    assert_parity(results, reference("lm", "adamw", layers=1))
    for result in results:
        up = result["model"].blocks[0].up.weight
        assert up.device_mesh.mesh_dim_names == ("fsdp", "tp") and up.device_mesh.mesh.tolist() == [[0, 1], [2, 3]]


def test_hybrid_sharding_over_tensor_parallelism() -> None:
    """HSDP: fully_shard over mesh["rep", "shard"] of a (rep, shard, tp) mesh; the sharded parameters live on all
    three dims, Replicate first."""
    initial = build("lm", layers=1)
    results = run_ranks(lambda rank, size: train("lm", copy.deepcopy(initial), "adamw", hybrid=True), 8,
                        timeout=TIMEOUT)
    assert_parity(results, reference("lm", "adamw", dp=4, layers=1))
    for result in results:
        up = result["model"].blocks[0].up.weight
        assert up.device_mesh == result["mesh"]
        assert up.placements == (Replicate(), _StridedShard(0, split_factor=TP), Shard(0))
        assert result["model"].proj.weight.placements == (Replicate(), Shard(0))


def _on_the_whole_mesh(model: nn.Module, mesh: DeviceMesh) -> None:
    """Each tensor-parallel parameter as torch 2.13's SPMD form has it: a DTensor on the whole mesh, Replicate on
    every dim but the last (tp)."""
    for sub in model.modules():
        for name, param in list(sub._parameters.items()):
            if isinstance(param, DTensor):
                placements = [Replicate()] * (mesh.ndim - 1) + [param.placements[0]]
                setattr(sub, name, nn.Parameter(DTensor.from_local(param.to_local(), mesh, placements, run_check=False,
                                                                   shape=param.shape, stride=param.stride())))


@pytest.mark.parametrize("hybrid", [False, True])
def test_dp_mesh_dims_shard_parameters_already_on_the_whole_mesh_as_over_its_dp_slice(hybrid: bool) -> None:
    """fully_shard(mesh=whole, dp_mesh_dims=...) of whole-mesh DTensors trains and lays out the parameters as
    fully_shard(mesh=mesh["dp"]) of tensor-parallel ones (test_hybrid_sharding_over_tensor_parallelism)."""
    dims = DataParallelMeshDims(shard="shard", replicate="rep") if hybrid else DataParallelMeshDims(shard="dp")

    def shard(model: nn.Module, dp_mesh: DeviceMesh) -> None:
        whole = dp_mesh._root
        _on_the_whole_mesh(model, whole)
        shard_blocks_then_root(model, whole, dp_mesh_dims=dims)

    initial = build("lm", layers=1)
    results = run_ranks(lambda rank, size: train("lm", copy.deepcopy(initial), "adamw", shard=shard, hybrid=hybrid),
                        8 if hybrid else 4, timeout=TIMEOUT)
    assert_parity(results, reference("lm", "adamw", dp=4 if hybrid else DP, layers=1))
    for result in results:
        up = result["model"].blocks[0].up.weight
        assert up.device_mesh == result["mesh"]
        assert up.placements == ((Replicate(),) if hybrid else ()) + (_StridedShard(0, split_factor=TP), Shard(0))


def test_dp_mesh_dims_refuse_what_they_cannot_shard() -> None:
    def body(rank: int, size: int) -> None:
        mesh = mesh_2d()
        for dims, message in [(DataParallelMeshDims(shard="pp"), "the mesh has no dim 'pp'"),
                              (DataParallelMeshDims(replicate="dp"), "replicating only is")]:
            with pytest.raises(ValueError, match=message):
                fully_shard(nn.Linear(4, 4), mesh=mesh, dp_mesh_dims=dims)
        linear = nn.Linear(4, 4)
        linear.weight = nn.Parameter(distribute_tensor(linear.weight.detach(), mesh, [Shard(0), Replicate()]))
        with pytest.raises(ValueError, match=r"parameter weight is \[Shard\(0\), Replicate\(\)\].*Replicate on "
                                             r"the data-parallel dims"):
            fully_shard(linear, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))

    run_ranks(body, 4, timeout=TIMEOUT)


def test_fsdp_on_dim_1_strides_the_rowwise_weights() -> None:
    """shard_placement_fn Shard(1): FSDP splits a colwise weight's columns (TP has its rows) and a rowwise
    weight's columns, which TP split first: _StridedShard(1)."""
    def shard(model, dp):
        fully_shard(model, mesh=dp, shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None)
    initial = build("mlp")
    results = run(lambda rank, size: train("mlp", copy.deepcopy(initial), "sgd", shard=shard))
    assert_parity(results, reference("mlp"))
    placements = {n: p.placements for n, p in results[0]["model"].named_parameters()}
    assert placements["up.weight"] == (Shard(1), Shard(0))
    assert placements["down.weight"] == (_StridedShard(1, split_factor=TP), Shard(1))


# -- layout ----------------------------------------------------------------------------------------------

def _tp_then_dp_block(full: Tensor, tp: Placement, fsdp_dim: int, d: int, t: int) -> Tensor:
    """Rank (d, t)'s sharded block: tp rank t's piece of `full`, then dp rank d's chunk of it along fsdp_dim."""
    if isinstance(tp, Shard):
        full = full.narrow(tp.dim, *chunk_range(full.shape[tp.dim], TP, t))
    return full.narrow(fsdp_dim, *chunk_range(full.shape[fsdp_dim], DP, d))


def test_sharded_parameters_are_2d_dtensors() -> None:
    initial = build("mlp")
    tp_placements = {"up.weight": Shard(0), "up.bias": Shard(0), "down.weight": Shard(1), "down.bias": Replicate()}

    def body(rank: int, size: int) -> None:
        mesh = mesh_2d()
        model = copy.deepcopy(initial)
        parallelize(model, mesh["tp"])
        fully_shard(model, mesh=mesh["dp"])
        d, t = mesh.get_coordinate()
        want = dict(initial.named_parameters())
        for name, param in model.named_parameters():
            assert isinstance(param, DTensor) and param.shape == want[name].shape, name
            block = _tp_then_dp_block(want[name].detach(), tp_placements.get(name, Replicate()), 0, d, t)
            assert torch.equal(param.to_local(), block), name
            assert param._spec.local_shape() == block.shape
            if name.startswith("proj."):     # plain: sharded over dp alone, as torch's fully_shard does
                assert param.device_mesh == mesh["dp"] and param.placements == (Shard(0),)
                continue
            assert param.device_mesh == mesh
            tp = tp_placements[name]
            fsdp = _StridedShard(0, split_factor=TP) if tp == Shard(0) else Shard(0)
            assert param.placements == (fsdp, tp), name
            torch.testing.assert_close(param.full_tensor(), want[name])
        # uneven: 11 rows -> tp pieces 6 / 5 -> dp chunks 3, 3 / 3, 2; 5 rows -> 3 / 2
        assert model.up.weight.to_local().shape == ((3, 7) if (d, t) != (1, 1) else (2, 7))
        assert model.down.weight.to_local().shape == ((3, 6 - t) if d == 0 else (2, 6 - t))
        x = torch.randn(3, 5, generator=torch.Generator().manual_seed(3))
        model(x)     # unsharded for the forward: the module sees TP DTensors on the tp mesh
        model.unshard()
        assert model.up.weight.device_mesh == mesh["tp"] and model.up.weight.placements == (Shard(0),)
        assert model.down.bias.placements == (Replicate(),) and not isinstance(model.proj.weight, DTensor)
        model.reshard()
        loss = model(x).sum()
        loss.backward()
        for name, param in model.named_parameters():
            assert param.grad.device_mesh == param.device_mesh and param.grad.placements == param.placements, name
            assert param.grad.to_local().shape == param.to_local().shape, name
    run(body)


def test_partial_gradient_of_a_sequence_parallel_norm_is_reduced_over_tp() -> None:
    """The norm weights' unsharded gradients come out Partial on tp: FSDP all-reduces them over tp first."""
    initial = build("lm", layers=1)

    def body(rank: int, size: int) -> dict:
        mesh = mesh_2d()
        model = copy.deepcopy(initial)
        parallelize(model, mesh["tp"])
        block = model.blocks[0]
        seen: dict[str, Any] = {}
        fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        block.set_requires_gradient_sync(False)       # keep the unsharded parameters and gradients to look at
        block.set_reshard_after_backward(False)
        x, y = batches("lm", 1)[0]
        F.mse_loss(model(x.chunk(DP)[0]), y.chunk(DP)[0]).backward()
        seen["unsharded"] = (block.norm1.weight.device_mesh, block.norm1.weight.grad.placements)
        block.set_requires_gradient_sync(True)
        block.set_reshard_after_backward(True)
        F.mse_loss(model(x.chunk(DP)[0]), y.chunk(DP)[0]).backward()
        seen["sharded"] = (block.norm1.weight.device_mesh, block.norm1.weight.grad.placements)
        seen["meshes"] = (mesh["tp"], mesh)
        return seen

    for seen in run(body):
        tp, both = seen["meshes"]
        assert seen["unsharded"] == (tp, (Partial(),))
        assert seen["sharded"] == (both, (Shard(0), Replicate()))


# -- state dict, clipping, meta init, mixed precision -------------------------------------------------------

def test_state_dict_round_trip() -> None:
    initial = build("lm")

    def body(rank: int, size: int) -> None:
        mesh = mesh_2d()

        def sharded() -> nn.Module:
            model = copy.deepcopy(initial)
            parallelize(model, mesh["tp"])
            shard_blocks_then_root(model, mesh["dp"])
            return model
        model = sharded()
        state = model.state_dict()
        want = initial.state_dict()
        assert state.keys() == want.keys()
        for key, value in state.items():
            assert isinstance(value, DTensor) and value.ndim == want[key].ndim
            assert value.device_mesh == (mesh["dp"] if key.startswith(("proj.", "head.")) else mesh), key
            torch.testing.assert_close(value.full_tensor(), want[key])
        other = sharded()
        with torch.no_grad():
            for p in other.parameters():
                p.zero_()
        other.load_state_dict(state)
        for key, p in other.state_dict().items():
            torch.testing.assert_close(p.full_tensor(), want[key])
        x = batches("lm", 1)[0][0]
        other.load_state_dict({k: v.clone() for k, v in state.items()}, assign=True)
        torch.testing.assert_close(other(x), model(x))
    run(body)


def test_clip_grad_norm_matches_one_process() -> None:
    """Every parameter tensor-parallel (no plain layer), so every gradient is on the (dp, tp) mesh."""
    def clip(model):
        return float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.3))
    initial = build("mlp", plain=False)
    results = run(lambda rank, size: train("mlp", copy.deepcopy(initial), "sgd", shard=shard_root, before_step=clip))
    ref = reference("mlp", "sgd", model=copy.deepcopy(initial), before_step=clip)
    assert_parity(results, ref)
    assert ref["extras"][0] > 0.3      # it clipped
    for result in results:
        torch.testing.assert_close(result["extras"], ref["extras"], rtol=RTOL, atol=ATOL)


def test_clip_grad_norm_over_plain_and_tensor_parallel_parameters_is_refused() -> None:
    """Plain parameters live on the dp mesh, tensor-parallel ones on (dp, tp) (as in torch): one norm over both
    can't be taken, and says so."""
    initial = build("mlp")

    def body(rank: int, size: int) -> None:
        mesh = mesh_2d()
        model = copy.deepcopy(initial)
        parallelize(model, mesh["tp"])
        fully_shard(model, mesh=mesh["dp"])
        model(torch.randn(2, 5, generator=torch.Generator().manual_seed(0))).sum().backward()
        with pytest.raises(ValueError, match="different meshes"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        tp_params = [p for n, p in model.named_parameters() if not n.startswith("proj.")]
        assert float(torch.nn.utils.clip_grad_norm_(tp_params, max_norm=1.0)) > 0
    run(body)


def _init_like_one_process(model: nn.Module, generator: torch.Generator | None) -> None:
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            nn.init.normal_(param, std=0.3, generator=generator)


def test_meta_device_init_then_to_empty() -> None:
    initial = build("lm")
    _init_like_one_process(initial, torch.Generator().manual_seed(5))

    def body(rank: int, size: int) -> dict:
        with torch.device("meta"):
            model = TinyLM()

        def shard(model, dp):
            shard_blocks_then_root(model, dp)
            assert all(p.device.type == "meta" for p in model.parameters())
            model.to_empty(device="cpu")
            manual_seed(5)
            _init_like_one_process(model, None)
        return train("lm", model, "adamw", shard=shard)

    results = run(body)
    assert_parity(results, reference("lm", "adamw", model=initial))
    for result in results:
        assert result["model"].blocks[0].up.weight.placements == (_StridedShard(0, split_factor=TP), Shard(0))


def test_bf16_mixed_precision_unshards_bf16_dtensors() -> None:
    """bf16 all-gathers and compute, fp32 reduction and master weights. Tensor parallelism sums partial products
    in bf16 where the one-process run doesn't, so only bf16 agreement with the fp32 run is expected."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    initial = build("lm")

    def body(rank: int, size: int) -> dict:
        seen: dict[str, Any] = {}

        def shard(model, dp):
            shard_blocks_then_root(model, dp, mp_policy=policy)

        def setup(model):
            def record(module, args):
                seen.setdefault("unsharded", (type(module.weight), module.weight.dtype, module.weight.placements))
            model.blocks[0].up.register_forward_pre_hook(record)
        result = train("lm", copy.deepcopy(initial), "sgd", shard=shard, setup=setup)
        result["seen"] = seen
        return result

    results = run(body)
    assert_parity(results, reference("lm"), rtol=2e-2, atol=2e-2)
    for result in results:
        assert result["seen"]["unsharded"] == (DTensor, torch.bfloat16, (Shard(0),))
        for param in result["model"].parameters():
            assert param.dtype == torch.float32 and param.grad.dtype == torch.float32


# -- expert tensor parallelism: a 2-d tensor-parallel mesh ------------------------------------------------

E, TOKENS, WIDTH, HIDDEN = 4, 6, 5, 7


class Experts(nn.Module):
    """A plain input projection, then every token through each of E experts (w1, gelu, w2) summed. Expert
    parallelism, as TorchTitan's ExpertTensorParallel lays it out: the expert dim Shard(0) on ep, w1 colwise
    (Shard(2)) and w2 rowwise (Shard(1)) on etp, of an (efsdp, ep, etp) mesh; FSDP shards over efsdp."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.w1 = nn.Parameter(torch.randn(E, WIDTH, HIDDEN) * 0.3)
        self.w2 = nn.Parameter(torch.randn(E, HIDDEN, WIDTH) * 0.3)

    def forward(self, x: Tensor) -> Tensor:
        x = self.proj(x).unsqueeze(0).expand(E, *x.shape)
        if isinstance(self.w1, DTensor):
            x = DTensor.from_local(x, self.w1.device_mesh, [Replicate(), Replicate()])
            x = x.redistribute(placements=[Shard(0), Replicate()])
        out = torch.bmm(F.gelu(torch.bmm(x, self.w1)), self.w2).sum(0)
        return out.redistribute(placements=[Replicate(), Replicate()]).to_local() if isinstance(out, DTensor) else out


def test_experts_on_a_2d_tensor_parallel_mesh_train_clip_and_save_as_one_process() -> None:
    """fully_shard of parameters on a 2-d (ep, etp) mesh: each lands on (efsdp, ep, etp) strided as torch lays it
    out, and training with clipping over the experts, and a state dict round trip, are those of one process."""
    with seeded(0):
        initial = Experts()
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(2 * TOKENS, WIDTH, generator=gen), torch.randn(2 * TOKENS, WIDTH, generator=gen))
            for _ in range(STEPS)]

    def clip(model: nn.Module) -> float:
        return float(torch.nn.utils.clip_grad_norm_([model.w1, model.w2], max_norm=0.5))

    model = copy.deepcopy(initial)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    want_norms = []
    for x, y in data:
        opt.zero_grad()
        (sum(F.mse_loss(model(xs), ys) for xs, ys in zip(x.chunk(2), y.chunk(2), strict=True)) / 2).backward()
        want_norms.append(clip(model))
        opt.step()
    want = dict(model.named_parameters())

    def body(rank: int, size: int) -> dict[str, Any]:
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("efsdp", "ep", "etp"))
        model = copy.deepcopy(initial)
        ep_etp = mesh["ep", "etp"]
        model.w1 = nn.Parameter(distribute_tensor(model.w1.detach(), ep_etp, [Shard(0), Shard(2)]))
        model.w2 = nn.Parameter(distribute_tensor(model.w2.detach(), ep_etp, [Shard(0), Shard(1)]))
        fully_shard(model, mesh=mesh["efsdp"])
        layout = {name: (p.device_mesh, p.placements) for name, p in model.named_parameters()}
        state = {key: value.full_tensor() for key, value in model.state_dict().items()}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        d = mesh["efsdp"].get_local_rank()
        norms = []
        for x, y in data:
            opt.zero_grad()
            F.mse_loss(model(x.chunk(2)[d]), y.chunk(2)[d]).backward()
            norms.append(clip(model))
            opt.step()
        other = copy.deepcopy(initial)
        other.w1 = nn.Parameter(distribute_tensor(other.w1.detach(), ep_etp, [Shard(0), Shard(2)]))
        other.w2 = nn.Parameter(distribute_tensor(other.w2.detach(), ep_etp, [Shard(0), Shard(1)]))
        fully_shard(other, mesh=mesh["efsdp"])
        other.load_state_dict(model.state_dict())
        with torch.no_grad():
            return {"layout": layout, "mesh": mesh, "state": state, "norms": norms,
                    "params": {n: p.full_tensor() for n, p in model.named_parameters()},
                    "loaded": {n: p.full_tensor() for n, p in other.named_parameters()}}

    for result in run_ranks(body, 8, timeout=TIMEOUT):
        mesh = result["mesh"]
        assert result["layout"]["w1"] == (mesh, (_StridedShard(0, split_factor=2), Shard(0), Shard(2)))
        assert result["layout"]["w2"] == (mesh, (_StridedShard(0, split_factor=2), Shard(0), Shard(1)))
        assert result["layout"]["proj.weight"] == (mesh["efsdp"], (Shard(0),))
        for name, value in initial.state_dict().items():
            assert torch.equal(result["state"][name], value), name
        torch.testing.assert_close(result["norms"], want_norms, rtol=RTOL, atol=ATOL)
        assert want_norms[0] > 0.5      # it clipped
        for name, param in want.items():
            torch.testing.assert_close(result["params"][name], param.detach(), rtol=RTOL, atol=ATOL, msg=name)
            assert torch.equal(result["loaded"][name], result["params"][name]), name


# -- errors ----------------------------------------------------------------------------------------------

def test_dtensor_parameters_fsdp_cannot_compose_with_are_named() -> None:
    def body(rank: int, size: int) -> None:
        mesh = mesh_2d()
        other = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("a", "b"))
        cases = [
            (mesh["dp"], Shard(0), "must span distinct dims"),                 # FSDP's own mesh
            (other["b"], Shard(0), "not slices of one mesh"),
            (mesh["tp"], Partial(), "must be Shard or Replicate"),
            (mesh, Shard(0), "must span distinct dims"),                          # overlaps FSDP's
        ]
        for tp, placement, message in cases:
            model = nn.Linear(4, 4)
            placements = [placement] * tp.ndim
            model.weight = nn.Parameter(DTensor.from_local(model.weight.detach(), tp, placements,
                                                           shape=(4 * (tp.size() if placement == Shard(0) else 1), 4)))
            with pytest.raises(ValueError, match=f"parameter weight is a DTensor.*{message}"):
                fully_shard(model, mesh=mesh["dp"])
        flipped = init_device_mesh("cpu", (TP, DP), mesh_dim_names=("tp", "dp"))
        model = nn.Linear(4, 4)
        model.weight = nn.Parameter(distribute_tensor(model.weight.detach(), flipped["tp"], [Shard(0)]))
        with pytest.raises(ValueError, match="in its order"):
            fully_shard(model, mesh=flipped["dp"])
    run(body)
