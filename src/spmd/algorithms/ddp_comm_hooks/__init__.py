"""Alias of spmd.ddp's communication hooks at torch's path (`algorithms.ddp_comm_hooks`): `DDPCommHookType`
and `register_ddp_comm_hook` (hooks by name), and the modules `default_hooks` (allreduce, fp16 and bf16
compression), `powerSGD_hook`, `quantization_hooks`, `post_localSGD_hook`, `debugging_hooks` (noop_hook) and
`ddp_zero_hook` (ZeroRedundancyOptimizer stepped in backward; imported by its path, as torch's).
Layer: ddp (an alias; it holds no logic)."""

from spmd.algorithms.ddp_comm_hooks import (
    debugging_hooks,
    default_hooks,
    post_localSGD_hook,
    powerSGD_hook,
    quantization_hooks,
)
from spmd.ddp.hook_types import DDPCommHookType, register_ddp_comm_hook

__all__ = ["DDPCommHookType", "debugging_hooks", "default_hooks", "post_localSGD_hook", "powerSGD_hook",
           "quantization_hooks", "register_ddp_comm_hook"]
