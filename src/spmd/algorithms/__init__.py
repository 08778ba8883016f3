"""torch's `algorithms` package path: `ddp_comm_hooks` (spmd.ddp's hooks) and `join` (spmd.comm.join), whose Join,
Joinable and JoinHook the package names too, as torch's does."""

from spmd.algorithms.join import Join, Joinable, JoinHook

__all__ = ["Join", "JoinHook", "Joinable"]
