"""Gradient buckets: which parameters are reduced together, their flat buffer, and the GradBucket hook view.

Layer: ddp. Pure layout and local tensor bookkeeping; nothing here communicates.

Note: bucket order
Autograd produces gradients roughly in reverse order of parameter registration (the last layer's gradients
are ready first), so buckets are filled walking the parameters backwards. Bucket 0 holds the last-registered
parameters and is capped at `first_bucket_bytes` (1 MiB by default): it is ready soonest, so its all-reduce
starts while most of backward is still to run. Later buckets are capped at `bucket_bytes`. Parameters of
different dtypes never share a bucket (a bucket is one flat buffer of one dtype). Every rank computes the same
assignment from the same parameter list, so buckets, and therefore collectives, line up across ranks.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from spmd.comm.group import ProcessGroup
from spmd.ddp.dtensor_params import local_of

FIRST_BUCKET_BYTES = 1 << 20


def assign_buckets(params: list[nn.Parameter], bucket_bytes: int, first_bucket_bytes: int) -> list[list[int]]:
    """Split parameter indices into buckets, walking `params` in reverse (see Note: bucket order).

    >>> ps = [nn.Parameter(torch.zeros(100_000)) for _ in range(4)]   # 400 kB each
    >>> assign_buckets(ps, bucket_bytes=900_000, first_bucket_bytes=500_000)
    [[3, 2], [1, 0]]
    """
    buckets: list[list[int]] = []
    open_bucket: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}
    closed_per_kind: dict[tuple[torch.dtype, torch.device], int] = {}
    for index in reversed(range(len(params))):
        param = params[index]
        kind = (param.dtype, param.device)
        members, size = open_bucket.get(kind, ([], 0))
        members.append(index)
        size += local_of(param).numel() * param.element_size()
        cap = first_bucket_bytes if closed_per_kind.get(kind, 0) == 0 else bucket_bytes
        if size >= cap:
            buckets.append(members)
            closed_per_kind[kind] = closed_per_kind.get(kind, 0) + 1
            open_bucket.pop(kind, None)
        else:
            open_bucket[kind] = (members, size)
    buckets.extend(members for members, _ in open_bucket.values())
    # Launch order follows readiness: the bucket holding the latest-registered parameter goes first.
    buckets.sort(key=lambda members: -members[0])
    return buckets


class Bucket:
    """One flat gradient buffer and the per-parameter views into it, each shaped like its parameter's local tensor
    (a DTensor parameter's shard: see Note: DDP over DTensor parameters in dtensor_params.py)."""

    def __init__(self, index: int, param_indices: list[int], params: list[nn.Parameter]) -> None:
        self.index = index
        self.param_indices = param_indices
        self.params = [params[i] for i in param_indices]
        shards = [local_of(p) for p in self.params]
        numel = sum(local.numel() for local in shards)
        self.buffer = torch.zeros(numel, dtype=self.params[0].dtype, device=self.params[0].device)
        self.views: list[Tensor] = []
        offset = 0
        for local in shards:
            self.views.append(self.buffer[offset:offset + local.numel()].view(local.shape))
            offset += local.numel()
        self.pending = len(self.params)


@dataclasses.dataclass
class GradBucket:
    """What a communication hook sees of one bucket (the interface of torch's GradBucket).

    The hook must return a torch.futures.Future whose value is a tensor shaped like `buffer()`, holding the
    bucket's reduced gradient (averaged over ranks: a hook owns the division).
    """

    _bucket: Bucket
    _is_last: bool
    _div_factor: int
    _group: ProcessGroup

    def index(self) -> int:
        return self._bucket.index

    def buffer(self) -> Tensor:
        return self._bucket.buffer

    def gradients(self) -> list[Tensor]:
        """Each parameter's gradient, as a view into `buffer()` shaped like the parameter."""
        return list(self._bucket.views)

    def parameters(self) -> list[nn.Parameter]:
        return list(self._bucket.params)

    def is_last(self) -> bool:
        """True for the last bucket launched in an iteration (hooks that batch work flush here)."""
        return self._is_last

    def set_buffer(self, tensor: Tensor) -> None:
        self._bucket.buffer.copy_(tensor)

    def div_factor(self) -> int:
        """The number the summed gradient is divided by: the group size, or the ranks still active under join()."""
        return self._div_factor

    def process_group(self) -> ProcessGroup:
        """The group the DDP module reduces over (what a hook uses when its state names no group)."""
        return self._group
