"""Alias at torch's module path for Join (`algorithms.join` in torch's distributed package): the generic Join
protocol of spmd.comm.join."""

from spmd.comm.join import Join, Joinable, JoinHook

__all__ = ["Join", "JoinHook", "Joinable"]
