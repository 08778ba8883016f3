"""Alias of spmd.ddp's communication hooks at torch's path (`algorithms.ddp_comm_hooks`): `default_hooks`
(allreduce, fp16 and bf16 compression), `powerSGD_hook`, `post_localSGD_hook` and `debugging_hooks` (noop_hook).
Layer: ddp (an alias; it holds no logic)."""

from spmd.algorithms.ddp_comm_hooks import debugging_hooks, default_hooks, post_localSGD_hook, powerSGD_hook

__all__ = ["debugging_hooks", "default_hooks", "post_localSGD_hook", "powerSGD_hook"]
