"""Make the "spmd" torch.distributed backend known in every process that imports spmd and torch, in either order,
so torch's `init_process_group("spmd")` works after `import spmd` (torch_backend.py, Note: spmd's world
under torch's default group), while `import spmd` alone never imports torch (the launcher, `spmd.run`, stays
light).

Layer: comm. Imports torch_backend only once torch is fully imported: at once if it already is, else from an
import hook that runs when torch's own import finishes (one finder on sys.meta_path, removed when it fires).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any

_TORCH = "torch"
_BACKEND_MODULE = "spmd.comm.torch_backend"
_lock = threading.Lock()


def install() -> None:
    """Register the backend now if torch is imported, else when it is."""
    torch = sys.modules.get(_TORCH)
    if torch is not None:
        if getattr(torch, "distributed", None) is not None:    # not while torch's own import is under way
            _register()
        return
    with _lock:
        if not any(isinstance(finder, _AfterTorchImport) for finder in sys.meta_path):
            sys.meta_path.insert(0, _AfterTorchImport())


def _register() -> None:
    importing = sys.modules.get(_BACKEND_MODULE)
    if importing is not None and getattr(importing.__spec__, "_initializing", False):
        return   # torch's import came from the backend module's own import, which registers at its end
    try:
        from spmd.comm import torch_backend
    except Exception as error:   # torch's import must not fail for spmd's sake; say what is missing instead
        _warn(error)
        return
    register_or_warn(torch_backend.register)


def register_or_warn(register: Callable[[], None]) -> None:
    """Run torch_backend's `register`, turning a failure into a warning."""
    try:
        register()
    except Exception as error:
        _warn(error)


def _warn(error: Exception) -> None:
    warnings.warn(f"spmd: could not register the 'spmd' torch.distributed backend ({error!r}); "
                  f"torch's init_process_group('spmd') will not find it", stacklevel=3)


class _AfterTorchImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: on torch's import, hands the real spec over with a loader that registers the
    backend after torch's module ran."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _TORCH:
            return None
        with _lock:
            if self in sys.meta_path:
                sys.meta_path.remove(self)
        spec = next((found for finder in sys.meta_path
                     if (found := getattr(finder, "find_spec", lambda *_: None)(fullname, path, target)) is not None),
                    None)
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisteringLoader(spec.loader)
        return spec


class _RegisteringLoader(importlib.abc.Loader):
    """torch's loader, registering the backend once torch's module has run."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        _register()

    def __getattr__(self, name: str) -> Any:     # get_source, is_package, ...: torch's loader answers
        return getattr(self._loader, name)
