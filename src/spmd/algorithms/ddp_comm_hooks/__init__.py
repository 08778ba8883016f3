"""Alias of spmd.ddp's communication hooks at torch's path (`algorithms.ddp_comm_hooks`): `default_hooks`
(allreduce, fp16 and bf16 compression), `powerSGD_hook` and `post_localSGD_hook`. Layer: ddp (an alias; it holds
no logic)."""

from spmd.algorithms.ddp_comm_hooks import default_hooks, post_localSGD_hook, powerSGD_hook

__all__ = ["default_hooks", "post_localSGD_hook", "powerSGD_hook"]
