"""Meta tensors as a stand-in accelerator for device-generic tests: `meta` (shapes without data), moved by
MetaTransport, the threads transport declaring that it moves meta tensors (data-free, so every op completes on
shapes alone) and asserting that every tensor it is handed lives on meta. NoCpuTensors fails any op that makes a
CPU tensor while code serves meta tensors, so a hidden `torch.zeros(...)` without `device=` fails in a test
instead of on the first GPU run. Register the transports with `register_fake_transports(monkeypatch)`.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from spmd.comm.transports import base
from spmd.comm.transports.threads import ThreadsTransport
from spmd.testing import run_ranks

TIMEOUT = 60.0
_TENSOR_METHODS = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "gather", "scatter",
                   "all_to_all", "isend", "irecv")


_OBJECTS_MODULE = "spmd/comm/objects.py"


def staging_objects() -> bool:
    """Whether an object collective (spmd.comm.objects) is on this thread's stack: it stages pickled bytes on its
    transport's first device, which is the host for HostObjectsMetaTransport (and CUDA over NCCL)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith(_OBJECTS_MODULE):
            return True
        frame = frame.f_back
    return False


class NoCpuTensors(TorchDispatchMode):
    """Fails when any op makes a CPU tensor from nothing or from tensors elsewhere (but an object collective's
    bytes, with `allow_object_staging`); ops on CPU tensors made before (a mesh's rank table: host metadata, as
    in torch) may. Ops on tensor subclasses (DTensor) are passed on with the mode still active, so the ops their
    handlers run on local tensors are checked too."""

    def __init__(self, allow_object_staging: bool = False) -> None:
        super().__init__()
        self.allow_object_staging = allow_object_staging

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is not Tensor for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        made_on_cpu = any(isinstance(value, Tensor) and value.device.type == "cpu" for value in pytree.tree_leaves(out))
        if made_on_cpu and not any(isinstance(value, Tensor) and value.device.type == "cpu"
                                   for value in pytree.tree_leaves((args, kwargs))) \
                and not (self.allow_object_staging and staging_objects()):
            raise AssertionError(f"{func} made a CPU tensor while serving meta tensors")
        return out


def _on_meta(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def checked(self: MetaTransport, *args: Any) -> Any:
        for value in args:
            if isinstance(value, Tensor):
                assert value.device.type == "meta", f"{method.__name__} was handed a tensor on {value.device}"
                self.handed.append((method.__name__, value.device))
        return method(self, *args)
    return checked


class MetaTransport(ThreadsTransport):
    """The threads transport, declaring meta tensors and asserting that it is handed nothing else."""

    name = "meta-threads"
    devices = ("meta",)

    def __init__(self, spec: base.TransportSpec) -> None:
        super().__init__(spec)
        self.handed: list[tuple[str, torch.device]] = []


for _name in _TENSOR_METHODS:
    setattr(MetaTransport, _name, _on_meta(getattr(ThreadsTransport, _name)))


def _on_meta_but_objects(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def checked(self: HostObjectsMetaTransport, *args: Any) -> Any:
        for value in args:
            if isinstance(value, Tensor) and not staging_objects():
                assert value.device.type == "meta", f"{method.__name__} was handed a tensor on {value.device}"
                self.handed.append((method.__name__, value.device))
        return method(self, *args)
    return checked


class HostObjectsMetaTransport(ThreadsTransport):
    """The threads transport moving meta tensors, and host ones for object collectives alone (declaring CPU
    first, so that their pickled bytes, which meta can't hold, stage there): what the parallelisms run on, whose
    object exchanges carry real values."""

    name = "meta-host-objects-threads"
    devices = ("cpu", "meta")

    def __init__(self, spec: base.TransportSpec) -> None:
        super().__init__(spec)
        self.handed: list[tuple[str, torch.device]] = []


for _name in _TENSOR_METHODS:
    setattr(HostObjectsMetaTransport, _name, _on_meta_but_objects(getattr(ThreadsTransport, _name)))


class CpuAndMetaTransport(ThreadsTransport):
    """The threads transport declaring CPU first and meta too (an op may not mix them)."""

    name = "cpu-meta-threads"
    devices = ("cpu", "meta")


def register_fake_transports(monkeypatch: pytest.MonkeyPatch) -> None:
    """Register the fake transports by name, as a real one is (the registry maps a name to module:class)."""
    monkeypatch.setitem(base._TRANSPORTS, MetaTransport.name, f"{__name__}:MetaTransport")
    monkeypatch.setitem(base._TRANSPORTS, CpuAndMetaTransport.name, f"{__name__}:CpuAndMetaTransport")
    monkeypatch.setitem(base._TRANSPORTS, HostObjectsMetaTransport.name, f"{__name__}:HostObjectsMetaTransport")


def meta(*shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def on_meta(fn: Callable[[int, int], Any], world_size: int) -> list[Any]:
    """run_ranks over MetaTransport, with fn under NoCpuTensors on every rank (modes are per thread)."""
    def body(rank: int, size: int) -> Any:
        with NoCpuTensors():
            return fn(rank, size)
    return run_ranks(body, world_size, timeout=TIMEOUT, backend=MetaTransport.name)
