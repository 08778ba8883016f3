"""The parallel styles one by one (layouts of parameters, inputs and outputs, keyword inputs, wildcards,
src_data_rank) and the bad inputs parallelize_module must name: unknown plan keys, unsupported module types,
meshes of the wrong dimension, dims too small to split, malformed plans."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import Tensor, nn

from spmd.device_mesh import DeviceMesh, init_device_mesh
from spmd.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from spmd.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from spmd.tensor.random import manual_seed
from spmd.testing import run_ranks, seeded

TIMEOUT = 60.0




def built(make, seed: int = 0) -> nn.Module:
    with seeded(seed):
        return make()


def on_ranks(fn, world_size: int = 2):
    def body(rank: int, size: int):
        return fn(init_device_mesh("cpu", (size,), mesh_dim_names=("tp",))["tp"], rank)
    return run_ranks(body, world_size, timeout=TIMEOUT)


def test_colwise_and_rowwise_embeddings_match_the_plain_lookup() -> None:
    ids = torch.tensor([[0, 5, 9, 3], [9, 9, 1, 0]])
    table = built(lambda: nn.Embedding(10, 6))
    want = table(ids)
    want.sum().backward()

    def body(mesh, rank: int) -> list:
        out = []
        for style, weight_layout, output_layout in (
                (ColwiseParallel(use_local_output=False), Shard(1), Shard(2)),
                (RowwiseParallel(input_layouts=Replicate(), use_local_output=False), Shard(0), Replicate()),
                (RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
                 Shard(0), Shard(1))):
            module = parallelize_module(built(lambda: nn.Embedding(10, 6)), mesh, style)
            assert module.weight.placements == (weight_layout,)
            y = module(ids)
            assert isinstance(y, DTensor) and y.placements == (output_layout,)
            y.sum().backward()
            out.append((y.full_tensor(), module.weight.grad.full_tensor()))
        return out
    for results in on_ranks(body):
        for value, grad in results:
            torch.testing.assert_close(value, want)
            torch.testing.assert_close(grad, table.weight.grad)


def test_linear_layouts_and_local_outputs() -> None:
    x = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(0))

    def body(mesh, rank: int) -> None:
        up = parallelize_module(built(lambda: nn.Linear(8, 6)), mesh, ColwiseParallel())
        assert (up.weight.placements, up.bias.placements) == ((Shard(0),), (Shard(0),))
        hidden = up(x)
        assert type(hidden) is Tensor and hidden.shape == (3, 4, 3)       # this rank's output features
        down = parallelize_module(built(lambda: nn.Linear(6, 8), 1), mesh, RowwiseParallel(use_local_output=False))
        assert (down.weight.placements, down.bias.placements) == ((Shard(1),), (Replicate(),))
        y = down(hidden)
        assert isinstance(y, DTensor) and y.placements == (Replicate(),)
        plain_up, plain_down = built(lambda: nn.Linear(8, 6)), built(lambda: nn.Linear(6, 8), 1)
        torch.testing.assert_close(y.full_tensor(), plain_down(plain_up(x)))
    on_ranks(body)


def test_sequence_parallel_keeps_the_sequence_sharded() -> None:
    x = torch.randn(2, 8, 5, generator=torch.Generator().manual_seed(1))

    def body(mesh, rank: int) -> None:
        norm = parallelize_module(nn.LayerNorm(5), mesh, SequenceParallel())
        assert norm.weight.placements == (Replicate(),)
        local = x.chunk(mesh.size(), dim=1)[rank]
        y = norm(local)                                     # a plain input is this rank's sequence shard
        assert isinstance(y, DTensor) and y.placements == (Shard(1),)
        torch.testing.assert_close(y.full_tensor(), nn.functional.layer_norm(x, (5,)))
        replicated = DTensor.from_local(x, mesh, [Replicate()])
        assert norm(replicated).placements == (Shard(1),)    # a DTensor input is redistributed to Shard(1)
        y.sum().backward()
        assert norm.weight.grad.placements in ((Partial(),), (Replicate(),))
        local_output = parallelize_module(nn.Dropout(0.0), mesh,
                                          SequenceParallel(sequence_dim=0, use_local_output=True))
        assert type(local_output(x[0])) is Tensor
    on_ranks(body)


class TwoInputs(nn.Module):
    def forward(self, x: Tensor, scale: Tensor | None = None, *, bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
        assert isinstance(x, DTensor) and x.placements == (Replicate(),)
        assert bias is None or (isinstance(bias, DTensor) and bias.placements == (Shard(0),))
        return x * 2, x + (bias.full_tensor().sum() if bias is not None else 0)


def test_prepare_module_input_output_with_positional_and_keyword_layouts() -> None:
    x = torch.arange(8.0).reshape(4, 2)

    def body(mesh, rank: int) -> None:
        module = parallelize_module(TwoInputs(), mesh, PrepareModuleInputOutput(
            input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(), None),
            input_kwarg_layouts={"bias": Replicate()}, desired_input_kwarg_layouts={"bias": Shard(0)},
            output_layouts=(Replicate(), None), desired_output_layouts=(Shard(0), None)))
        first, second = module(x.chunk(2)[rank], None, bias=torch.ones(4))
        torch.testing.assert_close(first, (x * 2).chunk(2)[rank])        # Shard(0), then the local tensor
        assert isinstance(second, DTensor) and second.placements == (Replicate(),)   # None: left alone
        torch.testing.assert_close(second.full_tensor(), x + 4)
    on_ranks(body)


def test_wildcard_paths_the_empty_path_and_src_data_rank() -> None:
    def make() -> nn.Module:
        return nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Sequential(nn.Linear(4, 4), nn.ReLU()))

    def body(mesh, rank: int) -> list[Tensor]:
        model = built(make, seed=rank)                   # the ranks start from different values
        own = model[1][0].weight.detach().clone()
        parallelize_module(model, mesh, {"*.0": ColwiseParallel()})
        assert all(isinstance(model[i][0].weight, DTensor) for i in range(2))
        other = built(make, seed=rank)
        parallelize_module(other[1][0], mesh, {"": ColwiseParallel()}, src_data_rank=None)
        torch.testing.assert_close(other[1][0].weight.to_local(), own.chunk(2)[rank])   # kept its own values
        return [model[1][0].weight.full_tensor(), own]
    (rank0_full, rank0_own), (rank1_full, _) = on_ranks(body)
    torch.testing.assert_close(rank1_full, rank0_own)      # src_data_rank=0: every rank takes rank 0's values
    torch.testing.assert_close(rank0_full, rank0_own)


def test_a_model_built_on_meta_is_laid_out_then_materialised() -> None:
    # TorchTitan's order: build on the meta device, parallelize_module, to_empty, initialise
    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 4))

    def body(mesh, rank: int) -> tuple[Tensor, Tensor]:
        with torch.device("meta"):
            model = make()
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        assert model[0].weight.is_meta and model[0].weight.to_local().shape == (3, 4)
        model.to_empty(device="cpu")
        manual_seed(0)                                   # DTensor initialisation draws the one-process numbers
        for layer in (model[0], model[2]):
            layer.reset_parameters()
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(5))
        return model[0].weight.full_tensor(), model(x)

    with seeded(0):
        reference = make()
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(5))
    for weight, out in on_ranks(body):
        torch.testing.assert_close(weight, reference[0].weight.detach())
        torch.testing.assert_close(out, reference(x).detach())


def test_bad_plans_name_what_is_wrong() -> None:
    def body(mesh, rank: int) -> None:
        model = nn.Sequential(nn.Linear(4, 1), nn.LayerNorm(4))
        # pytest.warns on one rank thread only: its filters are process-wide, and two threads' would race
        first = rank == 0
        with pytest.warns(UserWarning, match=r"plan key 'blocks\.\*\.wq' matches no submodule of Sequential") \
                if first else contextlib.nullcontext():
            parallelize_module(model, mesh, {"blocks.*.wq": ColwiseParallel()})    # skipped, as torch does
        assert not isinstance(model[0].weight, DTensor)
        stage = nn.Sequential(nn.Linear(4, 4))              # a pipeline stage: the plan's other modules are gone
        with pytest.warns(UserWarning, match=r"plan key 'tok_embeddings' matches no submodule") if first \
                else contextlib.nullcontext():
            parallelize_module(stage, mesh, {"tok_embeddings": ColwiseParallel(), "0": ColwiseParallel()})
        assert isinstance(stage[0].weight, DTensor)        # the entries that match still apply
        with pytest.raises(TypeError, match=r"ColwiseParallel supports nn.Linear and nn.Embedding, but '1' "
                                            r"\(LayerNorm\)"):
            parallelize_module(model, mesh, {"1": ColwiseParallel()})
        with pytest.raises(ValueError, match=r"'0' \(Linear\)\.weight has 1 entries along dim 0, fewer than the 2"):
            parallelize_module(model, mesh, {"0": ColwiseParallel()})
        with pytest.raises(TypeError, match=r"plan entry '0'"):
            parallelize_module(model, mesh, {"0": "colwise"})
        with pytest.raises(TypeError, match=r"a ParallelStyle or a dict"):
            parallelize_module(model, mesh, [ColwiseParallel()])
        with pytest.raises(ValueError, match=r"pass a parallelize_plan"):
            parallelize_module(model, mesh)
        grown = nn.Linear(4, 4)
        parallelize_module(grown, mesh, ColwiseParallel())
        with pytest.raises(ValueError, match=r"already a DTensor"):
            parallelize_module(grown, mesh, RowwiseParallel())
        wrong = parallelize_module(nn.Identity(), mesh, PrepareModuleInput(input_layouts=(Shard(0), None),
                                                                           desired_input_layouts=(Replicate(), None)))
        with pytest.raises(ValueError, match=r"got 1 positional inputs but input_layouts has 2 entries"):
            wrong(torch.ones(2))
        with pytest.raises(ValueError, match=r"2 output_layouts but 1 desired_output_layouts"):
            PrepareModuleOutput(output_layouts=(Shard(0), None), desired_output_layouts=(Replicate(),))
    on_ranks(body)


def test_a_2d_mesh_is_refused_with_the_slice_to_use() -> None:
    def body(rank: int, size: int) -> None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        with pytest.raises(ValueError, match=r"needs a 1-d tensor-parallel mesh, got a 2-d one .*mesh\['tp'\]"):
            parallelize_module(nn.Linear(4, 4), mesh, ColwiseParallel())
        parallelize_module(nn.Linear(4, 4), mesh["tp"], ColwiseParallel())
    run_ranks(body, 4, timeout=TIMEOUT)


def test_sequence_parallel_dropout_draws_the_one_process_mask() -> None:
    x = torch.randn(2, 8, 6, generator=torch.Generator().manual_seed(3))
    with seeded(0):
        want = nn.functional.dropout(x, 0.5)

    def body(mesh, rank: int) -> Tensor:
        manual_seed(0)
        dropout = parallelize_module(nn.Dropout(0.5), mesh, SequenceParallel())
        y = dropout(x.chunk(mesh.size(), dim=1)[rank])
        return y.full_tensor()
    for got in on_ranks(body, 4):
        torch.testing.assert_close(got, want)


class _CheckpointedMLP(nn.Module):
    """A colwise-rowwise MLP under reentrant activation checkpointing: it saves only its input for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(6, 10), nn.Linear(10, 6)

    def forward(self, x: Tensor) -> Tensor:
        return torch.utils.checkpoint.checkpoint(lambda y: self.down(torch.relu(self.up(y))), x, use_reentrant=True)


def test_input_reshard_keeps_the_saved_input_sharded_and_gathers_it_for_backward() -> None:
    from spmd.tensor.parallel.input_reshard import input_reshard
    from tests.parity.test_ddp import count_collectives

    def run(mesh, rank: int, reshard: bool) -> dict:
        model = built(_CheckpointedMLP)
        parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        if reshard:
            input_reshard(model, mesh, input_reshard_dim=0)
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(3), requires_grad=True)   # 5 rows: uneven
        saved: list[tuple] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
            out = model(x)
        counts = count_collectives(mesh.get_group())
        out.sum().backward()
        return {"grads": [x.grad] + [p.grad.full_tensor() for p in model.parameters()], "out": out.detach(),
                "saved": saved, "gathers": counts.get("all_gather", 0)}

    def body(mesh, rank: int) -> tuple[dict, dict, tuple]:
        kept = _pack(mesh, 0, torch.ones(5, 6))      # what the module's hook keeps of a replicated 5 x 6 input
        return run(mesh, rank, reshard=False), run(mesh, rank, reshard=True), tuple(kept.piece.to_local().shape)

    from spmd.tensor.parallel.input_reshard import _pack
    for rank, (plain, resharded, kept) in enumerate(on_ranks(body)):
        assert kept == ((3, 6), (2, 6))[rank]        # this rank's rows only
        torch.testing.assert_close(resharded["out"], plain["out"])
        for got, want in zip(resharded["grads"], plain["grads"], strict=True):
            torch.testing.assert_close(got, want)
        assert plain["saved"] == [(5, 6)]            # what the outer hooks see: the module's own are innermost
        assert resharded["gathers"] == plain["gathers"] + 1     # the saved input, gathered back in backward


def test_a_colwise_linear_takes_a_strided_slice_as_input() -> None:
    """torchtune feeds its output projection `h.chunk(n, dim=1)` pieces: not contiguous, not dense. The DTensor
    made from one keeps torch's global strides, so the Linear reshapes rather than views it."""
    def make() -> nn.Linear:
        with seeded(0):
            return nn.Linear(16, 8, bias=False)

    def body(mesh, rank: int) -> tuple[Tensor, Tensor]:
        layer = make()
        parallelize_module(layer, mesh, ColwiseParallel(output_layouts=Replicate()))
        hidden = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
        piece = hidden.chunk(2, dim=1)[0]
        out = layer(piece)
        out.square().sum().backward()
        return out.detach(), hidden.grad

    reference = make()
    hidden = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    expected = reference(hidden.chunk(2, dim=1)[0])
    expected.square().sum().backward()
    for out, grad in on_ranks(body):
        torch.testing.assert_close(out, expected.detach())
        torch.testing.assert_close(grad, hidden.grad)


def test_from_local_of_a_tensor_that_is_not_dense_keeps_torchs_global_strides() -> None:
    import torch.distributed as torch_dist
    from torch.distributed.tensor import DTensor as TorchDTensor
    from torch.distributed.tensor import Shard as TorchShard

    local = torch.randn(4, 6, 5)[:, :3]                                   # a strided slice: stride (30, 5, 1)
    torch_dist.init_process_group("fake", rank=0, world_size=2)
    try:
        torch_mesh = torch_dist.device_mesh.init_device_mesh("cpu", (2,))
        expected = [TorchDTensor.from_local(local, torch_mesh, [placement], run_check=False).stride()
                    for placement in (TorchShard(0), TorchShard(1), TorchShard(2))]
    finally:
        torch_dist.destroy_process_group()

    def body(mesh, rank: int) -> list:
        return [DTensor.from_local(local, mesh, [Shard(dim)], run_check=False).stride() for dim in range(3)]

    assert on_ranks(body)[0] == expected


class _Distributed(ParallelStyle):
    """A style written as TorchTitan writes its own (NoParallel, ExpertParallel, ...): torch's `_apply(module,
    device_mesh)` signature, any mesh."""

    def __init__(self, placements: list) -> None:
        self.placements = placements

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for key, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(key, nn.Parameter(distribute_tensor(param, mesh, self.placements)))
        return distribute_module(module, device_mesh, partition)


def test_a_style_of_your_own_takes_torchs_signature_and_any_mesh() -> None:
    def body(rank: int, size: int) -> None:
        tp = init_device_mesh("cpu", (4,))
        model = parallelize_module(nn.Sequential(nn.Linear(4, 4)), tp, {"0": _Distributed([Replicate()])})
        assert model[0].weight.placements == (Replicate(),)
        ep_etp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "etp"))
        experts = parallelize_module(nn.Linear(4, 4, bias=False), ep_etp, _Distributed([Shard(0), Shard(1)]))
        assert experts.weight.placements == (Shard(0), Shard(1)) and experts.weight.to_local().shape == (2, 2)
    run_ranks(body, 4, timeout=TIMEOUT)


def test_torchs_own_styles_are_refused_naming_spmds() -> None:
    import torch.distributed.tensor.parallel as torch_tp

    def body(rank: int, size: int) -> None:
        mesh = init_device_mesh("cpu", (2,))
        with pytest.raises(TypeError, match=r"one of torch\'s ParallelStyles.*spmd\.tensor\.parallel"):
            parallelize_module(nn.Sequential(nn.Linear(4, 4)), mesh, {"0": torch_tp.ColwiseParallel()})
        with pytest.raises(TypeError, match=r"one of torch\'s ParallelStyles"):
            parallelize_module(nn.Linear(4, 4), mesh, torch_tp.RowwiseParallel())
    on_ranks(body)
