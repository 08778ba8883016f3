"""Alias of `spmd.ddp.quantization_hooks` at torch's module path (`ddp_comm_hooks.quantization_hooks`).
Layer: ddp."""

from spmd.ddp.quantization_hooks import quantization_perchannel_hook, quantization_pertensor_hook

__all__ = ["quantization_perchannel_hook", "quantization_pertensor_hook"]
