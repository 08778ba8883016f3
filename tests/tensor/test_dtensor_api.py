"""DTensor's API: from_local / to_local / full_tensor and their adjoint gradients, distribute_tensor,
distribute_module, Partial gradients reaching an optimizer, the fallback, and the errors for bad input."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from spmd.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor, init_device_mesh
from spmd.tensor.dispatch import MixedTensorError
from spmd.tensor.rules import record_fallbacks
from spmd.testing import run_ranks
from tests.tensor.conftest import run_on_mesh

TIMEOUT = 60
FULL = torch.randn(7, 5, generator=torch.Generator().manual_seed(0))


def test_from_local_to_local_round_trip_uneven() -> None:
    def body(mesh) -> None:
        rank = mesh.get_rank()
        local = FULL.chunk(4)[rank] if rank < 4 else FULL[:0]
        x = DTensor.from_local(local, mesh, [Shard(0)], shape=(7, 5))
        assert x.shape == (7, 5) and x.placements == (Shard(0),) and x.device_mesh is mesh
        torch.testing.assert_close(x.full_tensor(), FULL)
        assert x.to_local() is not None and x.to_local().shape == local.shape
        with pytest.raises(ValueError, match="gives this rank"):
            DTensor.from_local(local, mesh, [Shard(0)], shape=(9, 5))
        even = DTensor.from_local(torch.ones(2, 5), mesh, [Shard(0)])       # no shape: assumes even shards
        assert even.shape == (8, 5)
        p = DTensor.from_local(torch.full((3,), float(rank)), mesh, [Partial()])
        torch.testing.assert_close(p.full_tensor(), torch.full((3,), 6.0))
        checked = DTensor.from_local(torch.full((2,), float(rank)), mesh, [Replicate()], run_check=True)
        torch.testing.assert_close(checked.to_local(), torch.zeros(2))   # broadcast from the first rank

    run_on_mesh((4,), body, timeout=TIMEOUT)


def test_from_local_and_to_local_gradients_are_adjoint() -> None:
    def body(mesh) -> None:
        rank = mesh.get_rank()
        local = FULL.chunk(2)[rank].clone().requires_grad_()
        x = DTensor.from_local(local, mesh, [Shard(0)], shape=(7, 5))
        (x.full_tensor() * 2).sum().backward()
        torch.testing.assert_close(local.grad, torch.full_like(local, 2.0))    # chunk of the replicated grad
        # to_local: the local gradient becomes the Shard gradient, no communication
        y = distribute_tensor(FULL, mesh, [Shard(0)]).requires_grad_()
        (y.to_local() * 3).sum().backward()
        assert y.grad.placements == (Shard(0),)
        torch.testing.assert_close(y.grad.full_tensor(), torch.full((7, 5), 3.0))
        # grad_placements=[Partial()]: each rank's loss is a partial term of the total
        z = distribute_tensor(FULL, mesh, [Replicate()]).requires_grad_()
        (z.to_local(grad_placements=[Partial()]) * (rank + 1)).sum().backward()
        assert z.grad.placements == (Partial(),)
        torch.testing.assert_close(z.grad.full_tensor(), torch.full((7, 5), 3.0))
        # from_local of a Replicate value used by a Partial computation: backward reduces (Partial -> Replicate)
        w_local = torch.ones(5, requires_grad=True)
        w = DTensor.from_local(w_local, mesh, [Replicate()])
        partial = DTensor.from_local(torch.full((5,), float(rank + 1)), mesh, [Partial()])
        (w * partial).full_tensor().sum().backward()
        torch.testing.assert_close(w_local.grad, torch.full((5,), 3.0))

    run_on_mesh((2,), body, timeout=TIMEOUT)


def test_non_contiguous_local_tensors_keep_their_layout_in_the_spec() -> None:
    """A local gradient reaching to_local's backward in another memory order (a transpose's gradient, as SDPA's
    backward kernels give) and from_local of a transposed tensor: the DTensor's strides follow the local layout,
    so a reshape that the wrapper's strides allow as a view is one on every rank's local tensor too."""
    def body(mesh) -> None:
        rank = mesh.get_rank()
        weight = torch.arange(12.0).reshape(1, 3, 4)
        base = distribute_tensor(torch.ones(4, 12), mesh, [Shard(0)]).requires_grad_()
        local = base.view(4, 4, 3).to_local()
        (local.transpose(1, 2) * weight).sum().backward()       # local's gradient is weight's transpose, expanded
        assert base.grad.placements == (Shard(0),)
        torch.testing.assert_close(base.grad.full_tensor(), weight.transpose(1, 2).reshape(1, 12).expand(4, 12))
        tall = torch.arange(24.0).reshape(6, 4)[rank * 3:rank * 3 + 3]   # this rank's rows of a (6, 4) value
        wide = DTensor.from_local(tall.t(), mesh, [Shard(1)])            # its transpose: (4, 6), sharded on dim 1
        assert wide.stride() == (1, 4) and wide.to_local().stride() == (1, 4)
        torch.testing.assert_close(wide.reshape(24).full_tensor(), torch.arange(24.0).reshape(6, 4).t().reshape(24))

    run_on_mesh((2,), body, timeout=TIMEOUT)


def test_distribute_tensor_sources() -> None:
    def body(mesh) -> None:
        rank = mesh.get_rank()
        mine = torch.full((4, 3), float(rank))
        x = distribute_tensor(mine, mesh, [Replicate(), Shard(1)])          # rank 0's value wins
        torch.testing.assert_close(x.full_tensor(), torch.zeros(4, 3))
        y = distribute_tensor(mine, mesh, [Shard(0), Replicate()], src_data_rank=None)   # local chunks only
        assert y.to_local().eq(float(rank)).all()
        leaf = distribute_tensor(FULL.clone().requires_grad_(), mesh, [Shard(0), Shard(1)])
        assert leaf.is_leaf and leaf.requires_grad
        with pytest.raises(ValueError, match="use redistribute"):
            distribute_tensor(leaf, mesh, [Replicate(), Replicate()])

    run_on_mesh((2, 2), body, timeout=TIMEOUT)


def test_distribute_module_and_training_step() -> None:
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(5, 7), nn.Tanh())
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(1))

    def body(mesh) -> list[torch.Tensor]:
        model = nn.Sequential(nn.Linear(5, 7), nn.Tanh())
        model.load_state_dict(state)

        def partition(name: str, module: nn.Module, mesh) -> None:
            if isinstance(module, nn.Linear):
                module.register_parameter("bias", nn.Parameter(distribute_tensor(module.bias.data, mesh, [Shard(0)])))

        seen = []
        distribute_module(model, mesh, partition,
                          input_fn=lambda mod, inputs, mesh: (distribute_tensor(inputs[0], mesh, [Replicate()]),),
                          output_fn=lambda mod, out, mesh: seen.append(out.placements) or out.full_tensor())
        assert isinstance(model[0].weight, DTensor) and model[0].weight.placements == (Replicate(),)
        assert model[0].bias.placements == (Shard(0),) and list(model.state_dict()) == list(state)
        with pytest.raises(RuntimeError, match="already distributed"):
            distribute_module(model, mesh)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
        outputs = []
        for _ in range(2):
            optimizer.zero_grad()
            y = model(x)
            outputs.append(y)
            y.square().sum().backward()
            optimizer.step()
        return outputs + [p.full_tensor() for p in model.parameters()]

    got = run_on_mesh((2,), body, timeout=TIMEOUT)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    want = []
    for _ in range(2):
        optimizer.zero_grad()
        y = reference(x)
        want.append(y.detach())
        y.square().sum().backward()
        optimizer.step()
    want += [p.detach() for p in reference.parameters()]
    for rank_result in got:
        for a, b in zip(rank_result, want):
            torch.testing.assert_close(a, b)


def test_partial_gradient_is_reduced_by_the_optimizer() -> None:
    def body(mesh) -> torch.Tensor:
        rank = mesh.get_rank()
        param = nn.Parameter(distribute_tensor(torch.ones(4), mesh, [Replicate()]))
        param.grad = DTensor.from_local(torch.full((4,), float(rank + 1)), mesh, [Partial()])   # total grad: 3
        torch.optim.SGD([param], lr=0.5, foreach=False).step()
        assert param.placements == (Replicate(),)
        local = param.to_local().detach().clone()
        torch.testing.assert_close(local, torch.full((4,), 1 - 0.5 * 3))   # every rank saw the reduced value
        return local

    run_on_mesh((2,), body, timeout=TIMEOUT)


@pytest.mark.filterwarnings("ignore:spmd DTensor")
def test_fallback_computes_on_replicas_and_writes_back() -> None:
    def body(mesh) -> None:
        x = distribute_tensor(FULL, mesh, [Shard(0)])
        with record_fallbacks() as fallbacks:
            flipped = torch.roll(x, 1, 0)
            torch.roll(x, 1, 0)
            y = distribute_tensor(FULL, mesh, [Shard(1)])
            y.tril_()
        assert [str(op) for op in fallbacks] == ["aten.roll.default", "aten.roll.default", "aten.tril_.default"]
        torch.testing.assert_close(flipped.full_tensor(), FULL.roll(1, 0))
        assert flipped.placements == (Shard(0),)                            # same shape: re-chunked like x
        assert y.placements == (Shard(1),)
        torch.testing.assert_close(y.full_tensor(), FULL.tril())

    run_on_mesh((2,), body, timeout=TIMEOUT, expect_fallbacks=("aten.roll.default", "aten.tril_.default"))


_LIBRARY = torch.library.Library("spmd_test_fallback", "DEF")    # an op no other test can have warned about
_LIBRARY.define("twice(Tensor x) -> Tensor")
_LIBRARY.impl("twice", lambda x: x * 2, "CompositeExplicitAutograd")


def test_fallback_warns_once_per_process_naming_the_op() -> None:
    op = torch.ops.spmd_test_fallback.twice.default

    def body(rank: int, world_size: int) -> list[str]:
        x = distribute_tensor(FULL, init_device_mesh("cpu", (2,)), [Shard(0)])
        with record_fallbacks() as fallbacks:
            for _ in range(3):
                torch.testing.assert_close(op(x).full_tensor(), FULL * 2)
        return [str(f) for f in fallbacks]

    # catch_warnings is entered on this thread only; the rank threads' warnings land in its list
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recorded = run_ranks(body, world_size=2, timeout=TIMEOUT)
    assert recorded == [["spmd_test_fallback.twice.default"] * 3] * 2    # every call, on each rank
    messages = [str(w.message) for w in caught if "spmd DTensor" in str(w.message)]
    assert len(messages) == 1, messages                                    # but one warning per process
    assert "spmd_test_fallback.twice.default has no sharding rule" in messages[0]


def test_bad_input_errors() -> None:
    def body(rank: int, world_size: int) -> None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        with pytest.raises(ValueError, match="got 1 placements"):
            distribute_tensor(FULL, mesh, [Shard(0)])
        with pytest.raises(ValueError, match="out of range for a tensor with 2 dims"):
            distribute_tensor(FULL, mesh, [Shard(0), Shard(2)])
        with pytest.raises(ValueError, match="got 1 placements"):
            DTensor.from_local(FULL, mesh, [Replicate()])
        x = distribute_tensor(FULL, mesh, [Shard(0), Replicate()])
        other = distribute_tensor(FULL, mesh["tp"], [Replicate()])
        with pytest.raises(ValueError, match="different meshes"):
            x + other
        with pytest.raises(MixedTensorError, match=r"plain torch\.Tensor of shape \(7, 5\)"):
            x + FULL
        torch.testing.assert_close((x * torch.tensor(2.0)).full_tensor(), FULL * 2)   # a scalar is fine
        assert torch.equal(x, FULL) and torch.equal(FULL, x) and not torch.equal(x, FULL + 1)   # by value

    run_ranks(body, 4, timeout=TIMEOUT)


@pytest.mark.parametrize("placement", [Shard(0), Shard(1), Replicate()], ids=["shard0", "shard1", "replicate"])
def test_a_plain_tensor_that_is_one_element_broadcast_counts_as_a_scalar(placement) -> None:
    """On an accelerator torch's `x[1] = 5` copies a 0-d tensor expanded to the slice's shape (on the CPU it
    fills): such a tensor holds one value, as unambiguous as a one-element one, and is taken as replicated."""
    def body(rank: int, world_size: int) -> None:
        mesh = init_device_mesh("cpu", (2,))
        x = distribute_tensor(FULL, mesh, [placement])
        want = FULL.clone()
        x[1].copy_(torch.scalar_tensor(5.0).expand(5))         # what x[1] = 5 runs on a CUDA tensor
        want[1] = 5.0
        x[:, 2].copy_(torch.scalar_tensor(-1.0).expand(7))
        want[:, 2] = -1.0
        torch.testing.assert_close(x.full_tensor(), want, rtol=0, atol=0)
        assert x.placements == (placement,)
        torch.testing.assert_close((x + torch.tensor(2.0).expand(7, 5)).full_tensor(), want + 2, rtol=0, atol=0)
        with pytest.raises(MixedTensorError, match=r"plain torch\.Tensor of shape \(7, 5\)"):
            x + torch.arange(5.0).expand(7, 5)                  # broadcast along one dim only: many values

    run_ranks(body, 2, timeout=TIMEOUT)


def test_deepcopy_keeps_layout_and_parameterness() -> None:
    def body(mesh) -> None:
        model = nn.Linear(5, 7)
        model.weight = nn.Parameter(distribute_tensor(model.weight.data, mesh, [Shard(0)]))
        clone = copy.deepcopy(model)
        assert isinstance(clone.weight, nn.Parameter) and clone.weight.placements == (Shard(0),)
        assert clone.weight.device_mesh is mesh
        clone.weight.to_local().detach().zero_()
        assert model.weight.to_local().abs().sum() > 0                 # the copy owns its local tensor

    run_on_mesh((2,), body, timeout=TIMEOUT)


def test_the_compile_cache_key_follows_the_layout() -> None:
    """_stable_hash_for_caching, torch's hook for its AOT autograd cache (without it torch warns, once per
    process, and pickles the spec): equal for equal layouts, different where the placements, the dtype or
    requires_grad differ."""
    def body(rank: int, size: int) -> None:
        mesh = init_device_mesh("cpu", (2,))
        rows, same = (distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)]) for _ in range(2))
        assert rows._stable_hash_for_caching() == same._stable_hash_for_caching()
        others = [distribute_tensor(torch.ones(4, 4), mesh, [Shard(1)]),
                  distribute_tensor(torch.ones(4, 4, dtype=torch.float64), mesh, [Shard(0)]),
                  distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)]).requires_grad_(True)]
        keys = [dt._stable_hash_for_caching() for dt in [rows, *others]]
        assert len(set(keys)) == 4

    run_ranks(body, 2, timeout=60)
