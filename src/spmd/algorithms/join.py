"""torch's `torch.distributed.algorithms.join` path: the generic Join protocol of spmd.comm.join."""

from spmd.comm.join import Join, Joinable, JoinHook

__all__ = ["Join", "JoinHook", "Joinable"]
