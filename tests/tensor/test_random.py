"""Random ops on DTensors draw exactly the numbers of the one-process run, on every mesh and placement."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from spmd.tensor import Replicate, Shard, distribute_tensor
from spmd.tensor.random import get_generator, manual_seed
from tests.tensor.conftest import placement_combos, run_on_mesh

TIMEOUT = 60
SHAPE = (7, 6)


def _reference(seed: int, fill) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return fill(torch.empty(SHAPE), generator)


INITIALISERS = [
    ("uniform_", lambda t, g: t.uniform_(-2, 3, generator=g)),
    ("normal_", lambda t, g: t.normal_(1.0, 0.5, generator=g)),
    ("bernoulli_", lambda t, g: t.bernoulli_(0.3, generator=g)),
    ("exponential_", lambda t, g: t.exponential_(generator=g)),
    ("kaiming_uniform_", lambda t, g: nn.init.kaiming_uniform_(t, a=5 ** 0.5, generator=g)),
    ("trunc_normal_", lambda t, g: nn.init.trunc_normal_(t, std=0.02, generator=g)),
]


def test_initialisers_match_one_process(mesh_shape: tuple[int, ...]) -> None:
    def body(mesh) -> None:
        for index, placements in enumerate(placement_combos(2, mesh.ndim)):
            name, fill = INITIALISERS[index % len(INITIALISERS)]
            manual_seed(100 + index)
            x = distribute_tensor(torch.zeros(SHAPE), mesh, list(placements))
            fill(x, get_generator())
            assert x.placements == placements, name
            torch.testing.assert_close(x.full_tensor(), _reference(100 + index, fill),
                                       msg=lambda m, name=name: f"{name}: {m}")

    run_on_mesh(mesh_shape, body, timeout=TIMEOUT)     # trunc_normal_'s aten.any has a rule: no fallback


def test_consecutive_ops_stay_in_step_and_replicas_agree() -> None:
    def body(mesh) -> list[torch.Tensor]:
        manual_seed(7)
        a = distribute_tensor(torch.zeros(SHAPE), mesh, [Shard(0), Replicate()])
        b = distribute_tensor(torch.zeros(SHAPE), mesh, [Replicate(), Replicate()])
        nn.init.normal_(a)     # no generator: the rank's DTensor generator is used
        nn.init.uniform_(b)
        generator = torch.Generator().manual_seed(7)
        want_a = torch.empty(SHAPE).normal_(generator=generator)
        want_b = torch.empty(SHAPE).uniform_(generator=generator)
        torch.testing.assert_close(a.full_tensor(), want_a)
        torch.testing.assert_close(b.full_tensor(), want_b)
        like = torch.rand_like(a)
        assert like.placements == a.placements
        torch.testing.assert_close(like.full_tensor(), torch.rand(SHAPE, generator=generator))
        return b.to_local()

    results = run_on_mesh((2, 2), body, timeout=TIMEOUT)
    assert all(torch.equal(r, results[0]) for r in results)


FALLBACK_DRAWS = {
    "multinomial": lambda t, g: torch.multinomial(t.abs() + 0.1, 3, generator=g),
    "normal(tensor, float)": lambda t, g: torch.normal(t, 1.0, generator=g),
    "normal(float, tensor)": lambda t, g: torch.normal(2.7, t.abs(), generator=g),
    "poisson": lambda t, g: torch.poisson(t.abs(), generator=g),
}


def test_random_ops_without_a_rule_draw_from_the_ranks_generator_too() -> None:
    """The ops the fallback runs draw the one-process numbers (they drew from torch's default generator)."""
    source = torch.randn(SHAPE, generator=torch.Generator().manual_seed(3))
    want = {name: draw(source, torch.Generator().manual_seed(11)) for name, draw in FALLBACK_DRAWS.items()}

    def body(mesh) -> dict[str, torch.Tensor]:
        got = {}
        for name, draw in FALLBACK_DRAWS.items():
            manual_seed(11)
            got[name] = draw(distribute_tensor(source, mesh, [Shard(0), Replicate()]), None).full_tensor()
        return got

    fallbacks = ["aten.multinomial.default", "aten.normal.Tensor_float", "aten.normal.float_Tensor",
                 "aten.poisson.default"]
    for got in run_on_mesh((2, 2), body, timeout=TIMEOUT, expect_fallbacks=fallbacks):
        for name, value in got.items():
            torch.testing.assert_close(value, want[name], rtol=0, atol=0, msg=name)


def test_manual_seed_takes_torchs_mesh_argument() -> None:
    # torch.distributed.tensor._random.manual_seed(seed, mesh), as TorchTitan calls it
    from spmd.tensor._random import is_rng_supported_mesh
    from spmd.tensor._random import manual_seed as torch_path_manual_seed

    def body(mesh) -> torch.Tensor:
        torch_path_manual_seed(3, mesh)
        assert is_rng_supported_mesh(mesh)
        return nn.init.normal_(distribute_tensor(torch.zeros(SHAPE), mesh, [Shard(0), Replicate()])).full_tensor()

    for full in run_on_mesh((2, 2), body, timeout=TIMEOUT):
        torch.testing.assert_close(full, torch.empty(SHAPE).normal_(generator=torch.Generator().manual_seed(3)))


@pytest.mark.parametrize("p", [0.0, 0.3, 0.8])
def test_dropout_matches_one_process_with_gradients(mesh_shape: tuple[int, ...], p: float) -> None:
    full = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))

    def body(mesh) -> None:
        for index, placements in enumerate(placement_combos(2, mesh.ndim)):
            manual_seed(index)
            x = distribute_tensor(full, mesh, list(placements)).requires_grad_()
            y = F.dropout(x, p)
            assert y.placements == placements       # linear in x: even a Partial x stays Partial
            torch.manual_seed(index)
            ref_x = full.clone().requires_grad_()
            generator_state = torch.Generator().manual_seed(index)
            mask = torch.empty(SHAPE).bernoulli_(1 - p, generator=generator_state)
            ref = ref_x * mask / (1 - p)
            torch.testing.assert_close(y.full_tensor(), ref)
            weight = torch.arange(42.0).view(SHAPE)
            (y.full_tensor() * weight).sum().backward()
            (ref * weight).sum().backward()
            torch.testing.assert_close(x.grad.full_tensor(), ref_x.grad)
            evaluated = F.dropout(x, p, training=False)
            torch.testing.assert_close(evaluated.full_tensor(), full)

    run_on_mesh(mesh_shape, body, timeout=TIMEOUT)
