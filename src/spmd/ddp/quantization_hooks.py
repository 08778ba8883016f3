"""DDP communication hooks that send gradients as 8-bit integers (torch's `quantization_pertensor_hook` and
`quantization_perchannel_hook`): a quarter of the bytes of fp32, at the cost of 256 levels per tensor or per
channel of `bucket_size` values.

Layer: ddp. Each rank quantizes its bucket with its own min/max (torch.ao's MinMaxObserver: affine, uint8), the
ranks all-gather their scales and zero points and then the quantized buckets, and every rank dequantizes each
rank's bucket with that rank's parameters and averages them. All-gather, not all-reduce: integers quantized
with different scales cannot be summed, so the bytes received grow with the number of ranks (as in torch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.ao.quantization import MinMaxObserver, PerChannelMinMaxObserver

from spmd.comm.collectives import all_gather_into_tensor
from spmd.comm.group import ProcessGroup
from spmd.ddp.bucket import GradBucket

__all__ = ["quantization_perchannel_hook", "quantization_pertensor_hook"]


def _gathered(tensor: Tensor, group: ProcessGroup) -> Tensor:
    """Every rank's `tensor`, stacked along a new dim 0 in rank order."""
    out = torch.empty(group.size(), *tensor.shape, dtype=tensor.dtype, device=tensor.device)
    all_gather_into_tensor(out.view(-1, *tensor.shape[1:]), tensor, group=group)
    return out


def _quantized_mean(rows: Tensor, scale: Tensor, zero_point: Tensor, group: ProcessGroup, divisor: int,
                    bucket: GradBucket, numel: int) -> torch.futures.Future:
    """The mean over ranks of `rows` (this rank's values, one row per channel) sent as uint8.

    `scale` and `zero_point` hold one value per row; each rank quantizes with its own, and dequantizes each
    rank's rows with that rank's."""
    params = _gathered(torch.stack([scale, zero_point.to(scale.dtype)]), group)    # (ranks, 2, rows)
    mine = params[group.rank()]
    quantized = (torch.round(rows / mine[0, :, None]) + mine[1, :, None]).clamp(0, 255).to(torch.uint8)
    received = torch.empty(group.size(), *quantized.shape, dtype=torch.uint8, device=quantized.device)
    work = all_gather_into_tensor(received.view(-1, quantized.shape[-1]), quantized, group=group, async_op=True)
    buffer = bucket.buffer()

    def dequantize_and_average(_: torch.futures.Future) -> Tensor:
        total = torch.zeros(quantized.shape, dtype=torch.float32, device=quantized.device)
        for rank_params, rows_of_rank in zip(params, received, strict=True):   # in rank order, as torch sums
            total += rank_params[0, :, None] * (rows_of_rank.to(torch.float32) - rank_params[1, :, None])
        buffer.copy_(total.flatten()[:numel].div_(divisor).view_as(buffer))
        return buffer

    return work.get_future().then(dequantize_and_average)


def quantization_pertensor_hook(process_group: ProcessGroup | None, bucket: GradBucket) -> torch.futures.Future:
    """Average the bucket sent as uint8 with one scale and zero point per rank's bucket."""
    group = process_group if process_group is not None else bucket.process_group()
    flat = bucket.buffer().detach().reshape(1, -1).to(torch.float32)
    observer = MinMaxObserver().to(flat.device)
    observer(flat)
    scale, zero_point = observer.calculate_qparams()
    return _quantized_mean(flat, scale.to(flat.device), zero_point.to(flat.device), group, bucket.div_factor(),
                           bucket, flat.numel())


def quantization_perchannel_hook(process_group: ProcessGroup | None, bucket: GradBucket,
                                 bucket_size: int = 512) -> torch.futures.Future:
    """Average the bucket sent as uint8, with a scale and zero point per run of `bucket_size` values (finer
    resolution than one per bucket for large buckets)."""
    group = process_group if process_group is not None else bucket.process_group()
    flat = bucket.buffer().detach().reshape(-1).to(torch.float32)
    channels = F.pad(flat, (0, -flat.numel() % bucket_size)).view(-1, bucket_size)
    observer = PerChannelMinMaxObserver().to(flat.device)
    observer(channels)
    scale, zero_point = observer.calculate_qparams()
    return _quantized_mean(channels, scale.to(flat.device), zero_point.to(flat.device), group, bucket.div_factor(),
                           bucket, flat.numel())
