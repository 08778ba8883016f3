"""torch's `algorithms` package path: `ddp_comm_hooks` (spmd.ddp's hooks) and `join` (spmd.comm.join)."""
