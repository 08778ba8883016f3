"""DistributedDataParallel (layer 4): replicated modules whose gradients are averaged during backward.

`spmd.DistributedDataParallel` is `spmd.ddp.DistributedDataParallel`. Communication hooks are in
`spmd.ddp.comm_hooks` (allreduce, bf16 and fp16 compression) and `spmd.ddp.powersgd`.
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
from spmd.ddp.powersgd import PowerSGDState, batched_powerSGD_hook, powerSGD_hook

__all__ = ["DistributedDataParallel", "GradBucket", "PowerSGDState", "allreduce_hook", "batched_powerSGD_hook",
           "bf16_compress_hook", "bf16_compress_wrapper", "fp16_compress_hook", "fp16_compress_wrapper", "noop_hook",
           "powerSGD_hook"]
