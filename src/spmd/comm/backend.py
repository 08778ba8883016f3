"""Backend names as torch users write them ("gloo", "nccl", "cpu:gloo,cuda:nccl"), translated to spmd's
transports, with torch's `Backend` class and availability queries.

Layer: comm (public edge, above the transports). "gloo" means spmd's fastest CPU transport ("auto": shared
memory inside a host, tcp across hosts), which is what a torch user asking for gloo wants; "nccl" means CUDA
tensors over torch's NCCL ("torch:nccl"). Names are case-insensitive, as in torch.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from spmd._core import env
from spmd.comm.transports.base import available_backends
from spmd.comm.transports.device_map import is_device_map, parse_device_map

TORCH_NAMES = ("gloo", "nccl", "mpi", "ucc", "xccl")


class Backend(str):
    """torch's backend names as string constants; `Backend("GLOO")` is "gloo" (names are lower-cased)."""

    UNDEFINED = "undefined"
    GLOO = "gloo"
    NCCL = "nccl"
    UCC = "ucc"
    MPI = "mpi"
    XCCL = "xccl"
    AUTO = "auto"
    TCP = "tcp"
    SHM = "shm"
    THREADS = "threads"
    FAKE = "fake"
    backend_list: ClassVar[list[str]] = [UNDEFINED, GLOO, NCCL, UCC, MPI, XCCL, FAKE, AUTO, TCP, SHM, THREADS]
    default_device_backend_map: ClassVar[dict[str, str]] = {"cpu": GLOO, "cuda": NCCL, "xpu": XCCL}

    def __new__(cls, name: str) -> str:  # type: ignore[misc]
        if not isinstance(name, str):
            raise ValueError(f"spmd: Backend name must be a string, got {type(name).__name__}")
        return name.lower()


def get_default_backend_for_device(device: str | torch.device) -> str:
    """The backend torch picks for a device ("cpu" -> "gloo", "cuda" -> "nccl"); `device` may be a torch.device."""
    device_type = device.type if isinstance(device, torch.device) else str(device).split(":", 1)[0]
    backend = Backend.default_device_backend_map.get(device_type)
    if backend is None:
        raise ValueError(f"spmd: no default backend for device type {device_type!r}; known: "
                         f"{sorted(Backend.default_device_backend_map)}")
    return backend


def transport_for(backend: str | None) -> str:
    """The spmd transport (or device map of transports) a backend name asks for; an error says why a name is
    unavailable and what to use instead."""
    if backend is None:
        return "auto"
    name = Backend(backend).strip()
    if is_device_map(name):
        return ",".join(f"{device}:{_transport_for_one(entry)}" for device, entry in parse_device_map(name))
    return _transport_for_one(name)


def torch_style_name(backend: str | None) -> str | None:
    """What torch's get_backend prints for a group created with `backend`, or None for spmd's own names."""
    if backend is None:
        return None
    name = Backend(backend).strip()
    return name if name in TORCH_NAMES or is_device_map(name) else None


def _transport_for_one(name: str) -> str:
    if name == Backend.GLOO:
        return "auto"
    if name == Backend.NCCL:
        return _nccl_transport()
    if name == Backend.MPI:
        raise RuntimeError("spmd: backend 'mpi' is not available: spmd has no MPI transport and torch's wheels are "
                           "built without MPI; use backend='gloo' (spmd's shared-memory/tcp transport) instead")
    if name in (Backend.UCC, Backend.XCCL):
        raise RuntimeError(f"spmd: backend {name!r} is not supported; use 'gloo' for CPU tensors or 'nccl' for "
                           f"CUDA tensors")
    if name not in available_backends():
        raise ValueError(f"spmd: unknown backend {name!r}; choose one of "
                         f"{['gloo', 'nccl', *available_backends()]} or a device map like 'cpu:gloo,cuda:nccl'")
    return name


def _nccl_transport() -> str:
    from spmd.comm import torch_backend  # here, not at the top: it imports the collectives, which import world

    reasons = []
    if not torch_backend.cuda_usable():
        reasons.append("torch.cuda.is_available() is False on this machine")
    if not torch_backend.torch_nccl_built():
        reasons.append("this torch is built without NCCL (its is_nccl_available() is False)")
    if not reasons and "torch:nccl" not in available_backends():
        reasons.append("this spmd has no torch:nccl transport")
    if reasons:
        raise RuntimeError(f"spmd: backend 'nccl' (CUDA tensors over torch's NCCL) is not available: "
                           f"{'; '.join(reasons)}. Use backend='gloo' (or 'auto') for CPU tensors")
    return "torch:nccl"


def is_available() -> bool:
    """Always True: spmd's communication layer is part of every build (torch scripts check it first)."""
    return True


def is_nccl_available() -> bool:
    """Whether backend "nccl" can be built here: torch has NCCL and spmd has its torch:nccl transport."""
    from spmd.comm import torch_backend

    return torch_backend.torch_nccl_built() and "torch:nccl" in available_backends()


def is_gloo_available() -> bool:
    """Always True: "gloo" is spmd's own CPU transport, which every build has."""
    return True


def is_mpi_available() -> bool:
    """Always False: spmd has no MPI transport."""
    return False


def is_ucc_available() -> bool:
    """Always False: spmd has no UCC transport."""
    return False


def is_xccl_available() -> bool:
    """Always False: spmd has no XCCL (Intel GPU) transport."""
    return False


def is_backend_available(backend: str) -> bool:
    """Whether init_process_group / new_group can build `backend` (a name, or a device map) on this machine."""
    try:
        transport_for(backend)
    except (RuntimeError, ValueError):
        return False
    return True


def is_torchelastic_launched() -> bool:
    """Whether this process was started by an elastic launcher (spmdrun or torchrun set TORCHELASTIC_RUN_ID)."""
    return env.optional_str("TORCHELASTIC_RUN_ID") is not None
