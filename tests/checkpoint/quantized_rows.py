"""QuantizedRows: a float32 tensor stored as int8 codes and one float32 scale per row, the shape of torchao's
8-bit optimizer states (a compressed tensor: fewer bytes than its values), for the checkpoint tests. Registered
with torch's safe globals, as torchao registers its own, so torch.load(weights_only=True) reads it."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_map_only

aten = torch.ops.aten


class QuantizedRows(Tensor):
    """Values codes * scales (per row); detach, clone and row slices stay QuantizedRows, copy_ into one quantizes
    (or copies codes and scales from another), torch's functional all-gather gathers codes and scales (as torchao's
    NF4 does), every other op computes on the values."""

    @staticmethod
    def __new__(cls, codes: Tensor, scales: Tensor) -> QuantizedRows:
        return Tensor._make_wrapper_subclass(cls, codes.shape, dtype=torch.float32, device=codes.device)

    def __init__(self, codes: Tensor, scales: Tensor) -> None:
        self.codes, self.scales = codes, scales

    @classmethod
    def quantize(cls, values: Tensor) -> QuantizedRows:
        """Scaled by each row's mean magnitude, so quantizing dequantized values again moves the scales (as
        torchao's dynamic-tree codes do): a round trip through values is not exact."""
        scales = values.abs().mean(dim=1, keepdim=True).clamp_min(1e-12) / 32
        return cls((values / scales).round().clamp(-127, 127).to(torch.int8), scales)

    def dequantize(self) -> Tensor:
        return self.codes.float() * self.scales

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["codes", "scales"], None

    @classmethod
    def __tensor_unflatten__(cls, inner: dict[str, Tensor], meta: None, size: Any, stride: Any) -> QuantizedRows:
        return cls(inner["codes"], inner["scales"])

    def __repr__(self) -> str:
        return f"QuantizedRows({self.dequantize()})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.clone.default):
            return cls(func(args[0].codes), func(args[0].scales))
        if func is aten.slice.Tensor and (len(args) < 2 or args[1] == 0):
            return cls(func(args[0].codes, *args[1:]), func(args[0].scales, *args[1:]))
        if func is torch.ops._c10d_functional.all_gather_into_tensor.default:     # as torchao's NF4: per inner
            return cls(func(args[0].codes, *args[1:]), func(args[0].scales, *args[1:]))
        if func is torch.ops._c10d_functional.wait_tensor.default:
            return cls(func(args[0].codes), func(args[0].scales))
        if func is aten.copy_.default:
            target, source = args[0], args[1]
            if isinstance(target, cls):
                source = source if isinstance(source, cls) else cls.quantize(source)
                target.codes.copy_(source.codes)
                target.scales.copy_(source.scales)
                return target
            return target.copy_(source.dequantize())
        values = tree_map_only(cls, lambda t: t.dequantize(), (args, kwargs))
        return func(*values[0], **values[1])


torch.serialization.add_safe_globals([QuantizedRows])
