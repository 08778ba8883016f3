"""RuntimeEstimator at torch's `_tools` path: the compute time of a step, op by op and module by module, estimated
under FakeTensorMode (no real data, no real step).

Layer: _tools (may import _core, comm, tensor, fsdp). A TorchDispatchMode, entered inside a FakeTensorMode:
  - "operator-level-benchmark": each op runs for real on tensors of its inputs' shapes, dtypes and device (random
    floats, ones otherwise), timed after warm-up (CUDA events on a GPU, the wall clock on the CPU), its outputs
    handed back as fake tensors; ops that only make views, or that only change metadata in place, cost nothing;
  - "operator-level-cost-model": a roofline, max(FLOPs / peak FLOP/s, bytes read and written / memory
    bandwidth), FLOPs from torch's flop-counter formulas. On CUDA the peaks are torch's (inductor's device table),
    on the CPU they are measured once per process (a float32 matmul, a copy).
Every op's time is added to the modules running it, forward or backward (ModTracker), and to the total, in
milliseconds. Unlike torch's, both modes run on the CPU too, and an op on DTensors is handed to DTensor, whose
local ops come back through the estimator: a rank's local compute is what it estimates. Communication is not
estimated (as in torch's).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.flop_counter import flop_registry

from spmd._tools.mod_tracker import ModTracker
from spmd.tensor import DTensor

__all__ = ["RuntimeEstimator"]

MODES = ("operator-level-benchmark", "operator-level-cost-model")
_WARMUP, _TIMED = 2, 3
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class RuntimeEstimator(TorchDispatchMode):
    """Estimated compute time (ms) of what runs inside it, per module (`mod_runtimes[fqn]["fw"|"bw"]`) and in all
    (`total_runtime`), with the modules' forward/backward pre- and post-orders. Use it inside a FakeTensorMode:

        estimator = RuntimeEstimator()
        with FakeTensorMode():
            model, x = ..., ...
            with estimator("operator-level-cost-model"):
                model(x).sum().backward()
        estimator.display_modulewise_stats()
    """

    def __init__(self) -> None:
        super().__init__()
        self._estimate: Callable[[Any, tuple, dict], tuple[Any, float]] | None = None
        self._estimate_mode_type = ""
        self._fake_mode: FakeTensorMode | None = None
        self._mod_tracker = ModTracker()
        self.mod_runtimes: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.mod_fw_pre_order: list[str] = []
        self.mod_bw_pre_order: list[str] = []
        self.mod_fw_post_order: list[str] = []
        self.mod_bw_post_order: list[str] = []
        self.total_runtime = 0.0

    def __call__(self, estimate_mode_type: str) -> RuntimeEstimator:
        """Pick how ops are estimated: "operator-level-benchmark" or "operator-level-cost-model"."""
        if estimate_mode_type == "operator-level-benchmark":
            self._estimate = self._benchmark_estimate
        elif estimate_mode_type == "operator-level-cost-model":
            self._estimate = self._roofline_estimate
        else:
            raise NotImplementedError(f"RuntimeEstimator: estimate_mode_type {estimate_mode_type!r} not supported; "
                                      f"use one of {list(MODES)}")
        self._estimate_mode_type = estimate_mode_type
        return self

    def __enter__(self) -> RuntimeEstimator:
        fake_mode = active_fake_mode()
        if not isinstance(fake_mode, FakeTensorMode):
            raise RuntimeError("RuntimeEstimator: enter it inside a FakeTensorMode (`with FakeTensorMode():`), on "
                               "fake tensors; it estimates a step without running it")
        if self._estimate is None:
            raise RuntimeError(f"RuntimeEstimator: pick a mode first: `with estimator({MODES[0]!r}):` or "
                               f"{MODES[1]!r}")
        self._fake_mode = fake_mode
        self.total_runtime = 0.0
        self.mod_runtimes = defaultdict(lambda: defaultdict(float))
        for order in (self.mod_fw_pre_order, self.mod_bw_pre_order, self.mod_fw_post_order, self.mod_bw_post_order):
            order.clear()
        known = self._mod_tracker.get_known_fqn
        self._mod_tracker.register_user_hooks(
            pre_fw_hook=lambda mod, inputs: self.mod_fw_pre_order.append(known(mod)),
            post_fw_hook=lambda mod, inputs, outputs: self.mod_fw_post_order.append(known(mod)),
            pre_bw_hook=lambda mod, grad_outputs: self.mod_bw_pre_order.append(known(mod)),
            post_bw_hook=lambda mod, grad_inputs: self.mod_bw_post_order.append(known(mod)))
        self._mod_tracker.__enter__()
        super().__enter__()
        return self

    def __exit__(self, *args: Any) -> None:
        super().__exit__(*args)
        self._mod_tracker.clear_user_hooks()
        self._mod_tracker.__exit__(*args)
        print(f"Estimated ({self._estimate_mode_type}) total_time: {self.total_runtime:.3f} ms")

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented        # DTensor runs its local ops, which come back through the estimator
        assert self._estimate is not None
        out, ms = self._estimate(func, args, kwargs or {})
        direction = "bw" if self._mod_tracker.is_bw else "fw"
        for parent in self._mod_tracker.parents:
            self.mod_runtimes[parent][direction] += ms
        self.total_runtime += ms
        return out

    # -- the two estimates ----------------------------------------------------------------------------------

    def _benchmark_estimate(self, func: Any, args: tuple, kwargs: dict) -> tuple[Any, float]:
        """Run `func` for real on inputs shaped as the fake ones and time it; outputs returned as fake tensors."""
        if _costs_nothing(func, args, kwargs) or torch.Tag.inplace_view in func.tags:
            return func(*args, **kwargs), 0.0
        fake_mode = self._fake_mode
        assert fake_mode is not None
        flat, spec = tree_flatten((args, kwargs))
        fake_of: dict[int, Tensor] = {}

        def real(value: Any) -> Any:
            if isinstance(value, Tensor) and fake_mode.is_our_fake(value):
                made = (torch.rand_like if value.dtype in _FLOATS else torch.ones_like)(
                    value, device=value.fake_device)     # its memory layout too
                fake_of[id(made)] = value
                return made
            return value

        with no_dispatch():
            real_args, real_kwargs = tree_unflatten([real(value) for value in flat], spec)
            out = func(*real_args, **real_kwargs)
            ms = _time_ms(lambda: func(*real_args, **real_kwargs), _device_of(flat))

        def fake(value: Any) -> Any:
            if not isinstance(value, Tensor):
                return value
            if id(value) in fake_of:            # an in-place op's result: the fake input it wrote
                return fake_of[id(value)]
            return fake_mode.fake_tensor_converter.from_real_tensor(fake_mode, value)

        return tree_map(fake, out), ms

    def _roofline_estimate(self, func: Any, args: tuple, kwargs: dict) -> tuple[Any, float]:
        """max(compute, memory traffic) of `func` on the fake tensors, in ms (see the module docstring)."""
        out = func(*args, **kwargs)
        if _costs_nothing(func, args, kwargs):
            return out, 0.0
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor)]
        device = _device_of(inputs + outputs)
        peaks = _peaks(device)
        seconds = sum(_bytes(t) for t in inputs + outputs) / peaks.bandwidth
        formula = flop_registry.get(func._overloadpacket)
        float_outs = {t.dtype for t in outputs if t.dtype in _FLOATS}
        if formula is not None and float_outs:
            flops = formula(*args, **kwargs, out_val=out)
            seconds = max(seconds, flops / peaks.flops(float_outs.pop()))
        return out, seconds * 1e3

    # -- display --------------------------------------------------------------------------------------------

    def display_modulewise_stats(self, depth: int = 2) -> None:
        """Print the pre-forward and pre-backward orders and each module's forward and backward ms, modules up to
        `depth` levels deep."""
        def shallow(fqn: str) -> bool:
            return fqn.count(".") + 1 <= depth

        print("Pre-Forward Execution Order: ")
        for fqn in filter(shallow, self.mod_fw_pre_order):
            print(fqn)
        print("Pre-Backward Execution Order: ")
        for fqn in filter(shallow, self.mod_bw_pre_order):
            print(fqn)
        for fqn, runtimes in self.mod_runtimes.items():
            if shallow(fqn):
                print(f"{fqn} fw: {runtimes.get('fw', 0.0):.3f}ms bw: {runtimes.get('bw', 0.0):.3f}ms")



_ALLOCATIONS = frozenset({"empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like",
                          "randint_like", "new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full"})


def _costs_nothing(func: Any, args: tuple, kwargs: dict) -> bool:
    """Ops counted as free, as in torch's estimator: views, metadata queries (prim::), allocations (factories,
    *_like, new_*), and ops on meta tensors (DTensor's dispatch works out global output shapes on them)."""
    if getattr(func, "is_view", False) or func.namespace == "prim" or func._schema.name.split("::")[-1] in _ALLOCATIONS:
        return True
    tensors = [value for value in tree_flatten((args, kwargs))[0] if isinstance(value, Tensor)]
    return not tensors or _device_of(tensors).type == "meta"


def _device_of(values: list[Any]) -> torch.device:
    for value in values:
        if isinstance(value, Tensor):
            return getattr(value, "fake_device", value.device)
    return torch.device("cpu")


def _bytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _time_ms(run: Callable[[], Any], device: torch.device) -> float:
    """Mean ms of `run()` after warm-up: CUDA events on a GPU, the wall clock elsewhere."""
    for _ in range(_WARMUP):
        run()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(_TIMED):
            run()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / _TIMED
    started = time.perf_counter()
    for _ in range(_TIMED):
        run()
    return (time.perf_counter() - started) / _TIMED * 1e3


class _Peaks:
    """A device's peak FLOP/s (by dtype) and memory bandwidth (bytes/s), for the roofline."""

    def __init__(self, flops: Callable[[torch.dtype], float], bandwidth: float) -> None:
        self.flops = flops
        self.bandwidth = bandwidth


_measured: dict[str, _Peaks] = {}


def _peaks(device: torch.device) -> _Peaks:
    key = str(device)
    if key not in _measured:
        _measured[key] = _cuda_peaks() if device.type == "cuda" else _cpu_peaks()
    return _measured[key]


def _cuda_peaks() -> _Peaks:
    """torch's table of the device's peaks (inductor's, as torch's own estimator uses)."""
    from torch._inductor.utils import get_device_tflops, get_gpu_dram_gbps

    return _Peaks(lambda dtype: get_device_tflops(dtype) * 1e12, get_gpu_dram_gbps() * 1e9)


def _cpu_peaks(size: int = 512, seconds: float = 0.02) -> _Peaks:
    """This process's float32 matmul FLOP/s and copy bandwidth with its torch threads: the best of three short
    runs each, so a moment of load from elsewhere doesn't lower them."""
    def rate(run: Callable[[], Any], work: float) -> float:
        run()
        best = 0.0
        for _ in range(3):
            count, started = 0, time.perf_counter()
            while time.perf_counter() - started < seconds:
                run()
                count += 1
            best = max(best, work * count / (time.perf_counter() - started))
        return best

    with no_dispatch():          # real tensors, even inside the FakeTensorMode
        generator = torch.Generator().manual_seed(0)
        a, b = torch.randn(size, size, generator=generator), torch.randn(size, size, generator=generator)
        src = torch.ones(32 << 20, dtype=torch.uint8)
        dst = torch.empty_like(src)
        matmul = rate(lambda: torch.mm(a, b), 2 * size ** 3)
        copy = rate(lambda: dst.copy_(src), 2 * src.numel())     # read and write
    return _Peaks(lambda dtype: matmul, copy)
