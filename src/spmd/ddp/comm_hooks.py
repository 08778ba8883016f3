"""Communication hooks for DistributedDataParallel: the default all-reduce and bf16 / fp16 compression.

Layer: ddp. A hook is `hook(state, bucket: GradBucket) -> torch.futures.Future[Tensor]`, registered with
`ddp.register_comm_hook(state, hook)`; `state` is the ProcessGroup to reduce over, or None for the DDP
module's own group. The future's value is the bucket's gradient averaged over ranks. PowerSGD lives in
spmd.ddp.powersgd.

Note: compression tolerance
bf16 keeps 8 significant bits (relative rounding error 2**-9 ~ 2e-3 per value), fp16 11 bits (2**-12 ~ 2.4e-4)
with a range of +-65504. The hooks divide by the number of ranks *before* casting down, so a sum of
gradients that fits in fp32 fits after division too; each rank's rounded contribution is then summed in
the low precision. Expect averaged gradients within a few times that relative error of the fp32 result.
"""

from __future__ import annotations

import torch
from torch import Tensor

from spmd.comm.collectives import all_reduce
from spmd.comm.group import ProcessGroup
from spmd.comm.reduce_op import ReduceOp
from spmd.ddp.bucket import GradBucket


def allreduce_hook(process_group: ProcessGroup | None, bucket: GradBucket) -> torch.futures.Future:
    """Average the bucket over the ranks: divide, then one async all-reduce (what DDP does with no hook)."""
    group = process_group if process_group is not None else bucket.process_group()
    buffer = bucket.buffer().div_(bucket.div_factor())
    work = all_reduce(buffer, ReduceOp.SUM, group=group, async_op=True)
    return work.get_future().then(lambda future: future.value()[0])


def _compressed(dtype: torch.dtype, process_group: ProcessGroup | None, bucket: GradBucket) -> torch.futures.Future:
    group = process_group if process_group is not None else bucket.process_group()
    buffer = bucket.buffer()
    compressed = torch.div(buffer, bucket.div_factor()).to(dtype)   # see Note: compression tolerance
    work = all_reduce(compressed, ReduceOp.SUM, group=group, async_op=True)

    def decompress(future: torch.futures.Future) -> Tensor:
        buffer.copy_(future.value()[0])
        return buffer

    return work.get_future().then(decompress)


def fp16_compress_hook(process_group: ProcessGroup | None, bucket: GradBucket) -> torch.futures.Future:
    """All-reduce the bucket in float16 (half the bytes); the result is written back in the bucket's dtype."""
    return _compressed(torch.float16, process_group, bucket)


def bf16_compress_hook(process_group: ProcessGroup | None, bucket: GradBucket) -> torch.futures.Future:
    """All-reduce the bucket in bfloat16 (half the bytes, fp32's range); written back in the bucket's dtype."""
    return _compressed(torch.bfloat16, process_group, bucket)
