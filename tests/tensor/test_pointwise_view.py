"""Pointwise, view/shape and factory rules: for every mesh and every input placement combination, the DTensor
result and gradients equal the plain computation (shapes uneven: 7 rows over 2 or 4 ranks)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from spmd.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from spmd.tensor.experimental import implicit_replication
from spmd.tensor.rules import record_fallbacks
from spmd.testing.dtensor import make_dtensor
from tests.tensor.conftest import check_parity, placement_combos, run_on_mesh, spread

TIMEOUT = 60


def _full(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _run(mesh_shape: tuple[int, ...], body) -> None:
    run_on_mesh(mesh_shape, body, timeout=TIMEOUT)


def _per_combo(mesh) -> int:
    """Every fn on every combo on 1-d meshes; on the 2-d mesh (16 combos per input) a rotating pair of them."""
    return 1000 if mesh.ndim == 1 else 2


UNARY = [torch.exp, torch.neg, torch.sigmoid, F.gelu, torch.tanh, lambda x: x.clamp(-0.5, 0.5), lambda x: x * 2.5,
         lambda x: x / 3, lambda x: (x + 1) ** 2, lambda x: x.to(torch.float64)]


def test_unary_every_placement(mesh_shape: tuple[int, ...]) -> None:
    a = _full(7, 5)

    def body(mesh) -> None:
        for placements, fn in spread(placement_combos(2, mesh.ndim), UNARY, _per_combo(mesh)):
            check_parity(fn, [a], mesh, [placements])

    _run(mesh_shape, body)


BINARY = [torch.add, torch.sub, torch.mul, torch.div, lambda x, y: torch.where(x > y, x, y), torch.maximum,
          lambda x, y: torch.add(x, y, alpha=0.5)]


def test_binary_broadcasting_every_placement(mesh_shape: tuple[int, ...]) -> None:
    shapes = [((7, 5), (7, 5)), ((7, 5), (5,)), ((7, 1), (1, 5))]

    def body(mesh) -> None:
        for (sa, sb) in shapes:
            a, b = _full(*sa, seed=1), _full(*sb, seed=2)
            combos = list(itertools.product(placement_combos(len(sa), mesh.ndim),
                                            placement_combos(len(sb), mesh.ndim)))
            if mesh.ndim == 2:
                combos = combos[::9]            # every 9th of the 2-d mesh's pairs, spread over both inputs
            for (pa, pb), fn in spread(combos, BINARY, 1):
                check_parity(fn, [a, b], mesh, [pa, pb])

    _run(mesh_shape, body)


def test_partial_stays_partial_only_where_linear() -> None:
    def body(mesh) -> None:
        a, b = _full(7, 5), _full(7, 5, seed=1)
        pa = make_dtensor(a, mesh, [Partial()])
        pb = make_dtensor(b, mesh, [Partial()])
        rb = make_dtensor(b, mesh, [Replicate()])
        assert (pa + pb).placements == (Partial(),)
        assert (pa * 3).placements == (Partial(),)
        assert (pa * rb).placements == (Partial(),)
        assert (-pa).placements == (Partial(),)
        assert (pa + 1).placements == (Replicate(),)        # +1 on each rank would add world_size
        assert pa.exp().placements == (Replicate(),)
        assert (pa * pb).placements == (Partial(),)          # one side all-reduced, the other stays Partial
        assert pa.to(torch.int32).placements == (Replicate(),)
        torch.testing.assert_close((pa + 1).full_tensor(), a + 1)
        torch.testing.assert_close((pa * pb).full_tensor(), a * b)
        torch.testing.assert_close(pa.to(torch.int32).full_tensor(), a.to(torch.int32))

    _run((4,), body)


def test_inplace_keeps_placements_and_redistributes_the_other(mesh_shape: tuple[int, ...]) -> None:
    def body(mesh) -> None:
        a, b = _full(7, 5), _full(7, 5, seed=1)
        for pa, pb in itertools.product(placement_combos(2, mesh.ndim, partial=False), placement_combos(2, mesh.ndim)):
            x = make_dtensor(a, mesh, list(pa))
            y = make_dtensor(b, mesh, list(pb))
            x.mul_(y).add_(y, alpha=2).sub_(1.5)
            assert x.placements == pa
            torch.testing.assert_close(x.full_tensor(), (a * b + 2 * b) - 1.5)
        # a Partial self stays Partial through linear in-place ops; a non-linear one all-reduces it in place first
        p = make_dtensor(a, mesh, [Partial()] * mesh.ndim)
        p.add_(make_dtensor(b, mesh, [Replicate()] * mesh.ndim)).mul_(2)
        assert p.placements == (Partial(),) * mesh.ndim
        torch.testing.assert_close(p.full_tensor(), (a + b) * 2)
        assert p.exp_() is p and p.placements == (Replicate(),) * mesh.ndim
        torch.testing.assert_close(p.full_tensor(), ((a + b) * 2).exp())

    _run(mesh_shape, body)


def test_comparisons_and_type_conversion(mesh_shape: tuple[int, ...]) -> None:
    def body(mesh) -> None:
        a, b = _full(7, 5), _full(7, 5, seed=1)
        pairs = list(itertools.product(placement_combos(2, mesh.ndim), repeat=2))
        for pa, pb in pairs if mesh.ndim == 1 else pairs[::9]:
            x, y = make_dtensor(a, mesh, list(pa)), make_dtensor(b, mesh, list(pb))
            for got, want in [(x > y, a > b), (x == x, a == a), (x.le(0.1), a.le(0.1)),
                              (x.to(torch.float16), a.to(torch.float16)), (x.int(), a.int()),
                              (x.double() * y.double(), a.double() * b.double())]:
                assert got.dtype == want.dtype
                # A Partial input's random float32 terms sum to the value up to a few ulps, also in float64; cast
                # to float16 each term rounds on its own (as a float16 reduction does): float16's eps then.
                tolerance = {torch.float16: {"rtol": 1e-2, "atol": 1e-2}, torch.float32: {"rtol": 1e-5, "atol": 1e-5},
                             torch.float64: {"rtol": 1e-5, "atol": 1e-5}}.get(want.dtype, {})
                torch.testing.assert_close(got.full_tensor(), want, **tolerance)

    _run(mesh_shape, body)


def test_plain_scalar_tensor_is_a_replicated_scalar() -> None:
    def body(mesh) -> None:
        a = _full(7, 5)
        x = make_dtensor(a, mesh, [Shard(0)])
        torch.testing.assert_close((x * torch.tensor(3.0)).full_tensor(), a * 3)
        torch.testing.assert_close((x + torch.tensor([2.0])).full_tensor(), a + 2)

    _run((2,), body)


VIEWS = [
    lambda x: x.view(7, 2, 3), lambda x: x.reshape(42), lambda x: x.flatten(), lambda x: x.unflatten(1, (3, 2)),
    lambda x: x.transpose(0, 1), lambda x: x.permute(1, 0), lambda x: x.t(), lambda x: x.t().contiguous(),
    lambda x: x.unsqueeze(1).squeeze(1), lambda x: x[None].expand(3, 7, 6), lambda x: x.split(4, dim=1)[1],
    lambda x: x.chunk(3, dim=0)[0], lambda x: torch.cat([x, x * 2], dim=1), lambda x: torch.cat([x, x], dim=0),
    lambda x: torch.stack([x, x + 1], dim=1), lambda x: x[:, 1:5:2], lambda x: x[2:5], lambda x: x.select(1, 3),
    lambda x: x[:, 4], lambda x: x[..., None], lambda x: x.narrow(1, 1, 3), lambda x: x.unbind(1)[2],
    lambda x: x.view(7, 6, 1).squeeze(), lambda x: x.view(-1, 3),
    lambda x: x.detach() * 1, lambda x: x.clone(),
]


def test_views_every_placement(mesh_shape: tuple[int, ...]) -> None:
    a = _full(7, 6)

    def body(mesh) -> None:
        for index, (placements, fn) in enumerate(spread(placement_combos(2, mesh.ndim), VIEWS,
                                                        len(VIEWS) if mesh.ndim == 1 else 4)):
            check_parity(fn, [a], mesh, [placements], seed=index)

    _run(mesh_shape, body)


def _rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """RoPE as Llama and DeepSeek write it: pairs read as complex numbers, rotated, read back as pairs."""
    return torch.view_as_real(torch.view_as_complex(x.view(*x.shape[:-1], -1, 2)) * rotation).flatten(-2)


def test_complex_views_keep_shards_and_partials(mesh_shape: tuple[int, ...]) -> None:
    """view_as_complex / view_as_real and autograd's conjugate (its backward of a complex multiply) keep every
    shard but the pair's and every Partial, where they fell back to gathering (DeepSeek's attention under tensor
    parallelism gathered its sharded heads for RoPE)."""
    a = _full(7, 5, 6)
    angles = torch.arange(3, dtype=torch.float32) * 0.3
    rotation = torch.polar(torch.ones_like(angles), angles)    # complex, replicated (TorchTitan's freqs_cis)

    def body(mesh) -> None:
        for placements in placement_combos(3, mesh.ndim):
            with record_fallbacks() as fallbacks:
                out = check_parity(_rotate, [a, rotation], mesh, [placements, [Replicate()] * mesh.ndim])
            assert not fallbacks, (placements, fallbacks)
            if mesh.size() > 1:       # the pair dim is gathered, every other placement kept
                assert out.placements == tuple(Replicate() if p == Shard(2) else p for p in placements), placements

    _run(mesh_shape, body)


def test_locals_and_plain_operands_with_torchs_lazy_conjugate_or_negative_bit_compute_with_their_values() -> None:
    """x.conj() of a complex tensor (and torch's _neg_view) only sets a bit; inside dispatch torch skips the fallback
    that resolves it, so a DTensor made from such a local, or such a plain operand beside a DTensor, multiplied and
    added the stored values: from_local, distribute_tensor and plain operands now take the values."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 6, dtype=torch.complex64, generator=gen), torch.randn(4, 6, dtype=torch.complex64,
                                                                               generator=gen)
    n = torch.randn(4, 6, generator=gen)

    def body(mesh) -> None:
        rows = [Shard(0)] + [Replicate()] * (mesh.ndim - 1)
        lazy_local = torch.chunk(a, 2)[mesh.get_coordinate()[0]].conj()
        from_local = DTensor.from_local(lazy_local, mesh, rows)
        assert lazy_local.is_conj() and not from_local.to_local().is_conj()
        other = distribute_tensor(b, mesh, rows)
        torch.testing.assert_close((from_local * other).full_tensor(), a.conj() * b)
        torch.testing.assert_close((distribute_tensor(a.conj(), mesh, rows) + other).full_tensor(), a.conj() + b)
        with implicit_replication():            # a plain operand
            torch.testing.assert_close((other * b.conj()[0]).full_tensor(), b * b.conj()[0])
        negative = DTensor.from_local(torch._neg_view(torch.chunk(n, 2)[mesh.get_coordinate()[0]]), mesh, rows)
        torch.testing.assert_close((negative * 2).full_tensor(), -n * 2)

    _run((2,), body)
    _run((2, 2), body)


def test_view_keeps_shards_when_it_can() -> None:
    def body(mesh) -> None:
        x = make_dtensor(_full(8, 6), mesh, [Shard(0)])
        assert x.view(2, 4, 6).placements == (Shard(0),)       # 8 -> (2, 4): both divisible by 2 ranks
        assert x.view(48).placements == (Shard(0),)            # flatten with the sharded dim leading
        assert x.view(8, 2, 3).placements == (Shard(0),)
        assert x.t().placements == (Shard(1),)
        y = make_dtensor(_full(7, 6), mesh, [Shard(1)])
        assert y.transpose(0, 1).placements == (Shard(0),)
        assert y[3].placements == (Shard(0),)
        assert y[:, 2].placements == (Replicate(),)

    _run((2,), body)


def test_factories_and_fills(mesh_shape: tuple[int, ...]) -> None:
    def body(mesh) -> None:
        a, b = _full(7, 5), _full(7, 5, seed=1)
        for placements in placement_combos(2, mesh.ndim):
            x = make_dtensor(a, mesh, list(placements))
            keep = tuple(Replicate() if isinstance(p, Partial) else p for p in placements)
            for made, value in [(torch.zeros_like(x), 0.0), (torch.ones_like(x), 1.0), (torch.full_like(x, 2.5), 2.5)]:
                assert made.placements == keep
                torch.testing.assert_close(made.full_tensor(), torch.full((7, 5), value))
            assert torch.empty_like(x).shape == (7, 5)
            assert x.new_zeros(3, 2).full_tensor().shape == (3, 2)
            y = make_dtensor(a, mesh, list(placements))
            y.fill_(4.0)
            torch.testing.assert_close(y.full_tensor(), torch.full((7, 5), 4.0))
            y.zero_()
            torch.testing.assert_close(y.full_tensor(), torch.zeros(7, 5))
            y.copy_(make_dtensor(b, mesh, [Replicate()] * mesh.ndim))
            assert y.placements == placements
            torch.testing.assert_close(y.full_tensor(), b)
            z = x.detach().clone()
            assert z.placements == placements and not z.requires_grad
            torch.testing.assert_close(z.full_tensor(), a)
            assert x[2, 3].item() == pytest.approx(a[2, 3].item(), rel=1e-6)   # Partial: terms sum to ulps
            assert torch.equal(x, make_dtensor(x.full_tensor(), mesh, [Replicate()] * mesh.ndim))
            assert isinstance(x.to(torch.float64), DTensor)

    _run(mesh_shape, body)
