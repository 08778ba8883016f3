"""Shared checks for the sharding-rule tests: run a function on DTensors laid out every supported way and
compare the full result, and the full gradients, with the same function on plain tensors.

The reference is the function itself on plain tensors, so a rule test states only WHAT to compute and which
layouts to try. Every rank runs the same combinations in the same order (full_tensor is collective). Partial
inputs hold a random term on every rank (spmd.testing.dtensor.make_dtensor), and a fallback fails the test.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from spmd.device_mesh import DeviceMesh, init_device_mesh
from spmd.tensor import DTensor, Partial, Placement, Replicate, Shard
from spmd.tensor.rules import record_fallbacks
from spmd.testing import run_ranks
from spmd.testing.dtensor import make_dtensor

MESH_SHAPES: tuple[tuple[int, ...], ...] = ((1,), (2,), (4,), (2, 2))

# fp32 on CPU: a sharded computation sums the same products in a different order (per-shard partial sums
# reduced across ranks), so results agree to a few ulps of the magnitudes involved, not bit for bit.
RTOL = 1e-5
ATOL = 1e-5


def on_meshes(body: Callable[[DeviceMesh], None], shapes: Iterable[tuple[int, ...]] = MESH_SHAPES,
              timeout: float = 60.0, backend: str = "threads", expect_fallbacks: Sequence[str] = ()) -> None:
    """Run `body(mesh)` on every rank of a world for each mesh shape (raises the first failure). The ranks are
    threads; `backend` is the transport they talk over ("threads", or a real one such as "tcp").

    A replicate-compute-reshard fallback on any rank fails the test (every op here must have a rule), unless
    the test names the ops it expects to fall back in `expect_fallbacks` (e.g. "aten.cumsum.default"): then
    exactly those must fall back, on every rank of every mesh of more than one rank."""
    for shape in shapes:
        run_ranks(lambda rank, world_size, shape=shape: checking_fallbacks(
                      lambda: body(init_device_mesh("cpu", shape)), expect_fallbacks, math.prod(shape) > 1),
                  world_size=math.prod(shape), timeout=timeout, backend=backend)


def checking_fallbacks(body: Callable[[], Any], expected: Sequence[str] = (), must_fire: bool = True) -> Any:
    """Run `body()` on this rank, failing on any fallback it does not expect (see `on_meshes`)."""
    with record_fallbacks() as fallbacks:
        result = body()
    fired = {str(op) for op in fallbacks}
    unexpected = fired - set(expected)
    assert not unexpected, f"ops ran through the replicate-compute-reshard fallback: {sorted(unexpected)}"
    missing = set(expected) - fired
    assert not (must_fire and missing), f"expected fallbacks that did not fire: {sorted(missing)}"
    return result


def layouts(ndim: int, mesh: DeviceMesh, *, partial: bool = False,
            shard_dims: Sequence[int] | None = None) -> list[tuple[Placement, ...]]:
    """Every placements tuple for a `ndim`-d tensor on `mesh`: Replicate or Shard(d) per mesh dim, plus
    Partial() when `partial` (only one Partial op per spec, as DTensorSpec requires)."""
    dims = range(ndim) if shard_dims is None else shard_dims
    choices: list[Placement] = [Replicate(), *(Shard(d) for d in dims)]
    if partial:
        choices.append(Partial())
    return list(itertools.product(choices, repeat=mesh.ndim))


def budget(mesh: DeviceMesh, on_two: int | None = None) -> int | None:
    """How many layout combinations a test tries on `mesh`: all of them on 2 ranks (or `on_two`), a fixed
    sample elsewhere. One rank is the identity case; on 4 ranks each check costs more, as the rank threads
    share one interpreter."""
    return {1: 4, 2: on_two}.get(mesh.size(), 6 if mesh.ndim == 1 else 4)


def combos(*choices: Sequence[Any], limit: int | None = None, seed: int = 0) -> list[tuple[Any, ...]]:
    """The product of `choices`, or a fixed random `limit` of it (the same on every rank and every run)."""
    return sample(list(itertools.product(*choices)), limit, seed)


def sample(items: Sequence[Any], limit: int | None, seed: int = 0) -> list[Any]:
    """`items`, or a fixed random `limit` of them (the same on every rank and every run)."""
    if limit is None or len(items) <= limit:
        return list(items)
    return random.Random(seed).sample(list(items), limit)


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def check(fn: Callable[..., Any], inputs: Sequence[Tensor], mesh: DeviceMesh,
          placements: Sequence[Sequence[Placement]], *, grad: bool = True, rtol: float = RTOL, atol: float = ATOL,
          expect_placements: Sequence[Placement] | None = None, constants: Sequence[int] = (), seed: int = 0) -> Any:
    """Compare `fn(*dtensors)` with `fn(*inputs)`: every tensor output's full value and, if `grad`, the full
    gradient of every floating input (but those at positions `constants`) for a random output gradient.
    `expect_placements` pins the first output's placements. Returns the DTensor output."""
    where = f"{getattr(fn, '__name__', fn)} on mesh {tuple(mesh.shape)} with placements {list(placements)}"
    wants_grad = [grad and t.is_floating_point() and k not in constants for k, t in enumerate(inputs)]
    plain = [t.detach().clone().requires_grad_(g) for t, g in zip(inputs, wants_grad)]
    expected = _as_list(fn(*plain))
    dtensors = [make_dtensor(t, mesh, p, requires_grad=g) for t, p, g in zip(inputs, placements, wants_grad)]
    got = _as_list(fn(*dtensors))
    if expect_placements is not None:
        assert tuple(got[0].placements) == tuple(expect_placements), f"{where}: got {got[0].placements}"
    for k, (want, have) in enumerate(zip(expected, got)):
        if not isinstance(want, Tensor):
            continue
        assert isinstance(have, DTensor), f"{where}: output {k} is {type(have).__name__}, not a DTensor"
        torch.testing.assert_close(have.full_tensor(), want.detach(), rtol=rtol, atol=atol,
                                   msg=lambda m, k=k: f"{where}: output {k}: {m}")
    if not any(wants_grad):
        return got[0]
    generator = torch.Generator().manual_seed(seed)
    outs = [(w, h) for w, h in zip(expected, got) if isinstance(w, Tensor) and w.requires_grad]
    grads = [torch.randn(w.shape, generator=generator, dtype=w.dtype) for w, _ in outs]
    torch.autograd.backward([w for w, _ in outs], grads)
    torch.autograd.backward([h for _, h in outs], [make_dtensor(g, mesh, [Replicate()] * mesh.ndim) for g in grads])
    for k, (t_plain, t_dist) in enumerate(zip(plain, dtensors)):
        if not wants_grad[k]:
            continue
        assert isinstance(t_dist.grad, DTensor), f"{where}: input {k} got no DTensor gradient"
        torch.testing.assert_close(t_dist.grad.full_tensor(), t_plain.grad, rtol=rtol, atol=atol,
                                   msg=lambda m, k=k: f"{where}: gradient of input {k}: {m}")
    return got[0]
