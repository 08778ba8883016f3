"""Redistribution between every pair of placements on 1/2/4/2x2 meshes (uneven shapes), its gradients, the
collective each transition uses, and a subset over the real tcp transport."""

from __future__ import annotations

import collections
import itertools
import threading

import pytest
import torch

import spmd.tensor.redistribute as redistribute_module
from spmd.tensor import DTensor, Partial, Replicate, Shard, init_device_mesh
from spmd.testing import run_ranks
from spmd.testing.dtensor import make_dtensor
from tests.tensor.conftest import placement_combos, run_on_mesh
from tests.tensor.rule_checks import checking_fallbacks

TIMEOUT = 60
FULL = torch.randn(7, 5, generator=torch.Generator().manual_seed(0))   # 7 rows: uneven over 2 and 4 ranks


def _check_pair(mesh, src, dst, grad: bool) -> None:
    x = make_dtensor(FULL, mesh, list(src)).requires_grad_(grad)
    y = x.redistribute(mesh, list(dst))
    assert y.placements == tuple(dst)
    if not any(isinstance(p, Partial) for p in dst):
        torch.testing.assert_close(y.to_local(), y._spec.local_from_full(FULL))
    torch.testing.assert_close(y.full_tensor(), FULL, msg=lambda m: f"{src} -> {dst}: {m}")
    if grad:
        weight = torch.arange(35.0).view(7, 5)
        (y.full_tensor() * weight).sum().backward()
        assert x.grad.placements == tuple(Replicate() if isinstance(p, Partial) else p for p in src)
        torch.testing.assert_close(x.grad.full_tensor(), weight, msg=lambda m: f"grad of {src} -> {dst}: {m}")


def test_every_pair(mesh_shape: tuple[int, ...]) -> None:
    def body(mesh) -> None:
        combos = placement_combos(2, mesh.ndim)
        for index, (src, dst) in enumerate(itertools.product(combos, repeat=2)):
            _check_pair(mesh, src, dst, grad=mesh.ndim == 1 or index % 8 == 0)

    run_on_mesh(mesh_shape, body, timeout=TIMEOUT)


def test_nested_and_uneven_on_2d() -> None:
    def body(mesh) -> None:
        full = torch.arange(13.0 * 3).view(13, 3)
        x = make_dtensor(full, mesh, [Shard(0), Shard(0)])
        assert x.to_local().shape[0] == [4, 3, 3, 3][mesh.get_rank()]
        for dst in ([Replicate(), Shard(0)], [Shard(1), Shard(0)], [Shard(0), Shard(1)], [Partial(), Shard(0)]):
            torch.testing.assert_close(x.redistribute(mesh, dst).full_tensor(), full)
        tiny = make_dtensor(torch.ones(1, 3), mesh, [Shard(0), Replicate()])   # trailing ranks hold 0 rows
        torch.testing.assert_close(tiny.redistribute(mesh, [Shard(1), Shard(0)]).full_tensor(), torch.ones(1, 3))

    run_on_mesh((2, 2), body, timeout=TIMEOUT)


class _Counter:
    """Counts the functional collectives redistribution calls, per kind (all ranks together)."""

    KINDS = ("all_gathered", "all_reduced", "reduce_scattered", "all_to_all_dims")

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()
        for kind in self.KINDS:
            original = getattr(redistribute_module, kind)
            monkeypatch.setattr(redistribute_module, kind, self._wrap(kind, original))

    def _wrap(self, kind, original):
        def counted(*args, **kwargs):
            with self.lock:
                self.counts[kind] += 1
            return original(*args, **kwargs)
        return counted


@pytest.mark.parametrize(("src", "dst", "kind"), [
    (Shard(0), Replicate(), "all_gathered"), (Partial(), Replicate(), "all_reduced"),
    (Partial(), Shard(1), "reduce_scattered"), (Shard(0), Shard(1), "all_to_all_dims"), (Replicate(), Shard(0), None),
    (Replicate(), Partial(), None)])
def test_each_transition_uses_the_cheapest_collective(monkeypatch: pytest.MonkeyPatch, src, dst, kind) -> None:
    counter = _Counter(monkeypatch)

    def body(mesh) -> None:
        x = make_dtensor(FULL, mesh, [src])
        x.redistribute(mesh, [dst])

    run_on_mesh((4,), body, timeout=TIMEOUT)
    assert counter.counts == (collections.Counter({kind: 4}) if kind else collections.Counter())


def test_redistribute_errors() -> None:
    def body(mesh) -> None:
        x = make_dtensor(FULL, mesh, [Shard(0)])
        with pytest.raises(ValueError, match="placements"):
            x.redistribute(mesh, [Shard(0), Replicate()])
        with pytest.raises(ValueError, match="out of range"):
            x.redistribute(mesh, [Shard(2)])
        other = init_device_mesh("cpu", (2,), mesh_dim_names=("other",))
        with pytest.raises(ValueError, match="another mesh"):
            x.redistribute(other, [Replicate()])
        assert x.redistribute(mesh, [Shard(0)]) is x

    run_on_mesh((2,), body, timeout=TIMEOUT)


def test_subset_over_tcp() -> None:
    def body(rank: int, world_size: int) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        pairs = [((Shard(0), Shard(1)), (Replicate(), Replicate())), ((Partial(), Shard(0)), (Shard(1), Shard(0))),
                 ((Replicate(), Shard(0)), (Shard(0), Partial())), ((Shard(1), Partial()), (Shard(0), Replicate()))]
        for src, dst in pairs:
            _check_pair(mesh, src, dst, grad=True)
        x = DTensor.from_local(torch.full((2, 3), float(rank)), mesh, [Shard(0), Shard(0)])
        torch.testing.assert_close(x.full_tensor()[:, 0], torch.tensor([0.0, 0, 1, 1, 2, 2, 3, 3]))

    run_ranks(lambda rank, world_size: checking_fallbacks(lambda: body(rank, world_size)), 4, timeout=TIMEOUT,
              backend="tcp")


def test_forward_and_backward_dtypes_cast_around_the_collectives_as_torchs() -> None:
    """torch's redistribute(forward_dtype=, backward_dtype=): the result (and its collective) in forward_dtype;
    the gradient's collective in backward_dtype (default: the input's dtype), returned in the input's dtype."""
    full = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))
    weight = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))

    def body(rank: int, size: int) -> None:
        mesh = init_device_mesh("cpu", (2,))
        for source, target in ([Shard(0)], [Replicate()]), ([Replicate()], [Shard(1)]), ([Shard(0)], [Shard(0)]):
            for backward_dtype in (None, torch.bfloat16):
                x = DTensor.from_local(full.chunk(2)[rank] if source == [Shard(0)] else full, mesh, source)
                x.requires_grad_(True)
                out = x.redistribute(placements=target, forward_dtype=torch.bfloat16, backward_dtype=backward_dtype)
                assert out.dtype == torch.bfloat16 and out.placements == tuple(target)
                assert torch.equal(out.full_tensor(), full.bfloat16())
                upstream = DTensor.from_local(weight.bfloat16(), mesh, [Replicate()]).redistribute(placements=target)
                (out * upstream).sum().backward()
                want = weight.bfloat16().float()           # the gradient of sum(out * w), cast back to float32
                assert x.grad.dtype == torch.float32 and x.grad.placements == tuple(source)
                torch.testing.assert_close(x.grad.full_tensor(), want)
        plain = DTensor.from_local(full.chunk(2)[rank], mesh, [Shard(0)])
        same = plain.redistribute(placements=[Shard(0)], backward_dtype=torch.bfloat16)
        assert same.dtype == torch.float32 and same.to_local() is not plain.to_local()

    run_ranks(body, 2, timeout=60)
