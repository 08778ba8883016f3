"""torch's `algorithms` package path; only `ddp_comm_hooks` is aliased here (to spmd.ddp's hooks)."""
