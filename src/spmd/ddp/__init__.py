"""DistributedDataParallel (layer 4): replicated modules whose gradients are averaged during backward.

`spmd.DistributedDataParallel` is `spmd.ddp.DistributedDataParallel`. Communication hooks are in
`spmd.ddp.comm_hooks` (allreduce, bf16 and fp16 compression), `spmd.ddp.powersgd`, `spmd.ddp.quantization_hooks`
(uint8) and `spmd.ddp.post_local_sgd`; `spmd.ddp.hook_types` names them (DDPCommHookType).
"""

from spmd.ddp.api import DistributedDataParallel
from spmd.ddp.bucket import GradBucket
from spmd.ddp.comm_hooks import (
    allreduce_hook,
    bf16_compress_hook,
    bf16_compress_wrapper,
    fp16_compress_hook,
    fp16_compress_wrapper,
    noop_hook,
)
from spmd.ddp.hook_types import DDPCommHookType, register_ddp_comm_hook
from spmd.ddp.powersgd import PowerSGDState, batched_powerSGD_hook, powerSGD_hook
from spmd.ddp.quantization_hooks import quantization_perchannel_hook, quantization_pertensor_hook

__all__ = ["DDPCommHookType", "DistributedDataParallel", "GradBucket", "PowerSGDState", "allreduce_hook",
           "batched_powerSGD_hook", "bf16_compress_hook", "bf16_compress_wrapper", "fp16_compress_hook",
           "fp16_compress_wrapper", "noop_hook", "powerSGD_hook", "quantization_perchannel_hook",
           "quantization_pertensor_hook", "register_ddp_comm_hook"]
