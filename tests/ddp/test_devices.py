"""DDP's temporaries live on the device of the tensors they serve, never on a default device.

DDP creates small tensors of its own (join's rank counts, the used-parameter map, PowerSGD's P and Q, the
compressed buckets). A factory call without `device=` lands on torch's default device, which is the CPU in
every test that trains on the CPU, so such a call would pass them all and break the first run on a GPU. Here the
model and data stay on the CPU but the default device is `meta` while DDP runs: a temporary that forgot its
device comes out on `meta`, which the recorder below catches and names (a meta tensor would also fail as soon as
a collective or `.tolist()` reads it). The fixture enters `with torch.device("meta")` in each of DDP's entry
points: its work before the module's forward, the two places autograd calls the Reducer (a gradient ready, the end
of backward; they run the buckets' launches and the comm hooks), and join's shadow iterations. (The user's module
runs outside it, and autograd would not carry it into backward anyway.) Construction is left out: its parameter
check goes through the object collectives, which the comm layer owns.
A device named explicitly is the code's to justify (PowerSGD draws its seeded Q on the CPU, as torch does).
"""

from __future__ import annotations

import collections
import contextlib
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

import spmd
from spmd.comm.join import Join
from spmd.ddp import PowerSGDState, bf16_compress_hook, fp16_compress_hook, powerSGD_hook
from spmd.ddp.api import DistributedDataParallel
from spmd.ddp.join import DDPJoinHook
from spmd.ddp.reducer import Reducer
from spmd.testing import run_ranks
from tests.parity.models import MLP, batch, build, loss_fn

TIMEOUT = 60.0


class DefaultDeviceTemporaries(TorchFunctionMode):
    """Records each torch call made from spmd's code whose tensor result landed on `device` (the default)."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.device = device
        self.found: list[str] = []

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if any(isinstance(leaf, Tensor) and leaf.device.type == self.device for leaf in tree_leaves(out)):
            spmd_frames = [frame for frame in traceback.extract_stack() if "/src/spmd/" in frame.filename]
            where = f"{spmd_frames[-1].filename.split('/src/')[-1]}:{spmd_frames[-1].lineno}" if spmd_frames \
                else "outside spmd"
            self.found.append(f"{getattr(func, '__name__', func)} at {where}")
        return out


@contextlib.contextmanager
def default_device_is_meta() -> Iterator[DefaultDeviceTemporaries]:
    with torch.device("meta"), DefaultDeviceTemporaries("meta") as recorder:
        yield recorder


ENTRY_POINTS = [(DistributedDataParallel, "_pre_forward"), (Reducer, "_on_grad_ready"), (Reducer, "_finalize"),
                (Join, "_keep_pace"), (DDPJoinHook, "main_hook"), (DDPJoinHook, "post_hook")]


@pytest.fixture
def ddp_on_meta(monkeypatch: pytest.MonkeyPatch) -> dict[int, list[str]]:
    """Run DDP's entry points with the default device on meta; returns what they made there, per global rank."""
    found: dict[int, list[str]] = collections.defaultdict(list)

    def on_meta(original: Callable) -> Callable:
        def run(self: Any, *args: Any) -> Any:
            with default_device_is_meta() as recorder:
                try:
                    return original(self, *args)
                except Exception as error:   # most likely a meta temporary reached a collective: name it
                    if recorder.found:
                        raise AssertionError(f"made on the default device: {recorder.found}") from error
                    raise
                finally:
                    found[spmd.get_rank()] += recorder.found
        return run

    for owner, name in ENTRY_POINTS:
        monkeypatch.setattr(owner, name, on_meta(getattr(owner, name)))
    return found


def train(model: spmd.DistributedDataParallel, kind: str, rank: int, size: int, steps: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = batch(kind, 4 * size, seed=step)
        opt.zero_grad()
        loss_fn(kind, model(x.chunk(size)[rank]), y.chunk(size)[rank]).backward()
        opt.step()


@pytest.mark.parametrize("options", [
    {},
    {"find_unused_parameters": True},
    {"static_graph": True},
    {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.001},
], ids=["default", "find_unused", "static_graph", "bucket_view"])
def test_reducer_makes_no_default_device_tensor(options: dict[str, Any],
                                                ddp_on_meta: dict[int, list[str]]) -> None:
    def body(rank: int, size: int) -> None:
        model = spmd.DistributedDataParallel(MLP(unused_branch=True) if options.get("find_unused_parameters")
                                             else build("cnn"), **options)
        train(model, "mlp" if options.get("find_unused_parameters") else "cnn", rank, size, steps=3)

    run_ranks(body, 2, timeout=TIMEOUT)
    assert ddp_on_meta == {rank: [] for rank in range(2)}


@pytest.mark.parametrize("hook", ["powerSGD", "powerSGD_cold", "fp16", "bf16"])
def test_comm_hooks_make_no_default_device_tensor(hook: str, ddp_on_meta: dict[int, list[str]]) -> None:
    def body(rank: int, size: int) -> None:
        model = spmd.DistributedDataParallel(build("gpt"), bucket_cap_mb=0.01)
        if hook.startswith("powerSGD"):
            state = PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=1,
                                  warm_start=hook == "powerSGD")
            model.register_comm_hook(state, powerSGD_hook)
        else:
            model.register_comm_hook(None, fp16_compress_hook if hook == "fp16" else bf16_compress_hook)
        train(model, "gpt", rank, size, steps=3)

    run_ranks(body, 2, timeout=TIMEOUT)
    assert ddp_on_meta == {rank: [] for rank in range(2)}


@pytest.mark.parametrize("divide_by_initial_world_size", [True, False])
def test_join_makes_no_default_device_tensor(divide_by_initial_world_size: bool,
                                             ddp_on_meta: dict[int, list[str]]) -> None:
    def body(rank: int, size: int) -> None:
        model = spmd.DistributedDataParallel(build("cnn", seed=rank))
        with model.join(divide_by_initial_world_size):
            for step in range(1 + rank):
                x, y = batch("cnn", 4, seed=step)
                loss_fn("cnn", model(x), y).backward()

    run_ranks(body, 3, timeout=TIMEOUT)
    assert ddp_on_meta == {rank: [] for rank in range(3)}
