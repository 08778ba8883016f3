"""Communication hooks for DistributedDataParallel: the default all-reduce, bf16 / fp16 compression, and the
wrappers that run any hook on a bf16 / fp16 copy of the bucket (fp16_compress_wrapper(powerSGD_hook)).

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

from collections.abc import Callable

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


def noop_hook(state: object, bucket: GradBucket) -> torch.futures.Future:
    """Leave the bucket as this rank's own gradient, communicating nothing: to measure how much of a step the
    all-reduce costs (headroom analysis), never to train."""
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


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


Hook = Callable[[object, GradBucket], torch.futures.Future]


class _CastGradBucket(GradBucket):
    """A bucket as a wrapped hook sees it: buffer() and gradients() are views of one copy cast to `dtype`."""

    def __init__(self, bucket: GradBucket, dtype: torch.dtype) -> None:
        super().__init__(bucket._bucket, bucket._is_last, bucket._div_factor, bucket._group)
        self._cast = bucket.buffer().to(dtype)
        start = bucket.buffer().storage_offset()
        self._cast_views = [self._cast[view.storage_offset() - start:][:view.numel()].view(view.shape)
                            for view in bucket.gradients()]

    def buffer(self) -> Tensor:
        return self._cast

    def gradients(self) -> list[Tensor]:
        return list(self._cast_views)

    def set_buffer(self, tensor: Tensor) -> None:
        self._cast.copy_(tensor)


def _compress_wrapper(hook: Hook, dtype: torch.dtype, name: str) -> Hook:
    def wrapped(state: object, bucket: GradBucket) -> torch.futures.Future:
        future = hook(state, _CastGradBucket(bucket, dtype))

        def decompress(done: torch.futures.Future) -> Tensor:
            buffer = bucket.buffer()
            buffer.copy_(done.value())          # in place, as torch's wrappers do, to keep the peak low
            return buffer

        return future.then(decompress)

    wrapped.__name__ = f"{name}({getattr(hook, '__name__', 'hook')})"
    return wrapped


def fp16_compress_wrapper(hook: Hook) -> Hook:
    """`hook` run on a float16 copy of each bucket, its result cast back into the bucket's dtype
    (fp16_compress_wrapper(allreduce_hook) is fp16_compress_hook; see Note: compression tolerance)."""
    return _compress_wrapper(hook, torch.float16, "fp16_compress_wrapper")


def bf16_compress_wrapper(hook: Hook) -> Hook:
    """`hook` run on a bfloat16 copy of each bucket, its result cast back into the bucket's dtype."""
    return _compress_wrapper(hook, torch.bfloat16, "bf16_compress_wrapper")
